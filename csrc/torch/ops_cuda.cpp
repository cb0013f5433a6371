// CUDA registration of the operators (CUDA builds only; setup.py adds this
// file): the device-generic bodies of ops.h, running the CUDA kernels on the
// caller's current stream, as torch's own CUDA operators do.
#include <c10/cuda/CUDAStream.h>

#include "../kernels/kernels_cuda.h"
#include "ops.h"

namespace pycomm {
namespace ops {
namespace {

cudaStream_t current() { return c10::cuda::getCurrentCUDAStream().stream(); }

const DeviceKernels kCuda{
    [](const kernels::QuantSpec& s, DType dt, const void* x, float* r, size_t n, uint8_t* payload,
       uint64_t index_base) { kernels::quantize_cuda(s, dt, x, r, n, payload, index_base, current()); },
    [](int bits, int block, const uint8_t* payload, size_t n, DType dt, void* out, bool accumulate) {
      kernels::dequantize_cuda(bits, block, payload, n, dt, out, accumulate, current());
    },
    [](const kernels::DequantReduce& a) { kernels::dequant_reduce_cuda(a, current()); },
    [](const kernels::TopK& s, DType dt, const void* x, float* r, size_t n, size_t cap, void* values,
       int32_t* indices, const at::Tensor& like) {
      const size_t ws_bytes = kernels::topk_cuda_workspace_bytes(n);
      // From the caching allocator, on the current stream: freed (for reuse
      // by later work on this stream) when this call returns.
      at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, like.options().dtype(at::kByte));
      return kernels::topk_cuda(s, dt, x, r, n, cap, values, indices, ws.data_ptr(), ws_bytes, current());
    },
    [](DType vt, const void* values, const int32_t* indices, size_t count, DType dt, void* dense, size_t n,
       const at::Tensor& like) {
      // The kernel skips and counts bad indices; the CPU kernel raises, so
      // read the count back (one synchronisation) and raise too.
      at::Tensor bad = at::zeros({1}, like.options().dtype(at::kInt));
      kernels::scatter_add_cuda(vt, values, indices, count, dt, dense, n, bad.data_ptr<int>(), current());
      const int nbad = bad.item<int>();
      if (nbad > 0)
        throw CommError("pycomm: scatter_add got " + std::to_string(nbad) + " indices outside [0, " +
                        std::to_string(n) + ")");
    },
    [](DType dt, RedOp op, void* out, const void* const* srcs, int nsrc, size_t count) {
      kernels::reduce_cuda(dt, op, out, nullptr, srcs, nsrc, count, current());
    },
    [](DType dt, void* data, size_t count, double divisor) {
      kernels::divide_cuda(dt, data, count, divisor, current());
    },
    [](DType dt, void* data, size_t batch, size_t rows, size_t cols, double epsilon) {
      kernels::orthogonalize_cuda(dt, data, batch, rows, cols, epsilon, current());
    },
};

}  // namespace

const DeviceKernels& cuda_kernels() { return kCuda; }

}  // namespace ops
}  // namespace pycomm

TORCH_LIBRARY_IMPL(pycomm, CUDA, m) { pycomm::ops::register_impls(m); }
