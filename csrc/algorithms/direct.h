// Direct: every rank talks to every other rank in one hop. Latency-optimal
// for small messages where the per-hop synchronisation dominates.
//   one-shot: everybody publishes its input, everybody reduces all of them
//             (in rank order, so every rank gets the same bits);
//   two-shot: rank r reduces shard r from everybody's input, then everybody
//             gathers the reduced shards. Half the reads of one-shot, one
//             extra synchronisation.
//   all-to-all: one hop. Chunk c names the block exchanged with rank c: a
//             rank sends input block c to rank c and receives output block q
//             from rank q, which the executor reads from the slot rank q
//             filled for this rank.
#pragma once

#include "schedule.h"

namespace pycomm {

struct DirectSchedule {
  PYCOMM_HOST_DEVICE static int num_chunks(Algorithm algo, Collective coll, int world) {
    if (coll == Collective::kBroadcast || algo == Algorithm::kOneShot) return 1;
    return world;
  }

  PYCOMM_HOST_DEVICE static int num_steps(Algorithm algo, Collective coll, int world) {
    if (world <= 1) return 0;
    if (coll == Collective::kAllReduce && algo == Algorithm::kTwoShot) return 2;
    return 1;
  }

  PYCOMM_HOST_DEVICE static int max_ops(int world) { return 2 * world + 2; }

  PYCOMM_HOST_DEVICE static int ops(Algorithm algo, Collective coll, int rank, int world, int root,
                                    int step, ScheduleOp* out) {
    if (world <= 1) return 0;
    int n = 0;
    if (coll == Collective::kBroadcast) {
      if (rank == root) {
        out[n++] = make_send(0, kAllPeers, 0);
      } else {
        out[n++] = make_recv(OpKind::kRecvCopy, 0, root, 0, 0);
      }
      return n;
    }
    if (coll == Collective::kAllToAll) {
      for (int c = 0; c < world; ++c)
        if (c != rank) out[n++] = make_send(0, c, c);
      for (int q = 0; q < world; ++q)
        if (q != rank) out[n++] = make_recv(OpKind::kRecvCopy, 0, q, q, 0);
      return n;
    }
    if (coll == Collective::kAllReduce && algo == Algorithm::kOneShot) {
      out[n++] = make_send(0, kAllPeers, 0);
      for (int q = 0; q < world; ++q) {
        out[n++] = make_recv(q == 0 ? OpKind::kRecvCopy : OpKind::kRecvReduce, 0, q, 0, 0);
      }
      return n;
    }
    // Two-shot halves. reduce-scatter runs only the first, all-gather only
    // the second, all-reduce both.
    const bool reduce_half = (coll == Collective::kAllReduce && step == 0) || coll == Collective::kReduceScatter;
    if (reduce_half) {
      // 1. Hand every other rank its shard of our input, then reduce ours
      //    from everybody's contribution.
      for (int c = 0; c < world; ++c)
        if (c != rank) out[n++] = make_send(0, c, c);
      for (int q = 0; q < world; ++q)
        if (q != rank) out[n++] = make_recv(OpKind::kRecvReduce, 0, q, rank, step);
    } else {
      // 2. Publish our finished shard and copy everybody else's.
      out[n++] = make_send(1, kAllPeers, rank);
      for (int q = 0; q < world; ++q)
        if (q != rank) out[n++] = make_recv(OpKind::kRecvCopy, 1, q, q, step);
    }
    return n;
  }
};

}  // namespace pycomm
