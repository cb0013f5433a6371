// The compression kernels as torch operators: schemas declared once here,
// implementations registered per device (CPU below; CUDA registers its own
// beside the CUDA kernels). Callable as torch.ops.pycomm.<name>; the typed
// Python wrappers are in pycomm/compression.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "kernels/kernels.h"
#include "kernels/quant.h"

namespace pycomm {
namespace {

DType float_dtype(const at::Tensor& t, const char* op, const char* role) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "pycomm.", op, ": ", role, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_dense(const at::Tensor& t, const char* op, const char* role) {
  TORCH_CHECK(t.device().is_cpu(), "pycomm.", op, ": ", role, " is on ", t.device(),
              "; this operator runs on CPU tensors here");
  TORCH_CHECK(t.is_contiguous(), "pycomm.", op, ": ", role, " must be contiguous");
}

void check_quant_args(const char* op, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "pycomm.", op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block >= 8 && block % 8 == 0 && block <= (1 << 20), "pycomm.", op,
              ": block must be a multiple of 8 between 8 and 1048576, got ", block);
}

void check_payload(const at::Tensor& p, int64_t numel, int64_t bits, int64_t block, const char* op) {
  check_dense(p, op, "payload");
  TORCH_CHECK(p.scalar_type() == at::kByte, "pycomm.", op, ": payload must be uint8, got ", p.scalar_type());
  TORCH_CHECK(numel >= 0, "pycomm.", op, ": numel must be >= 0");
  const size_t want = kernels::quant_payload_bytes(numel, bits, block);
  TORCH_CHECK(static_cast<size_t>(p.numel()) >= want, "pycomm.", op, ": a payload of ", numel, " elements at ",
              bits, " bits, block ", block, " needs ", want, " bytes, got ", p.numel());
}

float* residual_ptr(const c10::optional<at::Tensor>& r, int64_t numel, const char* op) {
  if (!r.has_value() || !r->defined()) return nullptr;
  check_dense(*r, op, "residual");
  TORCH_CHECK(r->scalar_type() == at::kFloat, "pycomm.", op, ": residual must be float32, got ", r->scalar_type());
  TORCH_CHECK(r->numel() == numel, "pycomm.", op, ": residual has ", r->numel(), " elements, expected ", numel);
  return r->data_ptr<float>();
}

// Kernel errors (CommError) surface as RuntimeError with their message.
template <typename F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const CommError& e) {
    TORCH_CHECK(false, e.what());
  }
}

at::Tensor quantize(const at::Tensor& x, int64_t bits, int64_t block, bool stochastic, int64_t seed,
                    const c10::optional<at::Tensor>& residual) {
  check_quant_args("quantize", bits, block);
  check_dense(x, "quantize", "input");
  const DType dt = float_dtype(x, "quantize", "input");
  float* r = residual_ptr(residual, x.numel(), "quantize");
  auto out = at::empty({static_cast<int64_t>(kernels::quant_payload_bytes(x.numel(), bits, block))},
                       x.options().dtype(at::kByte));
  kernels::QuantSpec s{static_cast<int>(bits), static_cast<int>(block), stochastic, static_cast<uint64_t>(seed)};
  guarded([&] { kernels::quantize_cpu(s, dt, x.data_ptr(), r, x.numel(), out.data_ptr<uint8_t>(), 0); });
  return out;
}

at::Tensor dequantize(const at::Tensor& payload, int64_t numel, int64_t bits, int64_t block, at::ScalarType dtype) {
  check_quant_args("dequantize", bits, block);
  check_payload(payload, numel, bits, block, "dequantize");
  auto out = at::empty({numel}, payload.options().dtype(dtype));
  const DType dt = float_dtype(out, "dequantize", "dtype");
  guarded([&] {
    kernels::dequantize_cpu(bits, block, payload.data_ptr<uint8_t>(), numel, dt, out.data_ptr(), false);
  });
  return out;
}

void dequantize_accumulate(const at::Tensor& acc, const at::Tensor& payload, int64_t bits, int64_t block) {
  check_quant_args("dequantize_accumulate", bits, block);
  check_dense(acc, "dequantize_accumulate", "acc");
  const DType dt = float_dtype(acc, "dequantize_accumulate", "acc");
  check_payload(payload, acc.numel(), bits, block, "dequantize_accumulate");
  guarded([&] {
    kernels::dequantize_cpu(bits, block, payload.data_ptr<uint8_t>(), acc.numel(), dt, acc.data_ptr(), true);
  });
}

