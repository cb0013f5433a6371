// What the CPU top-k's sample costs on its own: runs of 16 neighbouring
// entries at hashed places (kernels/topk_sample.h, what cpu/topk.cpp reads)
// against the single entries one stratum apart it read before, and single
// entries at hashed places (the runs' alternative). 16M float32, 1 % sampled,
// caches flushed before each; ms per sample, 5 rounds.
//
//     g++ -O2 -std=c++17 -Icsrc benchmarks/topk_sample_cost.cpp -o /tmp/topk_sample_cost && /tmp/topk_sample_cost
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/topk_sample.h"

using namespace pycomm::kernels;

namespace {

uint32_t key_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

}  // namespace

int main() {
  const size_t n = size_t{1} << 24, m = n / 100 / kSampleRun * kSampleRun;
  std::vector<float> x(n), flush(size_t{1} << 25);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i) * 1e-7f;
  std::vector<uint32_t> sample(m);
  const char* names[] = {"grid (before)", "single entries, hashed", "runs of 16, hashed"};
  std::printf("| round | %s | %s | %s |\n|---|---:|---:|---:|\n", names[0], names[1], names[2]);
  for (int round = 0; round < 5; ++round) {
    double ms[3];
    for (int how = 0; how < 3; ++how) {
      for (float& f : flush) f += 1.0f;  // out of every cache
      const uint64_t key = mix64(round);
      const auto t0 = std::chrono::steady_clock::now();
      if (how == 0) {
        const double width = static_cast<double>(n) / m, offset = uniform01(key, 0) * width;
        for (size_t j = 0; j < m; ++j) sample[j] = key_of(x[std::min(n - 1, static_cast<size_t>(offset + j * width))]);
      } else if (how == 1) {
        // m strata: one entry, at a run's start.
        for (size_t j = 0; j < m; ++j) sample[j] = key_of(x[sampled_run(j, m, n, key)]);
      } else {
        for (size_t j = 0; j < m; j += kSampleRun) {
          const size_t start = sampled_run(j / kSampleRun, m / kSampleRun, n, key);
          for (size_t e = 0; e < kSampleRun; ++e) sample[j + e] = key_of(x[start + e]);
        }
      }
      ms[how] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf("| %d | %.2f | %.2f | %.2f |\n", round, ms[0], ms[1], ms[2]);
  }
  std::printf("\nchecksum %u\n", sample[m / 2]);
  return 0;
}
