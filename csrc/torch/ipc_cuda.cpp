// CUDA builds only (setup.py adds *_cuda.cpp files to CUDA builds).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dtype.h"
#include "ipc.h"

namespace pycomm {

void ipc_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, RedOp op, int algo) {
  DType dt;
  TORCH_CHECK(in.is_cuda() && out.is_cuda(), "pycomm: the CUDA IPC all-reduce takes CUDA tensors");
  TORCH_CHECK(in.device() == out.device(), "pycomm: input and output must be on one device");
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "pycomm: tensors must be contiguous");
  TORCH_CHECK(in.scalar_type() == out.scalar_type() && in.numel() == out.numel(),
              "pycomm: output must match the input's dtype and size");
  TORCH_CHECK(to_dtype(in.scalar_type(), &dt), "pycomm: dtype ", in.scalar_type(), " is not supported");
  TORCH_CHECK(algo >= 0 && algo <= kLastIpcAlgo, "pycomm: unknown IPC algorithm");
  const c10::cuda::CUDAGuard guard(in.device());
  group.all_reduce(in.data_ptr(), out.data_ptr(), in.numel(), dt, op, static_cast<IpcAlgo>(algo),
                   c10::cuda::getCurrentCUDAStream().stream());
}

}  // namespace pycomm
