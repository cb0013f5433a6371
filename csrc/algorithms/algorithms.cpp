#include "algorithms.h"

namespace pycomm {

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kDirect: return "direct";
    case Algorithm::kOneShot: return "direct(one-shot)";
    case Algorithm::kTwoShot: return "direct(two-shot)";
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
  }
  return "?";
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
    case Collective::kAllReduce: return algo != Algorithm::kAuto && algo != Algorithm::kDirect;
    case Collective::kReduceScatter:
    case Collective::kAllGather: return algo == Algorithm::kRing || algo == Algorithm::kTwoShot;
    case Collective::kBroadcast:
      return algo == Algorithm::kRing || algo == Algorithm::kTree || algo == Algorithm::kOneShot;
    case Collective::kAllToAll: return algo == Algorithm::kTwoShot;
    case Collective::kBarrier:
    case Collective::kInvalid: return true;
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

}  // namespace pycomm
