// The plan: one rank's part of a schedule with the bookkeeping every
// executor needs worked out once (and cached): which receives form one
// reduction group, where each chunk's latest value lives at every step,
// which sends a fused reduce already staged, which peers read a send to
// kAllPeers, one receive buffer per incoming message, and which chunks end
// as a plain copy of the input. Building it also checks the schedule's
// invariants, so a schedule that breaks them fails loudly on first use
// instead of moving the wrong bytes.
//
// The shared-memory executor reads `from`, `to_output` and `fwd_phase`
// (it stages sends in mailbox regions, one per phase); the process-group
// executor reads `value`, `to` and `buf` (it sends straight from where a
// value lives). Both run the same plan.
#pragma once

#include <memory>
#include <vector>

#include "schedule.h"

namespace pycomm {

// Where a chunk's current value lives on this rank during a round.
enum class Loc : uint8_t {
  kNone,     // the rank does not have the chunk (yet)
  kInput,    // in the caller's input, untouched
  kOutput,   // in the caller's output
  kStaged0,  // only in the send staging of phase 0 (forwarded, not kept)
  kStaged1,  // ... of phase 1
};
inline Loc staged_loc(int phase) { return phase == 0 ? Loc::kStaged0 : Loc::kStaged1; }
inline bool is_staged(Loc l) { return l == Loc::kStaged0 || l == Loc::kStaged1; }

struct PlanSend {
  int chunk;
  int phase;
  // What to copy into the phase's staging region: kNone when the reduce
  // that produced the value already wrote it there (or an earlier send of
  // this step staged it for another peer).
  Loc from;
  Loc value;            // where the value is when it is sent
  std::vector<int> to;  // the peers that receive it (a kAllPeers send expanded)
};

struct PlanSrc {
  int peer;  // == the plan's rank: this rank's own current value
  int phase;
  Loc self_loc;        // where this rank's own value is, when peer is the rank itself
  uint32_t sent_step;  // the step at which `peer` sent it
  int buf;             // this message's receive buffer (executors that stage receives); -1 for own values
};

struct PlanGroup {
  int chunk;
  // The reduction goes to the output (the chunk's final value, or an output
  // chunk with nothing more to forward) ...
  bool to_output;
  // ... and/or into the staging region of this phase, for a later send (-1: none).
  int fwd_phase;
  std::vector<PlanSrc> srcs;  // reduced in this order
};

struct PlanStep {
  std::vector<PlanSend> sends;
  std::vector<PlanGroup> groups;
};

struct Plan {
  Algorithm algo;
  Collective coll;
  int root;
  int world;
  int rank;
  int num_chunks;
  int num_bufs = 0;  // receive buffers: one per message from a peer
  std::vector<PlanStep> steps;
  std::vector<int> final_copies;  // chunks whose output is their untouched input
};

// Throws CommError ("pycomm internal error: ...") when the schedule breaks
// an invariant of schedule.h.
std::unique_ptr<Plan> build_plan(const Schedule& schedule, int rank);

// Plans of one rank, built on first use. Not thread-safe: each transport
// runs one operation at a time.
class PlanCache {
 public:
  explicit PlanCache(int rank) : rank_(rank) {}
  const Plan& get(const Schedule& schedule);

 private:
  int rank_;
  std::vector<std::unique_ptr<Plan>> plans_;
};

}  // namespace pycomm
