#include "collective.h"

#include <sstream>

#include "codec.h"

namespace pycomm {

const char* dtype_name(DType t) { return dtype_valid(t) ? kDTypes[static_cast<int>(t)].name : "?"; }

std::string timed_out_waiting(double seconds) {
  return "Timed out waiting " + std::to_string(static_cast<long long>(seconds * 1000.0 + 0.5)) + "ms";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "sum";
    case RedOp::kAvg: return "avg";
    case RedOp::kMax: return "max";
    case RedOp::kMin: return "min";
    case RedOp::kProduct: return "product";
    case RedOp::kBand: return "band";
    case RedOp::kBor: return "bor";
    case RedOp::kBxor: return "bxor";
  }
  return "?";
}

namespace {

// "float32, float64, ... and bool": the dtypes reductions take, from the table.
std::string reducible_names() {
  std::string names;
  int last = -1;
  for (int i = 0; i <= kLastDType; ++i)
    if (kDTypes[i].kind != DTypeKind::kCopyOnly) last = i;
  for (int i = 0; i <= kLastDType; ++i) {
    if (kDTypes[i].kind == DTypeKind::kCopyOnly) continue;
    if (!names.empty()) names += i == last ? " and " : ", ";
    names += kDTypes[i].name;
  }
  return names;
}

}  // namespace

std::string check_reducible(DType t, RedOp op) {
  const std::string head = std::string("op=") + redop_name(op) + " ";
  switch (dtype_kind(t)) {
    case DTypeKind::kCopyOnly:
      return "reductions take " + reducible_names() + " tensors, got " + dtype_name(t) +
             " (copies such as broadcast and all_gather take every dtype)";
    case DTypeKind::kFloating:
      if (op == RedOp::kBand || op == RedOp::kBor || op == RedOp::kBxor)
        return head + "needs an integral or bool tensor, got " + dtype_name(t);
      return "";
    case DTypeKind::kIntegral:
    case DTypeKind::kBool:
      if (op == RedOp::kAvg) return head + "needs a floating-point tensor, got " + dtype_name(t);
      return "";
  }
  return "";
}

const char* failure_kind_name(FailureKind kind) {
  switch (kind) {
    case FailureKind::kNone: return "none";
    case FailureKind::kDied: return "died";
    case FailureKind::kShutDown: return "shut_down";
    case FailureKind::kWaiting: return "waiting";
    case FailureKind::kRejected: return "rejected";
    case FailureKind::kSilent: return "silent";
  }
  return "?";
}

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
  if (d.tag == kAllocateTag) {
    os << ", step of a registered allocation (comm.empty)";
  } else if (d.tag) {
    os << ", " << describe_tag(d.tag);
  }
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

Blame mismatch_blame(const CallHeader& a, int rank_a, const CallHeader& b, int rank_b) {
  const auto invalid = static_cast<uint8_t>(Collective::kInvalid);
  if (b.coll == invalid) return {FailureKind::kRejected, rank_b};
  if (a.coll == invalid) return {FailureKind::kRejected, rank_a};
  return {};
}

}  // namespace pycomm
