// CUDA top-k by magnitude (with fused error feedback) and sparse scatter-add:
// the twins of kernels/cpu/topk.cpp, same keys (quant.h), same results.
//
// Selection is a radix select over the 31-bit magnitude keys, one byte per
// pass, highest first: a histogram pass, then a one-block step that picks
// the byte value holding the k-th largest key. The approximate mode stops
// refining as soon as the keys at or above the chosen byte are within
// [k, k(1 + tolerance)], after one to three passes; on a large
// tensor its passes run over a sample of chunks of it, and the count of the
// kept keys checks the threshold on the whole (topk_sample.h). The
// exact mode runs all four and then keeps the ties of the k-th key with the
// lowest indices (found by counting ties per range of the tensor: no pass
// at all once the approximate mode settled).
// Kept indices come out ascending: each range of the tensor counts its kept
// keys, then writes them from the slot the ranges before it leave.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <string>
#include <type_traits>

#include "../kernels_cuda.h"
#include "../quant.h"
#include "../topk_sample.h"
#include "common.cuh"

namespace pycomm {
namespace kernels {
namespace {

using cuda_detail::check;
using cuda_detail::grid_for;
using cuda_detail::kThreads;
constexpr int kBins = 256;

struct SelectState {
  uint32_t prefix;     // key bits fixed so far
  uint32_t mask;       // which bits those are
  uint32_t k_left;     // entries still to take at or below the current prefix
  uint32_t above;      // entries with a key above the current prefix range
  uint32_t done;       // approximate mode settled on a threshold
  uint32_t threshold;  // keep key >= threshold (approx) or key > threshold (exact) ...
  int32_t tie_cutoff;  // ... plus key == threshold with index <= tie_cutoff (exact)
  uint32_t counted;    // step 3's counts per range hold this selection's kept keys
};

template <typename T>
__device__ __forceinline__ uint32_t key_at(const T* x, size_t i) {
  return topk_key(load_acc(x[i]));
}

__global__ void fold_kernel_f32(const float* x, float* r, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    r[i] += x[i];
}

template <typename T>
__global__ void fold_kernel(const T* x, float* r, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    r[i] += load_acc(x[i]);
}

// Elements each lane of histogram_kernel loads before it bins any: a
// grid that fills the GPU once holds ~1 MB of single loads in flight, under
// what HBM needs to stream (bandwidth x latency, ~3 MB on an H200).
constexpr int kHistLoads = 4;
// Lanes of a row at most that bin with plain shared-memory atomics
// (histogram_kernel); more take a match first.
constexpr int kFewBinned = 8;

// The histogram of the keys at sample positions [0, m) (elements past n
// carry none) under the state's prefix, by the byte at `shift`.
template <typename T>
__global__ void histogram_kernel(const T* x, size_t n, size_t m, size_t stride, const SelectState* st, int shift,
                                 uint32_t* hist) {
  static_assert(kSampleChunk % (32 * kHistLoads) == 0, "a warp's span lies within one sampled chunk");
  if (st->done) return;
  __shared__ uint32_t local[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix, mask = st->mask;
  // Lanes of a warp that hit one bin add once, by their count: the first
  // pass bins by the top byte of the magnitude (mostly the exponent), where
  // nearly every element of a tensor lands in a handful of bins, and one
  // shared-memory atomic per element serialized on them. A warp takes
  // kHistLoads rows of 32 consecutive elements at a time; every lane runs
  // the same iterations (the match needs the whole warp), and lanes past
  // the end carry no key.
  const int lane = threadIdx.x % 32;
  constexpr size_t kSpan = 32 * kHistLoads;
  const size_t warp = (blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x) / 32;
  const size_t warps = static_cast<size_t>(gridDim.x) * (blockDim.x / 32);
  for (size_t w = warp * kSpan; w < m; w += warps * kSpan) {
    // The loads first, unconditional where the warp's span is whole, so
    // that they are in flight together. A span is consecutive elements.
    uint32_t key[kHistLoads];
    bool in[kHistLoads];
    const size_t first = sampled_index(w, stride, n);
    const bool whole = w + kSpan <= m && first + kSpan <= n;  // warp-uniform
    if (whole) {
#pragma unroll
      for (int u = 0; u < kHistLoads; ++u) {
        key[u] = key_at(x, first + 32 * u + lane);
        in[u] = true;
      }
    } else {
#pragma unroll
      for (int u = 0; u < kHistLoads; ++u) {
        const size_t i = first + 32 * u + lane;
        in[u] = w + 32 * u + lane < m && i < n;
        key[u] = in[u] ? key_at(x, i) : 0u;
      }
    }
    uint32_t bin[kHistLoads];
#pragma unroll
    for (int u = 0; u < kHistLoads; ++u)
      bin[u] = in[u] && (key[u] & mask) == prefix ? (key[u] >> shift) & 0xffu : kBins;  // kBins: none
#pragma unroll
    for (int u = 0; u < kHistLoads; ++u) {
      // After the first pass only keys under the prefix are binned (a few
      // per cent of a tensor, when its k-th key lies in the tail): with few
      // lanes of a row binned, their atomics seldom meet, and the match
      // (which every row paid for, ~80 % of the SMs' issue slots at 16M on
      // an H200) costs more than it saves.
      const unsigned binned = __ballot_sync(0xffffffffu, bin[u] < kBins);
      if (__popc(binned) > kFewBinned) {
        const unsigned same = __match_any_sync(0xffffffffu, bin[u]);
        if (bin[u] < kBins && lane == __ffs(same) - 1)
          atomicAdd(&local[bin[u]], static_cast<uint32_t>(__popc(same)));
      } else if (bin[u] < kBins) {
        atomicAdd(&local[bin[u]], 1u);
      }
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x)
    if (local[b]) atomicAdd(&hist[b], local[b]);
}

// The byte value b of this pass's prefix, whose bin holds the k_left-th
// largest remaining key: `above` keys lie in the bins over it, `in_bin` in it.
__device__ void choose_byte(SelectState* st, int b, uint32_t above, uint32_t in_bin, int shift, bool last, bool exact,
                            uint32_t lo_ok, uint32_t hi_ok) {
  st->above += above;
  st->k_left -= above;
  st->prefix |= static_cast<uint32_t>(b) << shift;
  st->mask |= 0xffu << shift;
  const uint32_t at_or_above = st->above + in_bin;
  if (!exact && at_or_above >= lo_ok && at_or_above <= hi_ok) {
    st->done = 1;
    st->threshold = st->prefix;  // every key whose fixed bits are >= prefix
    st->tie_cutoff = -1;
  } else if (last) {
    st->threshold = st->prefix;  // the exact k-th key; k_left of its ties go
  }
}

// The selection's starting state and an empty histogram, from the launch's
// arguments: a copy from pageable host memory may wait for the stream.
__global__ void init_kernel(SelectState* st, SelectState init, uint32_t* hist) {
  if (threadIdx.x == 0) *st = init;
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
}

// One block of kBins threads: pick the byte value that holds the k-th
// largest key, then empty the histogram for the next pass. Thread t takes
// bin kBins - 1 - t, so a block-wide prefix sum gives each bin the keys in
// the bins above it, and the one thread whose bin holds the k_left-th
// records it; bin 0 takes what the bins above leave. (One thread walking
// the bins would wait for 256 loads from L2 one after another: tens of
// microseconds a pass, as long as the pass itself at 16M elements.)
__global__ void choose_kernel(SelectState* st, uint32_t* hist, int shift, bool last, bool exact, uint32_t lo_ok,
                              uint32_t hi_ok) {
  using Scan = cub::BlockScan<uint32_t, kBins>;
  __shared__ typename Scan::TempStorage scan;
  if (st->done) return;  // every thread reads the state before one of them writes it
  const uint32_t k_left = st->k_left;
  const int t = threadIdx.x;
  const int b = kBins - 1 - t;
  const uint32_t in_bin = hist[b];
  uint32_t above;
  Scan(scan).ExclusiveSum(in_bin, above);
  __syncthreads();
  if (above < k_left && (above + in_bin >= k_left || b == 0))
    choose_byte(st, b, above, in_bin, shift, last, exact, lo_ok, hi_ok);
  hist[b] = 0;  // each thread empties the bin it read
}

// Whether the key of element i is kept, from the selection's final state
// (read once per thread: read per element, as a functor given to
// cub::DeviceSelect was, its loads took more issue slots than the keys').
struct KeepTest {
  static constexpr bool kSkipWhenDone = false;
  static constexpr bool kSkipWhenCounted = true;  // the sample's check counted them
  uint32_t threshold;
  bool done;
  int32_t tie_cutoff;
  __device__ explicit KeepTest(const SelectState* st)
      : threshold(st->threshold), done(st->done != 0), tie_cutoff(st->tie_cutoff) {}
  __device__ bool operator()(uint32_t key, size_t i) const {
    if (done) return key >= threshold;
    return key > threshold || (key == threshold && static_cast<int64_t>(i) <= tie_cutoff);
  }
};

// The exact k-th key's ties complete the k with the lowest indices. The
// tensor is cut into `ranges` contiguous ranges; each block counts the ties
// in its own, then one block finds the range that holds the k_left-th tie
// and, in it, its index. Both do nothing once the approximate mode settled
// (the usual case: no pass over the tensor at all).
constexpr int kTieRanges = 1024;

int tie_ranges(size_t n) { return static_cast<int>(std::max<size_t>(1, std::min<size_t>(kTieRanges, n / 4096))); }

__device__ __forceinline__ void tie_range(size_t n, int ranges, int r, size_t* lo, size_t* hi) {
  const size_t per = (n + ranges - 1) / ranges;
  *lo = min(n, static_cast<size_t>(r) * per);
  *hi = min(n, *lo + per);
}

// Block-wide inclusive prefix count of `flag` over threadIdx order, and the
// block's total (every thread gets both).
__device__ uint32_t block_prefix_count(bool flag, uint32_t* total) {
  __shared__ uint32_t warp_count[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const uint32_t in_warp = __popc(ballot & (0xffffffffu >> (31 - lane)));
  if (lane == 31) warp_count[warp] = in_warp;
  __syncthreads();
  uint32_t before = 0, all = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? warp_count[w] : 0;
    all += warp_count[w];
  }
  __syncthreads();  // warp_count is reused by the next call
  *total = all;
  return before + in_warp;
}

// Calls f(key, i, in) for the keys of [lo, hi), a row of blockDim elements
// at a time, with kHistLoads rows' loads of a thread in flight before the
// first call (~1024 blocks hold too few single loads for HBM). Every thread
// makes the same calls (`in` false past hi): f may take a block-wide step.
template <typename T, typename F>
__device__ __forceinline__ void for_keys_in_range(const T* x, size_t lo, size_t hi, F&& f) {
  for (size_t b = lo; b < hi; b += kHistLoads * blockDim.x) {
    uint32_t key[kHistLoads];
#pragma unroll
    for (int u = 0; u < kHistLoads; ++u) {
      const size_t i = b + u * blockDim.x + threadIdx.x;
      key[u] = i < hi ? key_at(x, i) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kHistLoads; ++u) {
      const size_t i = b + u * blockDim.x + threadIdx.x;
      f(key[u], i, i < hi);
    }
  }
}

// The keys of each range that pass Test (TieTest: the ties of the exact
// k-th key, skipped once the approximate mode settled; KeepTest: the kept
// ones), one count per block.
struct TieTest {
  static constexpr bool kSkipWhenDone = true;
  static constexpr bool kSkipWhenCounted = false;
  uint32_t threshold;
  __device__ explicit TieTest(const SelectState* st) : threshold(st->threshold) {}
  __device__ bool operator()(uint32_t key, size_t) const { return key == threshold; }
};

template <typename T, typename Test>
__global__ void range_count_kernel(const T* x, size_t n, const SelectState* st, int ranges, uint32_t* counts) {
  if ((Test::kSkipWhenDone && st->done) || (Test::kSkipWhenCounted && st->counted)) return;
  __shared__ uint32_t total;
  if (threadIdx.x == 0) total = 0;
  const Test test(st);
  __syncthreads();
  size_t lo, hi;
  tie_range(n, ranges, blockIdx.x, &lo, &hi);
  uint32_t c = 0;
  for_keys_in_range(x, lo, hi, [&](uint32_t key, size_t i, bool in) { c += in && test(key, i); });
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % 32 == 0) atomicAdd(&total, c);
  __syncthreads();
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

// The counts of ranges kPer t .. kPer t + kPer - 1 of thread t, those
// below `limit` (0 from it on), into c; returns their sum. One thread would
// wait for 1024 loads from L2 one after another.
constexpr int kRangesPerThread = kTieRanges / kThreads;
static_assert(kTieRanges % kThreads == 0, "tie ranges split evenly over the threads");

__device__ __forceinline__ uint32_t thread_range_counts(const uint32_t* counts, int limit,
                                                        uint32_t (&c)[kRangesPerThread]) {
  uint32_t sum = 0;
#pragma unroll
  for (int j = 0; j < kRangesPerThread; ++j) {
    const int r = threadIdx.x * kRangesPerThread + j;
    c[j] = r < limit ? counts[r] : 0u;
    sum += c[j];
  }
  return sum;
}

template <typename T>
__global__ void tie_cutoff_kernel(const T* x, size_t n, SelectState* st, int ranges, const uint32_t* counts) {
  if (st->done) return;
  const uint32_t need = st->k_left;
  // 1. The range that holds the need-th tie, and the ties before it: thread
  //    t adds the counts of its ranges (thread_range_counts), a block-wide
  //    prefix sum gives it the ties before them, and the thread whose ranges
  //    reach `need` names the range.
  constexpr int kPer = kRangesPerThread;
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int range;
  __shared__ uint32_t seen0;
  uint32_t c[kPer];
  const uint32_t mine = thread_range_counts(counts, ranges, c);
  uint32_t before, all;
  Scan(scan).ExclusiveSum(mine, before, all);
  if (threadIdx.x == 0) {
    range = ranges;  // fewer ties than needed, unless a thread finds it
    seen0 = all;
  }
  __syncthreads();
  if (need > 0) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int r = threadIdx.x * kPer + j;
      if (r < ranges && before < need && before + c[j] >= need) {
        range = r;
        seen0 = before;
      }
      before += c[j];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // No tie needed: none kept; fewer ties than needed: all of them.
    if (need == 0) st->tie_cutoff = -1;
    else if (range == ranges) st->tie_cutoff = INT32_MAX;
  }
  if (need == 0 || range == ranges) return;
  // 2. In it, the index of that tie.
  size_t lo, hi;
  tie_range(n, ranges, range, &lo, &hi);
  const uint32_t threshold = st->threshold;
  uint32_t seen = seen0;  // the same in every thread
  for (size_t base = lo; base < hi && seen < need; base += blockDim.x) {
    const size_t i = base + threadIdx.x;
    const bool tie = i < hi && key_at(x, i) == threshold;
    uint32_t total;
    const uint32_t upto = block_prefix_count(tie, &total);
    if (tie && seen + upto == need) st->tie_cutoff = static_cast<int32_t>(i);
    seen += total;
  }
}

// After the sample's passes: the kept keys of the whole tensor (step 3's
// counts per range), summed. Within [lo_ok, hi_ok] the selection stands and
// step 3 reuses the counts; otherwise it starts over (`restart`) on the
// whole tensor.
__global__ void check_sample_kernel(SelectState* st, const uint32_t* counts, int ranges, SelectState restart,
                                    uint32_t lo_ok, uint32_t hi_ok) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  uint32_t c[kRangesPerThread];
  const uint32_t total = Reduce(reduce).Sum(thread_range_counts(counts, ranges, c));
  if (threadIdx.x != 0) return;
  if (st->done && total >= lo_ok && total <= hi_ok)
    st->counted = 1;
  else
    *st = restart;
}

// 3. The kept indices in ascending order, as cub::DeviceSelect gave them,
// in two passes over the tie ranges: each block counts the kept keys of its
// range, then writes them from the slot the ranges before it leave. cub's
// single pass (a look-back across tiles) ran at a quarter of the copy
// bandwidth here (54 us at 16M, H200); two passes with four loads of a
// thread in flight read the tensor twice at near the copy rate.
template <typename T>
__global__ void kept_write_kernel(const T* x, size_t n, const SelectState* st, int ranges, const uint32_t* counts,
                                  int32_t* idx, int* kept) {
  // 1. The first slot of this block's range: the kept keys of the ranges
  //    before it (and, in the last block, of all: the count kept).
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ uint32_t first;
  uint32_t c[kRangesPerThread];
  const uint32_t before = Reduce(reduce).Sum(thread_range_counts(counts, static_cast<int>(blockIdx.x), c));
  if (threadIdx.x == 0) {
    first = before;
    if (blockIdx.x == gridDim.x - 1) *kept = static_cast<int>(before + counts[blockIdx.x]);
  }
  const KeepTest keep(st);
  __syncthreads();
  // 2. The range's kept indices, in order: kHistLoads loads of a thread in
  //    flight, then a block-wide prefix count per row of blockDim elements.
  size_t lo, hi;
  tie_range(n, ranges, blockIdx.x, &lo, &hi);
  uint32_t slot = first;
  for_keys_in_range(x, lo, hi, [&](uint32_t key, size_t i, bool in) {
    const bool kept_here = in && keep(key, i);
    uint32_t row;
    const uint32_t upto = block_prefix_count(kept_here, &row);
    if (kept_here) idx[slot + upto - 1] = static_cast<int32_t>(i);
    slot += row;
  });
}

template <typename T>
__global__ void gather_kernel(const T* x, const float* eff, float* residual, const int32_t* idx, const int* count,
                              size_t cap, T* values, int32_t* indices) {
  const size_t c = min(static_cast<size_t>(*count), cap);
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < c;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int32_t i = idx[j];
    const float v = eff ? eff[i] : load_acc(x[i]);
    const T stored = store_acc<T>(v);
    values[j] = stored;
    indices[j] = i;
    if (residual) residual[i] = sent_residual(v, load_acc(stored));
  }
}

// topk_cpu's rule for Inf and NaN left in the residual: none is kept for
// later (an overflow step of a scaled loss puts them everywhere, and each
// step would send k of them until all had gone). Unsent ones exist only if
// the selection's threshold is a non-finite key: every sent value is then
// non-finite too, which is when the CPU drops them. `st` null: nothing was
// selected (k = 0), drop them whatever the state.
__global__ void drop_non_finite_kernel(float* r, size_t n, const SelectState* st) {
  if (st != nullptr && st->threshold < kTopkNonFiniteKey) return;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    if (!is_finite_f(r[i])) r[i] = 0.f;
}

template <typename V, typename D>
__global__ void scatter_kernel(const V* values, const int32_t* indices, size_t count, D* dense, size_t n, int* bad) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int32_t i = indices[j];
    if (i < 0 || static_cast<size_t>(i) >= n) {
      if (bad) atomicAdd(bad, 1);
      continue;
    }
    if constexpr (std::is_same_v<D, float>) {
      atomicAdd(&dense[i], load_acc(values[j]));
    } else {
      // 16-bit dense: atomics on the 32-bit word holding the element.
      auto* word = reinterpret_cast<unsigned int*>(reinterpret_cast<uintptr_t>(&dense[i]) & ~uintptr_t(3));
      const bool high = (reinterpret_cast<uintptr_t>(&dense[i]) & 2) != 0;
      unsigned int old = *word, assumed;
      do {
        assumed = old;
        D cur;
        cur.bits = static_cast<uint16_t>(high ? (assumed >> 16) : (assumed & 0xffffu));
        const D upd = store_acc<D>(load_acc(cur) + load_acc(values[j]));
        const unsigned int nw = high ? ((assumed & 0xffffu) | (static_cast<unsigned int>(upd.bits) << 16))
                                     : ((assumed & 0xffff0000u) | upd.bits);
        old = atomicCAS(word, assumed, nw);
      } while (old != assumed);
    }
  }
}




