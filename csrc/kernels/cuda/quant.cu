// CUDA blockwise quantization: the twins of kernels/cpu/quant.cpp, built on
// the same per-element math (quant.h), so payloads are bit-identical across
// CPU and GPU (compile with --fmad=false, as setup.py does).
//
// Blocks of 64 to 512 elements (the usual ones): one warp per quantization
// block, each lane holding 2 to 16 of its elements in registers, so the
// value is read once, the absmax takes five shuffles and no barrier, and no
// element pays for 64-bit index division. Nsight Compute showed the kernels
// before them (one thread block per quantization block, one element per
// thread, two block-wide reductions, a division per dequantized element)
// bound by instruction issue at 21-35 % of an H200's copy bandwidth, DRAM
// 8-14 % busy. Other block sizes take those block-wide kernels.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../kernels_cuda.h"
#include "../quant.h"
#include "common.cuh"

namespace pycomm {
namespace kernels {
namespace {

using cuda_detail::check;
using cuda_detail::grid_for;
using cuda_detail::kThreads;

template <typename T> __device__ __forceinline__ float load_f(const T* p, size_t i) { return load_acc(p[i]); }

// Block-wide unsigned max (all threads get the result).
__device__ uint32_t block_max(uint32_t v, uint32_t* smem) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x + 31) / 32 ? smem[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) smem[0] = v;
  }
  __syncthreads();
  const uint32_t out = smem[0];
  __syncthreads();
  return out;
}

// Sum of the dense addend and the quantized sources at element i of block
// blk, in the CPU kernel's order; then post_scale.
struct Sources {
  const uint8_t* p[kMaxCudaSources];
  int n;
};

// The code of element i (global; j within its block) of a payload's codes.
__device__ __forceinline__ int code_at(const uint8_t* codes, int bits, size_t i, int j) {
  if (bits == 8) return reinterpret_cast<const int8_t*>(codes)[i];
  const uint8_t byte = codes[i / 2];
  return code_of_nibble((j & 1) ? static_cast<uint8_t>(byte >> 4) : byte);
}

__device__ float dequant_at(const uint8_t* payload, size_t nblocks, int bits, int block, size_t blk, size_t i_in_blk) {
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
  template <int E>
  __device__ __forceinline__ void lane_values(size_t blk, size_t base, int lane, int m, float (&v)[E]) const {
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      v[k] = j < m ? (*this)(blk, j, base + j) : 0.f;
    }
  }
  const uint32_t* cancel = nullptr;
};


