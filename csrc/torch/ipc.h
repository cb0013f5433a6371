// Torch glue of the CUDA IPC all-reduce (CUDA builds only): tensor checks,
// the device guard and the caller's current stream around the torch-free
// transport/cuda_ipc.h.
#pragma once

#include <ATen/ATen.h>

#include "../core/common.h"
#include "../transport/cuda_ipc.h"

namespace pycomm {

// out = in reduced over the IPC group, on the current CUDA stream of in's
// device. Raises (c10::Error) on tensors the kernels cannot take.
void ipc_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, RedOp op, int algo);

}  // namespace pycomm