// Workspace: state | histogram | counter | counts per range (ties, then
// kept) | n kept indices.
struct Layout {
  size_t state = 0, hist, counters, ranges, idx, total;
  explicit Layout(size_t n) {
    hist = 64;
    counters = hist + kBins * 4;
    ranges = counters + 64;
    idx = ranges + kTieRanges * 4;
    total = idx + n * 4;
  }
};

}  // namespace

size_t topk_cuda_workspace_bytes(size_t n) { return Layout(n).total; }

size_t topk_cuda(const TopK& s, DType dtype, const void* x, float* residual, size_t n, size_t cap, void* values,
                 int32_t* indices, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (n > static_cast<size_t>(INT32_MAX)) throw CommError("pycomm: top-k indexes with int32");
  const Layout lay(n);
  if (workspace_bytes < lay.total) throw CommError("pycomm: topk_cuda workspace too small");
  auto* base = static_cast<uint8_t*>(workspace);
  auto* st = reinterpret_cast<SelectState*>(base + lay.state);
  auto* hist = reinterpret_cast<uint32_t*>(base + lay.hist);
  auto* counters = reinterpret_cast<int*>(base + lay.counters);
  auto* range_counts = reinterpret_cast<uint32_t*>(base + lay.ranges);
  auto* idx = reinterpret_cast<int32_t*>(base + lay.idx);
  const size_t k = s.k < n ? s.k : n;
  const uint32_t lo_ok = static_cast<uint32_t>(k);  // as on the CPU: a superset of the exact top-k
  const uint32_t hi_ok = static_cast<uint32_t>(topk_capacity(k, n, false, s.tolerance));
  size_t kept = 0;
  with_float_type(dtype, "CUDA topk", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xt = static_cast<const T*>(x);
    // 0. Error feedback: the residual becomes x + residual and is selected from.
    if (residual) {
      if constexpr (std::is_same_v<T, float>) {
        fold_kernel_f32<<<grid_for(n), kThreads, 0, stream>>>(xt, residual, n);
      } else {
        fold_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(xt, residual, n);
      }
    }
    if (k == 0) {
      if (residual && n > 0)
        drop_non_finite_kernel<<<cuda_detail::resident_grid(drop_non_finite_kernel, n), kThreads, 0, stream>>>(
            residual, n, nullptr);
      return;
    }
    auto run = [&](auto* eff) {
      using E = std::remove_cv_t<std::remove_pointer_t<decltype(eff)>>;
      const SelectState init{0, 0, static_cast<uint32_t>(k), 0, k >= n ? 1u : 0u, 0, -1, 0};
      // 1. Radix select, highest byte first (the key has 31 bits); each
      //    choice leaves the histogram empty for the next pass.
      const int shifts[4] = {23, 15, 7, 0};
      auto radix_passes = [&](size_t m, size_t stride, uint32_t lo, uint32_t hi, bool exact) {
        const unsigned grid = cuda_detail::resident_grid(histogram_kernel<E>, (m + kHistLoads - 1) / kHistLoads);
        for (int p = 0; p < 4; ++p) {
          histogram_kernel<E><<<grid, kThreads, 0, stream>>>(eff, n, m, stride, st, shifts[p], hist);
          choose_kernel<<<1, kBins, 0, stream>>>(st, hist, shifts[p], p == 3, exact, lo, hi);
        }
      };
      const int ranges = tie_ranges(n);
      const Sample sample(n, k, s.exact, s.tolerance);
      if (sample.stride > 1) {
        // 1a. Sampled mode on a large tensor: the passes over the sample,
        //     then step 3's count of the kept keys checks the threshold on
        //     the whole tensor (topk_sample.h); a miss starts over.
        SelectState on_sample = init;
        on_sample.k_left = sample.lo;
        init_kernel<<<1, kBins, 0, stream>>>(st, on_sample, hist);
        radix_passes(sample.m, sample.stride, sample.lo, sample.hi, false);
        range_count_kernel<E, KeepTest><<<ranges, kThreads, 0, stream>>>(eff, n, st, ranges, range_counts);
        check_sample_kernel<<<1, kThreads, 0, stream>>>(st, range_counts, ranges, init, lo_ok, hi_ok);
      } else {
        init_kernel<<<1, kBins, 0, stream>>>(st, init, hist);
      }
      // 1b. Over the whole tensor (nothing once a sample settled it).
      radix_passes(n, 1, lo_ok, hi_ok, s.exact);
      // 2. Unless the approximate mode settled: the lowest-index ties of
      //    the k-th key complete the k.
      range_count_kernel<E, TieTest><<<ranges, kThreads, 0, stream>>>(eff, n, st, ranges, range_counts);
      tie_cutoff_kernel<E><<<1, kThreads, 0, stream>>>(eff, n, st, ranges, range_counts);
      // 3. Everything kept, in index order, then values and residuals (the
      //    counts per range are the sample check's, where it held).
      range_count_kernel<E, KeepTest><<<ranges, kThreads, 0, stream>>>(eff, n, st, ranges, range_counts);
      kept_write_kernel<E><<<ranges, kThreads, 0, stream>>>(eff, n, st, ranges, range_counts, idx, counters);
      gather_kernel<T><<<grid_for(cap), kThreads, 0, stream>>>(xt, residual, residual, idx, counters, cap,
                                                               static_cast<T*>(values), indices);
      if (residual && k < n)
        drop_non_finite_kernel<<<cuda_detail::resident_grid(drop_non_finite_kernel, n), kThreads, 0, stream>>>(
            residual, n, st);
      int count = 0;
      check(cudaMemcpyAsync(&count, counters, sizeof count, cudaMemcpyDeviceToHost, stream), "topk count");
      check(cudaStreamSynchronize(stream), "topk");
      kept = static_cast<size_t>(count);
    };
    if (residual) {
      run(static_cast<const float*>(residual));
    } else {
      run(xt);
    }
  });
  check(cudaGetLastError(), "topk");
  if (kept > cap)
    throw CommError("pycomm: top-k kept " + std::to_string(kept) + " values but the output holds " +
                    std::to_string(cap));
  return kept;
}

void scatter_add_cuda(DType val_dtype, const void* values, const int32_t* indices, size_t count, DType dense_dtype,
                      void* dense, size_t n, int* bad, cudaStream_t stream) {
  if (count == 0) return;
  with_float_type(val_dtype, "CUDA scatter_add", [&](auto* vtag) {
    using V = std::remove_pointer_t<decltype(vtag)>;
    with_float_type(dense_dtype, "CUDA scatter_add", [&](auto* dtag) {
      using D = std::remove_pointer_t<decltype(dtag)>;
      scatter_kernel<V, D><<<grid_for(count), kThreads, 0, stream>>>(static_cast<const V*>(values), indices, count,
                                                                      static_cast<D*>(dense), n, bad);
    });
  });
  check(cudaGetLastError(), "scatter_add");
}

}  // namespace kernels
}  // namespace pycomm
