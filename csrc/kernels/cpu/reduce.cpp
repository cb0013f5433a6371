// CPU reduction kernels. Memory-bound: the goal is one pass over the data at
// copy speed, so sources are combined in L1-sized blocks instead of one full
// pass per source.
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "../reduce.h"
#include "dispatch.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

namespace {

// copy_cpu_streaming without the closing fence, for callers that stream
// several pieces and fence once.
void stream_copy(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Streaming stores need 16-byte aligned destinations: copy the head plainly.
  const size_t head = std::min(bytes, static_cast<size_t>((16 - reinterpret_cast<uintptr_t>(d) % 16) % 16));
  std::memcpy(d, s, head);
  size_t i = head;
  // A cache line per iteration, so that the write-combining buffers fill
  // whole lines (a partial line would go to memory twice).
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void store_fence() {
#if defined(__x86_64__)
  // Streaming stores are weakly ordered: without the fence a peer could see
  // a flag posted after them before it sees the data.
  _mm_sfence();
#endif
}

}  // namespace

void copy_cpu_streaming(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  stream_copy(dst, src, bytes);
  store_fence();
}

void reduce_cpu_streaming(DType dtype, RedOp op, void* out0, void* stream_out, const void* const* srcs, int nsrc,
                          size_t count) {
  if (count == 0 || nsrc <= 0) return;
  const size_t es = dtype_size(dtype);
  // 16 KiB per block: the block just written is still in L1/L2 when it is
  // streamed out, and blocks stay whole cache lines for every dtype.
  constexpr size_t kStreamBlockBytes = 16 * 1024;
  const size_t block = kStreamBlockBytes / es;
  alignas(64) char scratch[kStreamBlockBytes];
  std::vector<const void*> at(static_cast<size_t>(nsrc));
  for (size_t base = 0; base < count; base += block) {
    const size_t m = std::min(block, count - base);
    for (int k = 0; k < nsrc; ++k) at[k] = static_cast<const char*>(srcs[k]) + base * es;
    void* dst = out0 ? static_cast<char*>(out0) + base * es : static_cast<void*>(scratch);
    reduce_cpu(dtype, op, dst, nullptr, at.data(), nsrc, m);
    stream_copy(static_cast<char*>(stream_out) + base * es, dst, m * es);
  }
  store_fence();
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
