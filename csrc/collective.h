// One collective call as the transports see it: raw pointers, no torch.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "algorithms/schedule.h"
#include "common.h"

namespace pycomm {

struct CollectiveDesc {
  Collective coll = Collective::kBarrier;
  Algorithm algo = Algorithm::kOneShot;  // resolved, never kAuto/kDirect/kHier
  // The schedule between hosts when algo is kHierShard/kHierLeader.
  Algorithm inter = Algorithm::kAuto;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;
  // all_reduce, broadcast: elements of input and output.
  // reduce_scatter: elements of the output shard (input has world * count).
  // all_gather: elements of the input shard (output has world * count).
  uint64_t count = 0;
  // Part of a composite operation (a compressed all-reduce): which codec and
  // step, so ranks that disagree on them fail like any other mismatch.
  // 0 for plain collectives; see compression/codec.h.
  uint32_t tag = 0;
  // Compare headers only, move no data: the multi-host entry check.
  bool check_only = false;
  // The caller already checked that every rank runs this call: a transport
  // may skip its own header exchange (the process-group transport does).
  bool checked = false;
  const void* input = nullptr;
  void* output = nullptr;
};

// "codec=int8(block=256), step=all_to_all" for a non-zero tag (error messages).
std::string describe_tag(uint32_t tag);

// "all_reduce(count=10, dtype=float32, op=sum, algorithm=ring)", for the
// messages that report ranks disagreeing.
std::string describe_call(const CollectiveDesc& d);

// A call as ranks compare it before any data moves: shared memory keeps one
// per header slot, the process-group transport sends it. No padding holes,
// so two headers compare byte for byte.
struct CallHeader {
  uint64_t op;   // the transport's operation counter
  uint64_t seq;  // the communicator's number of the user call
  uint64_t count;
  uint32_t tag;
  int32_t root;
  uint8_t coll, algo, inter, dtype, redop, check_only, pad[2];

  static CallHeader of(const CollectiveDesc& d, uint64_t seq, uint64_t op);
  CollectiveDesc desc() const;  // without buffers
  bool same(const CallHeader& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
static_assert(sizeof(CallHeader) == 40, "no padding holes");

}  // namespace pycomm
