// The device side of the warp-per-block quantization kernels (quant.cu),
// shared with the fused quantized CUDA IPC all-reduce
// (compression/ipc_quantized.cu): the values to quantize (input + residual,
// or a sum of decoded sources), and one warp's quantize or dequantize of
// one quantization block, built on the per-element math of quant.h, so
// every kernel that uses them writes the CPU kernels' bits (compile with
// --fmad=false, as setup.py does).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../kernels_cuda.h"
#include "../quant.h"
#include "../reduce.h"

namespace pycomm {
namespace kernels {
namespace quant_detail {

template <typename T> __device__ __forceinline__ float load_f(const T* p, size_t i) { return load_acc(p[i]); }

// Sum of the dense addend and the quantized sources at element i of block
// blk, in the CPU kernel's order; then post_scale.
struct Sources {
  const uint8_t* p[kMaxCudaSources];
  int n;
};

// The code of element i (global; j within its block) of a payload's codes.
template <int kBits>
__device__ __forceinline__ int code_of(const uint8_t* codes, size_t i, int j) {
  if constexpr (kBits == 8) {
    return reinterpret_cast<const int8_t*>(codes)[i];
  } else {
    const uint8_t byte = codes[i / 2];
    return code_of_nibble((j & 1) ? static_cast<uint8_t>(byte >> 4) : byte);
  }
}

__device__ __forceinline__ int code_at(const uint8_t* codes, int bits, size_t i, int j) {
  return bits == 8 ? code_of<8>(codes, i, j) : code_of<4>(codes, i, j);
}

// What the warp kernels know of a quantization block before they touch its
// elements: the codec's bits (8 or 4) and whether the block is whole
// (m == 32 E, every block but a tensor's last), as compile-time constants.
// Tested element by element, the bits and the bound (j < m) compiled to a
// branch and a reconvergence point per element, in kernels bound by
// instruction issue; tested per block they are one warp-uniform branch.
template <int kBits_, bool kFull_>
struct BlockKind {
  static constexpr int kBits = kBits_;
  static constexpr bool kFull = kFull_;
};

// f(BlockKind<kBits, m == 32 E>{}), for a kernel built for one codec.
template <int E, int kBits, typename F>
__device__ __forceinline__ void with_block_full(int m, F&& f) {
  if (m == 32 * E) f(BlockKind<kBits, true>{});
  else f(BlockKind<kBits, false>{});
}

// f(BlockKind<bits, m == 32 E>{}).
template <int E, typename F>
__device__ __forceinline__ void with_block_kind(int bits, int m, F&& f) {
  if (bits == 8) with_block_full<E, 8>(m, f);
  else with_block_full<E, 4>(m, f);
}

// Whether element j of a block of m elements exists.
template <typename Kind>
__device__ __forceinline__ bool in_block(int j, int m) {
  return Kind::kFull || j < m;
}

__device__ __forceinline__ float dequant_at(const uint8_t* payload, size_t nblocks, int bits, int block, size_t blk,
                                            size_t i_in_blk) {
  const float stored = reinterpret_cast<const float*>(payload)[blk];
  return dequant_code(code_at(payload + nblocks * 4, bits, blk * block + i_in_blk, static_cast<int>(i_in_blk % 2)),
                      stored, bits);
}

// The value to quantize at element i (global) of the current call: either
// input + residual (quantize) or the fused sum (dequant_reduce).
// lane_values: the values of a lane's E elements of the block at `base`
// (lane, lane + 32, ...; 0 past the end, m elements in the block), for the
// warp kernels.
template <typename T>
struct InputValue {
  const T* x;
  const float* r;
  __device__ float operator()(size_t /*blk*/, size_t /*j*/, size_t i) const { return load_f(x, i) + (r ? r[i] : 0.f); }
  template <int E, typename Kind>
  __device__ __forceinline__ void lane_values(size_t blk, size_t base, int lane, int m, float (&v)[E]) const {
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      v[k] = in_block<Kind>(j, m) ? (*this)(blk, j, base + j) : 0.f;
    }
  }
  const uint32_t* cancel = nullptr;
};


// kMaxCodes: the most codes a lane holds in registers per group of sources
// (lane_values); kernels bound to fewer registers pass fewer.
template <typename D, int kMaxCodes = 32>
struct SumValue {
  Sources s;
  const D* dense;
  float post_scale;
  const float* r;  // added after post_scale (server error feedback)
  size_t nblocks;
  int bits, block;
  const uint32_t* cancel;  // see DequantReduce::cancel
  __device__ float operator()(size_t blk, size_t j, size_t i) const {
    float acc = dense ? load_f(dense, i) : 0.f;
    for (int k = 0; k < s.n; ++k) {
      const float d = dequant_at(s.p[k], nblocks, bits, block, blk, j);
      acc = (k == 0 && !dense) ? d : acc + d;
    }
    if (post_scale != 1.f) acc *= post_scale;
    return r ? acc + r[i] : acc;
  }
  // The same sums, a lane's E elements at once, with the loads of a group of
  // sources all issued before the first is used. Element by element (above)
  // the sources are a loop of runtime length: one load in flight per lane,
  // and the kernel waited on latency at a quarter of the copy bandwidth
  // (4 sources, H200). The additions keep operator()'s order, hence its bits.
  template <int E, typename Kind>
  __device__ __forceinline__ void lane_values(size_t blk, size_t base, int lane, int m, float (&v)[E]) const {
    // kMaxCodes / 2 to kMaxCodes codes of a lane in registers per group (1 to
    // 8 sources): at blocks of 256 and 32 codes, 4 sources' loads in one
    // round trip with 2 thread blocks resident per SM (~120 registers);
    // blocks of 512 take one source at a time, or a single thread block would
    // fit an SM.
    constexpr int kFit = kMaxCodes / E < 1 ? 1 : kMaxCodes / E;
    constexpr int kGroup = E >= 16 ? 1 : (kFit < 8 ? kFit : 8);
    float res[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      v[k] = dense && in_block<Kind>(j, m) ? load_f(dense, base + j) : 0.f;
      res[k] = r && in_block<Kind>(j, m) ? r[base + j] : 0.f;
    }
    for (int s0 = 0; s0 < s.n; s0 += kGroup) {
      int c[kGroup][E];
      float stored[kGroup];
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (s0 + q < s.n) {
          const uint8_t* p = s.p[s0 + q];
          stored[q] = reinterpret_cast<const float*>(p)[blk];
#pragma unroll
          for (int k = 0; k < E; ++k) {
            const int j = lane + 32 * k;
            c[q][k] = in_block<Kind>(j, m) ? code_of<Kind::kBits>(p + nblocks * 4, base + j, j) : 0;
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (s0 + q < s.n) {
          const bool first = s0 + q == 0 && !dense;
          // The flag tested once per source and block (dequant_code's
          // branches per element otherwise), with dequant_code's bits.
          if (!scale_flagged(stored[q])) {
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float d = dequant_code_unflagged(c[q][k], stored[q]);
              v[k] = first ? d : v[k] + d;
            }
          } else {
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float d = dequant_code(c[q][k], stored[q], Kind::kBits);
              v[k] = first ? d : v[k] + d;
            }
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      float a = v[k];
      if (post_scale != 1.f) a *= post_scale;
      if (r) a += res[k];
      v[k] = in_block<Kind>(lane + 32 * k, m) ? a : 0.f;
    }
  }
};

// A kernel whose `cancel` word (device memory) is non-zero when it starts
// does nothing: its sources may be a dead peer's memory (kernels_cuda.h).
// One read per thread block.
__device__ __forceinline__ bool cancelled(const uint32_t* cancel) {
  __shared__ int stop;
  if (threadIdx.x == 0) stop = cancel != nullptr && *reinterpret_cast<const volatile uint32_t*>(cancel) != 0;
  __syncthreads();
  return stop != 0;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls load(u, blk, base, m) for up to kU of this warp's quantization
// blocks of kBlock elements (block blk starts at element base and holds m:
// the last may be short), then use(u, blk, base, m) for each of them, and
// again until the warp's blocks are done: the kU blocks' loads are all in
// flight before any is used, where a kernel of few threads waited on one
// round trip per block. Warps take blocks in grid order. A warp's lanes
// agree on every argument, so every shuffle in load and use is
// warp-uniform. Which blocks a warp takes depends only on n and the launch
// shape: the fused IPC kernel relies on it (the same thread block of every
// rank touches the same quantization blocks).
template <int kBlock, int kU, typename Load, typename Use>
__device__ __forceinline__ void for_warp_blocks_batched(size_t n, Load&& load, Use&& use) {
  const size_t nb = quant_num_blocks(n, kBlock);
  const size_t warps = blockDim.x / 32, stride = gridDim.x * warps;
  for (size_t first = blockIdx.x * warps + threadIdx.x / 32; first < nb; first += kU * stride) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t blk = first + u * stride;
      if (blk < nb) load(u, blk, blk * kBlock, static_cast<int>(min(static_cast<size_t>(kBlock), n - blk * kBlock)));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t blk = first + u * stride;
      if (blk < nb) use(u, blk, blk * kBlock, static_cast<int>(min(static_cast<size_t>(kBlock), n - blk * kBlock)));
    }
  }
}

// f(blk, base, m) for each of this warp's blocks, one at a time.
template <int kBlock, typename F>
__device__ __forceinline__ void for_warp_blocks(size_t n, F&& f) {
  for_warp_blocks_batched<kBlock, 1>(
      n, [](int, size_t, size_t, int) {}, [&](int, size_t blk, size_t base, int m) { f(blk, base, m); });
}

// The padding after the codes travels too (the CPU kernel zeroes it): keep
// its bytes deterministic, or payloads differ between devices and runs.
__device__ __forceinline__ void zero_payload_tail(uint8_t* payload, size_t n, int bits, int block) {
  if (blockIdx.x != 0) return;
  const size_t used = quant_num_blocks(n, block) * 4 + quant_code_bytes(n, bits);
  const size_t end = quant_payload_bytes(n, bits, block);
  for (size_t p = used + threadIdx.x; p < end; p += blockDim.x) payload[p] = 0;
}

// Quantizes a warp's values of one quantization block (block blk, its
// first element at base, m elements; lane l holds elements l, l + 32, ...,
// l + 32 (E - 1): lane_values' layout). Scales and codes are the payload's
// (scales at [blk]); the residual, when given, is indexed like the values.
template <int E, typename Kind>
__device__ __forceinline__ void quantize_values(const float (&v)[E], size_t blk, size_t base, int m, int lane,
                                                bool stochastic, uint64_t key, uint64_t index_base, float* scales,
                                                uint8_t* codes, float* residual) {
  constexpr int bits = Kind::kBits;
  // 1. The largest magnitude (elements past the end count as 0, which no
  //    absmax notices); finite values only if the block holds NaN/Inf.
  uint32_t amax = 0;
#pragma unroll
  for (int k = 0; k < E; ++k) amax = max(amax, float_to_bits(v[k]) & 0x7fffffffu);
  amax = warp_max(amax);
  const bool flagged = amax >= 0x7f800000u;
  if (flagged) {
    amax = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const uint32_t u = float_to_bits(v[k]) & 0x7fffffffu;
      if (u < 0x7f800000u) amax = max(amax, u);
    }
    amax = warp_max(amax);
  }
  const BlockQuant b = make_block_quant(bits_to_float(amax), flagged, bits);
  const float stored = stored_scale(b);
  if (lane == 0) scales[blk] = stored;
  // 2. Codes and residuals; past the end the code is 0, as on the CPU. A
  //    block without NaN/Inf (nearly all) holds finite values only, and
  //    takes quant_code's and quant_residual's finite branches without
  //    testing each value. Int4: an even lane's element and the next lane's
  //    share a byte (blocks hold an even number of elements, so a pair never
  //    straddles two). Each code is stored as soon as it is known, which
  //    keeps a lane's codes out of registers.
  auto store = [&](int j, size_t i, int c) {
    if constexpr (bits == 8) {
      if (in_block<Kind>(j, m)) reinterpret_cast<int8_t*>(codes)[i] = static_cast<int8_t>(c);
    } else {
      const int next = __shfl_down_sync(0xffffffffu, c, 1);
      if ((lane & 1) == 0 && in_block<Kind>(j, m))
        codes[i / 2] = static_cast<uint8_t>(nibble_of(c) | (nibble_of(next) << 4));
    }
  };
  auto codes_of = [&](auto finite) {
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      const size_t i = base + j;
      int c = 0;
      if (in_block<Kind>(j, m)) {
        const float u = stochastic ? uniform01(key, index_base + i) : -1.f;
        if constexpr (decltype(finite)::value) {
          c = quant_code_finite(v[k], b, u);
          if (residual) residual[i] = v[k] - dequant_code_unflagged(c, stored);
        } else {
          c = quant_code(v[k], b, u);
          if (residual) residual[i] = quant_residual(v[k], dequant_code(c, stored, bits));
        }
      }
      store(j, i, c);
    }
  };
  if (!flagged)
    codes_of(std::true_type{});
  else
    codes_of(std::false_type{});
}

// Dequantizing. Either a lane takes elements lane, lane + 32, ... of a
// block (one code load and one store per element), or, with kPairs, two
// neighbouring elements per step (2 lane and 2 lane + 1, then 2 lane + 64,
// ...: one load of two int8 codes and one store of two outputs). Both
// layouts issued about 0.7-0.75 G elements per ms on an H200 whatever the
// bytes, so 16-bit outputs (3 bytes an element) reached 57 % of the copy
// bandwidth against 87 % for float32 one element at a time: instructions,
// not memory. Pairs need the output aligned to two elements and int8 codes
// to two bytes (pairs_fit).
//
// A lane's value k sits at element lane_elem(lane, k) of the block.
template <bool kPairs>
__device__ __forceinline__ int lane_elem(int lane, int k) {
  return kPairs ? 2 * (lane + 32 * (k / 2)) + (k & 1) : lane + 32 * k;
}

template <typename T>
struct alignas(2 * sizeof(T)) TwoOf {
  T a, b;
};

// A lane's codes of one block and the block's scale, loaded before any is
// used: a store between two loads keeps the second from being issued before
// the first has returned (the compiler cannot tell that the output and the
// payload do not overlap).
template <int E>
struct LaneCodes {
  int c[E];
  float stored;
};

template <int E, bool kPairs, typename Kind>
__device__ __forceinline__ void load_codes(const uint8_t* payload, const uint8_t* codes, size_t blk, size_t base,
                                           int m, int lane, LaneCodes<E>& lc) {
  lc.stored = reinterpret_cast<const float*>(payload)[blk];
#pragma unroll
  for (int k = 0; k < E; k += kPairs ? 2 : 1) {
    const int j = lane_elem<kPairs>(lane, k);  // even with kPairs: a whole int4 byte
    lc.c[k] = 0;
    if constexpr (kPairs) {
      lc.c[k + 1] = 0;
      if (in_block<Kind>(j + 1, m)) {
        if constexpr (Kind::kBits == 8) {
          const char2 two = *reinterpret_cast<const char2*>(codes + base + j);
          lc.c[k] = static_cast<int8_t>(two.x);  // whatever char's signedness
          lc.c[k + 1] = static_cast<int8_t>(two.y);
        } else {
          const uint8_t byte = codes[(base + j) / 2];
          lc.c[k] = code_of_nibble(byte);
          lc.c[k + 1] = code_of_nibble(static_cast<uint8_t>(byte >> 4));
        }
        continue;
      }
    }
    // Only a block's last pair may be cut (n odd).
    if (in_block<Kind>(j, m)) lc.c[k] = code_of<Kind::kBits>(codes, base + j, j);
  }
}

// The outputs a lane accumulates into, before it stores any.
template <int E, bool kPairs, typename Kind, typename T>
__device__ __forceinline__ void load_outputs(const T* out, size_t base, int m, int lane, float (&prev)[E]) {
#pragma unroll
  for (int k = 0; k < E; k += kPairs ? 2 : 1) {
    const int j = lane_elem<kPairs>(lane, k);
    prev[k] = 0.f;
    if constexpr (kPairs) {
      prev[k + 1] = 0.f;
      if (in_block<Kind>(j + 1, m)) {
        const TwoOf<T> t = *reinterpret_cast<const TwoOf<T>*>(out + base + j);
        prev[k] = load_acc(t.a);
        prev[k + 1] = load_acc(t.b);
        continue;
      }
    }
    if (in_block<Kind>(j, m)) prev[k] = load_acc(out[base + j]);
  }
}

// out = the decoded values (+ prev, accumulating: a select per element,
// where a compile-time flag doubled every dequantize kernel's code).
template <int E, bool kPairs, typename Kind, typename T>
__device__ __forceinline__ void store_decoded(const LaneCodes<E>& lc, size_t base, int m, int lane, T* out,
                                              bool accumulate, const float (&prev)[E]) {
  // The block's flag tested once, not per element (dequant_code's bits).
  float d[E];
  if (!scale_flagged(lc.stored)) {
#pragma unroll
    for (int k = 0; k < E; ++k) d[k] = dequant_code_unflagged(lc.c[k], lc.stored);
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) d[k] = dequant_code(lc.c[k], lc.stored, Kind::kBits);
  }
#pragma unroll
  for (int k = 0; k < E; k += kPairs ? 2 : 1) {
    const int j = lane_elem<kPairs>(lane, k);
    const float v0 = accumulate ? prev[k] + d[k] : d[k];
    if constexpr (kPairs) {
      if (in_block<Kind>(j + 1, m)) {
        TwoOf<T> t;
        t.a = store_acc<T>(v0);
        t.b = store_acc<T>(accumulate ? prev[k + 1] + d[k + 1] : d[k + 1]);
        *reinterpret_cast<TwoOf<T>*>(out + base + j) = t;
        continue;
      }
    }
    if (in_block<Kind>(j, m)) out[base + j] = store_acc<T>(v0);
  }
}

