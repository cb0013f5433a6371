// Batched Gram-Schmidt on the GPU: the twin of kernels/cpu/orthogonalize.cpp
// (same order of operations, double accumulators), one thread block per
// matrix. PowerSGD's factors are tall and thin (thousands of rows, rank 1 to
// a few dozen columns), so a block strides over the rows and reduces each sum
// in shared memory; matrices of a batch are independent blocks.
#include <cuda_runtime.h>

#include <cmath>

#include "../kernels_cuda.h"
#include "common.cuh"

namespace pycomm {
namespace kernels {
namespace {

using cuda_detail::check;
using cuda_detail::kThreads;

// The sum of every thread's `v` in the block, returned to every thread.
__device__ double block_sum(double v, double* scratch) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kThreads >> 5) ? scratch[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0) scratch[32] = v;
  }
  __syncthreads();
  const double total = scratch[32];
  __syncthreads();  // scratch is reused by the next sum
  return total;
}

template <typename T>
__global__ void orthogonalize_kernel(T* data, size_t rows, size_t cols, double epsilon) {
  __shared__ double scratch[33];
  T* m = data + static_cast<size_t>(blockIdx.x) * rows * cols;
  for (size_t i = 0; i < cols; ++i) {
    double part = 0;
    for (size_t r = threadIdx.x; r < rows; r += blockDim.x) part += static_cast<double>(m[r * cols + i]) * m[r * cols + i];
    const double norm = sqrt(block_sum(part, scratch)) + epsilon;
    const double inv = norm > 0 ? 1.0 / norm : 0.0;  // a zero column stays zero, as on the CPU
    for (size_t r = threadIdx.x; r < rows; r += blockDim.x) m[r * cols + i] = static_cast<T>(m[r * cols + i] * inv);
    __syncthreads();
    for (size_t j = i + 1; j < cols; ++j) {
      part = 0;
      for (size_t r = threadIdx.x; r < rows; r += blockDim.x)
        part += static_cast<double>(m[r * cols + i]) * m[r * cols + j];
      const double dot = block_sum(part, scratch);
      for (size_t r = threadIdx.x; r < rows; r += blockDim.x)
        m[r * cols + j] = static_cast<T>(m[r * cols + j] - dot * m[r * cols + i]);
    }
    __syncthreads();
  }
}

}  // namespace

void orthogonalize_cuda(DType dtype, void* data, size_t batch, size_t rows, size_t cols, double epsilon,
                        cudaStream_t stream) {
  if (batch == 0 || rows == 0 || cols == 0) return;
  if (batch > 0x7fffffffu) throw CommError("pycomm: orthogonalize: too many matrices in one batch");
  if (dtype == DType::kFloat64) {
    orthogonalize_kernel<double><<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(
        static_cast<double*>(data), rows, cols, epsilon);
  } else if (dtype == DType::kFloat32) {
    orthogonalize_kernel<float><<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(
        static_cast<float*>(data), rows, cols, epsilon);
  } else {
    throw CommError("pycomm: orthogonalize takes float32 or float64 matrices");
  }
  check(cudaGetLastError(), "orthogonalize launch");
}

}  // namespace kernels
}  // namespace pycomm
