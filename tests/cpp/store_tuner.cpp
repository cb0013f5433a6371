// The mailbox store tuner (transport/store_tuner.h) on simulated call times,
// and the streaming kernels it drives against their cached twins:
//   - pinned policies never change mode; calls below the smallest size
//     class always run cached;
//   - in a steady regime where cached stores win, auto never switches and
//     samples streaming about once per kExplorePeriod calls;
//   - when the regime changes so that streaming wins by 2x, auto switches
//     within a few calls, and back within about a period when it ends;
//   - one slow call (a preempted rank) moves nothing;
//   - copy_cpu_streaming / reduce_cpu_streaming give the bits of
//     memcpy / reduce_cpu at every alignment and odd length.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/kernels.h"
#include "transport/store_tuner.h"

using namespace pycomm;

namespace {

int failures = 0;

void check(bool ok, const char* what, long a = 0, long b = 0) {
  if (!ok) {
    std::printf("FAIL: %s (%ld, %ld)\n", what, a, b);
    ++failures;
  }
}

// Runs `calls` calls of `bytes` with per-byte costs by mode (ns per byte,
// with +-5 % noise); returns how many ran streaming and the index of the
// first call after which the tuner's mode was `want` (-1: never).
struct Run {
  int streaming = 0;
  int reached = -1;
};
Run simulate(StoreTuner& t, size_t bytes, int calls, double cached, double streaming, StoreMode want,
             std::mt19937& rng) {
  std::uniform_real_distribution<double> noise(0.95, 1.05);
  Run r;
  for (int i = 0; i < calls; ++i) {
    const StoreMode m = t.choose(bytes);
    if (m == StoreMode::kStreaming) ++r.streaming;
    const double per_byte = (m == StoreMode::kCached ? cached : streaming) * 1e-9;
    t.record(bytes, m, per_byte * static_cast<double>(bytes) * noise(rng));
    if (r.reached < 0 && t.mode(bytes) == want) r.reached = i;
  }
  return r;
}

void tuner_cases() {
  std::mt19937 rng(7);
  const size_t big = 1 << 20, small = 2 << 10;

  StoreTuner cached(StoreTuner::Policy::kCached), streaming(StoreTuner::Policy::kStreaming);
  for (int i = 0; i < 200; ++i) {
    check(cached.choose(big) == StoreMode::kCached, "pinned cached runs cached");
    check(streaming.choose(big) == StoreMode::kStreaming, "pinned streaming runs streaming");
    check(streaming.choose(small) == StoreMode::kCached, "small calls run cached");
    streaming.record(big, StoreMode::kStreaming, 1.0);
  }
  check(cached.switches() == 0 && streaming.switches() == 0, "pinned policies never switch");

  StoreTuner t;
  // Small calls: never sampled, never recorded.
  const Run s = simulate(t, small, 500, 1.0, 0.1, StoreMode::kStreaming, rng);
  check(s.streaming == 0 && t.switches() == 0, "small calls stay cached", s.streaming);

  // Steady regime, cached 2x faster: no switch, a sample per period.
  const Run steady = simulate(t, big, 1280, 1.0, 2.0, StoreMode::kStreaming, rng);
  check(steady.reached < 0 && t.switches() == 0, "steady regime keeps cached", steady.reached);
  // Samples: the 2nd and 8th call, then one per period.
  check(steady.streaming >= 1280 / 64 && steady.streaming <= 1280 / 64 + 3, "one sample per period",
        steady.streaming);

  // The regime changes: cached 3x slower, streaming now 2x faster than it.
  const Run slow = simulate(t, big, 300, 3.0, 1.5, StoreMode::kStreaming, rng);
  check(slow.reached >= 0 && slow.reached <= 3, "switches to streaming within a few calls", slow.reached);
  check(t.mode(big) == StoreMode::kStreaming, "stays streaming while it wins");

  // And back: cached wins again.
  const Run back = simulate(t, big, 300, 1.0, 2.0, StoreMode::kCached, rng);
  check(back.reached >= 0 && back.reached <= 64 + 4, "returns to cached within a period", back.reached);

  // One very slow call in a steady regime: no switch, no lasting effect.
  const uint64_t before = t.switches();
  simulate(t, big, 100, 1.0, 2.0, StoreMode::kStreaming, rng);
  t.record(big, t.choose(big), 1e-9 * 20 * big);
  const Run after = simulate(t, big, 100, 1.0, 2.0, StoreMode::kStreaming, rng);
  check(t.switches() == before && after.reached < 0, "one slow call moves nothing",
        static_cast<long>(t.switches() - before), after.reached);

  // A fresh tuner that starts in the slow regime switches within the
  // first calls of a size (a benchmark point may make only a few).
  StoreTuner fresh;
  const Run start_slow = simulate(fresh, 16 << 20, 10, 3.0, 1.5, StoreMode::kStreaming, rng);
  check(start_slow.reached >= 0 && start_slow.reached <= 2, "switches at the first sample", start_slow.reached);
  // A class used before in the normal regime samples the new mode as soon
  // as another class switched.
  StoreTuner shared;
  simulate(shared, 4 << 20, 200, 1.0, 2.0, StoreMode::kStreaming, rng);
  simulate(shared, 1 << 20, 200, 1.0, 2.0, StoreMode::kStreaming, rng);
  simulate(shared, 1 << 20, 4, 3.0, 1.5, StoreMode::kStreaming, rng);
  check(shared.mode(1 << 20) == StoreMode::kStreaming, "the 1 MiB class switched");
  const Run neighbour = simulate(shared, 4 << 20, 3, 3.0, 1.5, StoreMode::kStreaming, rng);
  check(neighbour.reached >= 0 && neighbour.reached <= 1, "another class follows within two calls",
        neighbour.reached);
}

void kernel_cases() {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  const size_t n = 70001;
  std::vector<float> a(n + 32), b(n + 32);
  for (auto& v : a) v = u(rng);
  for (auto& v : b) v = u(rng);
  std::vector<char> dst(4 * n + 256), ref(4 * n + 256);
  for (size_t off : {0, 1, 4, 15, 16, 17, 60}) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{129}, size_t{4 * n - 3}}) {
      std::memset(dst.data(), 0x5a, dst.size());
      std::memset(ref.data(), 0x5a, ref.size());
      kernels::copy_cpu_streaming(dst.data() + off, a.data(), bytes);
      std::memcpy(ref.data() + off, a.data(), bytes);
      check(dst == ref, "streaming copy equals memcpy", static_cast<long>(off), static_cast<long>(bytes));
    }
  }
  for (size_t count : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, n}) {
    for (size_t off : {size_t{0}, size_t{3}}) {
      const void* srcs[2] = {a.data() + off, b.data()};
      std::vector<float> out_ref(count), fwd_ref(count), out(count), fwd(count + 8);
      kernels::reduce_cpu(DType::kFloat32, RedOp::kSum, out_ref.data(), fwd_ref.data(), srcs, 2, count);
      kernels::reduce_cpu_streaming(DType::kFloat32, RedOp::kSum, out.data(), fwd.data() + 1, srcs, 2, count);
      check(std::memcmp(out.data(), out_ref.data(), 4 * count) == 0, "streaming reduce: output",
            static_cast<long>(count));
      check(std::memcmp(fwd.data() + 1, fwd_ref.data(), 4 * count) == 0, "streaming reduce: streamed copy",
            static_cast<long>(count));
      // Without a cached output (a forwarded partial result only).
      std::vector<float> fwd2(count);
      kernels::reduce_cpu_streaming(DType::kFloat32, RedOp::kSum, nullptr, fwd2.data(), srcs, 2, count);
      check(std::memcmp(fwd2.data(), fwd_ref.data(), 4 * count) == 0, "streaming reduce without output",
            static_cast<long>(count));
    }
  }
}

}  // namespace

int main() {
  tuner_cases();
  kernel_cases();
  if (failures) return 1;
  std::printf("ok\n");
  return 0;
}
