// Heartbeats between hosts (transport/peer_watch.h) over an in-memory board
// whose faults the test controls: a rank whose beats stop landing (frozen)
// is declared silent once, by every other rank, within the bound; the
// frozen rank itself, whose own beats do not land, judges nobody, and reads
// that it was declared; a rank
// that left or opted out, or never beat, is never judged; an abort's mark
// reaches the peers, but never over a verdict; a board slower
// than a beat period gives no verdicts; stop() returns within about a
// second even when the board never answers, and no verdict comes after it.
// Built with -fsanitize=thread by tests/test_cpp.py (a bound changed while
// the threads run, verdicts against stop()).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "transport/peer_watch.h"

using namespace pycomm;
using Clock = std::chrono::steady_clock;

namespace {

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

class MemoryBoard : public BeatBoard {
 public:
  void beat(int rank) override {
    wait_if_blocked();
    std::lock_guard<std::mutex> lk(mu_);
    if (frozen_.count(rank)) return;  // its beats stop landing
    ++counters_[rank];
    landed_[rank] = Clock::now();
  }
  // When `rank`'s last beat landed (the start of its counter's silence).
  Clock::time_point last_landed(int rank) {
    std::lock_guard<std::mutex> lk(mu_);
    return landed_[rank];
  }
  void mark(int rank, int64_t mark) override {
    std::lock_guard<std::mutex> lk(mu_);
    counters_[rank] = mark;
  }
  std::vector<int64_t> read(const std::vector<int>& ranks) override {
    wait_if_blocked();
    std::this_thread::sleep_for(read_delay_.load());
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<int64_t> out;
    for (int r : ranks) out.push_back(counters_.count(r) ? counters_[r] : 0);
    return out;
  }
  void freeze(int rank) {
    std::lock_guard<std::mutex> lk(mu_);
    frozen_.insert(rank);
  }
  void set_read_delay(std::chrono::milliseconds d) { read_delay_ = d; }
  // Every call blocks until release() (a board whose host stalled).
  void block() {
    std::lock_guard<std::mutex> lk(mu_);
    blocked_ = true;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      blocked_ = false;
    }
    cv_.notify_all();
  }

