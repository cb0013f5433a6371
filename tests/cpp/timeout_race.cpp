// Two ranks of one host, as two threads of one process with their own
// transports over one shared segment, run collectives and point-to-point
// messages while a third thread keeps changing their timeouts (what
// Communicator.timeout = ... does from Python while the progress thread and
// the lanes run). Built with -fsanitize=thread by tests/test_cpp.py: a
// timeout read and written without synchronisation is a reported race.
//
// Each thread maps the segment at its own address, so the sanitizer cannot
// see the ranks' shared-memory handshakes (and reports nothing about them);
// what it checks is the memory of each rank's own objects, which the
// threads of one rank share.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "one_host.h"
#include "transport/setup.h"

using namespace pycomm;

namespace {

constexpr int kWorld = 2;
constexpr int kCalls = 200;

TopologyConfig config(int rank, const std::string& name) {
  return one_host_config(rank, kWorld, name, "tsan", 60);
}

bool run_rank(Transports& t, int rank) {
  std::vector<float> in(1000, static_cast<float>(rank + 1)), out(1000);
  std::vector<char> msg(3000);
  for (int i = 0; i < kCalls; ++i) {
    CollectiveDesc d;
    d.coll = Collective::kAllReduce;
    d.algo = i % 2 ? Algorithm::kRing : Algorithm::kOneShot;
    d.count = in.size();
    d.input = in.data();
    d.output = out.data();
    t.top().run(d, i + 1);
    if (out[0] != 3.0f) return false;
    // One message each way: the reader's and writer's waits read the timeout too.
    const OpContext ctx{Collective::kSend, static_cast<uint64_t>(i + 1), 0, deadline_after(t.timeout())};
    const int peer = 1 - rank;
    if (rank == 0) {
      t.p2p()->write(peer, msg.data(), msg.size(), ctx);
      t.p2p()->read(peer, msg.data(), msg.size(), ctx);
    } else {
      t.p2p()->read(peer, msg.data(), msg.size(), ctx);
      t.p2p()->write(peer, msg.data(), msg.size(), ctx);
    }
  }
  return true;
}

}  // namespace

int main() {
  const std::string name = "/pycomm-test-race-" + std::to_string(getpid());
  Transports rank0(config(0, name));
  Transports rank1(config(1, name));
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::thread setter([&] {
    for (int i = 0; !done.load(); ++i) {
      rank0.set_timeout(60 + i % 7);
      rank1.set_timeout(60 + i % 5);
      std::this_thread::yield();
    }
  });
  std::thread r0([&] {
    rank0.wait_ready();
    if (!run_rank(rank0, 0)) ++failures;
  });
  std::thread r1([&] {
    rank1.wait_ready();
    if (!run_rank(rank1, 1)) ++failures;
  });
  r0.join();
  r1.join();
  done = true;
  setter.join();
  rank0.shutdown();
  rank1.shutdown();
  std::printf("%s\n", failures.load() ? "wrong results" : "ok");
  return failures.load() ? 1 : 0;
}
