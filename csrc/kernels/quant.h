// Per-element compression math shared by the CPU and CUDA kernels:
// blockwise absmax quantization codes, the counter-based random numbers of
// stochastic rounding, and the ordering key of top-k selection.
//
// Code layout of a quantized shard of n elements ("payload"):
//   float32 scales[ceil(n / block)]            one per block, then
//   codes: int8  -> n bytes, two's complement
//          int4  -> ceil(n / 2) bytes, element 2j in the low nibble of byte j,
//                   2j+1 in the high nibble, each stored as code + 8
//
// Symmetric codes in [-qmax, qmax] (127 for int8, 7 for int4); the one code
// left over (-qmax-1) and the sign bit of the scale carry non-finite values:
// a block that holds NaN or +-Inf is "flagged" (its scale is stored negated,
// with the sign bit set even when it is zero). In a flagged block finite
// values use [-(qmax-1), qmax-1] and
//     +qmax -> +Inf,   -qmax -> -Inf,   -qmax-1 -> NaN,
// so every non-finite input comes back exactly, and blocks without one lose
// no precision to the escape codes.
#pragma once

#include <cstdint>
#include <cstring>

#include "../core/common.h"
#include "reduce.h"

#include <math.h>

namespace pycomm {
namespace kernels {

constexpr int kDefaultQuantBlock = 256;
// Payloads start 8-byte aligned and are padded to this many bytes when
// several are laid side by side (the all-to-all slots of a compressed
// all-reduce), so every slot's scales stay aligned.
constexpr size_t kPayloadAlign = 64;

PYCOMM_HOST_DEVICE int quant_qmax(int bits) { return bits == 8 ? 127 : 7; }

PYCOMM_HOST_DEVICE size_t quant_num_blocks(size_t n, int block) { return (n + block - 1) / block; }

PYCOMM_HOST_DEVICE size_t quant_code_bytes(size_t n, int bits) { return bits == 8 ? n : (n + 1) / 2; }

// Bytes of one payload: scales then codes, padded to 8.
PYCOMM_HOST_DEVICE size_t quant_payload_bytes(size_t n, int bits, int block) {
  size_t b = quant_num_blocks(n, block) * 4 + quant_code_bytes(n, bits);
  return (b + 7) / 8 * 8;
}

PYCOMM_HOST_DEVICE bool is_finite_f(float x) {
  // Exponent all ones is Inf or NaN; integer test so fast-math cannot drop it.
  return (float_to_bits(x) & 0x7f800000u) != 0x7f800000u;
}

PYCOMM_HOST_DEVICE bool scale_flagged(float stored) { return (float_to_bits(stored) >> 31) != 0; }

// Per-block quantization parameters, derived from the block's largest finite
// magnitude and whether it holds a non-finite value.
struct BlockQuant {
  float scale;   // dequantization step (>= 0)
  float inv;     // 1 / scale, 0 when the block is all zeros
  int qmax;      // largest code of the format
  int qrange;    // largest finite code
  bool flagged;  // block holds NaN/Inf
};

// Blocks whose largest finite magnitude is below this are sent as zeros: at
// 2^-120 (7.5e-37) qrange / absmax still fits a float; below it the inverse
// overflows to Inf and 0 * Inf would turn the block's zeros into NaN. Such
// values (ReLU networks produce them) are far below any gradient that
// matters, and with error feedback they stay in the residual.
constexpr float kMinBlockAbsmax = 7.52316384526264e-37f;  // 2^-120

PYCOMM_HOST_DEVICE BlockQuant make_block_quant(float absmax_finite, bool flagged, int bits) {
  BlockQuant b;
  b.flagged = flagged;
  b.qmax = quant_qmax(bits);
  b.qrange = b.qmax - (flagged ? 1 : 0);
  if (!(absmax_finite >= kMinBlockAbsmax)) absmax_finite = 0.f;
  b.scale = absmax_finite / static_cast<float>(b.qrange);
  // inv from absmax, not 1/scale: x * inv then lands within an ulp of
  // +-qrange at the block's extreme, and the clamp absorbs the rest.
  b.inv = absmax_finite > 0.f ? static_cast<float>(b.qrange) / absmax_finite : 0.f;
  return b;
}

// The float stored in the payload for a block.
PYCOMM_HOST_DEVICE float stored_scale(const BlockQuant& b) {
  return b.flagged ? bits_to_float(float_to_bits(b.scale) | 0x80000000u) : b.scale;
}

// rintf rounds to nearest even in the default rounding mode, on the host and
// on the GPU alike.
PYCOMM_HOST_DEVICE float round_half_even(float v) { return rintf(v); }
PYCOMM_HOST_DEVICE float floor_f(float v) { return floorf(v); }

// quant_code of a finite x. In a block that is not flagged every value is
// finite, so the GPU's warp kernels call this for the whole block once they
// know it (the test per element was a branch per element).
PYCOMM_HOST_DEVICE int quant_code_finite(float x, const BlockQuant& b, float u) {
  const float v = x * b.inv;
  float q = u < 0.f ? round_half_even(v) : floor_f(v + u);
  const float lim = static_cast<float>(b.qrange);
  q = q > lim ? lim : (q < -lim ? -lim : q);
  return static_cast<int>(q);
}

// Code of one value. `u` in [0, 1) for stochastic rounding (floor(v + u) is
// unbiased: E[code] = v), or negative for round-to-nearest-even; a
// non-finite x gets the code that carries it exactly.
PYCOMM_HOST_DEVICE int quant_code(float x, const BlockQuant& b, float u) {
  if (!is_finite_f(x)) {
    if (x != x) return -b.qmax - 1;
    return x > 0.f ? b.qmax : -b.qmax;
  }
  return quant_code_finite(x, b, u);
}

// dequant_code in a block that is not flagged (scale_flagged false).
PYCOMM_HOST_DEVICE float dequant_code_unflagged(int q, float stored) { return static_cast<float>(q) * stored; }

// Value of one code given the block's stored scale.
PYCOMM_HOST_DEVICE float dequant_code(int q, float stored, int bits) {
  if (scale_flagged(stored)) {
    const int qmax = quant_qmax(bits);
    if (q == qmax) return bits_to_float(0x7f800000u);
    if (q == -qmax) return bits_to_float(0xff800000u);
    if (q == -qmax - 1) return bits_to_float(0x7fc00000u);
    return static_cast<float>(q) * -stored;
  }
  return dequant_code_unflagged(q, stored);
}

// int4 nibble <-> code.
PYCOMM_HOST_DEVICE uint8_t nibble_of(int q) { return static_cast<uint8_t>(q + 8) & 0xfu; }
PYCOMM_HOST_DEVICE int code_of_nibble(uint8_t nib) { return static_cast<int>(nib & 0xfu) - 8; }

// Residual left by transmitting x as code q: nothing for a non-finite value
// (it travels exactly, and a NaN residual would poison every later step).
PYCOMM_HOST_DEVICE float quant_residual(float x, float dequantized) {
  return is_finite_f(x) ? x - dequantized : 0.f;
}

// ------------------------------------------------------------ random numbers

// splitmix64's finaliser: turns a user seed into a well-mixed stream key.
PYCOMM_HOST_DEVICE uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A 32-bit integer hash with low bias (Wellons' "lowbias32"); 32-bit
// multiplies vectorise on AVX2 and are native on GPUs, which a 64-bit mix
// per element is not.
PYCOMM_HOST_DEVICE uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Uniform in [0, 1) for element `index` of the stream `key` (= mix64(seed)):
// stateless, so any split of the work over threads or shards draws the same
// numbers. 24 random bits: exactly representable in float32, so floor(v + u)
// never sees u rounded up to 1.
PYCOMM_HOST_DEVICE float uniform01(uint64_t key, uint64_t index) {
  uint32_t h = hash32(static_cast<uint32_t>(index) ^ static_cast<uint32_t>(key));
  h = hash32(h ^ static_cast<uint32_t>(index >> 32) ^ static_cast<uint32_t>(key >> 32));
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

// ------------------------------------------------------------------- top-k

// Residual left after sending `v` as `sent` (v rounded to the wire dtype):
// NaN/Inf travel as they are, and a value that overflowed the dtype leaves
// nothing behind rather than an infinite residual.
PYCOMM_HOST_DEVICE float sent_residual(float v, float sent) {
  return is_finite_f(v) && is_finite_f(sent) ? v - sent : 0.f;
}

// Ordering key of |x| as an unsigned integer: for non-negative floats the bit
// pattern orders like the value, and NaN patterns sort above +Inf, so a NaN
// is always selected (like torch.topk, which ranks NaN largest).
PYCOMM_HOST_DEVICE uint32_t topk_key(float x) { return float_to_bits(x) & 0x7fffffffu; }

// Keys of Inf and NaN: at or above this one.
constexpr uint32_t kTopkNonFiniteKey = 0x7f800000u;

// Entries a top-k selection of k (<= n) may keep: exactly k, or up to
// k(1 + tolerance) for the approximate selection.
PYCOMM_HOST_DEVICE size_t topk_capacity(size_t k, size_t n, bool exact, double tolerance) {
  if (exact) return k;
  const size_t hi = static_cast<size_t>(k * (1.0 + tolerance));
  const size_t cap = hi > k ? hi : k;
  return cap < n ? cap : n;
}

// Top-k payload: values (input dtype) for `cap` entries, padded to 8 bytes,
// then int32 indices for `cap` entries; entries past the kept count are
// unused.
PYCOMM_HOST_DEVICE size_t topk_values_bytes(size_t cap, size_t elem_size) { return (cap * elem_size + 7) / 8 * 8; }
PYCOMM_HOST_DEVICE size_t topk_payload_bytes(size_t cap, size_t elem_size) {
  return topk_values_bytes(cap, elem_size) + cap * 4;
}

}  // namespace kernels
}  // namespace pycomm
