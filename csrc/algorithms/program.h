// A plan flattened into a program: a fixed-size array of ops an executor
// with no allocator and no std::vector can run, one op after the other.
// The CUDA executor of schedules (transport/cuda_schedule.cu) runs it inside
// one kernel; transport/program_sim.cpp runs the same program on the CPU,
// several ranks in one process, which is how the program is tested without
// a GPU: bit for bit against the shared-memory executor of the same plan.
//
// Memory model (the shared-memory executor's, see transport/shm.cpp): each
// rank owns a mailbox of two halves (round parity) x kNumPhases regions x K
// chunk slots. A send copies a chunk into the rank's own slot; a receive
// reads the sender's slot. A rank posts "step t done" after its sends of
// step t and "round done" after its last step; before a round it waits
// until every peer is done with the round two before (same half).
#pragma once

#include <cstdint>
#include <vector>

#include "plan.h"

namespace pycomm {

// Bounds of the fixed-size arrays: every schedule of schedule.h fits (tree
// all-reduce cuts a round into 2 x kPipelineChunks chunks; ring and direct
// into world <= kProgMaxRanks; a one-shot group reads every rank).
constexpr int kProgMaxRanks = 8;
constexpr int kProgMaxChunks = 8;
constexpr int kProgMaxSrcs = kProgMaxRanks;

enum class ProgKind : uint8_t {
  kCopy = 0,    // dst <- src (a send staged, or a chunk's output = its input)
  kPost = 1,    // this rank's sends of `step` are in its mailbox
  kWait = 2,    // wait until `peer` posted `step`
  kReduce = 3,  // dst (and dst2) <- srcs combined in order
};

// A place one op reads or writes: a peer's mailbox slot (peer >= 0; `where`
// is the phase) or this rank's own (peer < 0; `where` is a Loc).
struct ProgRef {
  int8_t peer;
  uint8_t where;
};

struct ProgOp {
  ProgKind kind;
  uint8_t nsrc;
  int16_t chunk;
  int16_t peer;   // kWait
  int32_t step;   // kPost, kWait: step of the round
  ProgRef dst, dst2;  // dst2.where == Loc::kNone when unused
  ProgRef src[kProgMaxSrcs];
};

struct Program {
  int num_chunks = 0;
  int num_steps = 0;
  std::vector<ProgOp> ops;  // one round; every round runs the same ops
};

// Flattens `plan` (all-reduce, reduce-scatter, all-gather or broadcast; not
// all-to-all, whose slots are per reader). Throws CommError when the plan
// exceeds the bounds above.
Program flatten_plan(const Plan& plan);

// The pointer an op's reference names in round `j`, given this round's
// chunk pointers and every rank's mailbox half for it. Shared by the CPU
// simulation and the CUDA kernel.
struct RoundPointers {
  char* mailbox[kProgMaxRanks];  // each rank's half for this round (phase 0)
  size_t phase_bytes;            // K x chunk slot bytes
  size_t chunk_bytes;            // one chunk slot
  const char* in[kProgMaxChunks];
  char* out[kProgMaxChunks];
  size_t len[kProgMaxChunks];  // elements
};

PYCOMM_HOST_DEVICE char* resolve(const RoundPointers& p, ProgRef r, int chunk, int rank) {
  if (r.peer >= 0) return p.mailbox[r.peer] + r.where * p.phase_bytes + chunk * p.chunk_bytes;
  switch (static_cast<Loc>(r.where)) {
    case Loc::kInput: return const_cast<char*>(p.in[chunk]);
    case Loc::kOutput: return p.out[chunk];
    case Loc::kStaged0: return p.mailbox[rank] + chunk * p.chunk_bytes;
    case Loc::kStaged1: return p.mailbox[rank] + p.phase_bytes + chunk * p.chunk_bytes;
    default: return nullptr;
  }
}

// Bytes of one rank's mailbox for a schedule of K chunks of chunk_bytes.
inline size_t program_mailbox_bytes(int K, size_t chunk_bytes) { return 2 * kNumPhases * K * chunk_bytes; }

}  // namespace pycomm
