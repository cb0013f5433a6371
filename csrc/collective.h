// One collective call as the transports see it: raw pointers, no torch.
#pragma once

#include <cstdint>

#include "algorithms/schedule.h"
#include "common.h"

namespace pycomm {

struct CollectiveDesc {
  Collective coll = Collective::kBarrier;
  Algorithm algo = Algorithm::kOneShot;  // resolved, never kAuto/kDirect
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;
  // all_reduce, broadcast: elements of input and output.
  // reduce_scatter: elements of the output shard (input has world * count).
  // all_gather: elements of the input shard (output has world * count).
  uint64_t count = 0;
  const void* input = nullptr;
  void* output = nullptr;
};

}  // namespace pycomm