template <typename D>
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
  template <int E>
  __device__ __forceinline__ void lane_values(size_t blk, size_t base, int lane, int m, float (&v)[E]) const {
    // 16 to 32 codes of a lane in registers per group (1 to 8 sources): at
    // blocks of 256, 4 sources' loads in one round trip with 2 thread blocks
    // resident per SM (~120 registers); blocks of 512 take one source at a
    // time, or a single thread block would fit an SM.
    constexpr int kGroup = E >= 16 ? 1 : (32 / E < 8 ? 32 / E : 8);
    float res[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      v[k] = dense && j < m ? load_f(dense, base + j) : 0.f;
      res[k] = r && j < m ? r[base + j] : 0.f;
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
            c[q][k] = j < m ? code_at(p + nblocks * 4, bits, base + j, j) : 0;
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (s0 + q < s.n) {
#pragma unroll
          for (int k = 0; k < E; ++k) {
            const float d = dequant_code(c[q][k], stored[q], bits);
            v[k] = (s0 + q == 0 && !dense) ? d : v[k] + d;
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      float a = v[k];
      if (post_scale != 1.f) a *= post_scale;
      if (r) a += res[k];
      v[k] = lane + 32 * k < m ? a : 0.f;
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

constexpr int kWarps = kThreads / 32;

// Calls f(blk, base, m) for each of this warp's quantization blocks of
// kBlock elements (block blk starts at element base and holds m: the last
// may be short). A warp's lanes agree on every argument, so every shuffle in
// f is warp-uniform.
template <int kBlock, typename F>
__device__ __forceinline__ void for_warp_blocks(size_t n, F&& f) {
  const size_t nb = quant_num_blocks(n, kBlock);
  for (size_t blk = blockIdx.x * static_cast<size_t>(kWarps) + threadIdx.x / 32; blk < nb;
       blk += static_cast<size_t>(gridDim.x) * kWarps) {
    const size_t base = blk * kBlock;
    f(blk, base, static_cast<int>(min(static_cast<size_t>(kBlock), n - base)));
  }
}

// The padding after the codes travels too (the CPU kernel zeroes it): keep
// its bytes deterministic, or payloads differ between devices and runs.
__device__ void zero_payload_tail(uint8_t* payload, size_t n, int bits, int block) {
  if (blockIdx.x != 0) return;
  const size_t used = quant_num_blocks(n, block) * 4 + quant_code_bytes(n, bits);
  const size_t end = quant_payload_bytes(n, bits, block);
  for (size_t p = used + threadIdx.x; p < end; p += blockDim.x) payload[p] = 0;
}

// One quantization block of 32 * E elements per warp; lane l holds elements
// l, l + 32, ..., l + 32 (E - 1) of it (each register row a coalesced
// 32-element access of the warp).
template <int E, typename V>
__global__ void quantize_warp_kernel(V value, size_t n, int bits, bool stochastic, uint64_t key,
                                     uint64_t index_base, uint8_t* payload, float* residual) {
  constexpr int kBlock = 32 * E;
  if (cancelled(value.cancel)) return;
  const size_t nb = quant_num_blocks(n, kBlock);
  float* scales = reinterpret_cast<float*>(payload);
  uint8_t* codes = payload + nb * 4;
  const int lane = threadIdx.x % 32;
  for_warp_blocks<kBlock>(n, [&](size_t blk, size_t base, int m) {
    // 1. The values (elements past the end count as 0, which no absmax
    //    notices) and their largest magnitude; finite values only if the
    //    block holds NaN/Inf.
    float v[E];
    value.lane_values(blk, base, lane, m, v);
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
    // 2. Codes and residuals. Int4: an even lane's element and the next
    //    lane's share a byte (blocks hold an even number of elements, so a
    //    pair never straddles two); past the end the code is 0, as on the CPU.
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      const size_t i = base + j;
      int c = 0;
      if (j < m) {
        const float u = stochastic ? uniform01(key, index_base + i) : -1.f;
        c = quant_code(v[k], b, u);
        if (residual) residual[i] = quant_residual(v[k], dequant_code(c, stored, bits));
      }
      if (bits == 8) {
        if (j < m) reinterpret_cast<int8_t*>(codes)[i] = static_cast<int8_t>(c);
      } else {
        const int next = __shfl_down_sync(0xffffffffu, c, 1);
        if ((lane & 1) == 0 && j < m) codes[i / 2] = static_cast<uint8_t>(nibble_of(c) | (nibble_of(next) << 4));
      }
    }
  });
  zero_payload_tail(payload, n, bits, kBlock);
}

// Dequantize with the layout of quantize_warp_kernel: the scale read once
// per lane and block, no index division. A lane loads all its codes (and,
// accumulating, all its outputs) before it stores any: a store between two
// loads keeps the second from being issued before the first has returned
// (the compiler cannot tell that the output and the payload do not overlap).
template <int E, typename T>
__global__ void dequantize_warp_kernel(const uint8_t* payload, size_t n, int bits, T* out, bool accumulate,
                                       const uint32_t* cancel) {
  constexpr int kBlock = 32 * E;
  if (cancelled(cancel)) return;
  const uint8_t* codes = payload + quant_num_blocks(n, kBlock) * 4;
  const int lane = threadIdx.x % 32;
  for_warp_blocks<kBlock>(n, [&](size_t blk, size_t base, int m) {
    const float stored = reinterpret_cast<const float*>(payload)[blk];  // the block's scale
    // 1. Loads.
    int c[E];
    float prev[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      const size_t i = base + j;
      c[k] = j < m ? code_at(codes, bits, i, j) : 0;
    }
    if (accumulate) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const int j = lane + 32 * k;
        prev[k] = j < m ? load_acc(out[base + j]) : 0.f;
      }
    }
    // 2. Values.
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      if (j < m) {
        const float d = dequant_code(c[k], stored, bits);
        out[base + j] = store_acc<T>(accumulate ? prev[k] + d : d);
      }
    }
  });
}

