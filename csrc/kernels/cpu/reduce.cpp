// CPU reduction kernels. Memory-bound: the goal is one pass over the data at
// copy speed, so sources are combined in L1-sized blocks instead of one full
// pass per source.
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "../kernels.h"
#include "../reduce.h"
#include "dispatch.h"

namespace pycomm {
namespace kernels {
namespace {

// 2 KiB-4 KiB of accumulator: stays in L1 while every source streams through.
constexpr size_t kBlock = 512;

template <typename T, RedOp kOp>
PYCOMM_MULTIVERSION void reduce2(T* out0, T* out1, const T* a, const T* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    auto v = store_acc<T>(combine<kOp>(load_acc(a[i]), load_acc(b[i])));
    out0[i] = v;
    if (out1) out1[i] = v;
  }
}

template <typename T, RedOp kOp>
PYCOMM_MULTIVERSION void reduce_many(T* out0, T* out1, const T* const* srcs, int nsrc, size_t n) {
  using A = typename Acc<T>::type;
  A acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    const T* s0 = srcs[0] + base;
    for (size_t i = 0; i < m; ++i) acc[i] = load_acc(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const T* s = srcs[k] + base;
      for (size_t i = 0; i < m; ++i) acc[i] = combine<kOp>(acc[i], load_acc(s[i]));
    }
    T* o0 = out0 + base;
    for (size_t i = 0; i < m; ++i) o0[i] = store_acc<T>(acc[i]);
    if (out1) std::memcpy(out1 + base, o0, m * sizeof(T));
  }
}

template <typename T, RedOp kOp>
void reduce_typed(void* out0, void* out1, const void* const* srcs, int nsrc, size_t count) {
  auto* o0 = static_cast<T*>(out0);
  auto* o1 = static_cast<T*>(out1);
  if (nsrc == 2) {
    reduce2<T, kOp>(o0, o1, static_cast<const T*>(srcs[0]), static_cast<const T*>(srcs[1]), count);
  } else {
    reduce_many<T, kOp>(o0, o1, reinterpret_cast<const T* const*>(srcs), nsrc, count);
  }
}

template <typename T>
void reduce_op(RedOp op, void* out0, void* out1, const void* const* srcs, int nsrc, size_t count) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return reduce_typed<T, RedOp::kSum>(out0, out1, srcs, nsrc, count);
    case RedOp::kMax: return reduce_typed<T, RedOp::kMax>(out0, out1, srcs, nsrc, count);
    case RedOp::kMin: return reduce_typed<T, RedOp::kMin>(out0, out1, srcs, nsrc, count);
    case RedOp::kProduct: return reduce_typed<T, RedOp::kProduct>(out0, out1, srcs, nsrc, count);
    case RedOp::kBand:
    case RedOp::kBor:
    case RedOp::kBxor:
      // Floating dtypes never get here (check_reducible), and instantiating
      // bitwise loops for them would only cost compile time.
      if constexpr (std::is_integral<typename Acc<T>::type>::value) {
        if (op == RedOp::kBand) return reduce_typed<T, RedOp::kBand>(out0, out1, srcs, nsrc, count);
        if (op == RedOp::kBor) return reduce_typed<T, RedOp::kBor>(out0, out1, srcs, nsrc, count);
        return reduce_typed<T, RedOp::kBxor>(out0, out1, srcs, nsrc, count);
      }
      break;
  }
  throw CommError(std::string("pycomm: op=") + redop_name(op) + " needs an integral or bool dtype");
}

template <typename T>
PYCOMM_MULTIVERSION void divide_typed(T* data, size_t n, typename Acc<T>::type d) {
  for (size_t i = 0; i < n; ++i) data[i] = store_acc<T>(load_acc(data[i]) / d);
}

}  // namespace

void reduce_cpu(DType dtype, RedOp op, void* out0, void* out1, const void* const* srcs, int nsrc,
                size_t count) {
  if (count == 0 || nsrc <= 0) return;
  if (nsrc == 1) {
    copy_cpu(out0, out1, srcs[0], count * dtype_size(dtype));
    return;
  }
  switch (dtype) {
    case DType::kFloat32: return reduce_op<float>(op, out0, out1, srcs, nsrc, count);
    case DType::kFloat64: return reduce_op<double>(op, out0, out1, srcs, nsrc, count);
    case DType::kFloat16: return reduce_op<Half>(op, out0, out1, srcs, nsrc, count);
    case DType::kBFloat16: return reduce_op<BFloat16>(op, out0, out1, srcs, nsrc, count);
    case DType::kInt32: return reduce_op<int32_t>(op, out0, out1, srcs, nsrc, count);
    case DType::kInt64: return reduce_op<int64_t>(op, out0, out1, srcs, nsrc, count);
    case DType::kUInt8: return reduce_op<uint8_t>(op, out0, out1, srcs, nsrc, count);
    case DType::kInt8: return reduce_op<int8_t>(op, out0, out1, srcs, nsrc, count);
    case DType::kBool: return reduce_op<Bool>(op, out0, out1, srcs, nsrc, count);
    default:
      throw CommError(std::string("pycomm: ") + check_reducible(dtype, op));
  }
}

void copy_cpu(void* out0, void* out1, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (out0 != src) std::memcpy(out0, src, bytes);
  if (out1 && out1 != src) std::memcpy(out1, src, bytes);
}

void divide_cpu(DType dtype, void* data, size_t count, double divisor) {
  switch (dtype) {
    case DType::kFloat32: return divide_typed(static_cast<float*>(data), count, static_cast<float>(divisor));
    case DType::kFloat64: return divide_typed(static_cast<double*>(data), count, divisor);
    case DType::kFloat16: return divide_typed(static_cast<Half*>(data), count, static_cast<float>(divisor));
    case DType::kBFloat16: return divide_typed(static_cast<BFloat16*>(data), count, static_cast<float>(divisor));
    default:
      throw CommError("pycomm: avg is only defined for floating-point dtypes");
  }
}

}  // namespace kernels
}  // namespace pycomm
