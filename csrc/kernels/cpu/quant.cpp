// CPU blockwise quantization kernels: quantize (+ error feedback),
// dequantize(-accumulate) and the fused dequantize-reduce-requantize.
//
// Each quantization block is staged once in float32 in an L1-resident
// scratch buffer (runs of whole blocks up to 16 KB at a time), so the input
// and the residual stream through memory once per call whatever the block
// size. Blocks without NaN/Inf (the common case) take branch-free loops the
// compiler vectorises; a block that holds one takes the scalar path of
// quant.h, which encodes it exactly.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../kernels.h"
#include "../quant.h"
#include "dispatch.h"

namespace pycomm {
namespace kernels {
namespace {

// 1.5 * 2^23: (v + k) - k rounds |v| < 2^22 to the nearest integer, ties to
// even (exactly rintf, which the CUDA kernels use), in two adds that
// vectorise in every clone.
constexpr float kRoundMagic = 12582912.0f;

struct Scratch {
  std::vector<float> xs;          // the block (or run of blocks) in full precision
  std::vector<float> us;          // stochastic-rounding uniforms
  std::vector<int8_t> qs;         // int4 codes before packing
  std::vector<uint32_t> amax;     // per block of a run: largest magnitude bits ...
  std::vector<BlockQuant> bq;     // ... and quantization parameters
  void reserve(size_t m) {
    if (xs.size() < m) {
      xs.resize(m);
      us.resize(m);
      qs.resize(m);
      amax.resize(m / 8 + 1);  // blocks hold at least 8 elements (check_spec)
      bq.resize(m / 8 + 1);
    }
  }
};

Scratch& scratch(size_t m) {
  thread_local Scratch s;
  s.reserve(m);
  return s;
}

void check_spec(int bits, int block) {
  if (bits != 8 && bits != 4) throw CommError("pycomm: quantization bits must be 8 or 4");
  if (block < 8 || block % 8 != 0 || block > (1 << 20))
    throw CommError("pycomm: quantization block must be a multiple of 8 between 8 and 1048576, got " +
                    std::to_string(block));
}

// ---- staging: input -> float32 block

template <typename T>
PYCOMM_MULTIVERSION void stage(const T* __restrict__ x, const float* __restrict__ r, float* __restrict__ xs, size_t m) {
  if (r) {
    for (size_t i = 0; i < m; ++i) xs[i] = load_acc(x[i]) + r[i];
  } else {
    for (size_t i = 0; i < m; ++i) xs[i] = load_acc(x[i]);
  }
}

// Largest finite magnitude, and whether any value is NaN/Inf. One unsigned
// max over the magnitude bits (they order like the floats) vectorises; only
// a block that turns out to hold NaN/Inf pays a second, scalar pass. Plain
// ternaries, not std::max: a multiversioned loop cannot inline default-target
// helpers and would stay scalar.
PYCOMM_MULTIVERSION uint32_t max_magnitude_bits(const float* xs, size_t m) {
  uint32_t amax = 0;
  for (size_t i = 0; i < m; ++i) {
    const uint32_t u = float_to_bits(xs[i]) & 0x7fffffffu;
    amax = u > amax ? u : amax;
  }
  return amax;
}

void block_stats(const float* xs, size_t m, float* absmax, bool* flagged) {
  uint32_t amax = max_magnitude_bits(xs, m);
  *flagged = amax >= 0x7f800000u;
  if (*flagged) {
    amax = 0;
    for (size_t i = 0; i < m; ++i) {
      const uint32_t u = float_to_bits(xs[i]) & 0x7fffffffu;
      if (u < 0x7f800000u && u > amax) amax = u;
    }
  }
  *absmax = bits_to_float(amax);
}

PYCOMM_MULTIVERSION void draw_uniforms(float* us, size_t m, uint64_t key, uint64_t idx0) {
  for (size_t i = 0; i < m; ++i) us[i] = uniform01(key, idx0 + i);
}

// `us` holds the uniforms on entry and the codes (as floats) on return: one
// loop without the residual branch vectorises, floor included.
PYCOMM_MULTIVERSION void codes_stochastic(const float* __restrict__ xs, float* __restrict__ us, size_t m,
                                          const BlockQuant b, int8_t* __restrict__ q, float* __restrict__ r) {
  const float lim = static_cast<float>(b.qrange);
  for (size_t i = 0; i < m; ++i) {
    const float c = __builtin_floorf(xs[i] * b.inv + us[i]);
    us[i] = c > lim ? lim : (c < -lim ? -lim : c);
  }
  for (size_t i = 0; i < m; ++i) q[i] = static_cast<int8_t>(static_cast<int>(us[i]));
  if (r) {
    for (size_t i = 0; i < m; ++i) r[i] = xs[i] - us[i] * b.scale;
  }
}

// Block with NaN/Inf: exact escape codes, scalar.
void codes_flagged(const float* xs, const float* us, size_t m, const BlockQuant& b, int bits, int8_t* q,
                   float* r) {
  const float stored = stored_scale(b);
  for (size_t i = 0; i < m; ++i) {
    const int c = quant_code(xs[i], b, us ? us[i] : -1.f);
    q[i] = static_cast<int8_t>(c);
    if (r) r[i] = quant_residual(xs[i], dequant_code(c, stored, bits));
  }
}

PYCOMM_MULTIVERSION void pack4(const int8_t* qs, size_t m, uint8_t* out) {
  const size_t pairs = m / 2;
  for (size_t j = 0; j < pairs; ++j)
    out[j] = static_cast<uint8_t>(nibble_of(qs[2 * j]) | (nibble_of(qs[2 * j + 1]) << 4));
  if (m % 2) out[pairs] = nibble_of(qs[m - 1]) | static_cast<uint8_t>(nibble_of(0) << 4);
}

// ---- round to nearest, several blocks per call
//
// Blocks of 64 take ~20 ns each in calls alone (four dispatched functions
// and their loops' set-up per block): as much as their elements at int4.
// A run of blocks is staged once, their magnitudes and codes computed by
// one call each, and packed by one.

// Elements staged per run (whole blocks; a larger block is a run alone).
constexpr size_t kRunElems = 4096;

// The largest magnitude bits of each of the run's blocks (the last may be short).
PYCOMM_MULTIVERSION void max_magnitude_bits_blocks(const float* xs, size_t m, size_t block, uint32_t* amax) {
  for (size_t b = 0, base = 0; base < m; ++b, base += block) {
    const size_t end = base + block < m ? base + block : m;
    uint32_t a = 0;
    for (size_t i = base; i < end; ++i) {
      const uint32_t u = float_to_bits(xs[i]) & 0x7fffffffu;
      a = u > a ? u : a;
    }
    amax[b] = a;
  }
}

// Round-to-nearest codes (int8 per element) and residuals of the run's
// blocks, each with its own parameters; the flagged ones (NaN/Inf) are left
// to codes_flagged. The residual branch is outside the loops: each
// vectorises on its own.
PYCOMM_MULTIVERSION void codes_nearest_blocks(const float* __restrict__ xs, size_t m, size_t block,
                                              const BlockQuant* __restrict__ bq, int8_t* __restrict__ q,
                                              float* __restrict__ r) {
  for (size_t b = 0, base = 0; base < m; ++b, base += block) {
    if (bq[b].flagged) continue;
    const size_t end = base + block < m ? base + block : m;
    const float inv = bq[b].inv, scale = bq[b].scale, lim = static_cast<float>(bq[b].qrange);
    if (r) {
      for (size_t i = base; i < end; ++i) {
        float v = (xs[i] * inv + kRoundMagic) - kRoundMagic;
        v = v > lim ? lim : (v < -lim ? -lim : v);
        q[i] = static_cast<int8_t>(static_cast<int>(v));
        r[i] = xs[i] - v * scale;
      }
    } else {
      for (size_t i = base; i < end; ++i) {
        float v = (xs[i] * inv + kRoundMagic) - kRoundMagic;
        v = v > lim ? lim : (v < -lim ? -lim : v);
        q[i] = static_cast<int8_t>(static_cast<int>(v));
      }
    }
  }
}

// Quantizes one staged block by stochastic rounding (element `idx0` of the
// tensor, block number `blk` of the payload) and updates its residual slice.
void quantize_block_stochastic(const QuantSpec& s, Scratch& sc, size_t m, uint64_t key, uint64_t idx0,
                               float* scales, uint8_t* codes, size_t blk, float* r) {
  float absmax;
  bool flagged;
  block_stats(sc.xs.data(), m, &absmax, &flagged);
  const BlockQuant b = make_block_quant(absmax, flagged, s.bits);
  scales[blk] = stored_scale(b);
  draw_uniforms(sc.us.data(), m, key, idx0);
  int8_t* q = s.bits == 8 ? reinterpret_cast<int8_t*>(codes + blk * s.block) : sc.qs.data();
  if (flagged) {
    codes_flagged(sc.xs.data(), sc.us.data(), m, b, s.bits, q, r);
  } else {
    codes_stochastic(sc.xs.data(), sc.us.data(), m, b, q, r);
  }
  if (s.bits == 4) pack4(q, m, codes + blk * (s.block / 2));
}

// Quantizes the staged run sc.xs[0 .. m) (element `base` of the tensor, a
// whole number of blocks but for the tensor's last) into the payload's
// scales and codes, and updates its residual slice. Round to nearest takes
// the run's blocks together; stochastic rounding is given one block at a
// time (run_elems) and takes quantize_block_stochastic.
void quantize_run(const QuantSpec& s, Scratch& sc, size_t m, size_t base, uint64_t key, uint64_t idx0,
                  float* scales, uint8_t* codes, float* r) {
  const size_t block = static_cast<size_t>(s.block);
  const size_t blk0 = base / block, nblk = quant_num_blocks(m, s.block);
  if (s.stochastic) {
    quantize_block_stochastic(s, sc, m, key, idx0, scales, codes, blk0, r);
    return;
  }
  max_magnitude_bits_blocks(sc.xs.data(), m, block, sc.amax.data());
  bool any_flagged = false;
  for (size_t b = 0; b < nblk; ++b) {
    float absmax = bits_to_float(sc.amax[b]);
    bool flagged = false;
    if (sc.amax[b] >= 0x7f800000u) {  // NaN/Inf: the largest finite magnitude instead
      const size_t lo = b * block, hi = std::min(m, lo + block);
      block_stats(sc.xs.data() + lo, hi - lo, &absmax, &flagged);
      any_flagged = true;
    }
    sc.bq[b] = make_block_quant(absmax, flagged, s.bits);
    scales[blk0 + b] = stored_scale(sc.bq[b]);
  }
  int8_t* q = s.bits == 8 ? reinterpret_cast<int8_t*>(codes + base) : sc.qs.data();
  codes_nearest_blocks(sc.xs.data(), m, block, sc.bq.data(), q, r);
  if (any_flagged) {  // those blocks again, exactly (quant.h's scalar path)
    for (size_t b = 0; b < nblk; ++b) {
      if (!sc.bq[b].flagged) continue;
      const size_t lo = b * block, hi = std::min(m, lo + block);
      codes_flagged(sc.xs.data() + lo, nullptr, hi - lo, sc.bq[b], s.bits, q + lo, r ? r + lo : nullptr);
    }
  }
  if (s.bits == 4) pack4(q, m, codes + base / 2);
}

// Elements of a run: whole blocks up to kRunElems, or one block where the
// quantization is stochastic.
size_t run_elems(int block, bool stochastic) {
  const size_t b = static_cast<size_t>(block);
  return stochastic ? b : std::max(b, kRunElems / b * b);
}

// ---- dequantization of runs of blocks into a float accumulator

// acc[0 .. m) (+)= D(the run of blocks from blk0 of payload), blocks
// without NaN/Inf (flagged ones are left to dequant_block_flagged): one
// call for the run, the `add` branch outside the loops so that each
// vectorises.
PYCOMM_MULTIVERSION void dequant8_blocks(const int8_t* __restrict__ q, const float* __restrict__ scales, size_t m,
                                         size_t block, float* __restrict__ acc, bool add) {
  for (size_t b = 0, base = 0; base < m; ++b, base += block) {
    const float scale = scales[b];
    if (scale_flagged(scale)) continue;
    const size_t end = base + block < m ? base + block : m;
    if (add) {
      for (size_t i = base; i < end; ++i) acc[i] += static_cast<float>(q[i]) * scale;
    } else {
      for (size_t i = base; i < end; ++i) acc[i] = static_cast<float>(q[i]) * scale;
    }
  }
}

PYCOMM_MULTIVERSION void dequant4_blocks(const uint8_t* __restrict__ p, const float* __restrict__ scales, size_t m,
                                         size_t block, float* __restrict__ acc, bool add) {
  for (size_t b = 0, base = 0; base < m; ++b, base += block) {
    const float scale = scales[b];
    if (scale_flagged(scale)) continue;
    const size_t len = (base + block < m ? base + block : m) - base;
    const uint8_t* pb = p + base / 2;  // blocks hold an even number of elements
    float* ab = acc + base;
    const size_t pairs = len / 2;
    if (add) {
      for (size_t j = 0; j < pairs; ++j) {
        ab[2 * j] += static_cast<float>(code_of_nibble(pb[j])) * scale;
        ab[2 * j + 1] += static_cast<float>(code_of_nibble(static_cast<uint8_t>(pb[j] >> 4))) * scale;
      }
    } else {
      for (size_t j = 0; j < pairs; ++j) {
        ab[2 * j] = static_cast<float>(code_of_nibble(pb[j])) * scale;
        ab[2 * j + 1] = static_cast<float>(code_of_nibble(static_cast<uint8_t>(pb[j] >> 4))) * scale;
      }
    }
    if (len % 2) {
      const float lo = static_cast<float>(code_of_nibble(pb[pairs])) * scale;
      ab[len - 1] = add ? ab[len - 1] + lo : lo;
    }
  }
}

// acc[0 .. m) (+)= D(block blk of payload), a block that holds NaN/Inf:
// quant.h's scalar path, which decodes the escape codes.
void dequant_block_flagged(int bits, int block, const uint8_t* payload, size_t nblocks, size_t blk, size_t m,
                           float* acc, bool add) {
  const float stored = reinterpret_cast<const float*>(payload)[blk];
  const uint8_t* codes = payload + nblocks * 4;
  for (size_t i = 0; i < m; ++i) {
    int c;
    if (bits == 8) {
      c = reinterpret_cast<const int8_t*>(codes + blk * block)[i];
    } else {
      const uint8_t byte = codes[blk * (block / 2) + i / 2];
      c = code_of_nibble(i % 2 ? static_cast<uint8_t>(byte >> 4) : byte);
    }
    const float v = dequant_code(c, stored, bits);
    acc[i] = add ? acc[i] + v : v;
  }
}

// acc[0 .. m) (+)= D(the run of blocks from blk0 of payload).
void dequant_run(int bits, int block, const uint8_t* payload, size_t nblocks, size_t blk0, size_t m, float* acc,
                 bool add) {
  const auto* scales = reinterpret_cast<const float*>(payload) + blk0;
  const uint8_t* codes = payload + nblocks * 4;
  const size_t bs = static_cast<size_t>(block), base = blk0 * bs;
  if (bits == 8) {
    dequant8_blocks(reinterpret_cast<const int8_t*>(codes + base), scales, m, bs, acc, add);
  } else {
    dequant4_blocks(codes + base / 2, scales, m, bs, acc, add);
  }
  for (size_t b = 0, lo = 0; lo < m; ++b, lo += bs) {
    if (scale_flagged(scales[b]))
      dequant_block_flagged(bits, block, payload, nblocks, blk0 + b, std::min(bs, m - lo), acc + lo, add);
  }
}

template <typename T>
PYCOMM_MULTIVERSION void unstage(const float* xs, size_t m, T* out, bool add) {
  if (add) {
    for (size_t i = 0; i < m; ++i) out[i] = store_acc<T>(load_acc(out[i]) + xs[i]);
  } else {
    for (size_t i = 0; i < m; ++i) out[i] = store_acc<T>(xs[i]);
  }
}

PYCOMM_MULTIVERSION void scale_block(float* xs, size_t m, float f) {
  for (size_t i = 0; i < m; ++i) xs[i] *= f;
}

PYCOMM_MULTIVERSION void add_block(float* xs, const float* r, size_t m) {
  for (size_t i = 0; i < m; ++i) xs[i] += r[i];
}

template <typename T>
void stage_any(const void* x, size_t off, const float* r, float* xs, size_t m) {
  stage(static_cast<const T*>(x) + off, r, xs, m);
}

}  // namespace

void quantize_cpu(const QuantSpec& s, DType dtype, const void* x, float* residual, size_t n, uint8_t* payload,
                  uint64_t index_base) {
  check_spec(s.bits, s.block);
  const size_t nb = quant_num_blocks(n, s.block);
  auto* scales = reinterpret_cast<float*>(payload);
  uint8_t* codes = payload + nb * 4;
  const uint64_t key = mix64(s.seed);
  const size_t run = run_elems(s.block, s.stochastic);
  Scratch& sc = scratch(run);
  with_float_type(dtype, "quantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (size_t base = 0; base < n; base += run) {
      const size_t m = std::min(run, n - base);
      float* r = residual ? residual + base : nullptr;
      stage_any<T>(x, base, r, sc.xs.data(), m);
      quantize_run(s, sc, m, base, key, index_base + base, scales, codes, r);
    }
  });
  // Padding bytes are part of what travels: keep them deterministic.
  const size_t used = nb * 4 + quant_code_bytes(n, s.bits);
  std::memset(payload + used, 0, quant_payload_bytes(n, s.bits, s.block) - used);
}

