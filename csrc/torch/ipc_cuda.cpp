// CUDA builds only (setup.py adds *_cuda.cpp files to CUDA builds).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <utility>
#include <vector>

#include "dtype.h"
#include "ipc.h"
#include "tensor_checks.h"
#include "../compression/quantized_allreduce.h"

namespace pycomm {

namespace {

// What every IPC call takes: CUDA tensors on one device, contiguous, the
// output like the input, and the communicator's rule on their memory
// (tensor_checks.h: the kernels move memory). `call` names the call.
void check_tensors(const at::Tensor& in, const at::Tensor& out, const char* call) {
  TORCH_CHECK(in.is_cuda() && out.is_cuda(), "pycomm: the ", call, " takes CUDA tensors");
  for (const at::Tensor* t : {&in, &out}) {
    const std::string why = memory_mismatch(*t);
    TORCH_CHECK(why.empty(), "pycomm: the ", t == &in ? "input " : "output ", why);
  }
  TORCH_CHECK(in.device() == out.device(), "pycomm: input and output must be on one device");
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "pycomm: tensors must be contiguous");
  TORCH_CHECK(in.scalar_type() == out.scalar_type() && in.numel() == out.numel(),
              "pycomm: output must match the input's dtype and size");
}

// The same steps as IpcAllReduce._enqueue and IpcWork.wait in Python, which
// cost tens of microseconds per call (a 4 KB call took 52 us at 2 ranks on
// an H200 under MPS); here they are a handful of CUDA calls. `launch`
// enqueues the call's kernels on the current stream; `used`: the tensors
// they touch (undefined ones skipped).
template <typename Launch>
void run_sync(CudaIpcAllReduce& group, const at::Tensor& in, std::initializer_list<const at::Tensor*> used,
              int64_t side_id, int64_t side_device, int64_t side_type, Launch&& launch) {
  TORCH_CHECK(in.is_cuda(), "pycomm: the CUDA IPC all-reduce takes CUDA tensors");
  const c10::cuda::CUDAGuard guard(in.device());
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(in.device().index());
  const c10::cuda::CUDAStream side = c10::cuda::CUDAStream::unpack3(
      side_id, static_cast<c10::DeviceIndex>(side_device), static_cast<c10::DeviceType>(side_type));
  // 1. The group's stream waits for the caller's (under graph capture this
  //    draws it into the capture: one-shot and two-shot replay from it).
  group.order(side.stream(), caller.stream());
  // 2. The kernels, on the group's stream. A call refused after the fork
  //    joins the group's stream back first: a capture must end joined.
  try {
    const c10::cuda::CUDAStreamGuard on_side(side);
    launch();
  } catch (...) {
    group.order(caller.stream(), side.stream());
    throw;
  }
  // 3. The caching allocator must not hand the tensors' memory to the
  //    caller's stream before the group's stream is done with it.
  for (const at::Tensor* t : used)
    if (t->defined()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), side);
  // 4. The caller's stream waits for the result; a call already done and
  //    failed raises now (otherwise IpcAllReduce.check() tells). A capture
  //    may not query an event: replays report through check().
  group.order(caller.stream(), side.stream());
  if (!CudaIpcAllReduce::capturing(caller.stream()) && group.ordered_done()) group.check_usable();
}

// The quantized call's arguments, checked.
IpcQuantCall quantized_call(const CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg,
                            int bits, int block, bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize,
                            const at::Tensor& worker_residual, const at::Tensor& server_residual, bool fused) {
  check_tensors(in, out, "quantized CUDA IPC all-reduce");
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
  c.fused = fused;
  return c;
}

