// The kernels as torch operators: schemas declared once here, the
// device-generic bodies (ops.h) registered for CPU here and for CUDA in
// ops_cuda.cpp. Callable as torch.ops.pycomm.<name>; the typed Python
// wrappers are in pycomm/compression.py.
#include "ops.h"

#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/quant.h"
#include "dtype.h"

namespace pycomm {
namespace ops {
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

// Contiguous, and on `device` (the device of the operator's first tensor).
void check_dense(const at::Tensor& t, const c10::Device& device, const char* op, const char* role) {
  TORCH_CHECK(t.device() == device, "pycomm.", op, ": ", role, " is on ", t.device(), " but the input is on ",
              device);
  TORCH_CHECK(t.is_contiguous(), "pycomm.", op, ": ", role, " must be contiguous");
}

void check_quant_args(const char* op, int64_t bits, int64_t block) {
  TORCH_CHECK(bits == 8 || bits == 4, "pycomm.", op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block >= 8 && block % 8 == 0 && block <= (1 << 20), "pycomm.", op,
              ": block must be a multiple of 8 between 8 and 1048576, got ", block);
}

void check_payload(const at::Tensor& p, const c10::Device& device, int64_t numel, int64_t bits, int64_t block,
                   const char* op) {
  check_dense(p, device, op, "payload");
  TORCH_CHECK(p.scalar_type() == at::kByte, "pycomm.", op, ": payload must be uint8, got ", p.scalar_type());
  TORCH_CHECK(numel >= 0, "pycomm.", op, ": numel must be >= 0");
  const size_t want = kernels::quant_payload_bytes(numel, bits, block);
  TORCH_CHECK(static_cast<size_t>(p.numel()) >= want, "pycomm.", op, ": a payload of ", numel, " elements at ",
              bits, " bits, block ", block, " needs ", want, " bytes, got ", p.numel());
}

// The kernels read and write a payload's float scales in place, so a
// payload must start at a 4-byte boundary; a uint8 view at any other offset
// goes through an aligned copy (on a GPU a misaligned float access faults
// and poisons the whole context). Payload sizes are multiples of 8
// (quant_payload_bytes): payloads cut from one buffer at their sizes stay
// aligned and are never copied.
bool payload_aligned(const at::Tensor& p) {
  return reinterpret_cast<uintptr_t>(p.data_ptr()) % alignof(float) == 0;
}

// A payload the kernels only read.
at::Tensor readable_payload(const at::Tensor& p) { return payload_aligned(p) ? p : p.clone(); }

// A payload the kernels write: `p` itself, or an aligned scratch of its
// size whose first `bytes` finish() copies back into `p`.
struct WritablePayload {
  at::Tensor target, scratch;
  size_t bytes;
  WritablePayload(const at::Tensor& p, size_t used)
      : target(p), scratch(payload_aligned(p) ? p : at::empty_like(p)), bytes(used) {}
  uint8_t* data() { return scratch.data_ptr<uint8_t>(); }
  void finish() {
    if (scratch.is_same(target)) return;
    const auto used = static_cast<int64_t>(bytes);
    target.narrow(0, 0, used).copy_(scratch.narrow(0, 0, used));
  }
};

float* residual_ptr(const c10::optional<at::Tensor>& r, const c10::Device& device, int64_t numel, const char* op) {
  if (!r.has_value() || !r->defined()) return nullptr;
  check_dense(*r, device, op, "residual");
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

const DeviceKernels kCpu{
    &kernels::quantize_cpu,
    &kernels::dequantize_cpu,
    &kernels::dequant_reduce_cpu,
    [](const kernels::TopK& s, DType dt, const void* x, float* r, size_t n, size_t cap, void* values,
       int32_t* indices, const at::Tensor&) { return kernels::topk_cpu(s, dt, x, r, n, cap, values, indices); },
    [](DType vt, const void* values, const int32_t* indices, size_t count, DType dt, void* dense, size_t n,
       const at::Tensor&) { kernels::scatter_add_cpu(vt, values, indices, count, dt, dense, n); },
    [](DType dt, RedOp op, void* out, const void* const* srcs, int nsrc, size_t count) {
      kernels::reduce_cpu(dt, op, out, nullptr, srcs, nsrc, count);
    },
    &kernels::divide_cpu,
    &kernels::orthogonalize_cpu,
};

// The kernels of `t`'s device; the caller holds a DeviceGuard for it.
const DeviceKernels& kernels_for(const at::Tensor& t, const char* op) {
#ifdef PYCOMM_WITH_CUDA
  if (t.is_cuda()) return cuda_kernels();
#endif
#ifdef PYCOMM_WITH_CUDA
  constexpr const char* kBuilt = "CPU and CUDA";
#else
  constexpr const char* kBuilt = "CPU only; CUDA kernels are built when torch has CUDA and nvcc is found";
#endif
  TORCH_CHECK(t.is_cpu(), "pycomm.", op, ": no kernels for tensors on ", t.device(), " in this build of pycomm (",
              kBuilt, ")");
  return kCpu;
}

void check_index_base(int64_t index_base, const char* op) {
  TORCH_CHECK(index_base >= 0, "pycomm.", op, ": index_base must be >= 0, got ", index_base);
}

}  // namespace

void quantize_into(const at::Tensor& x, const at::Tensor& payload, int64_t bits, int64_t block, bool stochastic,
                   int64_t seed, const c10::optional<at::Tensor>& residual, int64_t index_base) {
  const char* op = "quantize";
  check_index_base(index_base, op);
  check_quant_args(op, bits, block);
  check_dense(x, x.device(), op, "input");
  const c10::DeviceGuard guard(x.device());
  const DeviceKernels& k = kernels_for(x, op);
  const DType dt = float_dtype(x, op, "input");
  float* r = residual_ptr(residual, x.device(), x.numel(), op);
  check_payload(payload, x.device(), x.numel(), bits, block, op);
  kernels::QuantSpec s{static_cast<int>(bits), static_cast<int>(block), stochastic, static_cast<uint64_t>(seed)};
  WritablePayload w(payload, kernels::quant_payload_bytes(x.numel(), bits, block));
  guarded([&] { k.quantize(s, dt, x.data_ptr(), r, x.numel(), w.data(), index_base); });
  w.finish();
}

at::Tensor quantize(const at::Tensor& x, int64_t bits, int64_t block, bool stochastic, int64_t seed,
                    const c10::optional<at::Tensor>& residual, int64_t index_base) {
  check_quant_args("quantize", bits, block);
  auto out = at::empty({static_cast<int64_t>(kernels::quant_payload_bytes(x.numel(), bits, block))},
                       x.options().dtype(at::kByte));
  quantize_into(x, out, bits, block, stochastic, seed, residual, index_base);
  return out;
}

// D(payload) into `out` (overwrite) or added to it (accumulate).
void dequantize_to(const at::Tensor& out, const at::Tensor& payload, int64_t bits, int64_t block, bool accumulate,
                   const char* op) {
  check_quant_args(op, bits, block);
  check_dense(out, out.device(), op, accumulate ? "acc" : "out");
  const c10::DeviceGuard guard(out.device());
  const DeviceKernels& k = kernels_for(out, op);
  const DType dt = float_dtype(out, op, accumulate ? "acc" : "out");
  check_payload(payload, out.device(), out.numel(), bits, block, op);
  const at::Tensor p = readable_payload(payload);
  guarded([&] { k.dequantize(bits, block, p.data_ptr<uint8_t>(), out.numel(), dt, out.data_ptr(), accumulate); });
}

at::Tensor dequantize(const at::Tensor& payload, int64_t numel, int64_t bits, int64_t block, at::ScalarType dtype) {
  check_quant_args("dequantize", bits, block);
  check_payload(payload, payload.device(), numel, bits, block, "dequantize");
  auto out = at::empty({numel}, payload.options().dtype(dtype));
  dequantize_to(out, payload, bits, block, false, "dequantize");
  return out;
}

void dequantize_into(const at::Tensor& out, const at::Tensor& payload, int64_t bits, int64_t block) {
  dequantize_to(out, payload, bits, block, false, "dequantize_into");
}

void dequantize_accumulate(const at::Tensor& acc, const at::Tensor& payload, int64_t bits, int64_t block) {
  dequantize_to(acc, payload, bits, block, true, "dequantize_accumulate");
}

void dequant_reduce_requant_into(const at::Tensor& out, at::TensorList payloads, const c10::optional<at::Tensor>& dense,
                                 int64_t numel, int64_t bits, int64_t block, double post_scale, bool stochastic,
                                 int64_t seed, const c10::optional<at::Tensor>& residual, int64_t index_base) {
  const char* op = "dequant_reduce_requant";
  check_quant_args(op, bits, block);
  check_index_base(index_base, op);
  TORCH_CHECK(!payloads.empty(), "pycomm.", op, ": needs at least one payload");
  const c10::Device device = payloads[0].device();
  std::vector<at::Tensor> held;  // aligned copies, alive until the launch
  std::vector<const uint8_t*> srcs;
  for (const auto& p : payloads) {
    check_payload(p, device, numel, bits, block, op);
    held.push_back(readable_payload(p));
    srcs.push_back(held.back().data_ptr<uint8_t>());
  }
  const c10::DeviceGuard guard(device);
  const DeviceKernels& k = kernels_for(payloads[0], op);
  kernels::DequantReduce a;
  a.bits = static_cast<int>(bits);
  a.block = static_cast<int>(block);
  a.srcs = srcs.data();
  a.nsrc = static_cast<int>(srcs.size());
  a.n = static_cast<size_t>(numel);
  if (dense.has_value() && dense->defined()) {
    check_dense(*dense, device, op, "dense");
    TORCH_CHECK(dense->numel() == numel, "pycomm.", op, ": dense has ", dense->numel(), " elements, expected ",
                numel);
    a.dense = dense->data_ptr();
    a.dense_dtype = float_dtype(*dense, op, "dense");
  }
  a.post_scale = static_cast<float>(post_scale);
  check_payload(out, device, numel, bits, block, op);
  WritablePayload w(out, kernels::quant_payload_bytes(numel, bits, block));
  a.out_payload = w.data();
  a.requant = kernels::QuantSpec{a.bits, a.block, stochastic, static_cast<uint64_t>(seed)};
  a.residual = residual_ptr(residual, device, numel, op);
  a.index_base = static_cast<uint64_t>(index_base);
  guarded([&] { k.dequant_reduce(a); });
  w.finish();
}

at::Tensor dequant_reduce_requant(at::TensorList payloads, const c10::optional<at::Tensor>& dense, int64_t numel,
                                  int64_t bits, int64_t block, double post_scale, bool stochastic, int64_t seed,
                                  const c10::optional<at::Tensor>& residual, int64_t index_base) {
  check_quant_args("dequant_reduce_requant", bits, block);
  TORCH_CHECK(!payloads.empty(), "pycomm.dequant_reduce_requant: needs at least one payload");
  auto out = at::empty({static_cast<int64_t>(kernels::quant_payload_bytes(numel, bits, block))},
                       payloads[0].options());
  dequant_reduce_requant_into(out, payloads, dense, numel, bits, block, post_scale, stochastic, seed, residual,
                              index_base);
  return out;
}

std::tuple<at::Tensor, int64_t, int64_t> topk(const at::Tensor& x, int64_t k, bool exact, double tolerance,
                                              double sample_fraction, int64_t seed,
                                              const c10::optional<at::Tensor>& residual) {
  check_dense(x, x.device(), "topk", "input");
  const c10::DeviceGuard guard(x.device());
  const DeviceKernels& dk = kernels_for(x, "topk");
  const DType dt = float_dtype(x, "topk", "input");
  TORCH_CHECK(k >= 0, "pycomm.topk: k must be >= 0, got ", k);
  TORCH_CHECK(tolerance >= 0 && tolerance < 1, "pycomm.topk: tolerance must be in [0, 1), got ", tolerance);
  const size_t n = x.numel();
  const size_t kk = std::min<size_t>(k, n);
  const size_t cap = kernels::topk_capacity(kk, n, exact, tolerance);
  float* r = residual_ptr(residual, x.device(), x.numel(), "topk");
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
    return dk.topk(s, dt, x.data_ptr(), r, n, cap, base,
                   reinterpret_cast<int32_t*>(base + kernels::topk_values_bytes(cap, es)), x);
  });
  return {out, static_cast<int64_t>(kept), static_cast<int64_t>(cap)};
}

