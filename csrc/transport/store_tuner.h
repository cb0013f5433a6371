// How a rank writes what it hands to its peers through its mailbox: through
// its cache, or with streaming (non-temporal) stores that send the lines to
// memory. Chosen per call size by measuring both, all the time.
//
// Why both: the staged protocol hands freshly written mailbox lines from one
// core to another every round. While the two cores exchange dirty lines
// quickly (on a VM: while the host runs the two vCPUs on cores that share a
// cache), cached stores win: 1 MiB all-reduces run ~2x faster than with
// streaming stores. But the host moves vCPUs: for seconds at a time (about
// one second in seven on the 2-vCPU development machine) the exchange of
// dirty lines slows ~3x while streaming from memory does not, and streaming
// stores then run 1.4-1.9x faster than cached ones (benchmarks/RESULTS.md,
// "All-reduce on one host"). No fixed choice is good in both regimes, and
// the guest cannot see which one it is in, so the tuner measures.
//
// How: per size class, the mode in use is timed on every call (cost =
// seconds per byte, a moving average), and the 2nd, the 8th and every
// kExplorePeriod-th call of the class run the other mode once; the tuner
// switches when the other mode's sample is clearly lower. Two calls in a row
// much slower than the class's usual also trigger a sample of the other mode
// at once, so that the switch follows a change of regime within a few calls;
// a single slow call (a preempted rank) does not. A switch in one size class
// makes the others re-time and sample at once. A call is timed whole, less
// its first wait for a peer: a late peer is not the mode's cost, but the
// writes before that wait are (in a one-shot call they are most of what the
// mode changes; timing only from the first peer's arrival missed them, and
// 16-32 KiB calls stayed cached through the slow regime). Exploring calls
// sit at the same call counts on every rank (every rank makes the same
// calls), so that ranks sample the other mode together; each rank then
// decides from its own clock, and ranks that disagree for a while only cost
// time: the mode changes no result bit.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace pycomm {

enum class StoreMode : uint8_t { kCached = 0, kStreaming = 1 };

class StoreTuner {
 public:
  // What the tuner may choose: PYCOMM_SHM_STORES=auto (the default), or a
  // mode pinned with cached / streaming.
  enum class Policy : uint8_t { kAuto, kCached, kStreaming };

  // Calls below this size run cached: at 1 KiB the modes tie in the slow
  // regime and streaming stores cost 0.3 us while the cores share a cache.
  // From 4 KiB the slow regime matters (2 ranks, the development machine,
  // cached against streaming: 4 KiB 5.4 against 4.0 us, 16 KiB 11.7 against
  // 5.4, 64 KiB 44 against 10; benchmarks/RESULTS.md), and with a whole call
  // timed (below) the tuner tells the modes apart at these sizes too. The
  // price: after a slow spell a small class may stay streaming (4 KiB 3.6
  // instead of 3.2 us), as the other mode must win by kSwitchBelow to switch.
  static constexpr size_t kMinBytes = size_t{1} << 12;
  // Every kExplorePeriod-th call of a size class samples the other mode:
  // where that mode keeps losing (the common case) this costs about
  // 0.6 / kExplorePeriod of the calls' mean time.
  static constexpr uint32_t kExplorePeriod = 64;
  // Switch when the other mode costs less than this fraction: a margin over
  // call-to-call noise, so that the mode does not flap.
  static constexpr double kSwitchBelow = 0.85;
  // A switch is checked by sampling the mode left this many calls later:
  // what made the switch look good may have been brief (a cold cache after
  // other work), and a wrong mode then costs a few calls, not a period.
  static constexpr uint32_t kConfirmAfter = 4;
  // Two calls in a row this much slower than their class's average: a new
  // regime; the other mode is sampled on the next call.
  static constexpr double kJumpAbove = 1.6;

  explicit StoreTuner(Policy policy = Policy::kAuto) : policy_(policy) {}

