// The shared-memory transport (see shm.h): the segment and its liveness
// records, the futex-backed flags and call headers, and the plan executor.
// About 500 lines: the segment layout, the waits and the executor share
// private state; the plans are built in algorithms/plan.cpp.
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "../core/race_window.h"
#include "../kernels/kernels.h"
#include "thread_name.h"
#include "futex.h"
#include "layout.h"
#include "process.h"
#include "shm_file.h"
#include "shm_segment.h"

namespace pycomm {

namespace {

uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // one clock for every process of the host
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// PYCOMM_SHM_STORES: auto (default), cached or streaming.
StoreTuner::Policy store_policy() {
  const char* env = std::getenv("PYCOMM_SHM_STORES");
  const std::string v = env ? env : "auto";
  if (v == "auto" || v.empty()) return StoreTuner::Policy::kAuto;
  if (v == "cached") return StoreTuner::Policy::kCached;
  if (v == "streaming") return StoreTuner::Policy::kStreaming;
  throw CommError("pycomm: PYCOMM_SHM_STORES must be auto, cached or streaming, not '" + v + "'");
}

int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
}

}  // namespace

ShmTransport::ShmTransport(const ShmConfig& config)
    : name_(config.name),
      rank_(config.rank),
      world_(config.world),
      round_bytes_(config.round_bytes),
      timeout_s_(config.timeout_s),
      names_(config.global_ranks),
      plans_(config.rank),
      stores_(store_policy()),
      token_(config.token) {
  if (world_ < 1 || rank_ < 0 || rank_ >= world_)
    throw CommError("pycomm: invalid shared-memory rank " + std::to_string(rank_) + " of " + std::to_string(world_));
  if (round_bytes_ < 64 * 1024 || round_bytes_ % kPage != 0)
    throw CommError("pycomm: shared-memory round size must be a multiple of 4096 and at least 64 KiB");
  if (name_.empty() || name_[0] != '/' || name_.find('/', 1) != std::string::npos)
    throw CommError("pycomm: invalid shared-memory segment name '" + name_ + "'");
  if (!names_.empty() && static_cast<int>(names_.size()) != world_)
    throw CommError("pycomm: shared-memory transport given names for the wrong number of ranks");
  map_segment(config);

  // While every rank has its own core, spinning costs nothing and waking a
  // sleeping rank costs a lot (on a VM, waking an idle vCPU takes ~100 us):
  // spin for longer than a typical step, so that two busy ranks never fall
  // into a sleep/wake ping-pong. With more ranks than cores a spinning rank
  // steals the core its peer needs, so there it spins only briefly, then
  // yields a few times (the peer it waits for is usually runnable on the
  // same core, and a yield hands it the core without a futex round trip:
  // 4 ranks on 2 cores, 1 KiB one-shot, ~40-110 us instead of ~200-290 us),
  // then sleeps, so that a long wait leaves the core to the peer entirely.
  const bool oversubscribed = world_ > usable_cpus();
  long spin_us = oversubscribed ? 2 : 1000;
  if (const char* env = std::getenv("PYCOMM_SPIN_US")) spin_us = std::max(0L, std::atol(env));
  spin_ = std::chrono::microseconds(spin_us);
  yield_iters_ = oversubscribed ? 8 : 2;
  heartbeat_s_.store(heartbeat_setting());
  // PYCOMM_HEARTBEAT_S=0: no thread, and a heartbeat of 0, which peers never
  // judge (whatever their own bound).
  if (heartbeat_timeout() > 0) {
    controls_[rank_].heartbeat_ns.store(monotonic_ns(), std::memory_order_release);
    heartbeat_ = named_thread("beat", [this] { heartbeat_loop(); });
  }
}

void ShmTransport::heartbeat_loop() {
  std::unique_lock<std::mutex> lk(heartbeat_mu_);
  while (!heartbeat_cv_.wait_for(lk, kHeartbeatPeriod, [this] { return heartbeat_stop_; }))
    controls_[rank_].heartbeat_ns.store(monotonic_ns(), std::memory_order_release);
}

