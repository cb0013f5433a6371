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
#include "quant_warp.cuh"

namespace pycomm {
namespace kernels {
namespace {

using cuda_detail::check;
using cuda_detail::grid_for;
using cuda_detail::kThreads;
using namespace quant_detail;

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

// One quantization block of 32 * E elements per warp (quantize_values),
// in runs of kV elements a lane (quant_warp.cuh's lane layouts).
template <int E, int kV, typename V>
__global__ void quantize_warp_kernel(V value, size_t n, int bits, bool stochastic, uint64_t key,
                                     uint64_t index_base, uint8_t* payload, float* residual) {
  constexpr int kBlock = 32 * E;
  if (cancelled(value.cancel)) return;
  float* scales = reinterpret_cast<float*>(payload);
  uint8_t* codes = payload + quant_num_blocks(n, kBlock) * 4;
  const int lane = threadIdx.x % 32;
  for_warp_blocks<kBlock>(n, [&](size_t blk, size_t base, int m) {
    with_block_kind<E, kV>(bits, m, [&](auto kind) {
      using Kind = decltype(kind);
      float v[E];
      value.template lane_values<E, Kind>(blk, base, lane, m, v);
      quantize_values<E, Kind>(v, blk, base, m, lane, stochastic, key, index_base, scales, codes, residual);
    });
  });
  zero_payload_tail(payload, n, bits, kBlock);
}

// Dequantize, one warp per quantization block, in runs of kV elements a
// lane where the output and codes allow (kRunOf<E>), else one.
template <int E, typename T, int kV>
__global__ void dequantize_warp_kernel(const uint8_t* payload, size_t n, int bits, T* out, bool accumulate,
                                       const uint32_t* cancel) {
  constexpr int kBlock = 32 * E;
  if (cancelled(cancel)) return;
  const uint8_t* codes = payload + quant_num_blocks(n, kBlock) * 4;
  const int lane = threadIdx.x % 32;
  for_warp_blocks<kBlock>(n, [&](size_t blk, size_t base, int m) {
    dequantize_block<E, kV>(payload, codes, blk, base, m, lane, bits, out, accumulate);
  });
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
// kernel where the block size allows (in runs where every pointer allows),
// else the block-wide one.
template <typename V>
void launch_quantize(const V& value, size_t n, int bits, int block, bool stochastic, uint64_t seed,
                     uint64_t index_base, uint8_t* payload, float* residual, cudaStream_t stream) {
  const size_t nb = quant_num_blocks(n, block);
  const bool warp = with_warp_block(block, [&](auto e) {
    constexpr int E = decltype(e)::value, kV = kRunOf<E>;
    const unsigned grid = grid_for(nb * 32);
    if (value.runs_fit(kV) && run_aligned<float>(residual, kV) && codes_aligned(payload, bits, kV))
      quantize_warp_kernel<E, kV><<<grid, kThreads, 0, stream>>>(value, n, bits, stochastic, mix64(seed),
                                                                 index_base, payload, residual);
    else
      quantize_warp_kernel<E, 1><<<grid, kThreads, 0, stream>>>(value, n, bits, stochastic, mix64(seed),
                                                                index_base, payload, residual);
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
    const unsigned grid = grid_for(quant_num_blocks(n, block) * 32);
    const bool warp = with_warp_block(block, [&](auto e) {
      constexpr int E = decltype(e)::value, kV = kRunOf<E>;
      if (run_aligned<T>(out, kV) && codes_aligned(payload, bits, kV))
        dequantize_warp_kernel<E, T, kV><<<grid, kThreads, 0, stream>>>(payload, n, bits, static_cast<T*>(out),
                                                                         accumulate, cancel);
      else
        dequantize_warp_kernel<E, T, 1><<<grid, kThreads, 0, stream>>>(payload, n, bits, static_cast<T*>(out),
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
    SumValue<D> sum{src, static_cast<const D*>(a.dense), a.post_scale, a.residual, nb, a.bits, a.block, a.cancel};
    if (a.out_payload)
      launch_quantize(sum, a.n, a.bits, a.block, a.requant.stochastic, a.requant.seed, a.index_base, a.out_payload,
                      a.residual, stream);
  });
  check(cudaGetLastError(), "dequant_reduce");
}

}  // namespace kernels
}  // namespace pycomm
