// A schedule is a pure function from (rank, world, step) to the transfers a
// rank makes at that step. Transports execute schedules; schedules know
// nothing about memory, sockets or kernels, so one schedule serves the
// shared-memory, the process-group and the CUDA executor (over IPC-mapped
// buffers, transport/cuda_schedule.cu), and is unit-tested alone. (The IPC group's one-shot and two-shot kernels
// are also written out by hand, in transport/cuda_ipc.cu.)
//
// Execution model every executor implements:
//   * A collective's data is cut into rounds; each round into num_chunks()
//     chunks. Chunk c of an all-reduce round is the c-th slice of it; for
//     reduce-scatter / all-gather chunk c is rank c's shard; for all-to-all
//     it is the block exchanged with rank c (see direct.h).
//   * Steps run in order. Within a step a rank first performs its sends, then
//     its receives. A receive names the step at which the peer sent the data
//     (sent_step <= the current step), which is all a transport needs to
//     match messages without tags.
//   * Consecutive receives of the same chunk within a step form one group
//     reduced in the listed order. A group that starts with kRecvReduce
//     starts from the rank's own current value of the chunk; one that starts
//     with kRecvCopy does not. A receive whose peer is the rank itself reads
//     its own current value (used to fix the reduction order).
//   * Deadlock freedom: receives at step s depend only on sends at steps
//     <= s, and a rank's sends at step s only on its receives before s.
#pragma once

#include <cstdint>
#include <vector>

#include "../core/collective.h"

namespace pycomm {

enum class OpKind : uint8_t { kSend = 0, kRecvReduce = 1, kRecvCopy = 2 };

// Sends to kAllPeers publish a chunk that several peers read (one-shot,
// broadcast); a transport with real point-to-point links expands it.
constexpr int kAllPeers = -1;

struct ScheduleOp {
  OpKind kind;
  uint8_t phase;  // which staging region carries it (e.g. 0: reduce, 1: gather)
  int16_t peer;
  int32_t chunk;
  int32_t sent_step;  // receives only: the step at which `peer` sent it
};

constexpr int kNumPhases = 2;
// Chunks a pipelined schedule (tree, chain broadcast) cuts one round into,
// per tree: enough to keep every level of a tree busy, few enough that each
// chunk stays well above the per-message synchronisation cost.
constexpr int kPipelineChunks = 4;

PYCOMM_HOST_DEVICE ScheduleOp make_send(int phase, int peer, int chunk) {
  return ScheduleOp{OpKind::kSend, static_cast<uint8_t>(phase), static_cast<int16_t>(peer), chunk, 0};
}
PYCOMM_HOST_DEVICE ScheduleOp make_recv(OpKind kind, int phase, int peer, int chunk, int sent_step) {
  return ScheduleOp{kind, static_cast<uint8_t>(phase), static_cast<int16_t>(peer), chunk, sent_step};
}

// Which chunks a rank starts with (input) and must end with (output).
inline bool chunk_has_input(Collective coll, int chunk, int rank) {
  return coll != Collective::kAllGather || chunk == rank;
}
inline bool chunk_has_output(Collective coll, int chunk, int rank) {
  return coll != Collective::kReduceScatter || chunk == rank;
}

// A schedule bound to one collective on one communicator. Adding an
// algorithm is one new header beside this one, one case in each switch of
// schedule.cpp and one line in the tuner.
struct Schedule {
  Algorithm algo;
  Collective coll;
  int world;
  int root;

  int num_chunks() const;
  int num_steps() const;
  int max_ops() const;
  // The ops of `rank` at `step`, sends first.
  void ops(int rank, int step, std::vector<ScheduleOp>& out) const;
};

// Which concrete algorithms can run a collective (kAuto, kDirect and kHier
// resolve to one of them).
bool algorithm_supports(Algorithm algo, Collective coll);

// Whether a caller may ask for `algo` for `coll`: kAuto, kDirect and kHier
// always (the tuner resolves them per collective), a concrete algorithm
// where it runs.
bool algorithm_applies(Algorithm algo, Collective coll);

}  // namespace pycomm