// Enqueues the quantized call on the current stream. The fused kernel
// takes tensors that start at kIpcQuantAlign bytes (it loads and stores
// runs of elements); one that starts elsewhere (an offset view) goes
// through an aligned copy made on this stream, and an output or residual is
// copied back after the kernel, as the op kernels do with payloads (ops.cpp).
// Allocated on the stream that uses them, the copies may be freed as soon
// as this returns.
void launch_quantized(CudaIpcAllReduce& group, IpcQuantCall c, const at::Tensor& in, const at::Tensor& out,
                      const at::Tensor& worker_residual, const at::Tensor& server_residual) {
  std::vector<std::pair<at::Tensor, at::Tensor>> back;  // (aligned copy, tensor) to copy back
  if (ipc_quantized_fused(c)) {
    at::Tensor in_copy;
    if (!ipc_quantized_aligned(c.input)) {
      in_copy = in.clone();
      c.input = in_copy.data_ptr();
    }
    if (!ipc_quantized_aligned(c.output)) {
      // In place: the input's copy serves as the output too.
      at::Tensor o = in_copy.defined() && in.data_ptr() == out.data_ptr() ? in_copy : at::empty_like(out);
      c.output = o.data_ptr();
      back.emplace_back(o, out);
    }
    for (auto [r, ptr] : {std::make_pair(&worker_residual, &c.worker_residual),
                          std::make_pair(&server_residual, &c.server_residual)}) {
      if (ipc_quantized_aligned(*ptr)) continue;
      at::Tensor copy = r->clone();
      *ptr = copy.data_ptr<float>();
      back.emplace_back(copy, *r);
    }
  }
  ipc_quantized_all_reduce(group, c, c10::cuda::getCurrentCUDAStream().stream());
  for (auto& [copy, t] : back) t.copy_(copy);
}

}  // namespace

void ipc_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, RedOp op, int algo) {
  check_tensors(in, out, "CUDA IPC all-reduce");
  DType dt;
  TORCH_CHECK(to_dtype(in.scalar_type(), &dt), "pycomm: dtype ", in.scalar_type(), " is not supported");
  TORCH_CHECK(algo >= 0 && algo <= kLastIpcAlgo, "pycomm: unknown IPC algorithm");
  const c10::cuda::CUDAGuard guard(in.device());
  group.all_reduce(in.data_ptr(), out.data_ptr(), in.numel(), dt, op, static_cast<IpcAlgo>(algo),
                   c10::cuda::getCurrentCUDAStream().stream());
}

void ipc_all_reduce_sync(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, RedOp op, int algo,
                         int64_t side_id, int64_t side_device, int64_t side_type) {
  run_sync(group, in, {&in, &out}, side_id, side_device, side_type, [&] { ipc_all_reduce(group, in, out, op, algo); });
}

void ipc_quantized_all_reduce(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg, int bits,
                              int block, bool stochastic, uint64_t seed_quantize, uint64_t seed_requantize,
                              const at::Tensor& worker_residual, const at::Tensor& server_residual, bool fused) {
  const IpcQuantCall c = quantized_call(group, in, out, avg, bits, block, stochastic, seed_quantize, seed_requantize,
                                        worker_residual, server_residual, fused);
  const c10::cuda::CUDAGuard guard(in.device());
  launch_quantized(group, c, in, out, worker_residual, server_residual);
}

void ipc_quantized_all_reduce_sync(CudaIpcAllReduce& group, const at::Tensor& in, const at::Tensor& out, bool avg,
                                   int bits, int block, bool stochastic, uint64_t seed_quantize,
                                   uint64_t seed_requantize, const at::Tensor& worker_residual,
                                   const at::Tensor& server_residual, bool fused, int64_t side_id,
                                   int64_t side_device, int64_t side_type) {
  const IpcQuantCall c = quantized_call(group, in, out, avg, bits, block, stochastic, seed_quantize, seed_requantize,
                                        worker_residual, server_residual, fused);
  run_sync(group, in, {&in, &out, &worker_residual, &server_residual}, side_id, side_device, side_type,
           [&] { launch_quantized(group, c, in, out, worker_residual, server_residual); });
}

}  // namespace pycomm
