// The device side of the warp-per-block quantization kernels (quant.cu),
// shared with the fused quantized CUDA IPC all-reduce
// (compression/ipc_quantized.cu): the values to quantize (input + residual,
// or a sum of decoded sources), and one warp's quantize or dequantize of
// one quantization block, built on the per-element math of quant.h, so
// every kernel that uses them writes the CPU kernels' bits (compile with
// --fmad=false, as setup.py does).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../kernels_cuda.h"
#include "../quant.h"
#include "../reduce.h"

namespace pycomm {
namespace kernels {
namespace quant_detail {

template <typename T> __device__ __forceinline__ float load_f(const T* p, size_t i) { return load_acc(p[i]); }

// Sum of the dense addend and the quantized sources at element i of block
// blk, in the CPU kernel's order; then post_scale.
struct Sources {
  const uint8_t* p[kMaxCudaSources];
  int n;
};

// The code of element i (global; j within its block) of a payload's codes.
template <int kBits>
__device__ __forceinline__ int code_of(const uint8_t* codes, size_t i, int j) {
  if constexpr (kBits == 8) {
    return reinterpret_cast<const int8_t*>(codes)[i];
  } else {
    const uint8_t byte = codes[i / 2];
    return code_of_nibble((j & 1) ? static_cast<uint8_t>(byte >> 4) : byte);
  }
}

__device__ __forceinline__ int code_at(const uint8_t* codes, int bits, size_t i, int j) {
  return bits == 8 ? code_of<8>(codes, i, j) : code_of<4>(codes, i, j);
}

// Lane layouts. With runs of kV = 1, lane l holds elements l, l + 32, ...
// of a block (its value k is element l + 32 k); with kV = 2 or 4, runs of
// kV neighbours: values k .. k + kV - 1 (k a multiple of kV) are elements
// kV l + 32 kV (k / kV) + 0 .. kV - 1. A whole run is one load or store: 16
// bytes of float32 and 4 bytes of int8 codes at kV = 4, where kV = 1 takes
// an instruction per element for each (and a 32-bit register per code);
// the warp's accesses stay contiguous either way. Which element a lane
// holds changes nothing in the results: every element's math is its own,
// and the block's absmax is a max over the warp.
template <int kV>
__device__ __forceinline__ int lane_elem(int lane, int k) {
  return kV * lane + 32 * kV * (k / kV) + k % kV;
}

// What the warp kernels know of a quantization block before they touch its
// elements: the codec's bits (8 or 4), whether the block is whole
// (m == 32 E, every block but a tensor's last), and the lane layout, as
// compile-time constants. Tested element by element, the bits and the bound
// (j < m) compiled to a branch and a reconvergence point per element, in
// kernels bound by instruction issue; tested per block they are one
// warp-uniform branch.
template <int kBits_, bool kFull_, int kV_>
struct BlockKind {
  static constexpr int kBits = kBits_;
  static constexpr bool kFull = kFull_;
  static constexpr int kV = kV_;
};

// f(BlockKind<kBits, m == 32 E, kV>{}), for a kernel built for one codec.
template <int E, int kBits, int kV, typename F>
__device__ __forceinline__ void with_block_full(int m, F&& f) {
  if (m == 32 * E) f(BlockKind<kBits, true, kV>{});
  else f(BlockKind<kBits, false, kV>{});
}

// f(BlockKind<bits, m == 32 E, kV>{}).
template <int E, int kV, typename F>
__device__ __forceinline__ void with_block_kind(int bits, int m, F&& f) {
  if (bits == 8) with_block_full<E, 8, kV>(m, f);
  else with_block_full<E, 4, kV>(m, f);
}

// Whether element j of a block of m elements exists.
template <typename Kind>
__device__ __forceinline__ bool in_block(int j, int m) {
  return Kind::kFull || j < m;
}

// How many of the kV elements of a run starting at element j of a block
// of m exist (Kind::kV, known at compile time, in a whole block; <= 0: none).
template <typename Kind>
__device__ __forceinline__ int run_avail(int j, int m) {
  return Kind::kFull ? Kind::kV : m - j;
}

template <typename T, int kV>
struct alignas(kV * sizeof(T)) RunOf {
  T v[kV];
};

// The run a kernel takes for blocks of 32 E elements where its pointers
// allow: 4 (2 for blocks of 64).
template <int E>
constexpr int kRunOf = E >= 4 ? 4 : E;

// Whether runs of kV elements of T load and store whole at p (host): p
// aligned to a run; null has nothing to load.
template <typename T>
inline bool run_aligned(const void* p, int kV) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % (kV * sizeof(T)) == 0;
}

// The same for a payload's codes: int8 runs of kV bytes, int4 of kV / 2
// (the codes start 4 x blocks bytes in: the payload's alignment is theirs,
// up to 4).
inline bool codes_aligned(const void* payload, int bits, int kV) {
  return run_aligned<uint8_t>(payload, bits == 8 ? kV : (kV < 2 ? 1 : kV / 2));
}

// p[0 .. kV) as floats into v[k0 ..): one load where the run is whole
// (avail >= kV), else element by element, 0 past avail.
template <int kV, int E, typename T>
__device__ __forceinline__ void load_run(const T* p, int avail, float (&v)[E], int k0) {
  if (avail >= kV) {
    const RunOf<T, kV> t = *reinterpret_cast<const RunOf<T, kV>*>(p);
#pragma unroll
    for (int u = 0; u < kV; ++u) v[k0 + u] = load_acc(t.v[u]);
  } else {
#pragma unroll
    for (int u = 0; u < kV; ++u) v[k0 + u] = u < avail ? load_acc(p[u]) : 0.f;
  }
}

// v[k0 .. k0 + kV) rounded into p[0 .. kV), up to avail of them.
template <int kV, int E, typename T>
__device__ __forceinline__ void store_run(T* p, int avail, const float (&v)[E], int k0) {
  if (avail >= kV) {
    RunOf<T, kV> t;
#pragma unroll
    for (int u = 0; u < kV; ++u) t.v[u] = store_acc<T>(v[k0 + u]);
    *reinterpret_cast<RunOf<T, kV>*>(p) = t;
  } else {
#pragma unroll
    for (int u = 0; u < kV; ++u)
      if (u < avail) p[u] = store_acc<T>(v[k0 + u]);
  }
}

// The codes of a lane's run as the payload holds them, in one register:
// int8 a byte each, int4 a nibble each (the lower nibble first, as bytes
// pack them). Codes past the block decode as 0.
template <int kBits, int kV>
struct CodeRun {
  uint32_t raw;
  __device__ __forceinline__ int code(int u) const {
    if constexpr (kBits == 8) return static_cast<int8_t>(static_cast<uint8_t>(raw >> (8 * u)));
    else return code_of_nibble(static_cast<uint8_t>(raw >> (4 * u)));
  }
};

// The unsigned word of kBytes (1, 2 or 4) bytes: a whole run's codes in
// one load or store.
template <int kBytes>
using WordOf = std::conditional_t<kBytes == 4, uint32_t, std::conditional_t<kBytes == 2, uint16_t, uint8_t>>;

// Where the codes of element i start, and how many bytes a run of kV takes
// (int4: whole bytes for runs of 2 or 4; i is even there).
template <int kBits>
__device__ __forceinline__ size_t code_byte(size_t i) {
  return kBits == 8 ? i : i / 2;
}
template <int kBits, int kV>
inline constexpr int kRunBytes = kV * kBits / 8;

// The codes of elements i .. i + kV - 1 (global; i is even where kV > 1,
// blocks holding an even number of elements), avail of them in the block.
template <int kBits, int kV>
__device__ __forceinline__ CodeRun<kBits, kV> load_code_run(const uint8_t* codes, size_t i, int avail) {
  static_assert(kV == 1 || kV == 2 || kV == 4, "runs of 1, 2 or 4");
  if (avail >= kV) {
    if constexpr (kRunBytes<kBits, kV> >= 1) {
      using W = WordOf<kRunBytes<kBits, kV>>;
      return {static_cast<uint32_t>(*reinterpret_cast<const W*>(codes + code_byte<kBits>(i)))};
    } else {
      return {static_cast<uint32_t>(codes[i / 2] >> (4 * (i & 1)))};  // an int4 alone: half a byte
    }
  }
  uint32_t raw = 0;
#pragma unroll
  for (int u = 0; u < kV; ++u) {
    const size_t e = i + u;
    const uint32_t c = u >= avail ? (kBits == 8 ? 0u : 8u)  // code 0
                                  : (kBits == 8 ? codes[e] : (codes[e / 2] >> (4 * (e & 1))) & 0xfu);
    raw |= c << (kBits * u);
  }
  return {raw};
}

// Stores a lane's kV codes c of elements i .. i + kV - 1, avail of them in
// the block (c is 0 past it, as on the CPU). Int4 with kV = 1: an even
// lane's element and the next lane's share a byte (a pair never straddles
// two blocks); every lane of the warp must call.
template <int kBits, int kV>
__device__ __forceinline__ void store_code_run(uint8_t* codes, size_t i, int avail, const int (&c)[kV], int lane) {
  if constexpr (kRunBytes<kBits, kV> == 0) {
    const int next = __shfl_down_sync(0xffffffffu, c[0], 1);
    if ((lane & 1) == 0 && avail > 0) codes[i / 2] = static_cast<uint8_t>(nibble_of(c[0]) | (nibble_of(next) << 4));
  } else if (avail >= kV) {
    uint32_t w = 0;
#pragma unroll
    for (int u = 0; u < kV; ++u) {
      const uint32_t bits = kBits == 8 ? static_cast<uint8_t>(static_cast<int8_t>(c[u])) : nibble_of(c[u]);
      w |= bits << (kBits * u);
    }
    using W = WordOf<kRunBytes<kBits, kV>>;
    *reinterpret_cast<W*>(codes + code_byte<kBits>(i)) = static_cast<W>(w);
  } else if constexpr (kBits == 8) {
#pragma unroll
    for (int u = 0; u < kV; ++u)
      if (u < avail) reinterpret_cast<int8_t*>(codes)[i + u] = static_cast<int8_t>(c[u]);
  } else {
    // Int4 runs of 2 or 4 end inside a block on a whole byte too.
#pragma unroll
    for (int u = 0; u < kV; u += 2)
      if (u < avail) codes[(i + u) / 2] = static_cast<uint8_t>(nibble_of(c[u]) | (nibble_of(c[u + 1]) << 4));
  }
}

__device__ __forceinline__ float dequant_at(const uint8_t* payload, size_t nblocks, int bits, int block, size_t blk,
                                            size_t i_in_blk) {
  const float stored = reinterpret_cast<const float*>(payload)[blk];
  return dequant_code(code_at(payload + nblocks * 4, bits, blk * block + i_in_blk, static_cast<int>(i_in_blk % 2)),
                      stored, bits);
}

// The value to quantize at element i (global) of the current call: either
// input + residual (quantize) or the fused sum (dequant_reduce).
// lane_values: the values of a lane's E elements of the block at `base`
// (lane, lane + 32, ...; 0 past the end, m elements in the block), for the
// warp kernels.
template <typename T>
struct InputValue {
  const T* x;
  const float* r;
  __device__ float operator()(size_t /*blk*/, size_t /*j*/, size_t i) const { return load_f(x, i) + (r ? r[i] : 0.f); }
  template <int E, typename Kind>
  __device__ __forceinline__ void lane_values(size_t /*blk*/, size_t base, int lane, int m, float (&v)[E]) const {
    constexpr int kV = Kind::kV;
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += kV) {
      const int j = lane_elem<kV>(lane, k0);
      const int avail = run_avail<Kind>(j, m);
      float rs[E];
      load_run<kV>(x + base + j, avail, v, k0);
      if (r) {
        load_run<kV>(r + base + j, avail, rs, k0);
#pragma unroll
        for (int u = 0; u < kV; ++u) v[k0 + u] += rs[k0 + u];
      } else {
#pragma unroll
        for (int u = 0; u < kV; ++u) v[k0 + u] += 0.f;  // operator()'s bits: -0 becomes +0
      }
    }
  }
  // Whether runs of kV elements load whole from x and r (host).
  bool runs_fit(int kV) const { return run_aligned<T>(x, kV) && run_aligned<float>(r, kV); }
  const uint32_t* cancel = nullptr;
};


// kMaxCodes: the most codes a lane holds in registers per group of sources
// (lane_values); kernels bound to fewer registers pass fewer.
template <typename D, int kMaxCodes = 32>
struct SumValue {
  Sources s;
  const D* dense;
  float post_scale;
  const float* r;  // added after post_scale (server error feedback)
  size_t nblocks;
  int bits, block;
  const uint32_t* cancel;  // see DequantReduce::cancel
  __device__ float operator()(size_t blk, size_t j, size_t i) const {
    float acc = dense ? load_f(dense, i) : 0.f;
    for (int k = 0; k < s.n; ++k) {
      const float d = dequant_at(s.p[k], nblocks, bits, block, blk, j);
      acc = (k == 0 && !dense) ? d : acc + d;
    }
    if (post_scale != 1.f) acc *= post_scale;
    return r ? acc + r[i] : acc;
  }
  // The same sums, a lane's E elements at once, with the loads of a group of
  // sources all issued before the first is used. Element by element (above)
  // the sources are a loop of runtime length: one load in flight per lane,
  // and the kernel waited on latency at a quarter of the copy bandwidth
  // (4 sources, H200). The additions keep operator()'s order, hence its bits.
  template <int E, typename Kind>
  __device__ __forceinline__ void lane_values(size_t blk, size_t base, int lane, int m, float (&v)[E]) const {
    constexpr int kV = Kind::kV;
    // Up to kMaxCodes codes of a lane per group of sources (1 to 8): at
    // blocks of 256 and 32 codes, 4 sources' loads in one round trip. Runs
    // of 4 hold them in a quarter of the registers (CodeRun). Blocks of 512
    // with a register per code take one source at a time, or a single
    // thread block would fit an SM.
    constexpr int kFit = kMaxCodes / E < 1 ? 1 : kMaxCodes / E;
    constexpr int kGroup = (E >= 16 && kV == 1) ? 1 : (kFit < 8 ? kFit : 8);
    float res[E];
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += kV) {
      const int j = lane_elem<kV>(lane, k0);
      const int avail = run_avail<Kind>(j, m);
      if (dense) load_run<kV>(dense + base + j, avail, v, k0);
      if (r) load_run<kV>(r + base + j, avail, res, k0);
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        if (!dense) v[k0 + u] = 0.f;
        if (!r) res[k0 + u] = 0.f;
      }
    }
    for (int s0 = 0; s0 < s.n; s0 += kGroup) {
      CodeRun<Kind::kBits, kV> c[kGroup][E / kV];
      float stored[kGroup];
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (s0 + q < s.n) {
          const uint8_t* p = s.p[s0 + q];
          stored[q] = reinterpret_cast<const float*>(p)[blk];
#pragma unroll
          for (int g = 0; g < E / kV; ++g) {
            const int j = lane_elem<kV>(lane, g * kV);
            c[q][g] = load_code_run<Kind::kBits, kV>(p + nblocks * 4, base + j, run_avail<Kind>(j, m));
          }
        }
      }
#pragma unroll
      for (int q = 0; q < kGroup; ++q) {
        if (s0 + q < s.n) {
          const bool first = s0 + q == 0 && !dense;
          // The flag tested once per source and block (dequant_code's
          // branches per element otherwise), with dequant_code's bits.
          if (!scale_flagged(stored[q])) {
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float d = dequant_code_unflagged(c[q][k / kV].code(k % kV), stored[q]);
              v[k] = first ? d : v[k] + d;
            }
          } else {
#pragma unroll
            for (int k = 0; k < E; ++k) {
              const float d = dequant_code(c[q][k / kV].code(k % kV), stored[q], Kind::kBits);
              v[k] = first ? d : v[k] + d;
            }
          }
        }
      }
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      float a = v[k];
      if (post_scale != 1.f) a *= post_scale;
      if (r) a += res[k];
      v[k] = in_block<Kind>(lane_elem<kV>(lane, k), m) ? a : 0.f;
    }
  }
  // Whether runs of kV elements load whole from the dense addend, the
  // residual and every source's codes (host).
  bool runs_fit(int kV) const {
    bool ok = run_aligned<D>(dense, kV) && run_aligned<float>(r, kV);
    for (int k = 0; k < s.n; ++k) ok = ok && codes_aligned(s.p[k], bits, kV);
    return ok;
  }
};

