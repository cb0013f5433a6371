// The samples top-k's sampled mode reads (kernels/topk_sample.h), checked on
// the host. CUDA's, the chunks its radix passes read:
//   - one chunk of every group, whole and inside the tensor (only the
//     tensor's last chunk may be short), `valid` counting the sampled
//     elements inside it, at sizes around chunk and group boundaries;
//   - the chunk a group gives is spread evenly over its positions;
//   - on a gradient-like tensor (rows of 1024 columns, the first 256
//     columns 8x the others), the sample's count of keys at or above the
//     whole tensor's k-th largest is k x valid / n within 5 %. The group's
//     first chunk, which the sample took before, sees only those columns:
//     its count is ~4x, and the passes had to run again on the whole tensor.
// The CPU's, runs of 16 elements, one in each stratum:
//   - every run inside its stratum, the runs apart, their places even;
//   - on rows of 1024 columns with 8 outlier columns 20x the others, one in
//     every 128, sampling one element in 128, the count at the whole
//     tensor's k-th largest is k x m / n within 12 % (3 standard
//     deviations). The grid the CPU took before (one element every 128 from
//     one offset) reads 8 columns of each row: all outliers or none, off by
//     40 % or more whichever the offset.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/topk_sample.h"

using namespace pycomm::kernels;

