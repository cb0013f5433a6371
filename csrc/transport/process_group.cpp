#include "process_group.h"

#include <cstring>
#include <deque>
#include <sstream>

#include "../core/race_window.h"
#include "../kernels/kernels.h"
#include "layout.h"

namespace pycomm {

namespace {

// Message tags name (transport, operation, round, step, phase, chunk) so
// that every message between two ranks that can be in flight at once has its
// own tag: several transports may share one backend, operations run one
// after another (two consecutive ones overlap at most), and at most `window`
// rounds are in flight. 1 + 4 + 5 + 10 + 1 + 10 = 31 bits (backends take a
// non-negative int).
constexpr int kMaxSteps = 1023;        // step 1023 is the header exchange
constexpr int kMaxChunks = 1024;
constexpr int kMaxWindow = 32;

uint32_t make_tag(int space, uint64_t op, uint64_t round, int step, int phase, int chunk) {
  return static_cast<uint32_t>((static_cast<uint64_t>(space & 1) << 30) | ((op & 0xF) << 26) |
                               ((round & 0x1F) << 21) | ((static_cast<uint32_t>(step) & 0x3FF) << 11) |
                               ((static_cast<uint32_t>(phase) & 1) << 10) | (static_cast<uint32_t>(chunk) & 0x3FF));
}

std::string first_line(const char* what) {
  std::string s(what);
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

// Collectives use phase 0 at step kMaxSteps (the header exchange): phase 1
// there is free.
uint32_t pg_p2p_tag() { return make_tag(0, 0, 0, kMaxSteps, 1, 0); }

std::string wait_transfer(PeerLink::Transfer& transfer, std::chrono::steady_clock::time_point deadline) {
  // Backends take whole milliseconds; never pass 0, which some read as "no
  // timeout".
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  try {
    if (transfer.wait(std::chrono::milliseconds(std::max<int64_t>(1, left.count() + 1)))) return "";
    return "the wait returned without completing";
  } catch (const std::exception& e) {
    return first_line(e.what());
  }
}

// One round in flight: where its chunks are, its staging memory, and its
// outstanding transfers.
struct PgRound {
  uint64_t j = 0;
  int step = 0;
  size_t chunk_bytes = 0;    // staging per chunk (the layout's largest)
  std::vector<char> values;  // chunks this rank forwards but does not keep
  std::vector<char> bufs;    // one receive buffer per message
  std::vector<const char*> in;
  std::vector<char*> out;
  std::vector<size_t> len;
  std::vector<std::shared_ptr<PeerLink::Transfer>> recvs;
  // Sends still reading a chunk, with their peers: the chunk's memory may
  // change only once they completed.
  std::vector<std::vector<std::pair<std::shared_ptr<PeerLink::Transfer>, int>>> sends;

  // Where a chunk's value is (null: the rank does not have it). A value
  // this rank forwards but does not keep lives in `values`, whichever
  // phase the plan stages it in: a transfer reads it in place.
  char* where(Loc l, int c) {
    switch (l) {
      case Loc::kInput: return const_cast<char*>(in[c]);
      case Loc::kOutput: return out[c];
      case Loc::kStaged0:
      case Loc::kStaged1: return values.data() + c * chunk_bytes;
      default: return nullptr;
    }
  }
};

PgTransport::PgTransport(const PgConfig& c)
    : link_(c.link),
      members_(c.members),
      names_(c.names.empty() ? c.members : c.names),
      rank_(c.rank),
      world_(static_cast<int>(c.members.size())),
      round_bytes_(c.round_bytes),
      window_(c.window),
      tag_space_(c.tag_space),
      timeout_s_(c.timeout_s),
      plans_(c.rank) {
  if (!link_) throw CommError("pycomm: the process-group transport needs a backend");
  if (world_ < 1 || rank_ < 0 || rank_ >= world_)
    throw CommError("pycomm: invalid process-group transport rank " + std::to_string(rank_) + " of " +
                    std::to_string(world_));
  if (world_ > kMaxChunks) throw CommError("pycomm: the process-group transport supports at most 1024 ranks");
  if (static_cast<int>(names_.size()) != world_)
    throw CommError("pycomm: process-group transport given names for the wrong number of ranks");
  if (members_[rank_] != link_->rank())
    throw CommError("pycomm: process-group transport member " + std::to_string(rank_) + " is backend rank " +
                    std::to_string(members_[rank_]) + ", but this process is backend rank " +
                    std::to_string(link_->rank()));
  if (round_bytes_ < 4096) throw CommError("pycomm: process-group round size must be at least 4 KiB");
  if (window_ < 1 || window_ > kMaxWindow) throw CommError("pycomm: process-group window must be 1..32");
  if (tag_space_ < 0 || tag_space_ > 1) throw CommError("pycomm: process-group tag space must be 0 or 1");
  for (int i = 0; i < window_; ++i) slots_.push_back(std::make_unique<PgRound>());
}

PgTransport::~PgTransport() = default;

void PgTransport::abort(const std::string& why, Blame blame) {
  race_window("group transport abort");
  std::lock_guard<std::mutex> lk(broken_mu_);
  if (!broken_) broken_ = CommError(why, blame);
}

PgTransport::TransferPtr PgTransport::send(const void* data, size_t bytes, int peer, uint32_t tag) {
  try {
    return link_->send(data, bytes, members_[peer], tag);
  } catch (const std::exception& e) {
    throw unreachable(peer, e.what());
  }
}

PgTransport::TransferPtr PgTransport::recv(void* data, size_t bytes, int peer, uint32_t tag) {
  try {
    return link_->recv(data, bytes, members_[peer], tag);
  } catch (const std::exception& e) {
    throw unreachable(peer, e.what());
  }
}

// A transfer the backend refused to post: the connection to `peer` is gone.
CommError PgTransport::unreachable(int peer, const std::string& error) const {
  return CommError("pycomm: rank " + std::to_string(name(rank_)) + " failed while waiting for rank " +
                       std::to_string(name(peer)) + " (posting a transfer): " + first_line(error.c_str()) +
                       "; rank " + std::to_string(name(peer)) + " may have died or left",
                   Blame{FailureKind::kWaiting, name(peer)});
}

void PgTransport::throw_if_broken() {
  std::lock_guard<std::mutex> lk(broken_mu_);
  if (broken_) throw *broken_;
}

void PgTransport::wait(TransferPtr& work, int peer, const char* what, const Ctx& ctx) {
  if (!work) return;
  // Checked after `work` was posted and before waiting: an abort that comes
  // later also interrupts the link (PeerLink::interrupt), which wakes this
  // wait, and then says why.
  throw_if_broken();
  const std::string error = wait_transfer(*work, ctx.deadline);
  if (error.empty()) {
    work.reset();
    return;
  }
  throw_if_broken();
  std::ostringstream os;
  os << "pycomm: " << collective_name(ctx.desc->coll) << " #" << ctx.seq;
  if (std::chrono::steady_clock::now() >= ctx.deadline) {
    os << " on rank " << name(rank_) << ": " << timed_out_waiting(ctx.timeout_s) << " for rank " << name(peer) << " ("
       << what << ")";
  } else {
    os << " failed on rank " << name(rank_) << " while waiting for rank " << name(peer) << " (" << what
       << "): " << error << "; rank " << name(peer) << " may have died or left";
  }
  throw CommError(os.str(), Blame{FailureKind::kWaiting, name(peer)});
}

void PgTransport::run(const CollectiveDesc& desc, uint64_t seq) {
  throw_if_broken();
  Ctx ctx;
  ctx.desc = &desc;
  ctx.seq = seq;
  ctx.op = ops_++;
  ctx.timeout_s = desc.timeout_s > 0 ? desc.timeout_s : timeout();
  ctx.deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(ctx.timeout_s));
  try {
    if (!desc.checked && world_ > 1) exchange_headers(ctx);
    if (!desc.check_only) execute(ctx);
  } catch (const std::exception& e) {
    // Transfers still posted may complete into our buffers later: keep them
    // (and the buffers, which the slots own) referenced, and refuse further
    // calls, whose tags could collide with the abandoned ones.
    const auto* comm_error = dynamic_cast<const CommError*>(&e);
    const CommError failure(e.what(), comm_error ? comm_error->blame() : Blame{});
    {
      std::lock_guard<std::mutex> lk(broken_mu_);
      if (!broken_) broken_ = failure;
    }
    for (auto& w : header_works_)
      if (w) abandoned_.push_back(std::move(w));
    header_works_.clear();
    abandoned_buffers_.push_back(std::move(headers_));
    for (auto& slot : slots_) {
      for (auto& w : slot->recvs)
        if (w) abandoned_.push_back(std::move(w));
      for (auto& per_chunk : slot->sends)
        for (auto& sw : per_chunk) abandoned_.push_back(std::move(sw.first));
      slot->recvs.clear();
      slot->sends.clear();
      abandoned_buffers_.push_back(std::move(slot->values));
      abandoned_buffers_.push_back(std::move(slot->bufs));
    }
    throw failure;
  }
}

void PgTransport::exchange_headers(const Ctx& ctx) {
  // headers_[q] is rank q's header, headers_[world_] ours as sent; on a
  // failure run() keeps the buffer and the transfers alive.
  headers_.resize(sizeof(CallHeader) * (world_ + 1));
  auto* headers = reinterpret_cast<CallHeader*>(headers_.data());
  headers[world_] = CallHeader::of(*ctx.desc, ctx.seq, ctx.op);
  const CallHeader& mine = headers[world_];
  headers[rank_] = mine;
  const uint32_t tag = make_tag(tag_space_, ctx.op, 0, kMaxSteps, 0, 0);
  // header_works_[q]: the receive from q; [world_ + q]: the send to q.
  header_works_.assign(2 * world_, {});
  for (int q = 0; q < world_; ++q)
    if (q != rank_) header_works_[q] = recv(&headers[q], sizeof(CallHeader), q, tag);
  for (int q = 0; q < world_; ++q)
    if (q != rank_) header_works_[world_ + q] = send(&mine, sizeof(CallHeader), q, tag);
  for (int q = 0; q < world_; ++q) wait(header_works_[q], q, "it to enter this collective", ctx);
  // Every rank holds every header, so every rank reaches the same verdict,
  // and names the same pair: the first rank that differs from rank 0.
  for (int q = 1; q < world_; ++q) {
    if (headers[q].same(headers[0])) continue;
    std::ostringstream os;
    os << "pycomm: ranks disagree on collective #" << ctx.seq << ": rank " << name(0) << " called "
       << describe_call(headers[0].desc()) << " but rank " << name(q) << " called "
       << describe_call(headers[q].desc());
    if (headers[q].seq != headers[0].seq) os << " (as its collective #" << headers[q].seq << ")";
    throw CommError(os.str(), mismatch_blame(headers[0], name(0), headers[q], name(q)));
  }
  for (int q = 0; q < world_; ++q) wait(header_works_[world_ + q], q, "it to take this rank's header", ctx);
}

void PgTransport::execute(const Ctx& ctx) {
  const CollectiveDesc& d = *ctx.desc;
  if (d.count == 0 || d.coll == Collective::kBarrier || d.coll == Collective::kInvalid) return;
  const size_t es = dtype_size(d.dtype);
  if (world_ == 1) {
    const RoundLayout layout(d, 1, 1, round_bytes_);
    kernels::copy_cpu(d.output, nullptr, d.input, layout.out_count * es);
  } else {
    const Plan& plan = plans_.get(Schedule{d.algo, d.coll, world_, d.root});
    if (static_cast<int>(plan.steps.size()) >= kMaxSteps || plan.num_chunks > kMaxChunks)
      throw CommError("pycomm internal error: schedule too long for the process-group transport's tags");
    const RoundLayout layout(d, plan.num_chunks, world_, round_bytes_);
    const int T = static_cast<int>(plan.steps.size());
    // 1. Keep up to `window` rounds in flight; every rank starts, advances
    //    and retires them in the same order.
    std::deque<PgRound*> active;
    uint64_t next = 0;
    while (next < layout.rounds || !active.empty()) {
      // 2. Start rounds into free slots: post every receive, then step 0's sends.
      while (static_cast<int>(active.size()) < window_ && next < layout.rounds) {
        PgRound& r = *slots_[next % window_];
        r.j = next++;
        start_round(r, plan, layout, ctx);
        active.push_back(&r);
      }
      // 3. Advance each round by one step: reduce what arrived, send on.
      for (PgRound* r : active) run_step(*r, plan, ctx);
      // 4. Retire finished rounds (the oldest finish first).
      while (!active.empty() && active.front()->step == T) {
        finish_round(*active.front(), plan, ctx);
        active.pop_front();
      }
    }
  }
  finish_average(d, world_);
}

void PgTransport::start_round(PgRound& r, const Plan& plan, const RoundLayout& layout, const Ctx& ctx) {
  const CollectiveDesc& d = *ctx.desc;
  const int K = plan.num_chunks;
  const size_t chunk_bytes = layout.chunk_max * layout.es;
  // All-to-all: the sender numbers each block by its receiver.
  const bool a2a = d.coll == Collective::kAllToAll;
  layout.chunks(r.j, rank_, d.input, d.output, r.in, r.out, r.len);
  r.step = 0;
  r.chunk_bytes = chunk_bytes;
  if (r.values.size() < K * chunk_bytes) r.values.resize(K * chunk_bytes);
  if (r.bufs.size() < plan.num_bufs * chunk_bytes) r.bufs.resize(plan.num_bufs * chunk_bytes);
  r.recvs.assign(plan.num_bufs, {});
  r.sends.assign(K, {});
  for (const PlanStep& step : plan.steps)
    for (const PlanGroup& g : step.groups)
      for (const PlanSrc& src : g.srcs) {
        if (src.buf < 0 || r.len[g.chunk] == 0) continue;
        const int tag_chunk = a2a ? rank_ : g.chunk;
        r.recvs[src.buf] = recv(r.bufs.data() + src.buf * chunk_bytes, r.len[g.chunk] * layout.es, src.peer,
                                make_tag(tag_space_, ctx.op, r.j, src.sent_step, src.phase, tag_chunk));
      }
  post_sends(r, plan, 0, ctx);
}

void PgTransport::post_sends(PgRound& r, const Plan& plan, int t, const Ctx& ctx) {
  const size_t es = dtype_size(ctx.desc->dtype);
  for (const PlanSend& s : plan.steps[t].sends) {
    const int c = s.chunk;
    if (r.len[c] == 0) continue;
    const char* data = r.where(s.value, c);
    for (int q : s.to)
      r.sends[c].emplace_back(send(data, r.len[c] * es, q, make_tag(tag_space_, ctx.op, r.j, t, s.phase, c)), q);
  }
}

void PgTransport::run_step(PgRound& r, const Plan& plan, const Ctx& ctx) {
  const CollectiveDesc& d = *ctx.desc;
  std::vector<const void*> srcs;
  for (const PlanGroup& g : plan.steps[r.step].groups) {
    const int c = g.chunk;
    if (r.len[c] == 0) continue;
    // Kept chunks reduce into the output; forwarded ones into `values`,
    // which the next send reads in place.
    char* dst = g.to_output ? r.out[c] : r.values.data() + c * r.chunk_bytes;
    srcs.clear();
    for (const PlanSrc& src : g.srcs) {
      if (src.buf < 0) {
        srcs.push_back(r.where(src.self_loc, c));
      } else {
        wait(r.recvs[src.buf], src.peer, "its data", ctx);
        srcs.push_back(r.bufs.data() + src.buf * r.chunk_bytes);
      }
    }
    // The chunk's memory changes now: sends still reading it must finish.
    for (auto& sw : r.sends[c]) wait(sw.first, sw.second, "it to take this rank's data", ctx);
    r.sends[c].clear();
    kernels::reduce_cpu(d.dtype, d.op, dst, nullptr, srcs.data(), static_cast<int>(srcs.size()), r.len[c]);
  }
  ++r.step;
  if (r.step < static_cast<int>(plan.steps.size())) post_sends(r, plan, r.step, ctx);
}

void PgTransport::finish_round(PgRound& r, const Plan& plan, const Ctx& ctx) {
  const size_t es = dtype_size(ctx.desc->dtype);
  for (int c : plan.final_copies) kernels::copy_cpu(r.out[c], nullptr, r.in[c], r.len[c] * es);
  for (auto& per_chunk : r.sends) {
    for (auto& sw : per_chunk) wait(sw.first, sw.second, "it to take this rank's data", ctx);
    per_chunk.clear();
  }
}

}  // namespace pycomm