 private:
  void wait_if_blocked() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [this] { return !blocked_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool blocked_ = false;
  std::map<int, int64_t> counters_;
  std::map<int, Clock::time_point> landed_;
  std::set<int> frozen_;
  std::atomic<std::chrono::milliseconds> read_delay_{std::chrono::milliseconds(0)};
};

struct Verdicts {
  std::mutex mu;
  std::vector<std::pair<int, int>> seen;  // (judge, peer)
  std::vector<Clock::time_point> at;
  Clock::time_point since = Clock::now();
  std::function<void(int, double, double)> for_judge(int judge) {
    return [this, judge](int peer, double, double bound) {
      CHECK(bound > 0);
      std::lock_guard<std::mutex> lk(mu);
      seen.emplace_back(judge, peer);
      at.push_back(Clock::now());
    };
  }
  size_t count() {
    std::lock_guard<std::mutex> lk(mu);
    return seen.size();
  }
};

std::unique_ptr<PeerWatch> watch(std::shared_ptr<BeatBoard> board, int rank, std::vector<int> peers, double bound,
                                 Verdicts& v) {
  PeerWatchConfig c;
  c.board = std::move(board);
  c.rank = rank;
  c.peers = std::move(peers);
  c.bound_s = bound;
  c.on_silent = v.for_judge(rank);
  return std::make_unique<PeerWatch>(std::move(c));
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

// Ranks 0..2 watch each other; rank 2 freezes: 0 and 1 declare it (once
// each, within the bound plus two periods), 2 declares nobody.
void frozen_rank_is_declared_by_the_others() {
  auto board = std::make_shared<MemoryBoard>();
  Verdicts v;
  const double bound = 0.3;
  std::vector<std::unique_ptr<PeerWatch>> w;
  for (int r = 0; r < 3; ++r) {
    std::vector<int> peers;
    for (int p = 0; p < 3; ++p)
      if (p != r) peers.push_back(p);
    w.push_back(watch(board, r, peers, bound, v));
  }
  sleep_s(0.5);  // everyone beat: a healthy group gives no verdict
  CHECK(v.count() == 0);
  {
    std::lock_guard<std::mutex> lk(v.mu);
    v.since = Clock::now();
  }
  board->freeze(2);
  // Until the three verdicts are in (bounded): a fixed sleep of the bound
  // plus two periods failed on a loaded 2-core machine, where a watcher's
  // thread can wait that long for a core.
  for (int i = 0; i < 500 && v.count() < 3; ++i) sleep_s(0.01);
  sleep_s(0.1);  // a fourth (wrong) verdict would come within a period
  for (auto& x : w) x->stop(true);
  std::lock_guard<std::mutex> lk(v.mu);
  // 0 and 1 declare it (the second may follow the first's mark); 2 reads
  // that it was declared (its own beats still reach its judge's reads of
  // the board, as a woken process's would) and learns that it is out.
  CHECK(v.seen.size() == 3);
  std::set<int> judges;
  for (auto& [judge, peer] : v.seen) {
    CHECK(peer == 2);
    judges.insert(judge);
  }
  CHECK(judges == (std::set<int>{0, 1, 2}));
  // Never before the peer's counter stood still for the bound: measured from
  // its last beat that landed, which may precede the freeze by up to a beat
  // period (measured from the freeze, a verdict 0.29 s after it was correct
  // and failed a check). After it, within what a loaded machine's scheduler
  // allows (two periods when idle).
  const Clock::time_point last_beat = board->last_landed(2);
  auto seconds_since = [](Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  };
  for (Clock::time_point t : v.at) {
    const double silent = seconds_since(last_beat, t), after_freeze = seconds_since(v.since, t);
    if (!(silent >= bound && after_freeze <= bound + 2.0))
      std::fprintf(stderr, "verdict %.3f s after the last beat, %.3f s after the freeze\n", silent, after_freeze);
    CHECK(silent >= bound && after_freeze <= bound + 2.0);
  }
}

// A rank that left, one that opted out and one that never beat are never
// judged, however long they stay quiet.
void left_opted_out_and_silent_from_the_start_are_not_judged() {
  auto board = std::make_shared<MemoryBoard>();
  Verdicts v;
  auto judge = watch(board, 0, {1, 2, 3}, 0.2, v);
  auto leaver = watch(board, 1, {0}, 0.2, v);
  board->mark(2, BeatBoard::kOptedOut);
  sleep_s(0.3);
  leaver->stop(/*leave=*/true);
  sleep_s(0.8);
  judge->stop(true);
  CHECK(v.count() == 0);
}

// A board slower than the slack gives no verdict even on a frozen peer;
// once it answers in time again the verdict comes.
void slow_board_gives_no_verdict() {
  auto board = std::make_shared<MemoryBoard>();
  Verdicts v;
  auto a = watch(board, 0, {1}, 0.2, v);
  auto b = watch(board, 1, {0}, 0.2, v);
  sleep_s(0.3);
  board->set_read_delay(std::chrono::milliseconds(250));
  board->freeze(1);
  sleep_s(1.0);
  CHECK(v.count() == 0);
  board->set_read_delay(std::chrono::milliseconds(0));
  sleep_s(0.8);
  a->stop(true);
  b->stop(true);
  std::lock_guard<std::mutex> lk(v.mu);
  // Rank 0's verdict, and rank 1 reading it (in either order).
  const std::set<std::pair<int, int>> seen(v.seen.begin(), v.seen.end());
  CHECK(v.seen.size() == 2 && seen == (std::set<std::pair<int, int>>{{0, 1}, {1, 1}}));
}

// stop() on a board that never answers returns in about a second; the
// threads finish later, when it answers, and deliver nothing. Meanwhile
// another thread keeps changing the bound (what Python's setter does).
void stop_does_not_wait_for_a_board_that_hangs() {
  auto board = std::make_shared<MemoryBoard>();
  Verdicts v;
  auto a = watch(board, 0, {1}, 0.1, v);
  auto b = watch(board, 1, {0}, 0.1, v);
  std::atomic<bool> done{false};
  std::thread tuner([&] {
    for (int i = 0; !done; ++i) {
      a->set_bound(i % 2 ? 0.1 : 0.2);
      CHECK(a->bound() > 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
    }
  });
  sleep_s(0.3);
  board->freeze(1);
  board->block();
  const auto t0 = Clock::now();
  a->stop(true);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  CHECK(took < 1.5);
  done = true;
  tuner.join();
  board->release();  // the detached threads see the stop and finish
  sleep_s(0.5);
  b->stop(true);
  // Rank 1 froze just before the board hung: no time to judge it.
  CHECK(v.count() == 0);
}

// An abort's mark reaches the peer's judge (on_failed, once) and stays
// when the aborted rank leaves; a rank its peers declared silent marks
// nothing when it aborts: their verdict (gone for good) stays.
void an_abort_is_marked_unless_the_rank_was_declared() {
  auto board = std::make_shared<MemoryBoard>();
  Verdicts v;
  std::mutex mu;
  std::vector<int> failed;
  auto with_failed = [&](int rank, std::vector<int> peers) {
    PeerWatchConfig c;
    c.board = board;
    c.rank = rank;
    c.peers = std::move(peers);
    c.bound_s = 0.2;
    c.on_silent = v.for_judge(rank);
    c.on_failed = [&](int peer) {
      std::lock_guard<std::mutex> lk(mu);
      failed.push_back(peer);
    };
    return std::make_unique<PeerWatch>(std::move(c));
  };
  auto a = with_failed(0, {1});
  auto b = with_failed(1, {0});
  sleep_s(0.1);
  b->mark_failed();
  b->mark_failed();  // once is what counts
  sleep_s(0.3);      // a beat period at 0.2 s is 40 ms
  b->stop(/*leave=*/true);
  CHECK(BeatBoard::failed(board->read({1})[0]));
  a->stop(true);
  {
    std::lock_guard<std::mutex> lk(mu);
    CHECK(failed == std::vector<int>{1});
  }
  CHECK(v.count() == 0);
  // Rank 2 was declared silent by its peers (before its judge read it).
  board->mark(2, BeatBoard::kSilenced);
  auto c = with_failed(2, {0});
  c->mark_failed();
  CHECK(BeatBoard::silenced(board->read({2})[0]));
  c->stop(/*leave=*/false);
  CHECK(BeatBoard::silenced(board->read({2})[0]));
}

}  // namespace

int main() {
  CHECK(PeerWatch::period_for(5.0) == std::chrono::milliseconds(500));
  CHECK(PeerWatch::period_for(1.0) == std::chrono::milliseconds(200));
  CHECK(PeerWatch::period_for(0.01) == std::chrono::milliseconds(10));
  frozen_rank_is_declared_by_the_others();
  left_opted_out_and_silent_from_the_start_are_not_judged();
  slow_board_gives_no_verdict();
  stop_does_not_wait_for_a_board_that_hangs();
  an_abort_is_marked_unless_the_rank_was_declared();
  std::printf("ok\n");
  return 0;
}
