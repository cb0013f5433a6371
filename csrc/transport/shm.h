// Shared-memory transport: the ranks of one host exchange data through one
// segment, synchronised by counters that live in it.
//
// Segment layout (every part page aligned):
//   SegmentHeader                       magic, token, sizes, abort state
//   RankControl[world]                  per-rank flags, liveness, headers
//   Mailbox[world]                      per rank: 2 halves x 2 phases x round_bytes
//
// A rank only ever writes its own control block and mailbox; peers read them.
// Rounds alternate between the two mailbox halves, so a rank can fill round
// R+1 while slow peers still read round R; before reusing a half it waits
// until every peer has finished the round that last used it.
//
// Registered memory (allocate, comm.empty) lives in segments of its own, one
// per allocation; collectives whose buffers lie there run in place without
// the mailboxes (protocol in shm_registered.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <thread>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <sched.h>

#include "../algorithms/plan.h"
#include "../core/collective.h"
#include "futex.h"
#include "peer_watch.h"
#include "store_tuner.h"
#include "transport.h"

namespace pycomm {

struct ShmConfig {
  std::string name;        // e.g. "/pycomm.<token>.<host>"; must start with '/'
  std::string token;       // random per job; checked on attach
  bool create = false;     // the host's first rank creates, the others attach
  int rank = 0;            // rank within this host's segment
  int world = 1;           // ranks sharing the segment
  size_t round_bytes = 0;  // bytes of one phase region of one mailbox half
  double timeout_s = 300;
  // The communicator's rank of each local rank, for messages (empty: same).
  std::vector<int> global_ranks;
};

struct SegmentHeader;
struct RankControl;

// Registered (symmetric) memory: one shared-memory segment per
// ShmTransport::allocate call, holding one equal region per local rank and
// mapped by every local rank, so that a collective on tensors inside it can
// read peers' data where it lies instead of staging it in the mailboxes.
// Its name is unlinked before allocate returns; the mapping lives as long as
// the last shared_ptr (the tensors' storage holds one), so memory a peer may
// still read is never unmapped under it.
class ShmAllocation {
 public:
  ~ShmAllocation();
  ShmAllocation(const ShmAllocation&) = delete;
  ShmAllocation& operator=(const ShmAllocation&) = delete;

  uint64_t id() const { return id_; }
  // The segment name of the transport that made it: allocations of another
  // communicator are refused by name.
  const std::string& owner() const { return owner_; }
  char* region(int local_rank) const { return regions_ + static_cast<size_t>(local_rank) * region_bytes_; }
  size_t region_bytes() const { return region_bytes_; }
  int rank() const { return rank_; }

