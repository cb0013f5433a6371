// Per-element reduction math shared by the CPU and CUDA kernels.
//
// Half-precision inputs are widened to float32, combined, and rounded back
// once per kernel call: a k-way reduce of fp16 data therefore rounds once,
// not k-1 times.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../core/common.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace pycomm {
namespace kernels {

// Storage types: 16-bit patterns, converted explicitly so that host and
// device code agree bit for bit.
struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };
// One byte read as false (0) or true (anything else), written as 0 or 1.
struct Bool { uint8_t bits; };

PYCOMM_HOST_DEVICE float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

PYCOMM_HOST_DEVICE uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

PYCOMM_HOST_DEVICE float to_float(BFloat16 v) {
  return bits_to_float(static_cast<uint32_t>(v.bits) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN rather than rounding up
// into the infinity pattern.
PYCOMM_HOST_DEVICE BFloat16 from_float_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // One conversion instruction on the GPU, where the bit arithmetic below
  // compiles to about ten: bf16 outputs cost more instructions than float32
  // ones, and the kernels that write them are bound by instruction issue
  // (H200: dequantize into bf16 at 42 % of the copy bandwidth, into float32
  // 70 %). IEEE round to nearest even gives the same bits for every value
  // but NaN, which comes out as the hardware's canonical NaN (as from the
  // reductions: a NaN's payload is the hardware's).
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return BFloat16{r};
#else
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(u >> 16)};
#endif
}

#if defined(__CUDACC__)
PYCOMM_HOST_DEVICE float to_float(Half v) {
  return __half2float(__ushort_as_half(v.bits));
}
PYCOMM_HOST_DEVICE Half from_float_f16(float f) {
  return Half{__half_as_ushort(__float2half_rn(f))};
}
#else
// _Float16 conversions are exact IEEE round-to-nearest-even; on x86 with
// F16C the compiler emits vcvtps2ph/vcvtph2ps for the multiversioned loops.
inline float to_float(Half v) {
  _Float16 h;
  memcpy(&h, &v.bits, sizeof h);
  return static_cast<float>(h);
}
inline Half from_float_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  Half out;
  memcpy(&out.bits, &h, sizeof h);
  return out;
}
#endif

// The accumulator type of each storage type.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<Half> { using type = float; };
template <> struct Acc<BFloat16> { using type = float; };
// Wide enough that a sum of any number of trues stays non-zero.
template <> struct Acc<Bool> { using type = uint32_t; };

template <typename T> PYCOMM_HOST_DEVICE typename Acc<T>::type load_acc(T v) { return v; }
PYCOMM_HOST_DEVICE float load_acc(Half v) { return to_float(v); }
PYCOMM_HOST_DEVICE float load_acc(BFloat16 v) { return to_float(v); }
PYCOMM_HOST_DEVICE uint32_t load_acc(Bool v) { return v.bits != 0; }

template <typename T> PYCOMM_HOST_DEVICE T store_acc(typename Acc<T>::type v) { return v; }
template <> PYCOMM_HOST_DEVICE Half store_acc<Half>(float v) { return from_float_f16(v); }
template <> PYCOMM_HOST_DEVICE BFloat16 store_acc<BFloat16>(float v) { return from_float_bf16(v); }
// Storing collapses to 0/1: a bool sum is OR and a product AND.
template <> PYCOMM_HOST_DEVICE Bool store_acc<Bool>(uint32_t v) { return Bool{static_cast<uint8_t>(v != 0)}; }

// max/min propagate NaN like torch.maximum/torch.minimum: comparisons with
// NaN are false, so test the incoming value explicitly.
template <typename A> PYCOMM_HOST_DEVICE bool is_nan(A v) { return v != v; }

template <RedOp kOp, typename A>
PYCOMM_HOST_DEVICE A combine(A a, A b) {
  if constexpr (kOp == RedOp::kSum || kOp == RedOp::kAvg) {
    return a + b;
  } else if constexpr (kOp == RedOp::kMax) {
    return (is_nan(a) || a > b) ? a : b;
  } else if constexpr (kOp == RedOp::kMin) {
    return (is_nan(a) || a < b) ? a : b;
  } else if constexpr (kOp == RedOp::kProduct) {
    return a * b;
  } else if constexpr (std::is_integral<A>::value) {
    if constexpr (kOp == RedOp::kBand) return a & b;
    if constexpr (kOp == RedOp::kBor) return a | b;
    return a ^ b;
  } else {
    // Bitwise ops on floating dtypes are refused before any kernel runs
    // (check_reducible); this branch only keeps the template total.
    return a;
  }
}

}  // namespace kernels
}  // namespace pycomm