void dequantize_cpu(int bits, int block, const uint8_t* payload, size_t n, DType dtype, void* out, bool accumulate) {
  check_spec(bits, block);
  const size_t nb = quant_num_blocks(n, block);
  const size_t run = run_elems(block, false);
  Scratch& sc = scratch(run);
  with_float_type(dtype, "dequantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = static_cast<T*>(out);
    for (size_t base = 0; base < n; base += run) {
      const size_t m = std::min(run, n - base);
      const size_t blk0 = base / static_cast<size_t>(block);
      if constexpr (std::is_same_v<T, float>) {
        // float32: straight into (or onto) the output, no staging.
        dequant_run(bits, block, payload, nb, blk0, m, o + base, accumulate);
      } else {
        dequant_run(bits, block, payload, nb, blk0, m, sc.xs.data(), false);
        unstage(sc.xs.data(), m, o + base, accumulate);
      }
    }
  });
}

void convert_cpu(DType from, const void* src, DType to, void* dst, size_t n) {
  Scratch& sc = scratch(kDefaultQuantBlock);
  for (size_t base = 0; base < n; base += kDefaultQuantBlock) {
    const size_t m = std::min<size_t>(kDefaultQuantBlock, n - base);
    with_float_type(from, "convert", [&](auto* tag) {
      using S = std::remove_pointer_t<decltype(tag)>;
      stage_any<S>(src, base, nullptr, sc.xs.data(), m);
    });
    with_float_type(to, "convert", [&](auto* tag) {
      using D = std::remove_pointer_t<decltype(tag)>;
      unstage(sc.xs.data(), m, static_cast<D*>(dst) + base, false);
    });
  }
}

