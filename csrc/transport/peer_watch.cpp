#include "peer_watch.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "../core/race_window.h"
#include "thread_name.h"

namespace pycomm {

double heartbeat_setting() {
  const char* env = std::getenv("PYCOMM_HEARTBEAT_S");
  return env ? std::max(0.0, std::atof(env)) : kDefaultHeartbeatS;
}

namespace {

using Clock = std::chrono::steady_clock;

// How late a read, or the judge's own wake-up, may be before the judge no
// longer trusts what it sees: a loaded host (8 ranks on 2 cores) oversleeps
// by tens of milliseconds; a frozen judge or a stalled board by far more.
Clock::duration slack_for(std::chrono::milliseconds period) {
  return std::max<Clock::duration>(period, std::chrono::milliseconds(200));
}

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

struct PeerWatch::State {
  PeerWatchConfig c;
  std::atomic<double> bound_s{kDefaultHeartbeatS};
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  int running = 0;  // threads that did not finish yet
  // Held while a verdict is delivered: stop() takes it to know that no
  // callback runs and none will.
  std::mutex verdict_mu;
  bool closed = false;
  std::atomic<bool> failed{false};  // mark_failed() was called

  // Sleeps one beat period; false once stop() was called.
  bool sleep_period() {
    std::unique_lock<std::mutex> lk(mu);
    return !cv.wait_for(lk, period_for(bound_s.load()), [this] { return stop; });
  }
  void finished() {
    {
      std::lock_guard<std::mutex> lk(mu);
      --running;
    }
    cv.notify_all();
  }

  void beat_loop() {
    do {
      try {
        c.board->beat(c.rank);
      } catch (const std::exception&) {
        // A board that did not answer this time: peers may judge us if it
        // stays so, and then rightly (nothing proves we are alive).
      }
    } while (sleep_period());
    finished();
  }

  void judge_loop() {
    struct Peer {
      int rank;
      int64_t value = 0;
      Clock::time_point changed;
      bool done = false;  // declared silent or failed, left or opted out
    };
    std::vector<Peer> peers;
    std::vector<int> ranks;
    const Clock::time_point start = Clock::now();
    for (int p : c.peers) {
      peers.push_back(Peer{p, 0, start, false});
      ranks.push_back(p);
    }
    ranks.push_back(c.rank);  // our own beats, read back: are they landing?
    int64_t own = 0;
    Clock::time_point own_changed = start, last = start;
    while (sleep_period()) {
      const double bound = bound_s.load();
      const auto slack = slack_for(period_for(bound));
      const Clock::time_point t0 = Clock::now();
      std::vector<int64_t> v;
      bool ok = true;
      try {
        v = c.board->read(ranks);
        ok = v.size() == ranks.size();
      } catch (const std::exception&) {
        ok = false;
      }
      const Clock::time_point t1 = Clock::now();
      const bool held_up = t0 - last > period_for(bound) + slack;
      last = t1;
      if (ok) {
        if (v.back() != own) own = v.back(), own_changed = t1;
        for (size_t i = 0; i < peers.size(); ++i)
          if (v[i] != peers[i].value) peers[i].value = v[i], peers[i].changed = t1;
      }
      // 1. Declared silent by a peer: this rank is out (it was frozen), however
      //    late the news.
      if (ok && BeatBoard::silenced(own)) {
        deliver([&] {
          if (c.on_silent) c.on_silent(c.rank, 0, bound_s.load());
        });
        break;
      }
      // 2. A peer that marked itself failed aborted: a fact it wrote itself,
      //    however stale this read, so no freshness test applies.
      bool stopped = false;
      for (Peer& p : peers) {
        if (!ok || p.done || !BeatBoard::failed(p.value)) continue;
        p.done = true;
        if (!deliver([&] {
              if (c.on_failed) c.on_failed(p.rank);
            })) {
          stopped = true;
          break;
        }
      }
      if (stopped) break;
      // 3. Trust this read only if the board answered in time, we were not
      //    held up ourselves, and our own beats are landing; otherwise start
      //    every peer's clock again (late verdicts, never false ones).
      const bool own_fresh = t1 - own_changed <= seconds(bound / 2) + slack;
      if (!ok || t1 - t0 > slack || held_up || !own_fresh) {
        for (Peer& p : peers) p.changed = t1;
        continue;
      }
      // 4. Judge every peer that beat at least once and is still watched;
      //    follow a verdict another rank wrote.
      for (Peer& p : peers) {
        if (p.done) continue;
        if (p.value == BeatBoard::kLeft || p.value == BeatBoard::kOptedOut) {
          p.done = true;
          continue;
        }
        const bool declared = BeatBoard::silenced(p.value);
        if (!declared && (bound <= 0 || p.value <= 0 || t1 - p.changed <= seconds(bound))) continue;
        p.done = true;
        if (!declared) {
          try {
            c.board->mark(p.rank, BeatBoard::kSilenced);
          } catch (const std::exception&) {
            // The others judge it themselves.
          }
        }
        const double silent_s = declared ? 0 : std::chrono::duration<double>(t1 - p.changed).count();
        if (!deliver([&] {
              if (c.on_silent) c.on_silent(p.rank, silent_s, bound_s.load());
            }))
          break;
      }
    }
    finished();
  }