namespace {

int failures = 0;

void check(bool ok, const char* what, double a = 0, double b = 0) {
  if (!ok) {
    std::printf("FAIL: %s (%g, %g)\n", what, a, b);
    ++failures;
  }
}

// Structure: every group's chunk whole, inside the tensor and its group;
// returns the sample's elements inside the tensor.
size_t walk(size_t n, const Sample& s) {
  const size_t chunks = (n + kSampleChunk - 1) / kSampleChunk;
  size_t inside = 0;
  for (size_t j = 0; j < s.m; ++j) {
    const size_t i = sampled_index(j, s.stride, n);
    const size_t g = j / kSampleChunk, c = i / kSampleChunk;
    if (j % kSampleChunk == 0) {
      check(c >= g * s.stride && c < std::min((g + 1) * s.stride, chunks), "chunk outside its group", g, c);
      check(i % kSampleChunk == 0, "chunk not aligned", g, i);
    } else {
      check(i == sampled_index(j - 1, s.stride, n) + 1, "chunk not consecutive", j, i);
    }
    inside += i < n;
  }
  return inside;
}

void test_structure() {
  const size_t base = size_t{1} << 22;  // 4M elements: stride 4 at k = 1 %
  for (size_t n : {base, base + 1, base + 255, base + 256, base + 257, base + 4 * 256 + 3, size_t{5000003},
                   size_t{1} << 24}) {
    const Sample s(n, n / 100, false, 0.1);
    check(s.stride >= 4, "a large tensor is sampled", static_cast<double>(n), static_cast<double>(s.stride));
    check(walk(n, s) == s.valid, "valid counts the sampled elements inside the tensor", static_cast<double>(n),
          static_cast<double>(s.valid));
    check(s.lo >= 1 && s.lo <= s.hi, "a window", s.lo, s.hi);
  }
  check(Sample(base, base / 100, true, 0.1).stride == 1, "exact mode reads everything");
  check(Sample(size_t{1} << 17, 2000, false, 0.1).stride == 1, "a small tensor is read whole");
  check(sampled_index(12345, 1, 99999) == 12345, "stride 1 is the tensor itself");
}

void test_spread() {
  const size_t n = size_t{1} << 24, stride = 16;
  const size_t groups = n / kSampleChunk / stride;  // 4096
  std::vector<size_t> hits(stride, 0);
  for (size_t g = 0; g < groups; ++g) ++hits[sampled_chunk_in_group(g, stride)];
  const double expected = static_cast<double>(groups) / stride;
  for (size_t h : hits)
    check(h > 0.8 * expected && h < 1.2 * expected, "positions taken evenly", static_cast<double>(h), expected);
}

// Keys of the sample (or of the group's first chunk, the old sample) at or
// above `threshold`.
size_t sampled_at_or_above(const std::vector<float>& x, const Sample& s, float threshold, bool first_chunk) {
  size_t count = 0;
  for (size_t j = 0; j < s.m; ++j) {
    const size_t i = first_chunk ? (j / kSampleChunk) * (s.stride * kSampleChunk) + j % kSampleChunk
                                 : sampled_index(j, s.stride, x.size());
    count += i < x.size() && x[i] >= threshold;
  }
  return count;
}

void test_rows_of_a_weight_gradient() {
  const size_t cols = 1024, n = size_t{1} << 22, k = n / 100;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = u(rng) * (i % cols < 256 ? 8.0f : 1.0f);
  std::vector<float> sorted(x);
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
  const float threshold = sorted[k - 1];
  const Sample s(n, k, false, 0.1);
  const double expected = static_cast<double>(k) * s.valid / n;
  const double got = static_cast<double>(sampled_at_or_above(x, s, threshold, false));
  const double old = static_cast<double>(sampled_at_or_above(x, s, threshold, true));
  check(s.stride == 4, "stride 4 here: 1024 columns are one group of chunks", static_cast<double>(s.stride));
  check(got > 0.95 * expected && got < 1.05 * expected, "the sample reads the whole tensor's threshold", got,
        expected);
  check(old > 3.0 * expected, "the group's first chunk (the old sample) sees only the first columns", old, expected);
}

void test_strata() {
  const uint64_t key = mix64(11);
  for (size_t n : {size_t{17}, size_t{1000}, size_t{1} << 20, size_t{5000003}}) {
    for (size_t runs : {size_t{1}, n / 128 + 1, n / 17, (n - 1) / kSampleRun}) {
      if (runs == 0) continue;
      bool inside = true, apart = true;
      size_t end = 0;  // the run before's end
      for (size_t r = 0; r < runs; ++r) {
        const size_t start = sampled_run(r, runs, n, key);
        inside = inside && start >= r * n / runs && start + kSampleRun <= (r + 1) * n / runs;
        apart = apart && start >= end;
        end = start + kSampleRun;
      }
      check(inside, "every run inside its stratum", static_cast<double>(n), static_cast<double>(runs));
      check(apart, "runs in order, none overlapping", static_cast<double>(n), static_cast<double>(runs));
    }
  }
  // The places are spread evenly over a stratum.
  const size_t n = size_t{1} << 20, runs = n / 64;  // strata of 64: 49 places
  std::vector<size_t> hits(64 - kSampleRun + 1, 0);
  for (size_t r = 0; r < runs; ++r) ++hits[sampled_run(r, runs, n, key) - r * 64];
  const double expected = static_cast<double>(runs) / hits.size();
  for (size_t h : hits)
    check(h > 0.8 * expected && h < 1.2 * expected, "places taken evenly", static_cast<double>(h), expected);
}

void test_rows_with_outlier_columns() {
  const size_t cols = 1024, n = size_t{1} << 23, k = n / 100, m = n / 128, runs = m / kSampleRun;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = u(rng) * (i % 128 == 5 ? 20.0f : 1.0f);
  static_assert(cols % 128 == 0, "the outliers are whole columns");
  std::vector<float> sorted(x);
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
  const float threshold = sorted[k - 1];
  const double expected = static_cast<double>(k) * m / n;
  for (uint64_t seed : {0, 1, 2, 3}) {
    const uint64_t key = mix64(seed);
    size_t got = 0, grid = 0;
    for (size_t r = 0; r < runs; ++r) {
      const size_t start = sampled_run(r, runs, n, key);
      for (size_t e = 0; e < kSampleRun; ++e) got += x[start + e] >= threshold;
    }
    const double offset = uniform01(key, 0) * 128.0;  // the grid's one offset
    for (size_t j = 0; j < m; ++j) grid += x[static_cast<size_t>(offset + j * 128.0)] >= threshold;
    // ~655 expected: a standard deviation of ~4 %.
    check(got > 0.88 * expected && got < 1.12 * expected, "the runs read the whole tensor's threshold",
          static_cast<double>(got), expected);
    check(grid < 0.6 * expected || grid > 1.4 * expected, "the grid (the old sample) reads 8 columns",
          static_cast<double>(grid), expected);
  }
}

}  // namespace

int main() {
  test_structure();
  test_spread();
  test_rows_of_a_weight_gradient();
  test_strata();
  test_rows_with_outlier_columns();
  if (failures) return 1;
  std::printf("ok\n");
  return 0;
}