 private:
  friend class ShmTransport;
  ShmAllocation() = default;
  uint64_t id_ = 0;
  std::string owner_;
  void* base_ = nullptr;
  size_t size_ = 0;
  char* regions_ = nullptr;
  size_t region_bytes_ = 0;
  int rank_ = 0;
};

// Where a call's buffers lie in registered memory: allocation id (0: not
// registered) and byte offset in the owner's region. Published beside the
// call header so that peers can find them.
struct RegisteredCall {
  uint64_t in_id = 0, in_off = 0, out_id = 0, out_off = 0;
};

// What a rank was doing, for error messages.
struct OpContext {
  Collective coll = Collective::kBarrier;
  uint64_t seq = 0;  // the communicator's number of the user call
  uint64_t op = 0;   // this transport's operation counter
  std::chrono::steady_clock::time_point deadline;
  double timeout_s = 0;  // what `deadline` was set from, for the messages
};

class ShmTransport : public Transport {
 public:
  explicit ShmTransport(const ShmConfig& config);
  ~ShmTransport() override;
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Blocks until every local rank has mapped the segment (bounded by the
  // timeout). Call once, after telling the other ranks the segment exists:
  // a rank that returned earlier could finish, or fail, and leave while a
  // slow one still needs the segment's name to attach.
  void wait_all_attached();
  // The same in slices, so that the caller can watch for a peer that died
  // before it attached: true once every local rank has mapped the segment,
  // false after `seconds`.
  bool wait_all_attached_for(double seconds);
  // Gives the bootstrap up: unlinks the segment's name (nobody may attach to
  // a job that failed to start); returns how many local ranks had attached.
  uint32_t abandon_attach();

  // Runs one collective of user call `seq` (see Transport). Throws CommError.
  void run(const CollectiveDesc& desc, uint64_t seq) override;

  // Registered memory: `bytes` in every local rank's region of a new
  // segment (comm.empty). Collective over the local ranks, as operation(s)
  // of user call `seq`; every rank must ask for the same size. A failure
  // (no space in /dev/shm) raises CommError on every rank and leaves the
  // transport usable.
  std::shared_ptr<ShmAllocation> allocate(size_t bytes, uint64_t seq);

  // Tells peers this rank is leaving: their waits on it fail fast instead of
  // timing out.
  void shutdown();
  // Makes every rank's current and future operations fail with `why`.
  void abort(const std::string& why, Blame blame = {}) override;

  // Aborts (as above) and throws the first abort's error (this one's if the
  // first aborting rank never finishes writing its own: it died meanwhile).
  [[noreturn]] void fail(const std::string& why, Blame blame = {});
  // How long fail() waits for a concurrent abort's message.
  static constexpr std::chrono::milliseconds kAbortWriteWait{200};

  bool aborted() const;
  // The communicator's ranks of the local peers that will never post
  // again: their process is gone, or their heartbeat stopped (a peer that
  // shut down is not among them). Safe from any thread.
  std::vector<int> gone_ranks();
  // The first abort's message and blame (an empty message while healthy).
  CommError abort_error() const;
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  size_t round_bytes() const { return round_bytes_; }
  // Calls that ran in place on registered memory (any thread may read it).
  uint64_t in_place_calls() const { return in_place_calls_.load(std::memory_order_relaxed); }
  // How this rank writes its mailboxes (store_tuner.h): the choice for a
  // call of `bytes`, and how often the tuner changed it. Executor thread.
  StoreMode store_mode(size_t bytes) const { return stores_.mode(bytes); }
  uint64_t store_switches() const { return stores_.switches(); }
  // Unique per communicator and job (it carries the job's random token).
  const std::string& segment_name() const { return name_; }
  // Atomic: the caller's thread may change it while the progress thread
  // and point-to-point lanes read it.
  double timeout() const { return timeout_s_.load(std::memory_order_relaxed); }
  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }
  // A peer whose heartbeat is older than this (seconds) is declared failed
  // while this rank waits for it (0: never): a rank that is alive but
  // frozen (SIGSTOP, a stalled VM) is found in seconds, not at the timeout,
  // while a rank that only computes for long keeps beating from its own
  // thread. Starts at heartbeat_setting() (peer_watch.h).
  double heartbeat_timeout() const { return heartbeat_s_.load(std::memory_order_relaxed); }
  void set_heartbeat_timeout(double seconds) { heartbeat_s_.store(seconds, std::memory_order_relaxed); }

 private:
  // Point-to-point channels share the segment's abort state, liveness
  // checks and waiting policy.
  friend class ShmChannels;
  void map_segment(const ShmConfig& config);
  void publish_header(const CollectiveDesc& desc, uint64_t seq, uint64_t op, const RegisteredCall& reg);
  int name(int local) const { return names_.empty() ? local : names_[local]; }
  void check_header(int peer, uint64_t seq, const OpContext& ctx);
  void wait_step(int peer, uint64_t step, const OpContext& ctx, const char* what = "its data");
  void wait_round_free(uint64_t round, const OpContext& ctx);
  void post_step(uint64_t step);
  void post_round_done(uint64_t round);
  template <typename Reached>
  void wait_on(std::atomic<uint32_t>* word, int peer, const OpContext& ctx, const char* what,
               Reached reached);
  // Every wait on a peer, collective or point-to-point: returns once
  // ready(); `word` is the futex word whose change signals it and `waiters`
  // the count its poster checks before waking. Spins for `spin`, then
  // yields, then sleeps in slices that re-check abort, the peer's liveness
  // (at most every kLivenessPeriod, tracked in *next_liveness) and
  // ctx.deadline, where it fails with timeout_message(), blaming `peer`.
  template <typename Ready, typename TimeoutMessage>
  void wait_until(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters, int peer, const OpContext& ctx,
                  std::chrono::steady_clock::duration spin, std::chrono::steady_clock::time_point* next_liveness,
                  Ready ready, TimeoutMessage timeout_message, int yields = -1);
  // A sleeping waiter re-checks abort, timeout and peer liveness this often
  // even if nobody wakes it.
  static constexpr long kFutexSleepNs = 5 * 1000 * 1000;
  static constexpr std::chrono::milliseconds kLivenessPeriod{50};
  void check_abort() const;
  // Why `peer` will never post again, with *blame set; "" while it lives.
  std::string peer_gone(int peer, const OpContext& ctx, Blame* blame);
  char* mailbox(int rank, uint64_t round, int phase) const;
  void execute(const CollectiveDesc& desc, const OpContext& ctx, std::vector<bool>& checked,
               uint64_t seq);
  // Registered memory (shm_registered.cpp). The allocation of this
  // transport holding [p, p + bytes) in this rank's region, with p's offset
  // there; null if none.
  std::shared_ptr<ShmAllocation> find_registered(const void* p, size_t bytes, uint64_t* offset);
  // The registered parts of a call's buffers; *keep pins their allocations.
  RegisteredCall registration(const CollectiveDesc& d, std::vector<std::shared_ptr<ShmAllocation>>* keep);
  // Runs the call in place on registered memory when every rank's buffers
  // allow it (decided from the headers, so every rank decides alike);
  // false: the caller runs the staged executor.
  bool run_registered(const CollectiveDesc& d, const OpContext& ctx, std::vector<bool>& checked, uint64_t seq,
                      const RegisteredCall& mine, const std::vector<std::shared_ptr<ShmAllocation>>& keep);
  // Waits until every peer posted step `step` (this rank posted it too).
  void wait_all_steps(uint64_t step, const OpContext& ctx, const char* what);