// A kernel whose `cancel` word (device memory) is non-zero when it starts
// does nothing: its sources may be a dead peer's memory (kernels_cuda.h).
// One read per thread block.
__device__ __forceinline__ bool cancelled(const uint32_t* cancel) {
  __shared__ int stop;
  if (threadIdx.x == 0) stop = cancel != nullptr && *reinterpret_cast<const volatile uint32_t*>(cancel) != 0;
  __syncthreads();
  return stop != 0;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls load(u, blk, base, m) for up to kU of this warp's quantization
// blocks of kBlock elements (block blk starts at element base and holds m:
// the last may be short), then use(u, blk, base, m) for each of them, and
// again until the warp's blocks are done: the kU blocks' loads are all in
// flight before any is used, where a kernel of few threads waited on one
// round trip per block. Warps take blocks in grid order. A warp's lanes
// agree on every argument, so every shuffle in load and use is
// warp-uniform. Which blocks a warp takes depends only on n and the launch
// shape: the fused IPC kernel relies on it (the same thread block of every
// rank touches the same quantization blocks).
template <int kBlock, int kU, typename Load, typename Use>
__device__ __forceinline__ void for_warp_blocks_batched(size_t n, Load&& load, Use&& use) {
  const size_t nb = quant_num_blocks(n, kBlock);
  const size_t warps = blockDim.x / 32, stride = gridDim.x * warps;
  for (size_t first = blockIdx.x * warps + threadIdx.x / 32; first < nb; first += kU * stride) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t blk = first + u * stride;
      if (blk < nb) load(u, blk, blk * kBlock, static_cast<int>(min(static_cast<size_t>(kBlock), n - blk * kBlock)));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t blk = first + u * stride;
      if (blk < nb) use(u, blk, blk * kBlock, static_cast<int>(min(static_cast<size_t>(kBlock), n - blk * kBlock)));
    }
  }
}

