// CUDA blockwise quantization: the twins of kernels/cpu/quant.cpp, built on
// the same per-element math (quant.h), so payloads are bit-identical across
// CPU and GPU (compile with --fmad=false, as setup.py does).
//
// One thread block per quantization block: a block's absmax is a block-wide
// reduction, and its codes are written by the same threads right after.
#include <cuda_runtime.h>

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

__device__ float dequant_at(const uint8_t* payload, size_t nblocks, int bits, int block, size_t blk, size_t i_in_blk) {
  const float stored = reinterpret_cast<const float*>(payload)[blk];
  const uint8_t* codes = payload + nblocks * 4;
  int c;
  if (bits == 8) {
    c = reinterpret_cast<const int8_t*>(codes)[blk * block + i_in_blk];
  } else {
    const uint8_t byte = codes[(blk * block + i_in_blk) / 2];
    c = code_of_nibble((i_in_blk % 2) ? static_cast<uint8_t>(byte >> 4) : byte);
  }
  return dequant_code(c, stored, bits);
}

// The value to quantize at element i (global) of the current call: either
// input + residual (quantize) or the fused sum (dequant_reduce).
template <typename T>
struct InputValue {
  const T* x;
  const float* r;
  __device__ float operator()(size_t /*blk*/, size_t /*j*/, size_t i) const { return load_f(x, i) + (r ? r[i] : 0.f); }
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
  // The padding after the codes travels too (the CPU kernel zeroes it): keep
  // its bytes deterministic, or payloads differ between devices and runs.
  if (blockIdx.x == 0) {
    const size_t used = nb * 4 + quant_code_bytes(n, bits);
    const size_t end = quant_payload_bytes(n, bits, block);
    for (size_t p = used + threadIdx.x; p < end; p += blockDim.x) payload[p] = 0;
  }
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
    InputValue<T> v{static_cast<const T*>(x), residual};
    quantize_kernel<<<grid_for(nb * kThreads), kThreads, 0, stream>>>(v, n, s.bits, s.block, s.stochastic,
                                                                      mix64(s.seed), index_base, payload, residual);
  });
  check(cudaGetLastError(), "quantize");
}

void dequantize_cuda(int bits, int block, const uint8_t* payload, size_t n, DType dtype, void* out, bool accumulate,
                     cudaStream_t stream, const uint32_t* cancel) {
  if (n == 0) return;
  with_float_type(dtype, "CUDA dequantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
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
        store_sum_kernel<D, O><<<grid_for(a.n), kThreads, 0, stream>>>(sum, a.n, static_cast<O*>(a.out));
      });
    }
    if (a.out_payload) {
      sum.r = a.residual;
      quantize_kernel<<<grid_for(nb * kThreads), kThreads, 0, stream>>>(
          sum, a.n, a.bits, a.block, a.requant.stochastic, mix64(a.requant.seed), a.index_base, a.out_payload,
          a.residual);
    }
  });
  check(cudaGetLastError(), "dequant_reduce");
}

}  // namespace kernels
}  // namespace pycomm
