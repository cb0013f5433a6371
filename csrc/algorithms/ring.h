// Ring: bandwidth-optimal reduce-scatter + all-gather, and a chained
// (pipelined) broadcast. Each rank talks only to its neighbours, so every
// link carries 2(n-1)/n of the data and no rank is a hot spot.
#pragma once

#include "schedule.h"

namespace pycomm {

struct RingSchedule {
  PYCOMM_HOST_DEVICE static int mod(int a, int n) { return ((a % n) + n) % n; }

  PYCOMM_HOST_DEVICE static int num_chunks(Collective coll, int world) {
    return coll == Collective::kBroadcast ? kPipelineChunks : world;
  }

  PYCOMM_HOST_DEVICE static int num_steps(Collective coll, int world) {
    if (world <= 1) return 0;
    switch (coll) {
      case Collective::kAllReduce: return 2 * (world - 1);
      case Collective::kReduceScatter:
      case Collective::kAllGather: return world - 1;
      case Collective::kBroadcast: return kPipelineChunks + world - 2;
      default: return 0;
    }
  }

  // Returns how many ops were written to `out`.
  PYCOMM_HOST_DEVICE static int ops(Collective coll, int rank, int world, int root, int step,
                                    ScheduleOp* out) {
    if (world <= 1) return 0;
    const int next = mod(rank + 1, world);
    const int prev = mod(rank - 1, world);
    int n = 0;
    if (coll == Collective::kBroadcast) {
      // Chain from the root: position p receives chunk k at step k+p-1 and
      // forwards it at step k+p.
      const int p = mod(rank - root, world);
      const int send_k = step - p;
      if (p < world - 1 && send_k >= 0 && send_k < kPipelineChunks) out[n++] = make_send(0, next, send_k);
      const int recv_k = step - p + 1;
      if (p > 0 && recv_k >= 0 && recv_k < kPipelineChunks)
        out[n++] = make_recv(OpKind::kRecvCopy, 0, prev, recv_k, step);
      return n;
    }
    const bool has_rs = coll == Collective::kAllReduce || coll == Collective::kReduceScatter;
    const int rs_steps = has_rs ? world - 1 : 0;
    if (step < rs_steps) {
      // 1. Reduce-scatter: pass a partial sum forward, fold the incoming one
      //    into our own; after n-1 steps rank r owns chunk r.
      out[n++] = make_send(0, next, mod(rank - step - 1, world));
      out[n++] = make_recv(OpKind::kRecvReduce, 0, prev, mod(rank - step - 2, world), step);
    } else {
      // 2. All-gather: circulate the finished chunks.
      const int s = step - rs_steps;
      out[n++] = make_send(1, next, mod(rank - s, world));
      out[n++] = make_recv(OpKind::kRecvCopy, 1, prev, mod(rank - s - 1, world), step);
    }
    return n;
  }
};

}  // namespace pycomm