// f(blk, base, m) for each of this warp's blocks, one at a time.
template <int kBlock, typename F>
__device__ __forceinline__ void for_warp_blocks(size_t n, F&& f) {
  for_warp_blocks_batched<kBlock, 1>(
      n, [](int, size_t, size_t, int) {}, [&](int, size_t blk, size_t base, int m) { f(blk, base, m); });
}

// The padding after the codes travels too (the CPU kernel zeroes it): keep
// its bytes deterministic, or payloads differ between devices and runs.
__device__ __forceinline__ void zero_payload_tail(uint8_t* payload, size_t n, int bits, int block) {
  if (blockIdx.x != 0) return;
  const size_t used = quant_num_blocks(n, block) * 4 + quant_code_bytes(n, bits);
  const size_t end = quant_payload_bytes(n, bits, block);
  for (size_t p = used + threadIdx.x; p < end; p += blockDim.x) payload[p] = 0;
}

// Quantizes a warp's values of one quantization block (block blk, its
// first element at base, m elements; lane l's value k is element
// lane_elem<Kind::kV>(l, k): lane_values' layout). Scales and codes are the payload's
// (scales at [blk]); the residual, when given, is indexed like the values.
template <int E, typename Kind>
__device__ __forceinline__ void quantize_values(const float (&v)[E], size_t blk, size_t base, int m, int lane,
                                                bool stochastic, uint64_t key, uint64_t index_base, float* scales,
                                                uint8_t* codes, float* residual) {
  constexpr int bits = Kind::kBits;
  // 1. The largest magnitude (elements past the end count as 0, which no
  //    absmax notices); finite values only if the block holds NaN/Inf.
  uint32_t amax = 0;
#pragma unroll
  for (int k = 0; k < E; ++k) amax = max(amax, float_to_bits(v[k]) & 0x7fffffffu);
  amax = warp_max(amax);
  const bool flagged = amax >= 0x7f800000u;
  if (flagged) {
    amax = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const uint32_t u = float_to_bits(v[k]) & 0x7fffffffu;
      if (u < 0x7f800000u) amax = max(amax, u);
    }
    amax = warp_max(amax);
  }
  const BlockQuant b = make_block_quant(bits_to_float(amax), flagged, bits);
  const float stored = stored_scale(b);
  if (lane == 0) scales[blk] = stored;
  // 2. Codes and residuals, a run at a time (one store of each per run);
  //    past the end the code is 0, as on the CPU. A block without NaN/Inf
  //    (nearly all) holds finite values only, and takes quant_code's and
  //    quant_residual's finite branches without testing each value.
  constexpr int kV = Kind::kV;
  auto codes_of = [&](auto finite) {
#pragma unroll
    for (int k0 = 0; k0 < E; k0 += kV) {
      const int j = lane_elem<kV>(lane, k0);
      const int avail = run_avail<Kind>(j, m);
      const size_t i = base + j;
      int c[kV];
      float res[E];
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        c[u] = 0;
        res[k0 + u] = 0.f;
        if (u < avail) {
          const float x = v[k0 + u];
          const float r01 = stochastic ? uniform01(key, index_base + i + u) : -1.f;
          if constexpr (decltype(finite)::value) {
            c[u] = quant_code_finite(x, b, r01);
            res[k0 + u] = x - dequant_code_unflagged(c[u], stored);
          } else {
            c[u] = quant_code(x, b, r01);
            res[k0 + u] = quant_residual(x, dequant_code(c[u], stored, bits));
          }
        }
      }
      store_code_run<bits, kV>(codes, i, avail, c, lane);
      if (residual) store_run<kV>(residual + i, avail, res, k0);
    }
  };
  if (!flagged)
    codes_of(std::true_type{});
  else
    codes_of(std::false_type{});
}

