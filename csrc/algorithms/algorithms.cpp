#include "algorithms.h"

#include <sstream>

#include "../collective.h"

namespace pycomm {

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kOneShot: return "direct(one-shot)";
    case Algorithm::kTwoShot: return "direct(two-shot)";
    case Algorithm::kHier: return "hierarchical";
    case Algorithm::kHierShard: return "hier(shard)";
    case Algorithm::kHierLeader: return "hier(leader)";
  }
  return "?";
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "all_gather";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
    case Collective::kInvalid: return "invalid";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kSend: return "send";
    case Collective::kRecv: return "recv";
  }
  return "?";
}

std::string describe_call(const CollectiveDesc& d) {
  if (d.coll == Collective::kInvalid) return "something it could not run (see the error on that rank)";
  std::ostringstream os;
  os << collective_name(d.coll);
  if (d.coll == Collective::kBarrier) return os.str();
  os << "(count=" << d.count << ", dtype=" << dtype_name(d.dtype);
  if (d.coll == Collective::kAllReduce || d.coll == Collective::kReduceScatter) os << ", op=" << redop_name(d.op);
  if (d.coll == Collective::kBroadcast) os << ", src=" << d.root;
  if (d.tag) os << ", " << describe_tag(d.tag);
  os << ", algorithm=" << algorithm_name(d.algo);
  if (d.algo == Algorithm::kHierShard || d.algo == Algorithm::kHierLeader)
    os << " between hosts " << algorithm_name(d.inter);
  os << ")";
  return os.str();
}

CallHeader CallHeader::of(const CollectiveDesc& d, uint64_t seq, uint64_t op) {
  CallHeader h;
  std::memset(&h, 0, sizeof h);
  h.op = op;
  h.seq = seq;
  h.count = d.count;
  h.tag = d.tag;
  h.root = d.root;
  h.coll = static_cast<uint8_t>(d.coll);
  h.algo = static_cast<uint8_t>(d.algo);
  h.inter = static_cast<uint8_t>(d.inter);
  h.dtype = static_cast<uint8_t>(d.dtype);
  h.redop = static_cast<uint8_t>(d.op);
  h.check_only = d.check_only;
  return h;
}

CollectiveDesc CallHeader::desc() const {
  CollectiveDesc d;
  d.coll = static_cast<Collective>(coll);
  d.algo = static_cast<Algorithm>(algo);
  d.inter = static_cast<Algorithm>(inter);
  d.dtype = static_cast<DType>(dtype);
  d.op = static_cast<RedOp>(redop);
  d.root = root;
  d.tag = tag;
  d.count = count;
  d.check_only = check_only;
  return d;
}

int Schedule::num_chunks() const {
  switch (algo) {
    case Algorithm::kRing: return RingSchedule::num_chunks(coll, world);
    case Algorithm::kTree: return TreeSchedule::num_chunks(coll, world);
    default: return DirectSchedule::num_chunks(algo, coll, world);
  }
}

int Schedule::num_steps() const {
  switch (algo) {
    case Algorithm::kRing: return RingSchedule::num_steps(coll, world);
    case Algorithm::kTree: return TreeSchedule::num_steps(coll, world);
    default: return DirectSchedule::num_steps(algo, coll, world);
  }
}

int Schedule::max_ops() const {
  switch (algo) {
    case Algorithm::kRing: return 4;
    case Algorithm::kTree: return TreeSchedule::max_ops(world);
    default: return DirectSchedule::max_ops(world);
  }
}

void Schedule::ops(int rank, int step, std::vector<ScheduleOp>& out) const {
  out.resize(max_ops());
  int n = 0;
  switch (algo) {
    case Algorithm::kRing: n = RingSchedule::ops(coll, rank, world, root, step, out.data()); break;
    case Algorithm::kTree: n = TreeSchedule::ops(coll, rank, world, root, step, out.data()); break;
    default: n = DirectSchedule::ops(algo, coll, rank, world, root, step, out.data()); break;
  }
  out.resize(n);
}

bool algorithm_supports(Algorithm algo, Collective coll) {
  switch (coll) {
    case Collective::kAllReduce:
      return algo != Algorithm::kAuto && algo != Algorithm::kDirect && algo != Algorithm::kHier;
    case Collective::kReduceScatter:
    case Collective::kAllGather: return algo == Algorithm::kRing || algo == Algorithm::kTwoShot;
    case Collective::kBroadcast:
      return algo == Algorithm::kRing || algo == Algorithm::kTree || algo == Algorithm::kOneShot;
    case Collective::kAllToAll: return algo == Algorithm::kTwoShot;
    case Collective::kBarrier:
    case Collective::kInvalid: return true;
    case Collective::kSend:
    case Collective::kRecv: return false;
  }
  return false;
}

