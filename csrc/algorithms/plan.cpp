#include "plan.h"

#include <array>
#include <sstream>
#include <string>

namespace pycomm {

namespace {

// The peers that read what `rank` sends at step t in `phase` (a send to
// kAllPeers names none; its readers are the receives that name it).
std::vector<int> readers(const std::vector<std::vector<std::vector<ScheduleOp>>>& all, int rank, int t,
                         const ScheduleOp& send) {
  if (send.peer != kAllPeers) return {send.peer};
  std::vector<int> to;
  const int world = static_cast<int>(all.size());
  const int T = static_cast<int>(all[rank].size());
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    bool reads = false;
    for (int u = t; u < T && !reads; ++u)
      for (const auto& r : all[q][u])
        if (r.kind != OpKind::kSend && r.peer == rank && r.sent_step == t && r.phase == send.phase &&
            r.chunk == send.chunk)
          reads = true;
    if (reads) to.push_back(q);
  }
  return to;
}

}  // namespace

std::unique_ptr<Plan> build_plan(const Schedule& s, int rank) {
  auto plan = std::make_unique<Plan>();
  plan->algo = s.algo;
  plan->coll = s.coll;
  plan->root = s.root;
  plan->world = s.world;
  plan->rank = rank;
  plan->num_chunks = s.num_chunks();
  const int K = plan->num_chunks;
  const int T = s.num_steps();

  // Every rank's ops: the readers of a kAllPeers send are found in them.
  std::vector<std::vector<std::vector<ScheduleOp>>> all(s.world, std::vector<std::vector<ScheduleOp>>(T));
  for (int q = 0; q < s.world; ++q)
    for (int t = 0; t < T; ++t) s.ops(q, t, all[q][t]);
  const auto& ops = all[rank];

  auto internal = [&](const std::string& why) {
    std::ostringstream os;
    os << "pycomm internal error: schedule " << algorithm_name(s.algo) << "/" << collective_name(s.coll)
       << " on rank " << rank << " of " << s.world << ": " << why;
    return CommError(os.str());
  };

  // Lookahead: for a receive of chunk c at step t, the phase of the next
  // send of c (before c is received again), and whether it is the last
  // receive of c.
  auto next_send_phase = [&](int c, int t) {
    for (int u = t + 1; u < T; ++u) {
      for (const auto& op : ops[u])
        if (op.chunk == c && op.kind == OpKind::kSend) return static_cast<int>(op.phase);
      for (const auto& op : ops[u])
        if (op.chunk == c && op.kind != OpKind::kSend) return -1;
    }
    return -1;
  };
  auto is_last_recv = [&](int c, int t) {
    for (int u = t + 1; u < T; ++u)
      for (const auto& op : ops[u])
        if (op.chunk == c && op.kind != OpKind::kSend) return false;
    return true;
  };

  std::vector<Loc> loc(K);
  std::vector<std::array<bool, kNumPhases>> staged(K, {false, false});
  std::vector<std::array<bool, kNumPhases>> written(K, {false, false});
  std::vector<bool> received(K, false);
  for (int c = 0; c < K; ++c) loc[c] = chunk_has_input(s.coll, c, rank) ? Loc::kInput : Loc::kNone;

  auto note_write = [&](int c, int phase) {
    // A region written twice in one round could be overwritten while a
    // peer still reads it; every schedule must avoid that.
    if (written[c][phase]) throw internal("chunk written twice into one staging region");
    written[c][phase] = true;
  };

  plan->steps.resize(T);
  for (int t = 0; t < T; ++t) {
    PlanStep& step = plan->steps[t];
    // 1. Sends.
    for (const auto& op : ops[t]) {
      if (op.kind != OpKind::kSend) continue;
      const int c = op.chunk;
      if (loc[c] == Loc::kNone) throw internal("sends a chunk it does not have");
      PlanSend send{c, op.phase, Loc::kNone, loc[c], readers(all, rank, t, op)};
      if (!staged[c][op.phase]) {
        note_write(c, op.phase);
        send.from = loc[c];
        staged[c][op.phase] = true;
      }
      step.sends.push_back(std::move(send));
    }
    // 2. Receives, grouped by consecutive chunk.
    const auto& v = ops[t];
    for (size_t i = 0; i < v.size();) {
      if (v[i].kind == OpKind::kSend) {
        ++i;
        continue;
      }
      const int c = v[i].chunk;
      PlanGroup g;
      g.chunk = c;
      if (v[i].kind == OpKind::kRecvReduce) {
        if (loc[c] == Loc::kNone) throw internal("reduces into a chunk it does not have");
        g.srcs.push_back({rank, 0, loc[c], 0, -1});
      }
      for (; i < v.size() && v[i].kind != OpKind::kSend && v[i].chunk == c; ++i) {
        if (v[i].kind == OpKind::kRecvCopy && !g.srcs.empty())
          throw internal("a copy in the middle of a reduction group");
        if (v[i].sent_step > t) throw internal("receives data sent at a later step");
        if (v[i].peer == rank) {
          if (loc[c] == Loc::kNone) throw internal("reads its own missing chunk");
          g.srcs.push_back({rank, v[i].phase, loc[c], static_cast<uint32_t>(v[i].sent_step), -1});
        } else {
          g.srcs.push_back(
              {v[i].peer, v[i].phase, loc[c], static_cast<uint32_t>(v[i].sent_step), plan->num_bufs++});
        }
      }
      g.fwd_phase = next_send_phase(c, t);
      g.to_output = chunk_has_output(s.coll, c, rank) && (is_last_recv(c, t) || g.fwd_phase < 0);
      if (!g.to_output && g.fwd_phase < 0) throw internal("a received chunk is neither kept nor sent");
      if (g.fwd_phase >= 0) note_write(c, g.fwd_phase);
      loc[c] = g.to_output ? Loc::kOutput : staged_loc(g.fwd_phase);
      staged[c] = {false, false};
      if (g.fwd_phase >= 0) staged[c][g.fwd_phase] = true;
      received[c] = true;
      step.groups.push_back(std::move(g));
    }
  }
  for (int c = 0; c < K; ++c) {
    if (!chunk_has_output(s.coll, c, rank) || received[c]) continue;
    if (!chunk_has_input(s.coll, c, rank)) throw internal("an output chunk is never received");
    plan->final_copies.push_back(c);
  }
  return plan;
}

const Plan& PlanCache::get(const Schedule& s) {
  for (const auto& p : plans_)
    if (p->algo == s.algo && p->coll == s.coll && p->root == s.root && p->world == s.world) return *p;
  plans_.push_back(build_plan(s, rank_));
  return *plans_.back();
}

}  // namespace pycomm