// Dequantizing, a run at a time: one load of a run's codes (CodeRun) and
// one store of its outputs. Element by element (kV = 1) and in pairs, the
// kernels issued about 0.7-0.75 G elements per ms on an H200 whatever the
// bytes, so 16-bit outputs (3 bytes an element) reached 57 % of the copy
// bandwidth against 87 % for float32: instructions, not memory.
//
// A lane's codes of one block and the block's scale, loaded before any is
// used: a store between two loads keeps the second from being issued before
// the first has returned (the compiler cannot tell that the output and the
// payload do not overlap).
template <int E, int kBits, int kV>
struct LaneCodes {
  CodeRun<kBits, kV> run[E / kV];
  float stored;
  __device__ __forceinline__ int code(int k) const { return run[k / kV].code(k % kV); }
};

template <int E, typename Kind>
__device__ __forceinline__ void load_codes(const uint8_t* payload, const uint8_t* codes, size_t blk, size_t base,
                                           int m, int lane, LaneCodes<E, Kind::kBits, Kind::kV>& lc) {
  constexpr int kV = Kind::kV;
  lc.stored = reinterpret_cast<const float*>(payload)[blk];
#pragma unroll
  for (int g = 0; g < E / kV; ++g) {
    const int j = lane_elem<kV>(lane, g * kV);
    lc.run[g] = load_code_run<Kind::kBits, kV>(codes, base + j, run_avail<Kind>(j, m));
  }
}