at::Tensor dequant_reduce_requant(at::TensorList payloads, const c10::optional<at::Tensor>& dense, int64_t numel,
                                  int64_t bits, int64_t block, double post_scale, bool stochastic, int64_t seed,
                                  const c10::optional<at::Tensor>& residual) {
  const char* op = "dequant_reduce_requant";
  check_quant_args(op, bits, block);
  std::vector<const uint8_t*> srcs;
  for (const auto& p : payloads) {
    check_payload(p, numel, bits, block, op);
    srcs.push_back(p.data_ptr<uint8_t>());
  }
  kernels::DequantReduce a;
  a.bits = static_cast<int>(bits);
  a.block = static_cast<int>(block);
  a.srcs = srcs.data();
  a.nsrc = static_cast<int>(srcs.size());
  a.n = static_cast<size_t>(numel);
  if (dense.has_value() && dense->defined()) {
    check_dense(*dense, op, "dense");
    TORCH_CHECK(dense->numel() == numel, "pycomm.", op, ": dense has ", dense->numel(), " elements, expected ",
                numel);
    a.dense = dense->data_ptr();
    a.dense_dtype = float_dtype(*dense, op, "dense");
  }
  a.post_scale = static_cast<float>(post_scale);
  auto out = at::empty({static_cast<int64_t>(kernels::quant_payload_bytes(numel, bits, block))},
                       at::TensorOptions().dtype(at::kByte));
  a.out_payload = out.data_ptr<uint8_t>();
  a.requant = kernels::QuantSpec{a.bits, a.block, stochastic, static_cast<uint64_t>(seed)};
  a.residual = residual_ptr(residual, numel, op);
  guarded([&] { kernels::dequant_reduce_cpu(a); });
  return out;
}

std::tuple<at::Tensor, int64_t, int64_t> topk(const at::Tensor& x, int64_t k, bool exact, double tolerance,
                                     double sample_fraction, int64_t seed, const c10::optional<at::Tensor>& residual) {
  check_dense(x, "topk", "input");
  const DType dt = float_dtype(x, "topk", "input");
  TORCH_CHECK(k >= 0, "pycomm.topk: k must be >= 0, got ", k);
  TORCH_CHECK(tolerance >= 0 && tolerance < 1, "pycomm.topk: tolerance must be in [0, 1), got ", tolerance);
  const size_t n = x.numel();
  const size_t kk = std::min<size_t>(k, n);
  const size_t cap = kernels::topk_capacity(kk, n, exact, tolerance);
  float* r = residual_ptr(residual, x.numel(), "topk");
  const size_t es = x.element_size();
  auto out = at::zeros({static_cast<int64_t>(kernels::topk_payload_bytes(cap, es))}, x.options().dtype(at::kByte));
  kernels::TopK s;
  s.k = kk;
  s.exact = exact;
  s.tolerance = tolerance;
  s.sample_fraction = sample_fraction;
  s.seed = static_cast<uint64_t>(seed);
  uint8_t* base = out.data_ptr<uint8_t>();
  size_t kept = guarded([&] {
    return kernels::topk_cpu(s, dt, x.data_ptr(), r, n, cap, base,
                             reinterpret_cast<int32_t*>(base + kernels::topk_values_bytes(cap, es)));
  });
  return {out, static_cast<int64_t>(kept), static_cast<int64_t>(cap)};
}

void scatter_add(const at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices) {
  check_dense(dense, "scatter_add", "dense");
  check_dense(values, "scatter_add", "values");
  check_dense(indices, "scatter_add", "indices");
  TORCH_CHECK(indices.scalar_type() == at::kInt, "pycomm.scatter_add: indices must be int32, got ",
              indices.scalar_type());
  TORCH_CHECK(values.numel() == indices.numel(), "pycomm.scatter_add: ", values.numel(), " values but ",
              indices.numel(), " indices");
  const DType vt = float_dtype(values, "scatter_add", "values");
  const DType dt = float_dtype(dense, "scatter_add", "dense");
  guarded([&] {
    kernels::scatter_add_cpu(vt, values.data_ptr(), indices.data_ptr<int32_t>(), values.numel(), dt,
                             dense.data_ptr(), dense.numel());
  });
}

}  // namespace
}  // namespace pycomm

TORCH_LIBRARY(pycomm, m) {
  // topk returns (buffer, kept, capacity): values for `capacity` entries in
  // the input dtype (padded to 8 bytes), then `capacity` int32 indices.
  m.def("quantize(Tensor x, int bits, int block, bool stochastic, int seed, Tensor(a!)? residual) -> Tensor");
  m.def("dequantize(Tensor payload, int numel, int bits, int block, ScalarType dtype) -> Tensor");
  m.def("dequantize_accumulate(Tensor(a!) acc, Tensor payload, int bits, int block) -> ()");
  m.def(
      "dequant_reduce_requant(Tensor[] payloads, Tensor? dense, int numel, int bits, int block, float post_scale, "
      "bool stochastic, int seed, Tensor(a!)? residual) -> Tensor");
  m.def(
      "topk(Tensor x, int k, bool exact, float tolerance, float sample_fraction, int seed, Tensor(a!)? residual) "
      "-> (Tensor, int, int)");
  m.def("scatter_add(Tensor(a!) dense, Tensor values, Tensor indices) -> ()");
}

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("quantize", &pycomm::quantize);
  m.impl("dequantize", &pycomm::dequantize);
  m.impl("dequantize_accumulate", &pycomm::dequantize_accumulate);
  m.impl("dequant_reduce_requant", &pycomm::dequant_reduce_requant);
  m.impl("topk", &pycomm::topk);
  m.impl("scatter_add", &pycomm::scatter_add);
}
