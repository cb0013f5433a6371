// CUDA reduction, copy and divide: the twins of kernels/cpu/reduce.cpp, on
// the same per-element math (reduce.h), so a GPU reduces a set of sources to
// the same bits as the CPU (with --fmad=false, as setup.py builds).
//
// Memory-bound: each thread moves 16 bytes per source per iteration
// (Pack loads and stores) when every pointer is 16-byte aligned, which
// caching-allocator and IPC buffers are; anything else takes the
// element-wise loop. Grid-stride loops, so one launch covers any count.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../kernels_cuda.h"
#include "common.cuh"

namespace pycomm {
namespace kernels {
namespace {

using cuda_detail::check;
using cuda_detail::grid_for;
using cuda_detail::kThreads;
using cuda_detail::Pack;
using cuda_detail::reduce_elem;
using cuda_detail::reduce_pack;

// Passed by value: kernel parameters live in constant memory, so the source
// table costs no extra copy or allocation.
struct SourceTable {
  const void* p[kMaxCudaSources];
  int n;
};

// Packs [0, vecs) in 16-byte loads and stores, then elements
// [vecs * kPer, count) one by one (vecs = 0: everything element-wise).
template <typename T, RedOp kOp>
__global__ void reduce_kernel(SourceTable s, T* out0, T* out1, size_t vecs, size_t count) {
  constexpr int kPer = Pack<T>::kPer;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (size_t v = tid; v < vecs; v += stride) {
    typename Acc<T>::type acc[kPer];
    reduce_pack<T, kOp>(s.p, s.n, v, acc);
    Pack<T> r;
#pragma unroll
    for (int j = 0; j < kPer; ++j) r.e[j] = store_acc<T>(acc[j]);
    reinterpret_cast<Pack<T>*>(out0)[v] = r;
    if (out1) reinterpret_cast<Pack<T>*>(out1)[v] = r;
  }
  for (size_t i = vecs * kPer + tid; i < count; i += stride) {
    const T r = store_acc<T>(reduce_elem<T, kOp>(s.p, s.n, i));
    out0[i] = r;
    if (out1) out1[i] = r;
  }
}

template <typename T>
__global__ void divide_kernel(T* data, size_t count, typename Acc<T>::type d) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    data[i] = store_acc<T>(load_acc(data[i]) / d);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, RedOp kOp>
void launch_reduce(const SourceTable& s, void* out0, void* out1, size_t count, cudaStream_t stream) {
  bool vec = aligned16(out0) && (!out1 || aligned16(out1));
  for (int k = 0; k < s.n; ++k) vec = vec && aligned16(s.p[k]);
  const size_t vecs = vec ? count / Pack<T>::kPer : 0;
  reduce_kernel<T, kOp><<<grid_for(vecs > 0 ? vecs : count), kThreads, 0, stream>>>(
      s, static_cast<T*>(out0), static_cast<T*>(out1), vecs, count);
}

template <typename T>
void reduce_op(RedOp op, const SourceTable& s, void* out0, void* out1, size_t count, cudaStream_t stream) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return launch_reduce<T, RedOp::kSum>(s, out0, out1, count, stream);
    case RedOp::kMax: return launch_reduce<T, RedOp::kMax>(s, out0, out1, count, stream);
    case RedOp::kMin: return launch_reduce<T, RedOp::kMin>(s, out0, out1, count, stream);
    default: break;
  }
  throw CommError(std::string("pycomm: CUDA reductions take op sum, avg, max or min, got ") + redop_name(op));
}

}  // namespace

void reduce_cuda(DType dtype, RedOp op, void* out0, void* out1, const void* const* srcs, int nsrc, size_t count,
                 cudaStream_t stream) {
  if (count == 0 || nsrc <= 0) return;
  if (nsrc > kMaxCudaSources)
    throw CommError("pycomm: a CUDA reduce takes at most " + std::to_string(kMaxCudaSources) + " sources, got " +
                    std::to_string(nsrc));
  if (nsrc == 1) {
    copy_cuda(out0, out1, srcs[0], count * dtype_size(dtype), stream);
    return;
  }
  SourceTable s{};
  s.n = nsrc;
  for (int k = 0; k < nsrc; ++k) s.p[k] = srcs[k];
  switch (dtype) {
    case DType::kFloat32: reduce_op<float>(op, s, out0, out1, count, stream); break;
    case DType::kFloat64: reduce_op<double>(op, s, out0, out1, count, stream); break;
    case DType::kFloat16: reduce_op<Half>(op, s, out0, out1, count, stream); break;
    case DType::kBFloat16: reduce_op<BFloat16>(op, s, out0, out1, count, stream); break;
    case DType::kInt32: reduce_op<int32_t>(op, s, out0, out1, count, stream); break;
    case DType::kInt64: reduce_op<int64_t>(op, s, out0, out1, count, stream); break;
    case DType::kUInt8: reduce_op<uint8_t>(op, s, out0, out1, count, stream); break;
    default:
      throw CommError(std::string("pycomm: CUDA reductions take float32, float64, float16, bfloat16, int32, int64 "
                                  "and uint8 tensors, got ") + dtype_name(dtype));
  }
  check(cudaGetLastError(), "reduce");
}

void copy_cuda(void* out0, void* out1, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (out0 != src) check(cudaMemcpyAsync(out0, src, bytes, cudaMemcpyDefault, stream), "copy");
  if (out1 && out1 != src) check(cudaMemcpyAsync(out1, src, bytes, cudaMemcpyDefault, stream), "copy");
}

void divide_cuda(DType dtype, void* data, size_t count, double divisor, cudaStream_t stream) {
  if (count == 0) return;
  const unsigned grid = grid_for(count);
  switch (dtype) {
    case DType::kFloat32:
      divide_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(data), count, static_cast<float>(divisor));
      break;
    case DType::kFloat64:
      divide_kernel<<<grid, kThreads, 0, stream>>>(static_cast<double*>(data), count, divisor);
      break;
    case DType::kFloat16:
      divide_kernel<<<grid, kThreads, 0, stream>>>(static_cast<Half*>(data), count, static_cast<float>(divisor));
      break;
    case DType::kBFloat16:
      divide_kernel<<<grid, kThreads, 0, stream>>>(static_cast<BFloat16*>(data), count,
                                                   static_cast<float>(divisor));
      break;
    default:
      throw CommError("pycomm: avg is only defined for floating-point dtypes");
  }
  check(cudaGetLastError(), "divide");
}

}  // namespace kernels
}  // namespace pycomm