// The outputs a lane accumulates into, before it stores any.
template <int E, typename Kind, typename T>
__device__ __forceinline__ void load_outputs(const T* out, size_t base, int m, int lane, float (&prev)[E]) {
  constexpr int kV = Kind::kV;
#pragma unroll
  for (int k0 = 0; k0 < E; k0 += kV) {
    const int j = lane_elem<kV>(lane, k0);
    load_run<kV>(out + base + j, run_avail<Kind>(j, m), prev, k0);
  }
}

// out = the decoded values (+ prev, accumulating: a select per element,
// where a compile-time flag doubled every dequantize kernel's code).
template <int E, typename Kind, typename T>
__device__ __forceinline__ void store_decoded(const LaneCodes<E, Kind::kBits, Kind::kV>& lc, size_t base, int m,
                                              int lane, T* out, bool accumulate, const float (&prev)[E]) {
  constexpr int kV = Kind::kV;
  // The block's flag tested once, not per element (dequant_code's bits).
  float d[E];
  if (!scale_flagged(lc.stored)) {
#pragma unroll
    for (int k = 0; k < E; ++k) d[k] = dequant_code_unflagged(lc.code(k), lc.stored);
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) d[k] = dequant_code(lc.code(k), lc.stored, Kind::kBits);
  }
