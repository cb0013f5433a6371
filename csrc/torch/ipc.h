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

// The quantized all-reduce (compression/ipc_quantized.h) on the current
// CUDA stream; residuals are float32 tensors on the device, or undefined.
void ipc_quantized_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg, int bits,
                              int block, bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize,
                              const at::Tensor& worker_residual, const at::Tensor& server_residual);

}  // namespace pycomm