// dequantize_warp_kernel with two neighbouring elements per lane and step
// (lane l takes elements 2l, 2l + 1, then 2l + 64, ...): one load of two
// int8 codes and one store of two outputs where the other kernel makes two of
// each. Both kernels issued about 0.7-0.75 G elements per ms on an H200
// whatever the bytes, so 16-bit outputs (3 bytes an element) reached 57 % of
// the copy bandwidth against 87 % for float32: instructions, not memory.
// Needs the output aligned to two elements and int8 codes to two bytes
// (launch_dequantize checks; the other kernel takes the rest).
template <typename T>
struct alignas(2 * sizeof(T)) TwoOf {
  T a, b;
};

template <int E, typename T>
__global__ void dequantize_pair_kernel(const uint8_t* payload, size_t n, int bits, T* out, bool accumulate,
                                       const uint32_t* cancel) {
  constexpr int kBlock = 32 * E;
  constexpr int kPairs = E / 2;
  if (cancelled(cancel)) return;
  const uint8_t* codes = payload + quant_num_blocks(n, kBlock) * 4;
  const int lane = threadIdx.x % 32;
  for_warp_blocks<kBlock>(n, [&](size_t blk, size_t base, int m) {
    const float stored = reinterpret_cast<const float*>(payload)[blk];  // the block's scale
    // 1. Loads: codes, then (accumulating) outputs. j is the pair's first
    //    element in the block (even: a whole int4 byte); only the block's
    //    last pair may be cut, when n is odd.
    int c0[kPairs], c1[kPairs];
    float p0[kPairs], p1[kPairs];
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const int j = 2 * (lane + 32 * k);
      c0[k] = c1[k] = 0;
      if (j + 1 < m) {
        if (bits == 8) {
          const char2 two = *reinterpret_cast<const char2*>(codes + base + j);
          c0[k] = static_cast<int8_t>(two.x);  // whatever char's signedness
          c1[k] = static_cast<int8_t>(two.y);
        } else {
          const uint8_t byte = codes[(base + j) / 2];
          c0[k] = code_of_nibble(byte);
          c1[k] = code_of_nibble(static_cast<uint8_t>(byte >> 4));
        }
      } else if (j < m) {
        c0[k] = code_at(codes, bits, base + j, j);
      }
    }
    if (accumulate) {
#pragma unroll
      for (int k = 0; k < kPairs; ++k) {
        const int j = 2 * (lane + 32 * k);
        p0[k] = p1[k] = 0.f;
        if (j + 1 < m) {
          const TwoOf<T> t = *reinterpret_cast<const TwoOf<T>*>(out + base + j);
          p0[k] = load_acc(t.a);
          p1[k] = load_acc(t.b);
        } else if (j < m) {
          p0[k] = load_acc(out[base + j]);
        }
      }
    }
    // 2. Values.
#pragma unroll
    for (int k = 0; k < kPairs; ++k) {
      const int j = 2 * (lane + 32 * k);
      const float d0 = dequant_code(c0[k], stored, bits), d1 = dequant_code(c1[k], stored, bits);
      if (j + 1 < m) {
        TwoOf<T> t;
        t.a = store_acc<T>(accumulate ? p0[k] + d0 : d0);
        t.b = store_acc<T>(accumulate ? p1[k] + d1 : d1);
        *reinterpret_cast<TwoOf<T>*>(out + base + j) = t;
      } else if (j < m) {
        out[base + j] = store_acc<T>(accumulate ? p0[k] + d0 : d0);
      }
    }
  });
}

// store_sum_kernel with the warp layout: no 64-bit division per element to
// find its quantization block.
template <int E, typename D, typename O>
__global__ void store_sum_warp_kernel(SumValue<D> sum, size_t n, O* out) {
  constexpr int kBlock = 32 * E;
  if (cancelled(sum.cancel)) return;
  const int lane = threadIdx.x % 32;
  for_warp_blocks<kBlock>(n, [&](size_t blk, size_t base, int m) {
    float v[E];
    sum.lane_values(blk, base, lane, m, v);
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = lane + 32 * k;
      if (j < m) out[base + j] = store_acc<O>(v[k]);
    }
  });
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