void scatter_add(const at::Tensor& dense, const at::Tensor& values, const at::Tensor& indices) {
  const c10::Device device = dense.device();
  check_dense(dense, device, "scatter_add", "dense");
  check_dense(values, device, "scatter_add", "values");
  check_dense(indices, device, "scatter_add", "indices");
  const c10::DeviceGuard guard(device);
  const DeviceKernels& k = kernels_for(dense, "scatter_add");
  TORCH_CHECK(indices.scalar_type() == at::kInt, "pycomm.scatter_add: indices must be int32, got ",
              indices.scalar_type());
  TORCH_CHECK(values.numel() == indices.numel(), "pycomm.scatter_add: ", values.numel(), " values but ",
              indices.numel(), " indices");
  const DType vt = float_dtype(values, "scatter_add", "values");
  const DType dt = float_dtype(dense, "scatter_add", "dense");
  guarded([&] {
    k.scatter_add(vt, values.data_ptr(), indices.data_ptr<int32_t>(), values.numel(), dt, dense.data_ptr(),
                  dense.numel(), dense);
  });
}

at::Tensor reduce(at::TensorList srcs, c10::string_view op_name) {
  const char* op = "reduce";
  TORCH_CHECK(!srcs.empty(), "pycomm.reduce: needs at least one tensor");
  const at::Tensor& first = srcs[0];
  // The ops by their names in common.cpp (redop_name), the one table of them.
  int red_id = 0;
  while (red_id <= kLastRedOp && op_name != redop_name(static_cast<RedOp>(red_id))) ++red_id;
  TORCH_CHECK(red_id <= kLastRedOp, "pycomm.reduce: op must be sum, avg, max, min, product, band, bor or bxor, got '",
              std::string(op_name), "'");
  const RedOp red = static_cast<RedOp>(red_id);
  DType dt;
  TORCH_CHECK(to_dtype(first.scalar_type(), &dt), "pycomm.reduce: dtype ", first.scalar_type(), " is not supported");
  const std::string why = check_reducible(dt, red);
  TORCH_CHECK(why.empty(), "pycomm.reduce: ", why);
  std::vector<const void*> ptrs;
  for (const auto& t : srcs) {
    check_dense(t, first.device(), op, "every tensor");
    TORCH_CHECK(t.scalar_type() == first.scalar_type() && t.sizes() == first.sizes(),
                "pycomm.reduce: every tensor must have the first's dtype and shape");
    ptrs.push_back(t.data_ptr());
  }
  const c10::DeviceGuard guard(first.device());
  const DeviceKernels& k = kernels_for(first, op);
  auto out = at::empty_like(first, at::MemoryFormat::Contiguous);
  guarded([&] {
    k.reduce(dt, red, out.data_ptr(), ptrs.data(), static_cast<int>(ptrs.size()), first.numel());
    if (red == RedOp::kAvg) k.divide(dt, out.data_ptr(), first.numel(), static_cast<double>(ptrs.size()));
  });
  return out;
}

