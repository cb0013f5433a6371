// The sample that CUDA top-k's radix passes run over in sampled mode on a
// large tensor (cuda/topk.cu): which elements, and the window the count of
// sampled keys at or above the threshold should fall in. Host and device
// code, free of CUDA, so that a C++ test checks it (tests/cpp/topk_sample.cpp).
//
// The tensor is cut into chunks of kSampleChunk consecutive elements (whole
// 32-byte sectors, and whole spans of the histogram kernel's warps), and the
// chunks into groups of `stride`; the sample is one chunk of each group,
// chosen by a hash of the group's index. Not the group's first chunk: a
// gradient is rows of a weight matrix, and a row of 1024 (or any multiple of
// stride x 256) would put the same columns in every sampled chunk. Columns
// differ in scale (a column's gradient scales with its input feature, and
// transformers have outlier features), so a sample of a few columns read the
// threshold of those columns, missed the window, and the passes ran again
// over the whole tensor (tests/cpp/topk_sample.cpp: 4x off at 1024 columns).
// A pass then reads 1/stride of the tensor instead of all of it. The count of
// the kept keys that the selection takes anyway checks the threshold on the
// whole tensor; only outside [k, k (1 + tolerance)] do the passes run again
// on all of it. The sample aims at the middle of that window, a quarter of
// the tolerance from either edge: with 10,000 sampled keys at or above the
// threshold its count errs by 1 % (a standard deviation), 2.5 of them at
// tolerance 0.1. Structure within a chunk adds to that, as chunks come
// whole: with a quarter of the columns 8x the rest, the count erred by 3.3 %
// (the test's tensor), where the group's first chunk erred by 4x.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../core/common.h"

namespace pycomm {
namespace kernels {

constexpr size_t kSampleChunk = 256;

// Which chunk of group g (of `in_group` chunks) the sample takes: a
// splitmix64 finalizer of g, so that no period of the tensor lines up with it.
PYCOMM_HOST_DEVICE size_t sampled_chunk_in_group(size_t g, size_t in_group) {
  uint64_t z = static_cast<uint64_t>(g) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<size_t>(z % in_group);
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

}  // namespace kernels
}  // namespace pycomm
