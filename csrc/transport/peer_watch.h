// Heartbeats between hosts: declaring a peer on another host failed when it
// is alive but frozen (SIGSTOP, a stalled host), within a bound of seconds
// instead of the collective timeout.
//
// Inside a host the shared-memory transport watches its peers' heartbeats
// in the segment (shm.h). Between hosts there is no shared memory, and
// pycomm opens no sockets of its own, so every rank adds one to a counter
// of its own on a board every rank can read (the bootstrap store), from a
// thread that does nothing else: a rank that computes for long keeps
// beating. A second thread reads its peers' counters; a peer whose counter
// stopped moving for longer than the bound is declared silent, once.
//
// Never a false verdict from our own trouble: the judge holds back (and
// starts every peer's clock again) while its own beats are not landing on
// the board, while the board answers slower than a beat period, and after
// its own thread was held up (this process frozen, then continued). A peer
// is judged only once it beat at least once, and never after it left (its
// communicator closed) or opted out (PYCOMM_HEARTBEAT_S=0 at its start).
//
// A rank that aborts marks its own counter failed: its peers' judges pass
// that on at their next read, so that ranks of other hosts stop waiting for
// it (a collective there would wait for the whole timeout otherwise).
//
// A verdict is written on the board (the peer's counter marked silenced):
// every other watcher then declares the same peer at once, and the peer
// itself, if it was only frozen and wakes up, reads that it was declared
// and learns that it is out (it may never take part again), instead of
// waiting for peers that already went on without it.
// This file is torch-free: the torch layer implements the board over a
// c10d Store.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace pycomm {

// The bound a rank starts with: PYCOMM_HEARTBEAT_S, else 5 s (0: no
// heartbeats at all). Shared by the shared-memory transport and PeerWatch.
double heartbeat_setting();
constexpr double kDefaultHeartbeatS = 5.0;

// Where ranks beat. The beat thread calls beat(), the judge read() and
// mark() (as does stop(), once the judge finished), so an implementation
// may give each thread its own connection; all may block (a slow board) and
// throw (one that cannot be reached).
class BeatBoard {
 public:
  // Counter values that beats never produce (beats count up from 1; 0 means
  // the rank has not beaten yet).
  static constexpr int64_t kLeft = -1;      // the rank closed its communicator
  static constexpr int64_t kOptedOut = -2;  // the rank neither beats nor judges
  // A peer declared the rank silent. Far below the other marks, so that the
  // beats a frozen rank still adds once it wakes keep it below kSilencedBelow.
  static constexpr int64_t kSilenced = -(int64_t{1} << 40);
  static constexpr int64_t kSilencedBelow = -(int64_t{1} << 39);
  // The rank aborted (its reason is on the failure board, blame.h). Further
  // below still, for the same reason: its beat thread goes on adding.
  static constexpr int64_t kFailed = -(int64_t{1} << 50);
  static constexpr int64_t kFailedBelow = -(int64_t{1} << 49);
  static constexpr bool failed(int64_t v) { return v < kFailedBelow; }
  static constexpr bool silenced(int64_t v) { return v >= kFailedBelow && v < kSilencedBelow; }

  virtual ~BeatBoard() = default;
  // Adds one to `rank`'s counter.
  virtual void beat(int rank) = 0;
  // Sets `rank`'s counter to kLeft, kOptedOut, kSilenced or kFailed.
  virtual void mark(int rank, int64_t mark) = 0;
  // The counters of `ranks`, in that order (0 for a rank that never beat).
  virtual std::vector<int64_t> read(const std::vector<int>& ranks) = 0;
};

struct PeerWatchConfig {
  std::shared_ptr<BeatBoard> board;
  int rank = 0;
  std::vector<int> peers;  // the ranks this one judges
  double bound_s = kDefaultHeartbeatS;
  // Called once per silent peer, on the judge's thread, with how long its
  // counter stood still (0: another rank declared it) and the bound; once
  // with this rank's own number when a peer declared this rank silent.
  // Never called once stop() returned.
  std::function<void(int peer, double silent_s, double bound_s)> on_silent;
  // Called once per peer that marked itself failed (mark_failed), on the
  // judge's thread, also while the bound is 0. Never once stop() returned.
  std::function<void(int peer)> on_failed;
};

class PeerWatch {
 public:
  // Starts beating and judging.
  explicit PeerWatch(PeerWatchConfig config);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // Seconds a peer's counter may stand still; 0 judges nobody (this rank
  // still beats). Safe from any thread; the beat period follows it.
  double bound() const;
  void set_bound(double seconds);
  // Tells the peers' judges that this rank aborted (they read why on the
  // failure board): within a beat period they stop waiting for it, as the
  // ranks of its host do at once. Blocks like one write to the board (on the
  // caller's thread); throws nothing. stop() then leaves the mark in place.
  // Marks nothing when a peer declared this rank silent: that verdict stays.
  void mark_failed();
  // Stops both threads (waiting at most about a second for a board that
  // does not answer; the threads then finish on their own and call nobody)
  // and, with `leave`, marks this rank as left so that peers stop judging
  // it. Idempotent.
  void stop(bool leave);

  // A beat period for `bound_s`: several beats per bound, so one late beat
  // is no verdict, but no faster than 100 per second.
  static std::chrono::milliseconds period_for(double bound_s);

 private:
  struct State;
  std::shared_ptr<State> s_;
};

}  // namespace pycomm
