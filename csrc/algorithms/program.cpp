#include "program.h"

#include <algorithm>
#include <sstream>
#include <string>

namespace pycomm {

namespace {

ProgRef own(Loc l) { return ProgRef{-1, static_cast<uint8_t>(l)}; }

}  // namespace

Program flatten_plan(const Plan& plan) {
  auto internal = [&](const std::string& why) {
    std::ostringstream os;
    os << "pycomm internal error: flattening " << algorithm_name(plan.algo) << "/" << collective_name(plan.coll)
       << " on rank " << plan.rank << " of " << plan.world << ": " << why;
    return CommError(os.str());
  };
  if (plan.coll == Collective::kAllToAll) throw internal("all-to-all has no program (its slots are per reader)");
  if (plan.world > kProgMaxRanks) throw internal("more ranks than a program holds");
  if (plan.num_chunks > kProgMaxChunks) throw internal("more chunks than a program holds");
  Program p;
  p.num_chunks = plan.num_chunks;
  p.num_steps = static_cast<int>(plan.steps.size());
  // The highest step of each peer already waited for in this round: step
  // posts only grow, so a later wait for an earlier step is redundant.
  std::vector<int> waited(plan.world, -1);
  for (int t = 0; t < p.num_steps; ++t) {
    const PlanStep& step = plan.steps[t];
    // 1. Stage this step's sends, then say so.
    for (const PlanSend& s : step.sends) {
      if (s.from == Loc::kNone) continue;  // a reduce of an earlier op staged it
      ProgOp op{};
      op.kind = ProgKind::kCopy;
      op.chunk = static_cast<int16_t>(s.chunk);
      op.dst = own(staged_loc(s.phase));
      op.dst2 = own(Loc::kNone);
      op.nsrc = 1;
      op.src[0] = own(s.from);
      p.ops.push_back(op);
    }
    if (!step.sends.empty()) {
      ProgOp op{};
      op.kind = ProgKind::kPost;
      op.step = t;
      p.ops.push_back(op);
    }
    // 2. Each reduction group: wait for the peers it reads, then combine in
    //    the plan's order.
    for (const PlanGroup& grp : step.groups) {
      if (grp.srcs.size() > static_cast<size_t>(kProgMaxSrcs)) throw internal("a group reads too many sources");
      if (!grp.to_output && grp.fwd_phase < 0) throw internal("a group with nowhere to go");
      ProgOp red{};
      red.kind = ProgKind::kReduce;
      red.chunk = static_cast<int16_t>(grp.chunk);
      red.dst = grp.to_output ? own(Loc::kOutput) : own(staged_loc(grp.fwd_phase));
      red.dst2 = grp.to_output && grp.fwd_phase >= 0 ? own(staged_loc(grp.fwd_phase)) : own(Loc::kNone);
      for (const PlanSrc& src : grp.srcs) {
        if (src.peer == plan.rank) {
          red.src[red.nsrc++] = own(src.self_loc);
          continue;
        }
        const int sent = static_cast<int>(src.sent_step);
        if (waited[src.peer] < sent) {
          ProgOp w{};
          w.kind = ProgKind::kWait;
          w.peer = static_cast<int16_t>(src.peer);
          w.step = sent;
          p.ops.push_back(w);
          waited[src.peer] = sent;
        }
        red.src[red.nsrc++] = ProgRef{static_cast<int8_t>(src.peer), static_cast<uint8_t>(src.phase)};
      }
      p.ops.push_back(red);
    }
  }
  // 3. Chunks whose output is their input, untouched.
  for (int c : plan.final_copies) {
    ProgOp op{};
    op.kind = ProgKind::kCopy;
    op.chunk = static_cast<int16_t>(c);
    op.dst = own(Loc::kOutput);
    op.dst2 = own(Loc::kNone);
    op.nsrc = 1;
    op.src[0] = own(Loc::kInput);
    p.ops.push_back(op);
  }
  return p;
}

}  // namespace pycomm