  // The mode for the next call of `bytes` (per rank's buffers).
  StoreMode choose(size_t bytes) {
    if (policy_ == Policy::kCached || bytes < kMinBytes) return StoreMode::kCached;
    if (policy_ == Policy::kStreaming) return StoreMode::kStreaming;
    Bucket& b = buckets_[bucket(bytes)];
    ++b.calls;
    const bool confirm = b.confirm_in > 0 && --b.confirm_in == 0;
    // Early samples too: a job (or a benchmark point) may make only a few
    // calls of a size, in either regime from the start.
    const bool early = b.calls == 2 || b.calls == 8;
    const bool explore = confirm || early || b.sample_now || b.calls % kExplorePeriod == 0;
    return explore ? other(b.mode) : b.mode;
  }

  // Records what a call of `bytes` in `used` mode took, from the moment
  // every peer had arrived (a late peer is not the mode's cost).
  void record(size_t bytes, StoreMode used, double seconds) {
    if (policy_ != Policy::kAuto || bytes < kMinBytes) return;
    Bucket& b = buckets_[bucket(bytes)];
    const double cost = seconds / static_cast<double>(bytes);
    double& avg = b.cost[static_cast<int>(used)];
    if (used == b.mode) {
      if (b.refresh) {
        avg = cost;
        b.refresh = false;
        b.sample_now = true;
      } else if (avg == 0) {
        avg = cost;
      } else if (cost > kJumpAbove * avg) {
        // One slow call is noise (preempted, interrupted) and does not
        // move the average; two in a row are a new regime: take its level
        // and sample the other mode at once.
        if (++b.slow_calls >= 2) {
          avg = cost;
          b.slow_calls = 0;
          b.sample_now = true;
        }
      } else {
        b.slow_calls = 0;
        avg += (cost - avg) / 8;
      }
      return;
    }
    // A sample of the other mode: the newest alone counts, the regime may
    // have changed since the last one (a noisy sample that switches wrongly
    // is undone kConfirmAfter calls later).
    b.sample_now = false;
    avg = cost;
    const double current = b.cost[static_cast<int>(b.mode)];
    if (current > 0 && avg < kSwitchBelow * current) {
      b.mode = used;
      b.slow_calls = 0;
      b.confirm_in = kConfirmAfter;
      ++switches_;
      // The regime is the machine's: the other size classes re-time their
      // mode on their next call and sample this one on the call after,
      // instead of waiting a period.
      for (Bucket& o : buckets_)
        if (&o != &b && o.calls > 0 && o.mode != used) o.refresh = true;
    }
  }

  Policy policy() const { return policy_; }
  // Mode changes so far, over every size class (for tests and benchmarks).
  uint64_t switches() const { return switches_; }
  StoreMode mode(size_t bytes) const {
    if (policy_ == Policy::kCached || bytes < kMinBytes) return StoreMode::kCached;
    if (policy_ == Policy::kStreaming) return StoreMode::kStreaming;
    return buckets_[bucket(bytes)].mode;
  }

 private:
  struct Bucket {
    StoreMode mode = StoreMode::kCached;
    double cost[2] = {0, 0};  // seconds per byte, by mode; 0: not measured yet
    uint32_t calls = 0;
    uint32_t slow_calls = 0;  // consecutive calls far above the average
    uint32_t confirm_in = 0;  // calls until the mode left is sampled again (0: none due)
    bool sample_now = false;
    bool refresh = false;  // another class switched: take the next call's level
  };
  // Size classes by powers of two from kMinBytes; the last holds the rest.
  static constexpr int kBuckets = 16;
  static int bucket(size_t bytes) {
    int b = 0;
    for (size_t s = kMinBytes * 2; s <= bytes && b < kBuckets - 1; s *= 2) ++b;
    return b;
  }
  static StoreMode other(StoreMode m) {
    return m == StoreMode::kCached ? StoreMode::kStreaming : StoreMode::kCached;
  }

  Policy policy_;
  std::array<Bucket, kBuckets> buckets_{};
  uint64_t switches_ = 0;
};

}  // namespace pycomm
