#include "pg_channels.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "../core/race_window.h"

namespace pycomm {

namespace {

// Reads this small go through a heap buffer the object keeps after a
// timeout: a header read into the caller's stack must never be written late.
constexpr size_t kStagedRead = 256;
// Bytes per peer that may wait for their receiver: what a shared-memory ring
// holds (4 MiB) is too little for a pipeline's step of activations, whose
// receives are all posted at the start of the step anyway.
constexpr size_t kMaxPendingBytes = size_t(256) << 20;
// How long the close of a rank that aborted waits for its sends to be taken.
// What it sent last is the abort's reason: a peer already waiting in a
// receive takes it within milliseconds; one that never receives from this
// rank again would hold the close for the whole timeout, and learns the
// reason from the failure board anyway.
constexpr double kAbortedFlushS = 2.0;

// Set while this thread writes send_unasked_failure's message (a lane
// thread writing to another peer at the same time is not affected).
thread_local bool t_unasked = false;

}  // namespace

PgChannels::PgChannels(std::shared_ptr<PeerLink> link, int rank)
    : link_(std::move(link)), rank_(rank), tag_(pg_p2p_tag()) {}

PgChannels::~PgChannels() {
  // Sends no receiver took: the backend may still read their buffers, so
  // they are left allocated rather than freed under it.
  for (auto& [peer, queue] : pending_)
    for (auto& p : queue)
      if (p.work && !p.work->done()) p.bytes.release();
}

void PgChannels::flush(double timeout_s, const std::function<bool(int)>& failed) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_) timeout_s = std::min(timeout_s, kAbortedFlushS);
  }
  std::lock_guard<std::mutex> lk(send_mu_);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (auto& [peer, queue] : pending_) {
    if (queue.empty() || ended(peer) || (failed && failed(peer))) continue;  // the destructor keeps them
    bool unasked = false;
    for (auto& p : queue) {
      if (p.unasked) {  // not waited for: the destructor keeps it
        unasked = true;
        continue;
      }
      if (std::chrono::steady_clock::now() >= deadline || !wait_transfer(*p.work, deadline).empty())
        return;  // the destructor keeps what is still pending
      p.work.reset();
    }
    if (unasked) continue;
    queue.clear();
    pending_bytes_[peer] = 0;
  }
}

void PgChannels::send_unasked_failure(int peer, const std::string& why, const OpContext& ctx) {
  t_unasked = true;
  try {
    send_failure(peer, why, ctx, /*last=*/true);
  } catch (...) {
    t_unasked = false;
    throw;
  }
  t_unasked = false;
}

void PgChannels::abort(const std::string& why, Blame blame) {
  race_window("pg channels abort");
  std::lock_guard<std::mutex> lk(mu_);
  if (!aborted_) aborted_.emplace(why, blame);
}

std::optional<CommError> PgChannels::peer_gone() {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_ && aborted_->blame().gone()) return aborted_;
  return std::nullopt;
}

void PgChannels::check_broken() {
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) throw *broken_;
}

void PgChannels::out_of_step(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!broken_) broken_.emplace(why);
  throw CommError(why);
}

CommError PgChannels::unreachable(const OpContext& ctx, int peer, const char* error) const {
  return CommError("pycomm." + std::string(collective_name(ctx.coll)) + " #" + std::to_string(ctx.seq) +
                       " on rank " + std::to_string(rank_) + ": cannot reach rank " + std::to_string(peer) +
                       " between hosts: " + error,
                   Blame{FailureKind::kWaiting, peer});
}

void PgChannels::wait(TransferPtr work, int peer, const char* what, const OpContext& ctx) {
  // As in PgTransport::wait: `work` is posted, so an abort after this check
  // wakes it, and raises at the check after the wait.
  std::optional<CommError> err = peer_gone();
  std::string error;
  if (!err) {
    error = wait_transfer(*work, ctx.deadline);
    if (error.empty()) return;
    err = peer_gone();
  }
  if (!err) {
    std::ostringstream os;
    os << "pycomm." << collective_name(ctx.coll) << " #" << ctx.seq << " on rank " << rank_;
    if (std::chrono::steady_clock::now() >= ctx.deadline)
      os << ": " << timed_out_waiting(ctx.timeout_s) << " for rank " << peer << " (" << what << " between hosts)";
    else
      os << " failed while waiting for rank " << peer << " (" << what << " between hosts): " << error
         << "; rank " << peer << " may have died or left";
    err.emplace(os.str(), Blame{FailureKind::kWaiting, peer});
  }
  // The backend may still touch the transfer's buffer.
  std::lock_guard<std::mutex> lk(mu_);
  abandoned_.push_back(std::move(work));
  // After the abort that declared a peer gone, sends still go out (see
  // abort()); any other failure leaves the channels unusable.
  if (!err->blame().gone() && !broken_) broken_ = err;
  throw *err;
}

void PgChannels::reap(int peer, size_t keep, const OpContext& ctx) {
  auto& queue = pending_[peer];
  size_t& bytes = pending_bytes_[peer];
  while (!queue.empty() && (queue.front().work->done() || bytes > keep)) {
    Pending& p = queue.front();
    if (!p.work->done()) {
      try {
        wait(p.work, peer, "sending", ctx);
      } catch (const CommError&) {
        p.bytes.release();  // the backend may still read it
        queue.pop_front();
        throw;
      }
    }
    bytes -= p.n;
    queue.pop_front();
  }
}

void PgChannels::write(int peer, const void* data, size_t n, const OpContext& ctx) {
  check_broken();
  std::lock_guard<std::mutex> lk(send_mu_);
  reap(peer, kMaxPendingBytes > n ? kMaxPendingBytes - n : 0, ctx);
  Pending p;
  p.bytes.reset(new char[n ? n : 1]);
  if (n) std::memcpy(p.bytes.get(), data, n);
  p.n = n;
  p.unasked = t_unasked;
  try {
    p.work = link_->send(p.bytes.get(), n, peer, tag_);
  } catch (const std::exception& e) {
    throw unreachable(ctx, peer, e.what());
  }
  pending_bytes_[peer] += n;
  pending_[peer].push_back(std::move(p));
}

void PgChannels::read(int peer, void* data, size_t n, const OpContext& ctx) {
  check_broken();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_) throw *aborted_;
  }
  std::unique_ptr<char[]> staged;
  void* into = data;
  if (n <= kStagedRead) {
    staged.reset(new char[n ? n : 1]);
    into = staged.get();
  }
  TransferPtr work;
  try {
    work = link_->recv(into, n, peer, tag_);
  } catch (const std::exception& e) {
    throw unreachable(ctx, peer, e.what());
  }
  try {
    wait(work, peer, "receiving", ctx);
  } catch (const CommError&) {
    std::lock_guard<std::mutex> lk(mu_);
    if (staged) abandoned_buffers_.push_back(std::move(staged));
    throw;
  }
  if (staged) std::memcpy(data, staged.get(), n);
}

}  // namespace pycomm