// One warp dequantizes one block into out (adding to it when accumulating).
template <int E, bool kPairs, typename T>
__device__ __forceinline__ void dequantize_block(const uint8_t* payload, const uint8_t* codes, size_t blk, size_t base,
                                                 int m, int lane, int bits, T* out, bool accumulate) {
  with_block_kind<E>(bits, m, [&](auto kind) {
    using Kind = decltype(kind);
    LaneCodes<E> lc;
    load_codes<E, kPairs, Kind>(payload, codes, blk, base, m, lane, lc);
    float prev[E];
    if (accumulate) load_outputs<E, kPairs, Kind>(out, base, m, lane, prev);
    store_decoded<E, kPairs, Kind>(lc, base, m, lane, out, accumulate, prev);
  });
}

// Whether the kPairs layout may write `out` (aligned to two elements)
// from `payload` (int8 codes aligned to two bytes; int4 bytes hold pairs).
template <typename T>
inline bool pairs_fit(const void* out, const void* payload, int bits) {
  return reinterpret_cast<uintptr_t>(out) % (2 * sizeof(T)) == 0 &&
         (bits == 4 || reinterpret_cast<uintptr_t>(payload) % 2 == 0);
}

// f(std::integral_constant<int, E>) for a block of 32 * E elements that the
// warp kernels take; false for the others.
template <typename F>
bool with_warp_block(int block, F&& f) {
  switch (block) {
    case 64: f(std::integral_constant<int, 2>{}); return true;
    case 128: f(std::integral_constant<int, 4>{}); return true;
    case 256: f(std::integral_constant<int, 8>{}); return true;
    case 512: f(std::integral_constant<int, 16>{}); return true;
    default: return false;
  }
}

}  // namespace quant_detail
}  // namespace kernels
}  // namespace pycomm