  // Hands a verdict to its callback; false once stop() was called.
  template <typename Call>
  bool deliver(Call&& call) {
    race_window("peer watch: verdict");
    std::lock_guard<std::mutex> lk(verdict_mu);
    if (closed) return false;
    call();
    return true;
  }
};

std::chrono::milliseconds PeerWatch::period_for(double bound_s) {
  // Five beats per bound: a peer is declared silent only after about five
  // of its beats in a row went missing.
  const auto ms = static_cast<int64_t>(bound_s * 1000 / 5);
  return std::chrono::milliseconds(std::clamp<int64_t>(ms, 10, 500));
}

PeerWatch::PeerWatch(PeerWatchConfig config) : s_(std::make_shared<State>()) {
  s_->c = std::move(config);
  s_->bound_s.store(std::max(0.0, s_->c.bound_s));
  s_->running = 2;
  // Detached: a board that never answers must not hold stop() (or the
  // process) for its own timeout. Each thread keeps the state alive.
  std::shared_ptr<State> s = s_;
  named_thread("hostbeat", [s] { s->beat_loop(); }).detach();
  named_thread("judge", [s] { s->judge_loop(); }).detach();
}

PeerWatch::~PeerWatch() { stop(false); }

double PeerWatch::bound() const { return s_->bound_s.load(); }

void PeerWatch::set_bound(double seconds) {
  s_->bound_s.store(std::max(0.0, seconds));
}

void PeerWatch::mark_failed() {
  if (s_->failed.exchange(true)) return;
  try {
    // Not over a peer's verdict: a rank declared silent (frozen, then woke)
    // is gone for good to its peers, which an abort's mark would overwrite.
    // Checked on the board itself, not by the reason of the abort: the rank
    // may abort for another reason before its judge read the verdict. (A
    // verdict written between this read and the mark is lost: the peer that
    // wrote it declared this rank already, and the others now read an abort.)
    const std::vector<int64_t> own = s_->c.board->read({s_->c.rank});
    if (!own.empty() && BeatBoard::silenced(own[0])) return;
    s_->c.board->mark(s_->c.rank, BeatBoard::kFailed);
  } catch (const std::exception&) {
    // Peers then learn of it as before: from their own waits.
  }
}

void PeerWatch::stop(bool leave) {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    if (s_->stop) return;
    s_->stop = true;
  }
  s_->cv.notify_all();
  race_window("peer watch: stop");
  {
    std::lock_guard<std::mutex> lk(s_->verdict_mu);
    s_->closed = true;
  }
  bool finished;
  {
    std::unique_lock<std::mutex> lk(s_->mu);
    finished = s_->cv.wait_for(lk, std::chrono::seconds(1), [this] { return s_->running == 0; });
  }
  // Only a board that answered the threads is worth a last write: one that
  // does not would hold this call for its own timeout.
  // A rank that aborted stays marked failed: its peers may not have read it
  // yet, and a left rank is one they stop judging.
  if (leave && finished && !s_->failed.load()) {
    try {
      s_->c.board->mark(s_->c.rank, BeatBoard::kLeft);
    } catch (const std::exception&) {
    }
  }
}

}  // namespace pycomm
