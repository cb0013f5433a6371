// Torch glue of the CUDA IPC all-reduce (CUDA builds only): tensor checks,
// the device guard and the caller's current stream around the torch-free
// transport/cuda_ipc.h.
#pragma once

#include <ATen/ATen.h>

#include "../core/common.h"
#include "../compression/ipc_quantized.h"
#include "../transport/cuda_ipc.h"

namespace pycomm {

// out = in reduced over the IPC group, on the current CUDA stream of in's
// device. Raises (c10::Error) on tensors the kernels cannot take.
void ipc_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, RedOp op, int algo);

// A synchronous call as IpcAllReduce.all_reduce makes it, in one crossing
// from Python: the call on `side` (the group's own stream: stream id, device
// index, device type as torch.cuda.Stream gives them), after the caller's
// current stream's work; the caller's stream then waits for it (the CPU does
// not); the tensors' memory is marked in use on `side` for the caching
// allocator. Raises CommError when the call is already known to have failed.
void ipc_all_reduce_sync(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, RedOp op, int algo,
                         int64_t side_id, int64_t side_device, int64_t side_type);

// The quantized all-reduce (compression/ipc_quantized.h) on the current
// CUDA stream; residuals are float32 tensors on the device, or undefined.
// fused: IpcQuantCall::fused.
void ipc_quantized_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg, int bits,
                              int block, bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize,
                              const at::Tensor& worker_residual, const at::Tensor& server_residual, bool fused);

// The same as a synchronous call (ipc_all_reduce_sync's steps around it),
// in one crossing from Python.
void ipc_quantized_all_reduce_sync(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg,
                                   int bits, int block, bool stochastic, uint64_t seed_quantize,
                                   uint64_t seed_requantize, const at::Tensor& worker_residual,
                                   const at::Tensor& server_residual, bool fused, int64_t side_id,
                                   int64_t side_device, int64_t side_type);

}  // namespace pycomm
