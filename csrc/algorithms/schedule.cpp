#include "schedule.h"

#include "direct.h"
#include "ring.h"
#include "tree.h"

namespace pycomm {

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

bool algorithm_applies(Algorithm algo, Collective coll) {
  return algo == Algorithm::kAuto || algo == Algorithm::kDirect || algo == Algorithm::kHier ||
         algorithm_supports(algo, coll);
}

}  // namespace pycomm
