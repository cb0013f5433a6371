// Race windows, widened on purpose in sanitizer builds.
//
// Where one thread hands an object to another (an abort, a close, a verdict
// about a peer, a lane's last message), a sanitizer can only report a bad
// order that actually happens, and a 2-core machine rarely produces the
// unlucky ones (the progress thread still inside a transport while the
// caller tears it down). setup.py defines PYCOMM_RACE_WINDOWS in sanitizer
// builds (PYCOMM_SANITIZE); there race_window() sleeps a random
// 0..PYCOMM_RACE_WINDOW_US microseconds (unset or 0: no delay), so such
// orders come up in every run. In normal builds it is empty and free.
#pragma once

#if defined(PYCOMM_RACE_WINDOWS)
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>
#include <thread>
#endif

namespace pycomm {

#if defined(PYCOMM_RACE_WINDOWS)
inline long race_window_max_us() {
  static const long max_us = [] {
    const char* env = std::getenv("PYCOMM_RACE_WINDOW_US");
    return env ? std::max(0L, std::atol(env)) : 0L;
  }();
  return max_us;
}

// `where` names the hand-over; it shows up in a debugger's stack.
inline void race_window(const char* /*where*/) {
  const long max_us = race_window_max_us();
  if (max_us == 0) return;
  thread_local std::minstd_rand rng(std::random_device{}());
  const long us = std::uniform_int_distribution<long>(0, max_us)(rng);
  if (us == 0) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
}
#else
inline void race_window(const char* /*where*/) {}
#endif

}  // namespace pycomm