void dequant_reduce_cpu(const DequantReduce& a) {
  check_spec(a.bits, a.block);
  if (a.out_payload && (a.requant.bits != a.bits || a.requant.block != a.block))
    throw CommError("pycomm: dequant_reduce requantizes with the sources' bits and block size only");
  const size_t nb = quant_num_blocks(a.n, a.block);
  const size_t run = run_elems(a.block, a.out_payload && a.requant.stochastic);
  Scratch& sc = scratch(run);
  float* xs = sc.xs.data();
  const uint64_t key = mix64(a.requant.seed);
  auto* out_scales = reinterpret_cast<float*>(a.out_payload);
  uint8_t* out_codes = a.out_payload ? a.out_payload + nb * 4 : nullptr;
  for (size_t base = 0; base < a.n; base += run) {
    const size_t m = std::min(run, a.n - base);
    const size_t blk0 = base / static_cast<size_t>(a.block);
    // 1. The dense addend (a ring hop's own chunk) starts the sum ...
    bool have = false;
    if (a.dense) {
      with_float_type(a.dense_dtype, "dequant_reduce", [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        stage_any<T>(a.dense, base, nullptr, xs, m);
      });
      have = true;
    }
    // 2. ... then every quantized source, in order (same bits everywhere).
    for (int j = 0; j < a.nsrc; ++j) {
      dequant_run(a.bits, a.block, a.srcs[j], nb, blk0, m, xs, have);
      have = true;
    }
    if (!have) std::fill(xs, xs + m, 0.f);
    if (a.post_scale != 1.f) scale_block(xs, m, a.post_scale);
    // 3. Requantized, with its own error feedback.
    if (a.out_payload) {
      float* r = a.residual ? a.residual + base : nullptr;
      if (r) add_block(xs, r, m);
      quantize_run(a.requant, sc, m, base, key, a.index_base + base, out_scales, out_codes, r);
    }
  }
  if (a.out_payload) {
    const size_t used = nb * 4 + quant_code_bytes(a.n, a.bits);
    std::memset(a.out_payload + used, 0, quant_payload_bytes(a.n, a.bits, a.block) - used);
  }
}

}  // namespace kernels
}  // namespace pycomm