  std::string name_;
  int rank_ = 0;
  int world_ = 1;
  size_t round_bytes_ = 0;
  std::atomic<double> timeout_s_{300};
  std::atomic<double> heartbeat_s_{kDefaultHeartbeatS};
  // Beats every kHeartbeatPeriod into this rank's control block.
  static constexpr std::chrono::milliseconds kHeartbeatPeriod{100};
  void heartbeat_loop();
  // Ends the beats (once; any thread): shutdown() needs them no longer,
  // since peers read `exited` before the heartbeat.
  void stop_heartbeat();
  std::thread heartbeat_;
  std::mutex heartbeat_join_mu_;  // one joiner at a time
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  void* base_ = nullptr;
  size_t size_ = 0;
  SegmentHeader* header_ = nullptr;
  RankControl* controls_ = nullptr;
  char* mailboxes_ = nullptr;
  size_t mailbox_stride_ = 0;

  std::vector<int> names_;
  uint64_t ops_ = 0;         // operations run, same on every rank
  uint64_t step_base_ = 0;   // global step counter, same on every rank
  uint64_t round_base_ = 0;  // global round counter, same on every rank
  std::chrono::steady_clock::duration spin_{};
  int yield_iters_ = 0;
  std::chrono::steady_clock::time_point next_liveness_check_{};
  PlanCache plans_;
  StoreTuner stores_;
  // Registered allocations by id. Weak: the tensors own them; an id is
  // never reused, so a freed one is simply gone.
  std::mutex registered_mu_;
  std::map<uint64_t, std::weak_ptr<ShmAllocation>> registered_;
  uint64_t allocations_ = 0;  // allocate calls so far, same on every rank
  std::atomic<uint64_t> in_place_calls_{0};
  std::string token_;
};

template <typename Ready, typename TimeoutMessage>
void ShmTransport::wait_until(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters, int peer,
                              const OpContext& ctx, std::chrono::steady_clock::duration spin,
                              std::chrono::steady_clock::time_point* next_liveness, Ready ready,
                              TimeoutMessage timeout_message, int yields) {
  if (ready()) return;
  // 1. Spin, for a time rather than a count: `pause` lasts 3 to 140 cycles
  //    depending on the CPU.
  const auto spin_until = std::chrono::steady_clock::now() + spin;
  for (int i = 1;; ++i) {
    cpu_relax();
    if (ready()) return;
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
  }
  // 2. Then yield a few times (`yields`, or this transport's number), then
  //    sleep on the futex, waking at least every kFutexSleepNs to check
  //    abort, liveness and the deadline.
  if (yields < 0) yields = yield_iters_;
  for (int i = 0;; ++i) {
    check_abort();
    const auto now = std::chrono::steady_clock::now();
    if (now >= *next_liveness) {
      // Only the awaited peer matters: a peer that finished its part and
      // left needs nothing from us, and one that died while others wait on
      // it is reported by them (abort reaches us through check_abort). It
      // may also have posted just before leaving: look once more.
      Blame blame;
      const std::string gone = peer_gone(peer, ctx, &blame);
      if (!gone.empty()) {
        if (ready()) return;
        fail(gone, blame);
      }
      *next_liveness = now + kLivenessPeriod;
    }
    if (now >= ctx.deadline) fail(timeout_message(), Blame{FailureKind::kWaiting, name(peer)});
    if (i < yields) {
      sched_yield();
    } else {
      // Dekker pair with the poster: either it sees our waiter count and
      // wakes us, or we see its new value before sleeping.
      waiters->fetch_add(1, std::memory_order_seq_cst);
      const uint32_t v = word->load(std::memory_order_seq_cst);
      if (!ready()) {
        timespec ts{0, kFutexSleepNs};
        futex_op(word, FUTEX_WAIT, v, &ts);
      }
      waiters->fetch_sub(1, std::memory_order_seq_cst);
    }
    if (ready()) return;
  }
}

}  // namespace pycomm