#pragma unroll
  for (int k = 0; k < E; ++k) d[k] = accumulate ? prev[k] + d[k] : d[k];
#pragma unroll
  for (int k0 = 0; k0 < E; k0 += kV) {
    const int j = lane_elem<kV>(lane, k0);
    store_run<kV>(out + base + j, run_avail<Kind>(j, m), d, k0);
  }
}

// One warp dequantizes one block into out (adding to it when accumulating).
template <int E, int kV, typename T>
__device__ __forceinline__ void dequantize_block(const uint8_t* payload, const uint8_t* codes, size_t blk, size_t base,
                                                 int m, int lane, int bits, T* out, bool accumulate) {
  with_block_kind<E, kV>(bits, m, [&](auto kind) {
    using Kind = decltype(kind);
    LaneCodes<E, Kind::kBits, kV> lc;
    load_codes<E, Kind>(payload, codes, blk, base, m, lane, lc);
    float prev[E];
    if (accumulate) load_outputs<E, Kind>(out, base, m, lane, prev);
    store_decoded<E, Kind>(lc, base, m, lane, out, accumulate, prev);
  });
}

// f(std::integral_constant<int, E>) for a block of 32 * E elements that the
// warp kernels take; false for the others.
template <typename F>
bool with_warp_block(int block, F&& f) {
  switch (block) {
    case 64: f(std::integral_constant<int, 2>{}); return true;
    case 128: f(std::integral_constant<int, 4>{}); return true;
    case 256: f(std::integral_constant<int, 8>{}); return true;
    case 512: f(std::integral_constant<int, 16>{}); return true;
    default: return false;
  }
}

}  // namespace quant_detail
}  // namespace kernels
}  // namespace pycomm
