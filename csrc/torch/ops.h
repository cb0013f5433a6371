// The kernels as torch operators. Schemas are declared once (ops.cpp); the
// operator bodies below are device-generic: they check their arguments,
// allocate outputs on the input's device and run that device's kernels
// through a DeviceKernels table. ops.cpp registers them for CPU, ops_cuda.cpp
// (CUDA builds only) for CUDA.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../kernels/kernels.h"

namespace pycomm {
namespace ops {

// One device's kernels, on that device's current stream where it has one.
// `like` is a tensor on the device, for scratch allocations.
struct DeviceKernels {
  // index_base: the global index of x[0] (stochastic rounding draws per
  // global index, so a shard rounds as it would inside the whole tensor).
  void (*quantize)(const kernels::QuantSpec& spec, DType dtype, const void* x, float* residual, size_t n,
                   uint8_t* payload, uint64_t index_base);
  void (*dequantize)(int bits, int block, const uint8_t* payload, size_t n, DType dtype, void* out, bool accumulate);
  void (*dequant_reduce)(const kernels::DequantReduce& args);
  size_t (*topk)(const kernels::TopK& spec, DType dtype, const void* x, float* residual, size_t n, size_t cap,
                 void* values, int32_t* indices, const at::Tensor& like);
  // Raises (CommError) on an index outside [0, n).
  void (*scatter_add)(DType val_dtype, const void* values, const int32_t* indices, size_t count, DType dense_dtype,
                      void* dense, size_t n, const at::Tensor& like);
  void (*reduce)(DType dtype, RedOp op, void* out, const void* const* srcs, int nsrc, size_t count);
  void (*divide)(DType dtype, void* data, size_t count, double divisor);
  void (*orthogonalize)(DType dtype, void* data, size_t batch, size_t rows, size_t cols, double epsilon);
};

#ifdef PYCOMM_WITH_CUDA
const DeviceKernels& cuda_kernels();  // ops_cuda.cpp
#endif

at::Tensor quantize(const at::Tensor& x, int64_t bits, int64_t block, bool stochastic, int64_t seed,
                    const c10::optional<at::Tensor>& residual, int64_t index_base);
at::Tensor dequantize(const at::Tensor& payload, int64_t numel, int64_t bits, int64_t block, at::ScalarType dtype);
void quantize_into(const at::Tensor& x, const at::Tensor& payload, int64_t bits, int64_t block, bool stochastic,
                   int64_t seed, const c10::optional<at::Tensor>& residual, int64_t index_base);
void dequantize_into(const at::Tensor& out, const at::Tensor& payload, int64_t bits, int64_t block);
void dequant_reduce_requant_into(const at::Tensor& out, at::TensorList payloads, const c10::optional<at::Tensor>& dense,
                                 int64_t numel, int64_t bits, int64_t block, double post_scale, bool stochastic,
                                 int64_t seed, const c10::optional<at::Tensor>& residual, int64_t index_base);
void dequantize_accumulate(const at::Tensor& acc, const at::Tensor& payload, int64_t bits, int64_t block);
at::Tensor dequant_reduce_requant(at::TensorList payloads, const c10::optional<at::Tensor>& dense, int64_t numel,
                                  int64_t bits, int64_t block, double post_scale, bool stochastic, int64_t seed,
                                  const c10::optional<at::Tensor>& residual, int64_t index_base);
std::tuple<at::Tensor, int64_t, int64_t> topk(const at::Tensor& x, int64_t k, bool exact, double tolerance,
                                              double sample_fraction, int64_t seed,
                                              const c10::optional<at::Tensor>& residual);
void scatter_add(const at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices);
at::Tensor reduce(at::TensorList srcs, c10::string_view op);
void orthogonalize_(const at::Tensor& m, double epsilon);

// Registers the bodies above as one dispatch key's implementations.
void register_impls(torch::Library& m);

}  // namespace ops
}  // namespace pycomm