void ShmTransport::map_segment(const ShmConfig& config) {
  const size_t header_bytes = align_up(sizeof(SegmentHeader), kPage);
  const size_t control_bytes = align_up(sizeof(RankControl) * world_, kPage);
  mailbox_stride_ = 2 * kNumPhases * round_bytes_;
  size_ = header_bytes + control_bytes + mailbox_stride_ * world_;

  int fd;
  if (config.create) {
    // O_EXCL: never adopt a segment somebody else made; 0600: only our uid.
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
      throw CommError("pycomm: cannot create shared memory segment " + name_ + ": " + std::strerror(errno) +
                      " (is /dev/shm mounted and writable? PYCOMM_TRANSPORT=pg sends through the process group "
                      "instead)");
    const std::string why = size_shm_file(fd, size_, "shared memory segment " + name_);
    if (!why.empty()) {
      close(fd);
      shm_unlink(name_.c_str());
      throw CommError("pycomm: " + why);
    }
  } else {
    fd = shm_open(name_.c_str(), O_RDWR, 0);
    if (fd < 0)
      throw CommError("pycomm: cannot open shared memory segment " + name_ + ": " + std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != size_) {
      close(fd);
      throw CommError("pycomm: shared memory segment " + name_ +
                      " has the wrong size: ranks disagree on world size or round size");
    }
  }
  // MAP_POPULATE faults every page in now rather than inside the first
  // timed collectives.
  base_ = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int map_err = errno;
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (config.create) shm_unlink(name_.c_str());
    throw CommError("pycomm: cannot map shared memory segment " + name_ + ": " + std::strerror(map_err));
  }
  header_ = static_cast<SegmentHeader*>(base_);
  controls_ = reinterpret_cast<RankControl*>(static_cast<char*>(base_) + header_bytes);
  mailboxes_ = static_cast<char*>(base_) + header_bytes + control_bytes;

  if (config.token.size() >= sizeof(header_->token)) throw CommError("pycomm: segment token too long");
  if (config.create) {
    header_->version = kLayoutVersion;
    header_->world = static_cast<uint32_t>(world_);
    header_->round_bytes = round_bytes_;
    header_->total_size = size_;
    std::memcpy(header_->token, config.token.data(), config.token.size());
    // The magic goes last: an attacher that sees it sees a complete header.
    __atomic_store_n(&header_->magic, kMagic, __ATOMIC_RELEASE);
  } else {
    const bool ok = __atomic_load_n(&header_->magic, __ATOMIC_ACQUIRE) == kMagic &&
                    header_->version == kLayoutVersion && header_->world == static_cast<uint32_t>(world_) &&
                    header_->round_bytes == round_bytes_ && header_->total_size == size_ &&
                    std::strncmp(header_->token, config.token.c_str(), sizeof(header_->token)) == 0;
    if (!ok) {
      munmap(base_, size_);
      base_ = nullptr;
      throw CommError("pycomm: shared memory segment " + name_ +
                      " does not belong to this job (stale or foreign segment); refusing to attach");
    }
  }

  RankControl& me = controls_[rank_];
  const ProcessId self = this_process();
  me.starttime = self.starttime;
  me.pidns = self.pidns;
  me.exited.store(0);
  me.pid.store(self.pid, std::memory_order_release);
  // The last rank to map the segment removes its name: from then on it lives
  // only as long as some rank maps it, and a kill -9 leaves nothing behind.
  if (header_->attached.fetch_add(1) + 1 == static_cast<uint32_t>(world_)) {
    shm_unlink(name_.c_str());
    futex_wake_all(&header_->attached);
  }
}

void ShmTransport::wait_all_attached() {
  // Nobody returns from construction before everybody has mapped the
  // segment: otherwise a fast rank could finish (or fail) and leave while a
  // slow one still needs the name to attach.
  const double timeout_s = timeout();
  if (wait_all_attached_for(timeout_s)) return;
  const uint32_t v = abandon_attach();
  throw CommError("pycomm: only " + std::to_string(v) + " of " + std::to_string(world_) +
                  " local ranks joined the shared memory segment within " + std::to_string(timeout_s) +
                  " s (did every rank create the communicator?)");
}

