#include "program_sim.h"

#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "../algorithms/program.h"
#include "layout.h"

namespace pycomm {

namespace {

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};

struct RankState {
  std::unique_ptr<Plan> plan;
  Program prog;
  std::unique_ptr<char, FreeDeleter> mailbox;
  uint64_t round = 0;   // the round it runs (== rounds done)
  size_t pc = 0;        // the next op of that round
  uint64_t posted = 0;  // round * steps + step + 1 of its last post
};

}  // namespace

void simulate_program(Algorithm algo, Collective coll, int root, DType dtype, RedOp op, size_t count,
                      const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                      size_t round_bytes, uint64_t seed) {
  const int world = static_cast<int>(inputs.size());
  if (world < 1 || world > kProgMaxRanks || outputs.size() != inputs.size())
    throw CommError("pycomm: simulate_program takes 1.." + std::to_string(kProgMaxRanks) +
                    " ranks, one input and one output each");
  if ((algo != Algorithm::kRing && algo != Algorithm::kTree && algo != Algorithm::kOneShot &&
       algo != Algorithm::kTwoShot) ||
      !algorithm_supports(algo, coll))
    throw CommError(std::string("pycomm: simulate_program runs a concrete schedule (ring, tree, one-shot, two-shot) "
                                "of its collective, got ") + algorithm_name(algo) + " for " + collective_name(coll));
  CollectiveDesc d;
  d.coll = coll;
  d.op = op;
  d.root = root;
  d.count = count;
  d.dtype = dtype;
  const size_t es = dtype_size(dtype);
  if (world == 1 || count == 0) {
    if (count == 0) return;
    const RoundLayout one(d, 1, 1, round_bytes);
    kernels::copy_cpu(outputs[0], nullptr, inputs[0], one.out_count * es);
    return;
  }
  const Schedule schedule{algo, coll, world, root};
  std::vector<RankState> ranks(world);
  for (int r = 0; r < world; ++r) {
    ranks[r].plan = build_plan(schedule, r);
    ranks[r].prog = flatten_plan(*ranks[r].plan);
  }
  const int K = ranks[0].prog.num_chunks;
  const uint64_t T = static_cast<uint64_t>(ranks[0].prog.num_steps);
  const RoundLayout layout(d, K, world, round_bytes);
  std::vector<char*> mailboxes(world);
  for (int r = 0; r < world; ++r) {
    // 64-byte aligned, as a device allocation would be (and as the chunk
    // slots' alignment assumes).
    ranks[r].mailbox.reset(
        static_cast<char*>(std::aligned_alloc(64, program_mailbox_bytes(K, layout.chunk_max * es))));
    if (!ranks[r].mailbox) throw CommError("pycomm: simulate_program: out of memory");
    mailboxes[r] = ranks[r].mailbox.get();
  }
  auto pointers = [&](int r, uint64_t j) {
    RoundPointers p{};
    point_round(p, layout, j, j, r, world, mailboxes.data(), static_cast<const char*>(inputs[r]),
                static_cast<char*>(outputs[r]));
    return p;
  };
  // Runs rank r until it finishes, meets a wait it cannot pass, or has run
  // `budget` ops; returns whether it moved.
  auto advance = [&](int r, uint64_t budget) {
    RankState& s = ranks[r];
    bool moved = false;
    while (s.round < layout.rounds) {
      const uint64_t j = s.round;
      // 1. Before a round: every peer is done with the round two before,
      //    which used the same mailbox half.
      if (s.pc == 0 && j >= 2)
        for (int q = 0; q < world; ++q)
          if (ranks[q].round < j - 1) return moved;
      const RoundPointers p = pointers(r, j);
      const std::vector<ProgOp>& ops = s.prog.ops;
      // 2. The round's ops, in order.
      for (; s.pc < ops.size(); ++s.pc) {
        if (budget == 0) return moved;
        const ProgOp& o = ops[s.pc];
        const size_t len = p.len[o.chunk];
        switch (o.kind) {
          case ProgKind::kPost: s.posted = j * T + o.step + 1; break;
          case ProgKind::kWait:
            if (ranks[o.peer].posted < j * T + o.step + 1) return moved;
            break;
          case ProgKind::kCopy:
            kernels::copy_cpu(resolve(p, o.dst, o.chunk, r), nullptr, resolve(p, o.src[0], o.chunk, r), len * es);
            break;
          case ProgKind::kReduce: {
            const void* srcs[kProgMaxSrcs];
            for (int k = 0; k < o.nsrc; ++k) srcs[k] = resolve(p, o.src[k], o.chunk, r);
            kernels::reduce_cpu(dtype, op, resolve(p, o.dst, o.chunk, r), resolve(p, o.dst2, o.chunk, r), srcs,
                                o.nsrc, len);
            break;
          }
        }
        moved = true;
        --budget;
      }
      // 3. avg: each output chunk divided once, when the round is done (the
      //    kernel's order; the same bits as dividing the whole output).
      if (op == RedOp::kAvg && (coll == Collective::kAllReduce || coll == Collective::kReduceScatter))
        for (int c = 0; c < K; ++c)
          if (p.out[c]) kernels::divide_cpu(dtype, p.out[c], p.len[c], static_cast<double>(world));
      ++s.round;
      s.pc = 0;
      moved = true;
    }
    return moved;
  };
  auto deadlock = [&] {
    return CommError(std::string("pycomm internal error: the program of ") + algorithm_name(algo) + "/" +
                     collective_name(coll) + " deadlocks on " + std::to_string(world) + " ranks");
  };
  auto finished = [&] {
    for (const RankState& s : ranks)
      if (s.round < layout.rounds) return false;
    return true;
  };
  constexpr uint64_t kUnbounded = ~uint64_t{0};
  if (seed == 0) {
    for (;;) {
      bool moved = false;
      for (int r = 0; r < world; ++r) moved = advance(r, kUnbounded) || moved;
      if (finished()) return;
      if (!moved) throw deadlock();
    }
  }
  std::mt19937_64 rng(seed);
  while (!finished()) {
    const int r = static_cast<int>(rng() % static_cast<uint64_t>(world));
    if (advance(r, 1 + rng() % 8)) continue;
    // r could not move: someone else must, or nobody ever will.
    bool moved = false;
    for (int q = 0; q < world && !moved; ++q) moved = advance(q, 1);
    if (!moved && !finished()) throw deadlock();
  }
}

uint64_t program_traffic(Algorithm algo, Collective coll, int world, int root, DType dtype, size_t count,
                         size_t round_bytes) {
  if (world <= 1 || count == 0) return 0;
  CollectiveDesc d;
  d.coll = coll;
  d.count = count;
  d.dtype = dtype;
  const size_t es = dtype_size(dtype);
  const Schedule schedule{algo, coll, world, root};
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    const Program prog = flatten_plan(*build_plan(schedule, r));
    const RoundLayout layout(d, prog.num_chunks, world, round_bytes);
    for (uint64_t j = 0; j < layout.rounds; ++j)
      for (const ProgOp& o : prog.ops) {
        if (o.kind != ProgKind::kCopy && o.kind != ProgKind::kReduce) continue;
        int64_t in, out;
        size_t len;
        layout.span(j, o.chunk, r, &in, &out, &len);
        const int writes = 1 + (o.dst2.peer < 0 && static_cast<Loc>(o.dst2.where) != Loc::kNone ? 1 : 0);
        total += static_cast<uint64_t>(o.nsrc + writes) * len * es;
      }
  }
  return total;
}

}  // namespace pycomm
