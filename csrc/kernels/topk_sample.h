// The samples that top-k's sampled mode estimates its threshold from:
//   - CUDA (cuda/topk.cu): which elements its radix passes run over on a large
//     tensor, and the window the count of sampled keys at or above the
//     threshold should fall in;
//   - CPU (cpu/topk.cpp): a run of consecutive elements from each of m / 16
//     equal strata of the tensor.
// Host and device code, free of CUDA, so that a C++ test checks both
// (tests/cpp/topk_sample.cpp).
//
// Neither sample may follow a period of the tensor. A gradient is rows of a
// weight matrix, and columns differ in scale (a column's gradient scales with
// its input feature, and transformers have outlier features): a sample that
// takes the same columns in every row reads those columns' threshold, misses
// its window, and the selection passes over the whole tensor again.
//
// CUDA: the tensor is cut into chunks of kSampleChunk consecutive elements
// (whole 32-byte sectors, and whole spans of the histogram kernel's warps),
// and the chunks into groups of `stride`; the sample is one chunk of each
// group, chosen by a hash of the group's index. Not the group's first chunk:
// a row of 1024 (or any multiple of stride x 256) put the same columns in
// every sampled chunk (tests/cpp/topk_sample.cpp: 4x off at 1024 columns).
// A pass then reads 1/stride of the tensor instead of all of it. The count of
// the kept keys that the selection takes anyway checks the threshold on the
// whole tensor; only outside [k, k (1 + tolerance)] do the passes run again
// on all of it. The sample aims at the middle of that window, a quarter of
// the tolerance from either edge: with 10,000 sampled keys at or above the
// threshold its count errs by 1 % (a standard deviation), 2.5 of them at
// tolerance 0.1. Structure within a chunk adds to that, as chunks come
// whole: with a quarter of the columns 8x the rest, the count erred by 3.3 %
// (the test's tensor), where the group's first chunk erred by 4x.
//
// CPU: runs of 16 elements at a hashed place inside each stratum, not single
// elements at one offset plus multiples of the stratum's width: with a width
// of 128 and rows of 1024 that grid read 8 columns of every row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../core/common.h"
#include "quant.h"

namespace pycomm {
namespace kernels {

constexpr size_t kSampleChunk = 256;

// Which chunk of group g (of `in_group` chunks) the sample takes: a
// splitmix64 finalizer of g, so that no period of the tensor lines up with it.
PYCOMM_HOST_DEVICE size_t sampled_chunk_in_group(size_t g, size_t in_group) {
  return static_cast<size_t>(mix64(static_cast<uint64_t>(g)) % in_group);
}

// Element of sample position j of a tensor of n elements (stride 1: the
// tensor itself). Every sampled chunk starts inside the tensor: the last
// group's choice is among the chunks it has.
PYCOMM_HOST_DEVICE size_t sampled_index(size_t j, size_t stride, size_t n) {
  if (stride == 1) return j;
  const size_t g = j / kSampleChunk;
  const size_t chunks = (n + kSampleChunk - 1) / kSampleChunk;
  const size_t first = g * stride;
  const size_t in_group = chunks - first < stride ? chunks - first : stride;
  return (first + sampled_chunk_in_group(g, in_group)) * kSampleChunk + j % kSampleChunk;
}

// The sample of a sampled-mode selection of k of n keys: one chunk in
// `stride` (1: no sample), its m positions (the last chunk may run past n),
// `valid` of them inside the tensor, and the window [lo, hi] its count at or
// above the threshold should fall in.
struct Sample {
  size_t stride = 1, m = 0, valid = 0;
  uint32_t lo = 0, hi = 0;
  Sample(size_t n, size_t k, bool exact, double tolerance) {
    if (exact || !(tolerance > 0) || k >= n) return;
    // Sampled keys at or above the threshold for a count within a quarter
    // of the window at 2.5 standard deviations (10,000 at tolerance 0.1).
    const double need = (10.0 / tolerance) * (10.0 / tolerance);
    size_t s = 64;
    while (s > 1 && !(n / s >= (size_t{1} << 16) && static_cast<double>(k) / s >= need)) s /= 2;
    if (s < 4) return;
    const size_t chunks = (n + kSampleChunk - 1) / kSampleChunk;
    const size_t taken = (chunks + s - 1) / s;
    // Only the tensor's last chunk can be short, and only if the last group takes it.
    const size_t last = sampled_index((taken - 1) * kSampleChunk, s, n);
    const size_t count = (taken - 1) * kSampleChunk + std::min(kSampleChunk, n - last);
    const double ratio = static_cast<double>(count) / static_cast<double>(n);
    const double lo_d = std::ceil(static_cast<double>(k) * (1 + tolerance / 4) * ratio);
    const double hi_d = std::floor(static_cast<double>(k) * (1 + 3 * tolerance / 4) * ratio);
    if (!(hi_d >= lo_d) || lo_d < 1) return;
    stride = s;
    m = taken * kSampleChunk;
    valid = count;
    lo = static_cast<uint32_t>(lo_d);
    hi = static_cast<uint32_t>(hi_d);
  }
};

// CPU: runs of kSampleRun consecutive elements (one 64-byte line of float32),
// one run at a hashed place inside each of ceil(m / kSampleRun) equal strata.
// Runs, not single elements: a line's elements cost what one does, and the
// hashed places defeat the hardware prefetcher, which followed the old grid
// (single elements one stratum apart) at ~20 ns an element against ~75 ns
// for single elements at hashed places.
constexpr size_t kSampleRun = 16;

// Where run r of `runs` (runs x kSampleRun < n) starts, for the stream `key`
// (= mix64(seed)): the run lies inside stratum r, [r n / runs, (r + 1) n /
// runs), which is at least a run wide, at a uniform place.
inline size_t sampled_run(size_t r, size_t runs, size_t n, uint64_t key) {
  const size_t lo = r * n / runs, hi = (r + 1) * n / runs;
  const size_t room = hi - lo - kSampleRun;  // other places the run could start
  return lo + std::min(room, static_cast<size_t>(uniform01(key, r) * static_cast<float>(room + 1)));
}

}  // namespace kernels
}  // namespace pycomm
