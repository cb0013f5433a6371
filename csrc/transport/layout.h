// How every executor cuts a collective into rounds of chunks and finds each
// chunk in the caller's buffers (the model is in algorithms/schedule.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

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

  // Points round j's chunks into the caller's buffers: in[c] / out[c] are
  // null where the rank has no such chunk; len[c] is in elements.
  void chunks(uint64_t j, int rank, const void* input, void* output, std::vector<const char*>& in,
              std::vector<char*>& out, std::vector<size_t>& len) const {
    in.resize(K);
    out.resize(K);
    len.resize(K);
    const auto* src = static_cast<const char*>(input);
    auto* dst = static_cast<char*>(output);
    const uint64_t first = j * per_round;
    const size_t rem = static_cast<size_t>(std::min<uint64_t>(per_round, count - first));
    if (sharded) {
      for (int c = 0; c < K; ++c) {
        len[c] = rem;
        const size_t shard_off = (static_cast<size_t>(c) * count + first) * es;
        if (coll == Collective::kAllToAll) {
          in[c] = src + shard_off;
          out[c] = dst + shard_off;
        } else if (coll == Collective::kReduceScatter) {
          in[c] = src + shard_off;
          out[c] = c == rank ? dst + first * es : nullptr;
        } else {
          in[c] = c == rank ? src + first * es : nullptr;
          out[c] = dst + shard_off;
        }
      }
      return;
    }
    const size_t ce = std::min(chunk_max, ((rem + K - 1) / K + align_ - 1) / align_ * align_);
    for (int c = 0; c < K; ++c) {
      const size_t lo = std::min(rem, c * ce), hi = std::min(rem, (c + 1) * ce);
      len[c] = hi - lo;
      in[c] = src + (first + lo) * es;
      out[c] = dst + (first + lo) * es;
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

}  // namespace pycomm
