// A schedule is a pure function from (rank, world, step) to the transfers a
// rank makes at that step. Transports execute schedules; schedules know
// nothing about memory, sockets or kernels, so one schedule serves shared
// memory, CUDA IPC and a wrapped ProcessGroup, and is unit-tested alone.
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

#include "../common.h"

namespace pycomm {

// Numeric values travel in collective headers: never reorder.
enum class Algorithm : uint8_t {
  kAuto = 0,
  kRing = 1,
  kTree = 2,
  kDirect = 3,   // user-facing; resolved to one of the two below
  kOneShot = 4,  // direct: every rank reads every input (small messages)
  kTwoShot = 5,  // direct: reduce-scatter then all-gather, each one hop
  // Several hosts: reduce inside each host over shared memory, across hosts
  // over the process-group transport, then share the result inside the host.
  kHier = 6,        // user-facing; resolved to one of the two below
  kHierShard = 7,   // every local rank runs the inter-host part on its shard
  kHierLeader = 8,  // one leader per host runs it on the whole tensor
};

enum class Collective : uint8_t {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kBroadcast = 3,
  kBarrier = 4,
  // A call one rank rejected (bad tensor, bad argument). It still takes its
  // place in the sequence so that peers fail fast instead of waiting.
  kInvalid = 5,
  // Rank r sends block p of its input to rank p, which stores it as block r
  // of its output (torch's all_to_all_single with equal splits).
  kAllToAll = 6,
  // Point-to-point messages. They never run on a transport's schedules (no
  // schedule supports them): the names serve the Work, messages and profiler.
  kSend = 7,
  kRecv = 8,
};

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

const char* algorithm_name(Algorithm a);
const char* collective_name(Collective c);

PYCOMM_HOST_DEVICE ScheduleOp make_send(int phase, int peer, int chunk) {
  return ScheduleOp{OpKind::kSend, static_cast<uint8_t>(phase), static_cast<int16_t>(peer), chunk, 0};
}
PYCOMM_HOST_DEVICE ScheduleOp make_recv(OpKind kind, int phase, int peer, int chunk, int sent_step) {
  return ScheduleOp{kind, static_cast<uint8_t>(phase), static_cast<int16_t>(peer), chunk, sent_step};
}

}  // namespace pycomm