void orthogonalize_(const at::Tensor& m, double epsilon) {
  const char* op = "orthogonalize_";
  TORCH_CHECK(m.dim() == 2 || m.dim() == 3, "pycomm.orthogonalize_: takes a matrix or a batch of matrices "
              "(2 or 3 dimensions), got ", m.dim());
  TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == at::kDouble,
              "pycomm.orthogonalize_: takes float32 or float64, got ", m.scalar_type());
  check_dense(m, m.device(), op, "the matrices");
  TORCH_CHECK(epsilon >= 0, "pycomm.orthogonalize_: epsilon must be >= 0, got ", epsilon);
  const int64_t rows = m.size(-2), cols = m.size(-1);
  TORCH_CHECK(cols <= rows, "pycomm.orthogonalize_: ", cols, " columns cannot be orthonormal in ", rows,
              " dimensions (columns must not outnumber rows)");
  const int64_t batch = m.dim() == 3 ? m.size(0) : 1;
  const c10::DeviceGuard guard(m.device());
  const DeviceKernels& k = kernels_for(m, op);
  const DType dt = m.scalar_type() == at::kFloat ? DType::kFloat32 : DType::kFloat64;
  guarded([&] { k.orthogonalize(dt, m.data_ptr(), batch, rows, cols, epsilon); });
}

}  // namespace ops
}  // namespace pycomm

