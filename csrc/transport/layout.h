// How every executor cuts a collective into rounds of chunks and finds each
// chunk in the caller's buffers (the model is in algorithms/schedule.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../algorithms/program.h"
#include "../algorithms/schedule.h"
#include "../core/collective.h"
#include "../kernels/kernels.h"

namespace pycomm {

// op=avg: every executor sums, then divides the output once by the number of
// ranks whose data it summed.
inline void finish_average(const CollectiveDesc& d, int world) {
  if (d.op == RedOp::kAvg && (d.coll == Collective::kAllReduce || d.coll == Collective::kReduceScatter))
    kernels::divide_cpu(d.dtype, d.output, d.count, static_cast<double>(world));
}

struct RoundLayout {
  // Chunk boundaries fall on cache lines, so that two ranks never write the
  // same line of a staging buffer.
  static constexpr size_t kChunkAlignBytes = 64;

  RoundLayout() = default;  // (kernel arguments are built field by field)
  // `round_bytes` bounds one round's K chunks together.
  RoundLayout(const CollectiveDesc& d, int num_chunks, int world, size_t round_bytes)
      : coll(d.coll), K(num_chunks), count(d.count), es(dtype_size(d.dtype)) {
    sharded = coll == Collective::kReduceScatter || coll == Collective::kAllGather || coll == Collective::kAllToAll;
    out_count = (coll == Collective::kAllGather || coll == Collective::kAllToAll) ? count * world : count;
    const size_t align = std::max<size_t>(1, kChunkAlignBytes / es);
    chunk_max = std::max<size_t>(align, (round_bytes / (K * es)) / align * align);
    per_round = sharded ? chunk_max : chunk_max * K;
    rounds = (count + per_round - 1) / per_round;
    align_ = align;
  }

  // Where chunk c of round j lies in the caller's buffers, in elements from
  // their start: in_off / out_off are -1 where the rank has no such chunk.
  // Host and device code (the CUDA executor of schedules) share it, so both
  // cut a call into the same chunks and reduce each in the same order.
  PYCOMM_HOST_DEVICE void span(uint64_t j, int c, int rank, int64_t* in_off, int64_t* out_off, size_t* len) const {
    const uint64_t first = j * per_round;
    const size_t rem = static_cast<size_t>(count - first < per_round ? count - first : per_round);
    if (sharded) {
      *len = rem;
      const int64_t shard = static_cast<int64_t>(static_cast<uint64_t>(c) * count + first);
      const int64_t own = static_cast<int64_t>(first);
      if (coll == Collective::kAllToAll) {
        *in_off = shard;
        *out_off = shard;
      } else if (coll == Collective::kReduceScatter) {
        *in_off = shard;
        *out_off = c == rank ? own : -1;
      } else {
        *in_off = c == rank ? own : -1;
        *out_off = shard;
      }
      return;
    }
    const size_t even = ((rem + K - 1) / K + align_ - 1) / align_ * align_;
    const size_t ce = even < chunk_max ? even : chunk_max;
    const size_t lo = c * ce < rem ? c * ce : rem, hi = (c + 1) * ce < rem ? (c + 1) * ce : rem;
    *len = hi - lo;
    *in_off = *out_off = static_cast<int64_t>(first + lo);
  }

  // Points round j's chunks into the caller's buffers: in[c] / out[c] are
  // null where the rank has no such chunk; len[c] is in elements.
  void chunks(uint64_t j, int rank, const void* input, void* output, std::vector<const char*>& in,
              std::vector<char*>& out, std::vector<size_t>& len) const {
    in.resize(K);
    out.resize(K);
    len.resize(K);
    const auto* src = static_cast<const char*>(input);
    auto* dst = static_cast<char*>(output);
    for (int c = 0; c < K; ++c) {
      int64_t i, o;
      span(j, c, rank, &i, &o, &len[c]);
      in[c] = i < 0 ? nullptr : src + i * es;
      out[c] = o < 0 ? nullptr : dst + o * es;
    }
  }

  Collective coll;
  int K;
  uint64_t count;
  size_t es;
  bool sharded;
  uint64_t out_count;  // elements of the output
  size_t chunk_max;    // elements of the largest chunk
  size_t per_round;    // elements of `count` one round covers
  uint64_t rounds;

 private:
  size_t align_;
};

// A program's pointers for one round (algorithms/program.h) of `rank`: every
// rank's mailbox half for it (`mailboxes[q]`: rank q's whole mailbox; the
// half alternates with `round_id`, the round's number across calls) and the
// chunks of round `j` of this call in the caller's buffers. The CUDA executor
// and its CPU twin both point their rounds here, so both cut a call alike.
PYCOMM_HOST_DEVICE void point_round(RoundPointers& p, const RoundLayout& layout, uint64_t round_id, uint64_t j,
                                    int rank, int world, char* const* mailboxes, const char* in, char* out) {
  p.chunk_bytes = layout.chunk_max * layout.es;
  p.phase_bytes = layout.K * p.chunk_bytes;
  const size_t half = kNumPhases * p.phase_bytes;  // program_mailbox_bytes is two of them
  for (int q = 0; q < world; ++q) p.mailbox[q] = mailboxes[q] + (round_id % 2) * half;
  for (int c = 0; c < layout.K; ++c) {
    int64_t i, o;
    layout.span(j, c, rank, &i, &o, &p.len[c]);
    p.in[c] = i < 0 ? nullptr : in + i * layout.es;
    p.out[c] = o < 0 ? nullptr : out + o * layout.es;
  }
}

}  // namespace pycomm
