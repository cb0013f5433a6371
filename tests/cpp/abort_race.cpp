// Two ranks abort the same segment at once: rank 0 with abort() (as a
// heartbeat verdict or Communicator.abort does), rank 1 with fail() (as a
// rank that finds a mismatch does). fail() must throw the first abort's
// reason, complete, even while the winner is still writing it (state 1),
// never an empty message.
//
// Built by tests/test_cpp.py with PYCOMM_RACE_WINDOWS: the winner then
// sleeps up to kWindowUs between claiming the abort and publishing its
// message (csrc/core/race_window.h), which a 2-core machine almost never
// does by itself.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "one_host.h"
#include "transport/setup.h"

using namespace pycomm;

namespace {

constexpr int kWorld = 2;
constexpr int kTrials = 40;
constexpr const char* kWindowUs = "3000";

TopologyConfig config(int rank, const std::string& name) {
  return one_host_config(rank, kWorld, name, "abort-race", 30);
}

}  // namespace

int main() {
  setenv("PYCOMM_RACE_WINDOW_US", kWindowUs, 1);
  int bad = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const std::string name = "/pycomm-test-abort-" + std::to_string(getpid()) + "-" + std::to_string(trial);
    Transports rank0(config(0, name));
    Transports rank1(config(1, name));
    std::thread t0([&] { rank0.wait_ready(); });
    rank1.wait_ready();
    t0.join();

    std::string seen;
    std::thread aborter([&] { rank0.local()->abort("rank 0's reason", Blame{}); });
    // Most trials land inside the winner's window; some before it (then
    // rank 1 wins and reports its own reason), which is fine too.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    try {
      rank1.local()->fail("rank 1's reason", Blame{});
    } catch (const CommError& e) {
      seen = e.what();
    }
    aborter.join();
    const std::string first = rank1.local()->abort_error().what();
    if (seen.empty() || seen != first) {
      std::printf("trial %d: fail() threw \"%s\", the first abort said \"%s\"\n", trial, seen.c_str(),
                  first.c_str());
      ++bad;
    }
    rank0.shutdown();
    rank1.shutdown();
  }
  std::printf("%s\n", bad ? "wrong abort messages" : "ok");
  return bad ? 1 : 0;
}