TORCH_LIBRARY(pycomm, m) {
  // topk returns (buffer, kept, capacity): values for `capacity` entries in
  // the input dtype (padded to 8 bytes), then `capacity` int32 indices.
  // index_base: the global index of the input's first element, so that a
  // shard quantized alone draws its stochastic rounding as it would inside
  // the whole tensor (the compressed all-reduce quantizes shards).
  m.def(
      "quantize(Tensor x, int bits, int block, bool stochastic, int seed, Tensor(a!)? residual, int index_base=0) "
      "-> Tensor");
  m.def("dequantize(Tensor payload, int numel, int bits, int block, ScalarType dtype) -> Tensor");
  // The _into twins write into a caller's buffer (a payload of at least the
  // needed bytes; an output of the payload's numel): callers that reuse
  // buffers touch no fresh pages, whose first-touch faults cost as much as
  // the kernels.
  m.def(
      "quantize_into(Tensor x, Tensor(a!) payload, int bits, int block, bool stochastic, int seed, "
      "Tensor(b!)? residual, int index_base=0) -> ()");
  m.def("dequantize_into(Tensor(a!) out, Tensor payload, int bits, int block) -> ()");
  m.def(
      "dequant_reduce_requant_into(Tensor(a!) out, Tensor[] payloads, Tensor? dense, int numel, int bits, int block, "
      "float post_scale, bool stochastic, int seed, Tensor(b!)? residual, int index_base=0) -> ()");
  m.def("dequantize_accumulate(Tensor(a!) acc, Tensor payload, int bits, int block) -> ()");
  m.def(
      "dequant_reduce_requant(Tensor[] payloads, Tensor? dense, int numel, int bits, int block, float post_scale, "
      "bool stochastic, int seed, Tensor(a!)? residual, int index_base=0) -> Tensor");
  m.def(
      "topk(Tensor x, int k, bool exact, float tolerance, float sample_fraction, int seed, Tensor(a!)? residual) "
      "-> (Tensor, int, int)");
  m.def("scatter_add(Tensor(a!) dense, Tensor values, Tensor indices) -> ()");
  // The transports' reduction kernel, element-wise over same-shaped tensors
  // in list order (the bits every rank computes): for tests and benchmarks.
  m.def("reduce(Tensor[] srcs, str op='sum') -> Tensor");
  // PowerSGD's orthogonalization, in place: the columns of each matrix of a
  // (batch, rows, cols) or (rows, cols) tensor by modified Gram-Schmidt.
  m.def("orthogonalize_(Tensor(a!) m, float epsilon=0) -> ()");
}

namespace pycomm {
namespace ops {

void register_impls(torch::Library& m) {
  m.impl("quantize", &quantize);
  m.impl("quantize_into", &quantize_into);
  m.impl("dequantize_into", &dequantize_into);
  m.impl("dequant_reduce_requant_into", &dequant_reduce_requant_into);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_accumulate", &dequantize_accumulate);
  m.impl("dequant_reduce_requant", &dequant_reduce_requant);
  m.impl("topk", &topk);
  m.impl("scatter_add", &scatter_add);
  m.impl("reduce", &reduce);
  m.impl("orthogonalize_", &orthogonalize_);
}

}  // namespace ops
}  // namespace pycomm

TORCH_LIBRARY_IMPL(pycomm, CPU, m) { pycomm::ops::register_impls(m); }