bool ShmTransport::wait_all_attached_for(double seconds) {
  const auto deadline = deadline_after(seconds);
  while (true) {
    const uint32_t v = header_->attached.load(std::memory_order_acquire);
    if (v >= static_cast<uint32_t>(world_)) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    timespec ts{0, kFutexSleepNs};
    futex_op(&header_->attached, FUTEX_WAIT, v, &ts);
  }
}

uint32_t ShmTransport::abandon_attach() {
  shm_unlink(name_.c_str());
  return header_->attached.load(std::memory_order_acquire);
}

void ShmTransport::stop_heartbeat() {
  std::lock_guard<std::mutex> once(heartbeat_join_mu_);
  if (!heartbeat_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  heartbeat_.join();
}

ShmTransport::~ShmTransport() {
  stop_heartbeat();
  if (!base_) return;
  shutdown();
  race_window("shm: before unmapping");
  munmap(base_, size_);
}

void ShmTransport::shutdown() {
  if (!base_) return;
  RankControl& me = controls_[rank_];
  if (me.exited.exchange(1) == 0) {
    for (int q = 0; q < world_; ++q) {
      futex_wake_all(&controls_[q].step_flag);
      futex_wake_all(&controls_[q].round_done);
    }
  }
  // Peers that see `exited` no longer read the heartbeat: a closed
  // communicator keeps no thread.
  stop_heartbeat();
}

bool ShmTransport::aborted() const {
  return header_->abort_state.load(std::memory_order_acquire) == 2;
}

CommError ShmTransport::abort_error() const {
  if (!aborted()) return CommError("");
  Blame blame;
  blame.kind = static_cast<FailureKind>(header_->abort_kind);
  blame.rank = header_->abort_rank;
  return CommError(std::string(header_->abort_msg, strnlen(header_->abort_msg, sizeof(header_->abort_msg))), blame);
}

void ShmTransport::abort(const std::string& why, Blame blame) {
  uint32_t expected = 0;
  if (header_->abort_state.compare_exchange_strong(expected, 1)) {
    race_window("shm abort: message half written");
    const size_t n = std::min(why.size(), sizeof(header_->abort_msg) - 1);
    std::memcpy(header_->abort_msg, why.data(), n);
    header_->abort_msg[n] = '\0';
    header_->abort_rank = blame.rank;
    header_->abort_kind = static_cast<uint8_t>(blame.kind);
    header_->abort_state.store(2, std::memory_order_release);
  }
  // Sleepers re-check abort within kFutexSleepNs anyway; waking them makes
  // every rank fail together.
  for (int q = 0; q < world_; ++q) {
    futex_wake_all(&controls_[q].step_flag);
    futex_wake_all(&controls_[q].round_done);
    for (auto& slot : controls_[q].headers) futex_wake_all(&slot.op);
  }
}

void ShmTransport::check_abort() const {
  if (aborted()) throw abort_error();
}

void ShmTransport::fail(const std::string& why, Blame blame) {
  abort(why, blame);
  // If another rank aborted first, report the original cause. It may still
  // be writing it (state 1, between its compare-exchange and its release
  // store): wait for it, but not for a rank that died in between, whose
  // cause never comes; then this rank's own reason is the best there is.
  const auto give_up = std::chrono::steady_clock::now() + kAbortWriteWait;
  while (!aborted() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  if (!aborted()) throw CommError(why, blame);
  throw abort_error();
}

std::vector<int> ShmTransport::gone_ranks() {
  std::vector<int> out;
  const OpContext ctx{};
  for (int q = 0; q < world_; ++q) {
    Blame blame;
    // A peer that shut down may live on (it may be shrinking this
    // communicator too): only the dead and the frozen are gone.
    if (q != rank_ && !peer_gone(q, ctx, &blame).empty() && blame.gone())
      out.push_back(name(q));
  }
  return out;
}

// Why `q` will never post again ("" while it is alive or not yet attached).
std::string ShmTransport::peer_gone(int q, const OpContext& ctx, Blame* blame) {
  RankControl& pc = controls_[q];
  const int pid = pc.pid.load(std::memory_order_acquire);
  if (pid == 0) return "";  // not attached yet: only the timeout applies
  std::ostringstream os;
  if (pc.exited.load()) {
    os << "pycomm: rank " << name(q) << " shut down its communicator while rank " << name(rank_) << " was in "
       << collective_name(ctx.coll) << " #" << ctx.seq;
    *blame = {FailureKind::kShutDown, name(q)};
    return os.str();
  }
  // (Its pid means something only in our pid namespace: process_gone says
  // false for another's.)
  ProcessId peer;
  peer.pid = pid;
  peer.starttime = pc.starttime;
  peer.pidns = pc.pidns;
  if (process_gone(peer)) {
    // "Connection closed by peer" is Gloo's phrase for a lost peer, which
    // users' error handling matches on; the rest says which and where.
    os << "pycomm: rank " << name(q) << " (pid " << pid << ") died; detected by rank " << name(rank_)
       << " during " << collective_name(ctx.coll) << " #" << ctx.seq << " (Connection closed by peer)";
    *blame = {FailureKind::kDied, name(q)};
    return os.str();
  }
  // Alive but frozen (or, in another pid namespace, perhaps dead): its
  // heartbeat thread stopped beating too.
  const double heartbeat_s = heartbeat_timeout();
  const uint64_t last = pc.heartbeat_ns.load(std::memory_order_acquire);
  const uint64_t now = monotonic_ns();
  if (heartbeat_s > 0 && last != 0 && now > last && static_cast<double>(now - last) > heartbeat_s * 1e9) {
    os << "pycomm: rank " << name(q) << " (pid " << pid << ") stopped responding: no heartbeat for "
       << static_cast<double>(now - last) / 1e9 << " s (stopped, frozen, or its machine stalled; the bound is "
       << heartbeat_s << " s); detected by rank " << name(rank_) << " during " << collective_name(ctx.coll)
       << " #" << ctx.seq;
    *blame = {FailureKind::kSilent, name(q)};
    return os.str();
  }
  return "";
}

template <typename Reached>
void ShmTransport::wait_on(std::atomic<uint32_t>* word, int peer, const OpContext& ctx, const char* what,
                           Reached is_reached) {
  RankControl& pc = controls_[peer];
  wait_until(
      word, &pc.waiters, peer, ctx, spin_, &next_liveness_check_,
      [&] { return is_reached(word->load(std::memory_order_acquire)); },
      [&] {
        const HeaderSlot* last = &pc.headers[0];
        for (const auto& slot : pc.headers)
          if (slot.call.op > last->call.op) last = &slot;
        std::ostringstream os;
        os << "pycomm: " << collective_name(ctx.coll) << " #" << ctx.seq << " on rank " << name(rank_) << ": "
           << timed_out_waiting(ctx.timeout_s) << " for rank " << name(peer) << " (" << what << "); rank "
           << name(peer) << " last entered collective #" << last->call.seq;
        return os.str();
      });
}

void ShmTransport::post_step(uint64_t step) {
  RankControl& me = controls_[rank_];
  me.step_flag.store(static_cast<uint32_t>(step + 1), std::memory_order_seq_cst);
  if (me.waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&me.step_flag);
}

void ShmTransport::post_round_done(uint64_t round) {
  RankControl& me = controls_[rank_];
  me.round_done.store(static_cast<uint32_t>(round + 1), std::memory_order_seq_cst);
  if (me.waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&me.round_done);
}

void ShmTransport::wait_step(int peer, uint64_t step, const OpContext& ctx, const char* what) {
  const uint32_t target = static_cast<uint32_t>(step + 1);
  wait_on(&controls_[peer].step_flag, peer, ctx, what, [target](uint32_t v) { return reached(v, target); });
}

void ShmTransport::wait_round_free(uint64_t round, const OpContext& ctx) {
  // Round `round` reuses the half of round-2: every peer must have finished
  // reading it, i.e. completed round-2 (round_done >= round-1).
  if (round < 2) return;
  const uint32_t target = static_cast<uint32_t>(round - 1);
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    wait_on(&controls_[q].round_done, q, ctx, "it to finish reading the previous round",
            [target](uint32_t v) { return reached(v, target); });
  }
}

void ShmTransport::publish_header(const CollectiveDesc& d, uint64_t seq, uint64_t op,
                                  const RegisteredCall& reg) {
  RankControl& me = controls_[rank_];
  HeaderSlot& h = me.headers[op % kHeaderSlots];
  h.call = CallHeader::of(d, seq, op);
  me.registered[op % kHeaderSlots] = reg;
  h.op.store(static_cast<uint32_t>(op), std::memory_order_seq_cst);
  if (me.waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&h.op);
}

void ShmTransport::check_header(int peer, uint64_t seq, const OpContext& ctx) {
  HeaderSlot& h = controls_[peer].headers[ctx.op % kHeaderSlots];
  const uint32_t target = static_cast<uint32_t>(ctx.op);
  wait_on(&h.op, peer, ctx, "it to enter this collective", [target](uint32_t v) { return reached(v, target); });
  const CallHeader& mine = controls_[rank_].headers[ctx.op % kHeaderSlots].call;
  if (h.call.same(mine)) return;
  std::ostringstream os;
  os << "pycomm: ranks disagree on collective #" << seq << ": rank " << name(rank_) << " called "
     << describe_call(mine.desc()) << " but rank " << name(peer) << " called " << describe_call(h.call.desc());
  if (h.call.seq != mine.seq) os << " (as its collective #" << h.call.seq << ")";
  fail(os.str(), mismatch_blame(mine, name(rank_), h.call, name(peer)));
}

char* ShmTransport::mailbox(int rank, uint64_t round, int phase) const {
  return mailboxes_ + rank * mailbox_stride_ + (round % 2) * kNumPhases * round_bytes_ + phase * round_bytes_;
}

void ShmTransport::run(const CollectiveDesc& desc, uint64_t seq) {
  check_abort();
  OpContext ctx;
  ctx.coll = desc.coll;
  ctx.seq = seq;
  ctx.op = ++ops_;  // from 1: a slot never written reads as op 0
  ctx.timeout_s = desc.timeout_s > 0 ? desc.timeout_s : timeout();
  ctx.deadline = deadline_after(ctx.timeout_s);
  std::vector<std::shared_ptr<ShmAllocation>> keep;
  const RegisteredCall reg = desc.check_only ? RegisteredCall{} : registration(desc, &keep);
  publish_header(desc, seq, ctx.op, reg);
  std::vector<bool> checked(world_, false);
  checked[rank_] = true;
  if (!desc.check_only && !run_registered(desc, ctx, checked, seq, reg, keep)) execute(desc, ctx, checked, seq);
  // Every peer must have entered the same collective before anybody returns:
  // a mismatch therefore fails on every rank, and no rank runs ahead of the
  // header slots.
  for (int q = 0; q < world_; ++q)
    if (!checked[q]) check_header(q, seq, ctx);
}

void ShmTransport::execute(const CollectiveDesc& d, const OpContext& ctx, std::vector<bool>& checked,
                           uint64_t seq) {
  if (d.count == 0 || d.coll == Collective::kBarrier || d.coll == Collective::kInvalid) return;
  const size_t es = dtype_size(d.dtype);
  const bool a2a = d.coll == Collective::kAllToAll;
  auto* out = static_cast<char*>(d.output);

  if (world_ == 1) {
    const RoundLayout layout(d, 1, 1, round_bytes_);
    kernels::copy_cpu(out, nullptr, d.input, layout.out_count * es);
  } else {
    const Schedule schedule{d.algo, d.coll, world_, d.root};
    const Plan& plan = plans_.get(schedule);
    const RoundLayout layout(d, plan.num_chunks, world_, round_bytes_);
    const size_t chunk_max = layout.chunk_max;
    const uint64_t rounds = layout.rounds;
    const uint64_t steps = plan.steps.size();

    std::vector<const char*> chunk_in;
    std::vector<char*> chunk_out;
    std::vector<size_t> chunk_len;
    std::vector<const void*> srcs;
    // How this call writes the mailboxes, timed for the tuner (store_tuner.h).
    const size_t call_bytes = (layout.sharded ? d.count * world_ : layout.out_count) * es;
    const StoreMode stores = stores_.choose(call_bytes);
    const bool streaming = stores == StoreMode::kStreaming;
    // The call's time less its first wait for a peer: what the writes and
    // reads cost in this mode, not how late a peer came. (Timing only from
    // that wait on missed the mailbox writes before it, which are what the
    // store mode changes most in a one-shot call.)
    using Clock = std::chrono::steady_clock;
    const Clock::time_point began = Clock::now();
    Clock::time_point waiting{}, arrived{};  // the first wait on a peer: began, returned
    for (uint64_t j = 0; j < rounds; ++j) {
      const uint64_t R = round_base_ + j;
      // 1. Lay out this round's chunks in the caller's buffers.
      layout.chunks(j, rank_, d.input, d.output, chunk_in, chunk_out, chunk_len);
      auto where = [&](Loc l, int c) -> const char* {
        switch (l) {
          case Loc::kInput: return chunk_in[c];
          case Loc::kOutput: return chunk_out[c];
          case Loc::kStaged0: return mailbox(rank_, R, 0) + c * chunk_max * es;
          case Loc::kStaged1: return mailbox(rank_, R, 1) + c * chunk_max * es;
          default: return nullptr;
        }
      };
      // 2. Make sure no peer still reads the mailbox half we are about to fill.
      wait_round_free(R, ctx);
      // 3. Run the schedule's steps.
      for (uint64_t t = 0; t < steps; ++t) {
        const PlanStep& step = plan.steps[t];
        const uint64_t g = step_base_ + t;
        for (const PlanSend& s : step.sends) {
          if (s.from == Loc::kNone) continue;
          char* slot = mailbox(rank_, R, s.phase) + s.chunk * chunk_max * es;
          if (streaming)
            kernels::copy_cpu_streaming(slot, where(s.from, s.chunk), chunk_len[s.chunk] * es);
          else
            kernels::copy_cpu(slot, nullptr, where(s.from, s.chunk), chunk_len[s.chunk] * es);
        }
        if (!step.sends.empty()) post_step(g);
        for (const PlanGroup& grp : step.groups) {
          const int c = grp.chunk;
          srcs.clear();
          for (const PlanSrc& src : grp.srcs) {
            if (src.peer == rank_) {
              srcs.push_back(where(src.self_loc, c));
              continue;
            }
            const bool first_wait = arrived.time_since_epoch().count() == 0;
            if (first_wait) waiting = Clock::now();
            wait_step(src.peer, step_base_ + src.sent_step, ctx);
            if (first_wait) arrived = Clock::now();
            if (!checked[src.peer]) {
              // Never read a peer's data before knowing it runs the same op.
              check_header(src.peer, seq, ctx);
              checked[src.peer] = true;
            }
            // All-to-all: the peer filled one slot per reader, ours is ours.
            srcs.push_back(mailbox(src.peer, R, src.phase) + (a2a ? rank_ : c) * chunk_max * es);
          }
          char* fwd = grp.fwd_phase >= 0 ? mailbox(rank_, R, grp.fwd_phase) + c * chunk_max * es : nullptr;
          const int nsrc = static_cast<int>(srcs.size());
          if (streaming && fwd) {
            // What peers read goes out with streaming stores; the output, read
            // by the caller, through the cache.
            kernels::reduce_cpu_streaming(d.dtype, d.op, grp.to_output ? chunk_out[c] : nullptr, fwd, srcs.data(),
                                          nsrc, chunk_len[c]);
          } else {
            char* dst0 = grp.to_output ? chunk_out[c] : fwd;
            char* dst1 = grp.to_output ? fwd : nullptr;
            kernels::reduce_cpu(d.dtype, d.op, dst0, dst1, srcs.data(), nsrc, chunk_len[c]);
          }
        }
      }
      for (int c : plan.final_copies) kernels::copy_cpu(chunk_out[c], nullptr, chunk_in[c], chunk_len[c] * es);
      // 4. Let peers reuse this half once everybody is done with it.
      post_round_done(R);
      step_base_ += steps;
    }
    round_base_ += rounds;
    if (arrived.time_since_epoch().count() != 0)
      stores_.record(call_bytes, stores,
                     std::chrono::duration<double>((Clock::now() - began) - (arrived - waiting)).count());
  }
  finish_average(d, world_);
}

}  // namespace pycomm