// One quantization block per thread block. `value(blk, j, i)` is recomputed
// in the second pass instead of staged: blocks may be larger than shared
// memory, and the re-read hits L2.
template <typename V>
__global__ void quantize_kernel(V value, size_t n, int bits, int block, bool stochastic, uint64_t key,
                                uint64_t index_base, uint8_t* payload, float* residual) {
  __shared__ uint32_t smem[32];
  if (cancelled(value.cancel)) return;
  const size_t nb = quant_num_blocks(n, block);
  float* scales = reinterpret_cast<float*>(payload);
  uint8_t* codes = payload + nb * 4;
  for (size_t blk = blockIdx.x; blk < nb; blk += gridDim.x) {
    const size_t base = blk * block;
    const size_t m = min(static_cast<size_t>(block), n - base);
    // 1. Largest magnitude; a second pass over finite values only if the
    //    block holds NaN/Inf.
    uint32_t amax = 0;
    for (size_t j = threadIdx.x; j < m; j += blockDim.x)
      amax = max(amax, float_to_bits(value(blk, j, base + j)) & 0x7fffffffu);
    amax = block_max(amax, smem);
    const bool flagged = amax >= 0x7f800000u;
    if (flagged) {
      amax = 0;
      for (size_t j = threadIdx.x; j < m; j += blockDim.x) {
        const uint32_t u = float_to_bits(value(blk, j, base + j)) & 0x7fffffffu;
        if (u < 0x7f800000u) amax = max(amax, u);
      }
      amax = block_max(amax, smem);
    }
    const BlockQuant b = make_block_quant(bits_to_float(amax), flagged, bits);
    const float stored = stored_scale(b);
    if (threadIdx.x == 0) scales[blk] = stored;
    // 2. Codes and residuals; int4 threads own a byte (two elements).
    const size_t step = bits == 8 ? 1 : 2;
    for (size_t j0 = threadIdx.x * step; j0 < m; j0 += blockDim.x * step) {
      uint8_t packed = 0;
      for (size_t e = 0; e < step; ++e) {
        const size_t j = j0 + e;
        int c = 0;
        if (j < m) {
          const size_t i = base + j;
          const float x = value(blk, j, i);
          const float u = stochastic ? uniform01(key, index_base + i) : -1.f;
          c = quant_code(x, b, u);
          if (residual) residual[i] = quant_residual(x, dequant_code(c, stored, bits));
        }
        if (bits == 8) {
          reinterpret_cast<int8_t*>(codes)[base + j] = static_cast<int8_t>(c);
        } else {
          packed |= static_cast<uint8_t>(nibble_of(c) << (4 * e));
        }
      }
      if (bits == 4) codes[(base + j0) / 2] = packed;
    }
  }
  zero_payload_tail(payload, n, bits, block);
}

// Quantizes `value` (input + residual, or the fused sum) with the warp
// kernel where the block size allows, else the block-wide one.
template <typename V>
void launch_quantize(const V& value, size_t n, int bits, int block, bool stochastic, uint64_t seed,
                     uint64_t index_base, uint8_t* payload, float* residual, cudaStream_t stream) {
  const size_t nb = quant_num_blocks(n, block);
  const bool warp = with_warp_block(block, [&](auto e) {
    quantize_warp_kernel<decltype(e)::value><<<grid_for(nb * 32), kThreads, 0, stream>>>(
        value, n, bits, stochastic, mix64(seed), index_base, payload, residual);
  });
  if (!warp)
    quantize_kernel<<<grid_for(nb * kThreads), kThreads, 0, stream>>>(value, n, bits, block, stochastic, mix64(seed),
                                                                      index_base, payload, residual);
}

template <typename T>
__global__ void dequantize_kernel(const uint8_t* payload, size_t n, int bits, int block, T* out, bool accumulate,
                                  const uint32_t* cancel) {
  if (cancelled(cancel)) return;
  const size_t nb = quant_num_blocks(n, block);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float v = dequant_at(payload, nb, bits, block, i / block, i % block);
    out[i] = store_acc<T>(accumulate ? load_acc(out[i]) + v : v);
  }
}

