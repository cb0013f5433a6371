// CUDA builds only (setup.py adds *_cuda.cpp files to CUDA builds).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dtype.h"
#include "ipc.h"
#include "../compression/quantized_allreduce.h"

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

void ipc_quantized_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg, int bits,
                              int block, bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize,
                              const at::Tensor& worker_residual, const at::Tensor& server_residual) {
  TORCH_CHECK(in.is_cuda() && out.is_cuda(), "pycomm: the quantized CUDA IPC all-reduce takes CUDA tensors");
  TORCH_CHECK(in.device() == out.device(), "pycomm: input and output must be on one device");
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "pycomm: tensors must be contiguous");
  TORCH_CHECK(in.scalar_type() == out.scalar_type() && in.numel() == out.numel(),
              "pycomm: output must match the input's dtype and size");
  TORCH_CHECK(in.scalar_type() == at::kFloat || in.scalar_type() == at::kHalf || in.scalar_type() == at::kBFloat16,
              "pycomm: the quantized all-reduce takes float32, float16 or bfloat16 tensors");
  TORCH_CHECK(bits == 8 || bits == 4, "pycomm: bits must be 8 or 4");
  const size_t shard = QuantizedAllReduce::shard_elems(in.numel(), group.world(), block);
  auto residual = [&](const at::Tensor& r, const char* name, int64_t want) -> float* {
    if (!r.defined()) return nullptr;
    TORCH_CHECK(r.device() == in.device() && r.scalar_type() == at::kFloat && r.is_contiguous() &&
                    r.numel() == want,
                "pycomm: the ", name, " residual must be a contiguous float32 tensor of ", want,
                " elements on the input's device");
    return r.data_ptr<float>();
  };
  IpcQuantCall c;
  c.input = in.data_ptr();
  c.output = out.data_ptr();
  c.n = in.numel();
  to_dtype(in.scalar_type(), &c.dtype);
  c.avg = avg;
  c.bits = bits;
  c.block = block;
  c.stochastic = stochastic;
  c.seed_quantize = seed_quantize;
  c.seed_requantize = seed_requantize;
  c.worker_residual = residual(worker_residual, "worker", in.numel());
  c.server_residual = residual(server_residual, "server", static_cast<int64_t>(shard));
  const c10::cuda::CUDAGuard guard(in.device());
  ipc_quantized_all_reduce(group, c, c10::cuda::getCurrentCUDAStream().stream());
}

}  // namespace pycomm