// Thresholds measured with pycomm-bench on shared memory (see
// benchmarks/RESULTS.md). One-shot wins while a message is small enough that
// one synchronisation costs more than reading every peer's copy; beyond that
// two-shot reads each byte once per rank in two hops, which on one host beats
// the ring's 2(n-1) synchronised hops.
constexpr size_t kOneShotMaxBytes = 32 * 1024;

Algorithm tune(Algorithm requested, Collective coll, size_t bytes, int world) {
  if (coll == Collective::kBarrier || coll == Collective::kInvalid) return Algorithm::kOneShot;
  const bool direct = requested == Algorithm::kDirect || requested == Algorithm::kAuto;
  if (!direct) return requested;
  switch (coll) {
    case Collective::kAllReduce:
      return (bytes <= kOneShotMaxBytes || world <= 1) ? Algorithm::kOneShot : Algorithm::kTwoShot;
    case Collective::kReduceScatter:
    case Collective::kAllGather:
    case Collective::kAllToAll: return Algorithm::kTwoShot;
    case Collective::kBroadcast: return Algorithm::kOneShot;
    default: return Algorithm::kOneShot;
  }
}

// Between hosts every hop costs a network round trip, so the thresholds
// differ from shared memory's (benchmarks/RESULTS.md, "Several hosts"):
// one-shot while one message is small; the ring beyond that. Two-shot moves
// the same bytes in 2 hops instead of 2(n-1), but makes every rank stream to
// n-1 peers at once, and those flows fight over each host's link: at 64 MB
// on 4 hosts at 1 Gbit/s it reached 86-94% of the link where the ring
// reached 90-94%.
constexpr size_t kNetOneShotMaxBytes = 64 * 1024;
// Hierarchical all-reduce by size (2 hosts x 2 ranks at 1 Gbit/s, RESULTS.md):
// up to 16 KiB through one leader per host (3-9x faster than a flat call:
// one small message per host crosses the network); from 4 MiB sharded over
// every local rank (1.2-1.6x); in between a flat call wins, because the
// three hierarchical phases each cost a synchronisation that the data no
// longer hides.
constexpr size_t kHierLeaderMaxBytes = 16 * 1024;
constexpr size_t kHierShardMinBytes = 4 << 20;

Algorithm tune_network(Algorithm requested, Collective coll, size_t bytes, int world) {
  if (coll == Collective::kBarrier || coll == Collective::kInvalid) return Algorithm::kOneShot;
  if (requested == Algorithm::kDirect) return tune(requested, coll, bytes, world);
  if (requested != Algorithm::kAuto) return requested;
  const bool small = bytes <= kNetOneShotMaxBytes || world <= 1;
  switch (coll) {
    case Collective::kAllReduce:
    case Collective::kBroadcast: return small ? Algorithm::kOneShot : Algorithm::kRing;
    case Collective::kReduceScatter:
    case Collective::kAllGather: return Algorithm::kRing;
    case Collective::kAllToAll: return Algorithm::kTwoShot;
    default: return Algorithm::kOneShot;
  }
}

Resolved tune_multihost(Algorithm requested, Collective coll, size_t bytes, int hosts, int local_size) {
  const int world = hosts * std::max(local_size, 1);
  const bool hier_coll = coll == Collective::kAllReduce || coll == Collective::kReduceScatter ||
                         coll == Collective::kAllGather || coll == Collective::kBroadcast;
  // local_size 0: hosts have different numbers of ranks; only flat runs.
  const bool hier_ok = hier_coll && local_size > 0 && hosts > 1;
  const bool auto_hier = requested == Algorithm::kAuto && local_size > 1 &&
                         (coll != Collective::kAllReduce || bytes <= kHierLeaderMaxBytes ||
                          bytes >= kHierShardMinBytes);
  const bool want_hier = hier_ok && (requested == Algorithm::kHier || auto_hier);
  if (!want_hier) {
    const Algorithm flat = tune_network(requested == Algorithm::kHier ? Algorithm::kAuto : requested, coll,
                                        bytes, world);
    return {flat, flat};
  }
  if (coll == Collective::kAllReduce && (bytes <= kHierLeaderMaxBytes || local_size == 1))
    return {Algorithm::kHierLeader, tune_network(Algorithm::kAuto, coll, bytes, hosts)};
  // Between hosts a sharded all-reduce, reduce-scatter or all-gather moves
  // 1/local_size of the tensor per rank; a broadcast moves all of it.
  const size_t inter_bytes = coll == Collective::kBroadcast ? bytes : bytes / local_size;
  return {Algorithm::kHierShard, tune_network(Algorithm::kAuto, coll, inter_bytes, hosts)};
}

}  // namespace pycomm
