// Host-callable CUDA twins of the kernels in kernels.h: same
// arguments and the same per-element math (quant.h), so a payload made on
// the GPU decodes bit for bit on the CPU and back. Device pointers, an
// explicit stream; nothing here allocates: callers pass workspace.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels.h"

namespace pycomm {
namespace kernels {

// Sources one dequant_reduce_cuda call can sum (passed by value to the kernel).
constexpr int kMaxCudaSources = 64;

// Like reduce_cpu; srcs is a host array of device pointers (at most
// kMaxCudaSources; peers' IPC-mapped buffers are fine).
void reduce_cuda(DType dtype, RedOp op, void* out0, void* out1, const void* const* srcs, int nsrc, size_t count,
                 cudaStream_t stream);
void copy_cuda(void* out0, void* out1, const void* src, size_t bytes, cudaStream_t stream);
void divide_cuda(DType dtype, void* data, size_t count, double divisor, cudaStream_t stream);

// Payloads (read or written) start at a 4-byte boundary: their float scales
// are accessed in place (the torch glue stages any other through a copy).
void quantize_cuda(const QuantSpec& spec, DType dtype, const void* x, float* residual, size_t n, uint8_t* payload,
                   uint64_t index_base, cudaStream_t stream);
// `cancel` (optional): a word in device memory (every thread block reads it
// once: host-mapped memory would cost a PCIe trip per block); non-zero when
// the kernel starts, it does nothing (the payload may be a dead peer's memory).
void dequantize_cuda(int bits, int block, const uint8_t* payload, size_t n, DType dtype, void* out, bool accumulate,
                     cudaStream_t stream, const uint32_t* cancel = nullptr);
// args.srcs is a host array of device pointers (at most kMaxCudaSources).
void dequant_reduce_cuda(const DequantReduce& args, cudaStream_t stream);

// Workspace bytes topk_cuda needs for n elements.
size_t topk_cuda_workspace_bytes(size_t n);
// Like topk_cpu; synchronises `stream` once to learn the kept count.
size_t topk_cuda(const TopK& spec, DType dtype, const void* x, float* residual, size_t n, size_t cap, void* values,
                 int32_t* indices, void* workspace, size_t workspace_bytes, cudaStream_t stream);
// Like scatter_add_cpu, but out-of-range indices are skipped and counted in
// *bad (device int, may be null) instead of raising.
void scatter_add_cuda(DType val_dtype, const void* values, const int32_t* indices, size_t count, DType dense_dtype,
                      void* dense, size_t n, int* bad, cudaStream_t stream);

// Like orthogonalize_cpu: one block per matrix.
void orthogonalize_cuda(DType dtype, void* data, size_t batch, size_t rows, size_t cols, double epsilon,
                        cudaStream_t stream);

}  // namespace kernels
}  // namespace pycomm