// The dense sum, rounded once into the output dtype like the CPU kernel.
template <typename T, typename O>
__global__ void store_sum_kernel(SumValue<T> sum, size_t n, O* out) {
  if (cancelled(sum.cancel)) return;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = store_acc<O>(sum(i / sum.block, i % sum.block, i));
}
}  // namespace

void quantize_cuda(const QuantSpec& s, DType dtype, const void* x, float* residual, size_t n, uint8_t* payload,
                   uint64_t index_base, cudaStream_t stream) {
  const size_t nb = quant_num_blocks(n, s.block);
  if (nb == 0) return;
  with_float_type(dtype, "CUDA quantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_quantize(InputValue<T>{static_cast<const T*>(x), residual}, n, s.bits, s.block, s.stochastic, s.seed,
                    index_base, payload, residual, stream);
  });
  check(cudaGetLastError(), "quantize");
}

void dequantize_cuda(int bits, int block, const uint8_t* payload, size_t n, DType dtype, void* out, bool accumulate,
                     cudaStream_t stream, const uint32_t* cancel) {
  if (n == 0) return;
  with_float_type(dtype, "CUDA dequantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool pairs = reinterpret_cast<uintptr_t>(out) % (2 * sizeof(T)) == 0 &&
                       (bits == 4 || reinterpret_cast<uintptr_t>(payload) % 2 == 0);
    const unsigned grid = grid_for(quant_num_blocks(n, block) * 32);
    const bool warp = with_warp_block(block, [&](auto e) {
      constexpr int E = decltype(e)::value;
      if (pairs)
        dequantize_pair_kernel<E, T><<<grid, kThreads, 0, stream>>>(payload, n, bits, static_cast<T*>(out),
                                                                     accumulate, cancel);
      else
        dequantize_warp_kernel<E, T><<<grid, kThreads, 0, stream>>>(payload, n, bits, static_cast<T*>(out),
                                                                     accumulate, cancel);
    });
    if (!warp)
      dequantize_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(payload, n, bits, block, static_cast<T*>(out),
                                                                  accumulate, cancel);
  });
  check(cudaGetLastError(), "dequantize");
}

void dequant_reduce_cuda(const DequantReduce& a, cudaStream_t stream) {
  if (a.nsrc > kMaxCudaSources)
    throw CommError("pycomm: dequant_reduce_cuda sums at most " + std::to_string(kMaxCudaSources) + " sources");
  if (a.n == 0) return;
  Sources src{};
  for (int k = 0; k < a.nsrc; ++k) src.p[k] = a.srcs[k];
  src.n = a.nsrc;
  const size_t nb = quant_num_blocks(a.n, a.block);
  with_float_type(a.dense ? a.dense_dtype : DType::kFloat32, "CUDA dequant_reduce", [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    SumValue<D> sum{src, static_cast<const D*>(a.dense), a.post_scale, nullptr, nb, a.bits, a.block, a.cancel};
    if (a.out) {
      with_float_type(a.out_dtype, "CUDA dequant_reduce", [&](auto* otag) {
        using O = std::remove_pointer_t<decltype(otag)>;
        const bool warp = with_warp_block(a.block, [&](auto e) {
          store_sum_warp_kernel<decltype(e)::value, D, O><<<grid_for(nb * 32), kThreads, 0, stream>>>(
              sum, a.n, static_cast<O*>(a.out));
        });
        if (!warp)
          store_sum_kernel<D, O><<<grid_for(a.n), kThreads, 0, stream>>>(sum, a.n, static_cast<O*>(a.out));
      });
    }
    if (a.out_payload) {
      sum.r = a.residual;
      launch_quantize(sum, a.n, a.bits, a.block, a.requant.stochastic, a.requant.seed, a.index_base, a.out_payload,
                      a.residual, stream);
    }
  });
  check(cudaGetLastError(), "dequant_reduce");
}

}  // namespace kernels
}  // namespace pycomm
