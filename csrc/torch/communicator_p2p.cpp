// Point-to-point messages of the communicator: one lane (a queue and a
// thread) per direction and peer, over shared-memory channels within the
// host and the process group's channels between hosts (the same protocol).
#include <set>
#include <sstream>

#include "../core/race_window.h"
#include "../transport/thread_name.h"
#include "communicator.h"
#include "tensor_checks.h"

namespace pycomm {

namespace {

std::string p2p_prefix(Collective coll) { return std::string("pycomm.") + collective_name(coll) + ": "; }

// What a point-to-point message's waits report and how long they may take.
OpContext p2p_context(Collective coll, uint64_t seq, double timeout_s) {
  return OpContext{coll, seq, 0, deadline_after(timeout_s), timeout_s};
}

}  // namespace

// ------------------------------------------------------- point-to-point

// The messages of one direction with one peer run in order on their own
// thread: a receive waiting for its data never holds up collectives or
// traffic with other peers, and a send blocked on a full ring never holds
// up receives (so two ranks can send each other large messages at once).
struct Communicator::Lane {
  // `await_data` (incoming lanes over shared memory): waits up to a bound
  // for the next message's bytes; true once they are there.
  using AwaitData = std::function<bool(std::chrono::microseconds)>;
  Lane(Communicator* comm, AwaitData await)
      : comm_(comm), await_data(std::move(await)), thread(named_thread("p2p", [this] { loop(); })) {}
  // Finishes what was queued, then joins (one caller at a time: the
  // communicator's shutdown, or the destructor after it).
  void finish() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stopping = true;
    }
    race_window("lane close");
    cv.notify_one();
    if (thread.joinable()) thread.join();
  }
  ~Lane() { finish(); }

  void push(std::shared_ptr<Work> work) {
    {
      std::lock_guard<std::mutex> lk(mu);
      queue.push_back(std::move(work));
    }
    cv.notify_one();
  }

  // A synchronous message finding the lane idle runs on the caller's thread
  // (as collectives do): two thread hand-offs fewer, which is most of a small
  // message's cost. Nothing queued and nothing running means no earlier
  // message of this direction can still be pending, so the order holds.
  bool claim() {
    std::lock_guard<std::mutex> lk(mu);
    if (busy || !queue.empty()) return false;
    busy = true;
    return true;
  }
  // Wakes the lane's thread only when it waits for busy to clear: a message
  // queued behind this one, or a lane being destroyed (notified under the
  // lock: it may be freed as soon as this caller lets go of mu). Waking an
  // idle lane's thread for nothing cost every synchronous message two futex
  // calls and a context switch on the caller's core (~8 us of a 4 KB
  // message's ~11 us one way, bound to a core).
  void release() {
    std::lock_guard<std::mutex> lk(mu);
    busy = false;
    if (stopping || !queue.empty()) cv.notify_one();
  }

  // The caller waits on `work`, a receive nobody has started: it runs here,
  // on the caller's thread, so that the sender's wake-up reaches the thread
  // that needs the data (one hand-off instead of two). Only the lane's next
  // message, so the order holds.
  bool run_inline(Work* work) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (busy || queue.empty() || queue.front().get() != work) return false;
      queue.pop_front();
      busy = true;
    }
    comm_->execute(*work);
    release();
    return true;
  }

  void loop() {
    std::unique_lock<std::mutex> lk(mu);
    Work* deferred = nullptr;
    auto deferred_since = std::chrono::steady_clock::now();
    while (true) {
      cv.wait(lk, [&] { return (!queue.empty() && !busy) || (stopping && queue.empty() && !busy); });
      if (queue.empty()) return;
      // An incoming message is left to a caller that will wait for it until
      // its bytes arrive: then this thread takes it unless a caller already
      // did (background progress, so a sender is never stuck on a full
      // ring). After kDeferMax this thread takes it anyway, so that the
      // receive's own waits (peer liveness, abort, its deadline) apply.
      if (await_data && !stopping) {
        Work* head = queue.front().get();
        const auto now = std::chrono::steady_clock::now();
        if (head != deferred) {
          deferred = head;
          deferred_since = now;
        }
        if (now - deferred_since < kDeferMax) {
          lk.unlock();
          bool ready = true;
          try {
            ready = await_data(kDeferSlice);
          } catch (const std::exception&) {
            // The receive itself reports it.
          }
          lk.lock();
          if (!ready || busy || queue.empty() || queue.front().get() != head) continue;
        }
      }
      auto work = std::move(queue.front());
      queue.pop_front();
      busy = true;
      lk.unlock();
      comm_->execute(*work);
      lk.lock();
      busy = false;
    }
  }

  // How long this thread leaves a message to a caller at most, and how long
  // one wait for its bytes lasts before the thread looks at its queue again.
  static constexpr auto kDeferMax = std::chrono::milliseconds(500);
  static constexpr auto kDeferSlice = std::chrono::microseconds(5000);

  Communicator* comm_;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Work>> queue;
  bool busy = false;  // a message of this lane runs (on its thread or a caller's)
  bool stopping = false;
  uint64_t messages = 0;  // numbers this direction's messages, for errors
  AwaitData await_data;
  std::thread thread;
};

void Communicator::finish_lanes() {
  // The lanes stay listed while they finish, so that a callback on one of
  // them is still known to run on this communicator's thread.
  std::vector<std::shared_ptr<Lane>> lanes;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    for (const auto& entry : lanes_) lanes.push_back(entry.second);
  }
  for (const auto& lane : lanes) lane->finish();
  std::lock_guard<std::mutex> lk(lanes_mu_);
  lanes_.clear();
}

bool Communicator::on_own_thread() const {
  const std::thread::id me = std::this_thread::get_id();
  if (progress_.get_id() == me) return true;
  std::lock_guard<std::mutex> lk(lanes_mu_);
  for (const auto& entry : lanes_)
    if (entry.second->thread.get_id() == me) return true;
  return false;
}

std::pair<MessageChannels*, int> Communicator::p2p_peer(int peer, Collective coll) const {
  const char* dir = coll == Collective::kSend ? "dst" : "src";
  if (peer < 0 || peer >= world_)
    throw CommError(p2p_prefix(coll) + dir + "=" + std::to_string(peer) + " is not a rank of this communicator (0.." +
                    std::to_string(world_ - 1) + ")");
  if (peer == rank_) throw CommError(p2p_prefix(coll) + dir + " is this rank itself (" + std::to_string(rank_) + ")");
  // Shared memory within the host; the process group to other hosts (the
  // same protocol, so order, checks and errors are the same).
  if (transports_.p2p() && transports_.local_rank_of(peer) >= 0)
    return {transports_.p2p(), transports_.local_rank_of(peer)};
  if (transports_.remote_p2p()) return {transports_.remote_p2p(), peer};
  throw CommError(p2p_prefix(coll) + "rank " + std::to_string(peer) + " is on another host and this communicator "
                  "has no process group to reach it");
}

void Communicator::submit_p2p(int peer, bool incoming, std::shared_ptr<Work> work, bool async_op) {
  refuse_in_fork();
  Lane* lane;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    if (stop_) throw CommError("pycomm: the communicator has been shut down");
    auto& slot = lanes_[{peer, incoming}];
    if (!slot) {
      Lane::AwaitData await;
      ShmChannels* shm = transports_.p2p();
      if (incoming && shm && transports_.local_rank_of(peer) >= 0) {
        const int local = transports_.local_rank_of(peer);
        await = [this, shm, local](std::chrono::microseconds max_wait) {
          return shm->await_readable(local, max_wait, p2p_context(Collective::kRecv, 0, timeout()));
        };
      }
      slot = std::make_shared<Lane>(this, std::move(await));
    }
    lane = slot.get();
    if (incoming && async_op && slot->await_data) {
      std::weak_ptr<Lane> weak = slot;
      Work* raw = work.get();
      work->help_ = [weak, raw] {
        auto l = weak.lock();
        return l && l->run_inline(raw);
      };
    }
    // Numbered at submission, in the order the caller issued them.
    work->seq_ = ++lane->messages;
  }
  if (!async_op && lane->claim()) {
    execute(*work);
    lane->release();
    work->wait();  // rethrows its error
    return;
  }
  if (at::hasCallbacks()) work->caller_state_ = std::make_shared<at::ThreadLocalState>();
  lane->push(work);
  if (!async_op) work->wait();
}

std::shared_ptr<Work> Communicator::send(const std::vector<at::Tensor>& tensors, int dst, uint32_t tag,
                                         bool async_op) {
  const auto target = p2p_peer(dst, Collective::kSend);
  MessageChannels& channels = *target.first;
  const int peer = target.second;
  const std::string why = check_send(tensors, kP2PMaxDims);
  if (!why.empty()) {
    // A send this rank cannot make still goes out, as an error message, so
    // that the receiver raises now instead of waiting for the timeout.
    const std::string msg = p2p_prefix(Collective::kSend) + why;
    try {
      send_failure(dst, msg, /*async_op=*/false, /*last=*/false);
    } catch (const CommError&) {
      // The peer is gone too; our own reason is the useful one.
    }
    throw CommError(msg);
  }
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kSend;
  work->desc_.root = dst;
  // Non-contiguous tensors travel as contiguous copies, made now: the data
  // sent is the data at the time of the call, as for collectives.
  for (const auto& t : tensors) work->inputs_.push_back(t.contiguous());
  work->body_ = [this, &channels, w = work.get(), peer, tag](uint64_t seq) {
    const auto n = static_cast<uint32_t>(w->inputs_.size());
    std::vector<TensorMeta> metas(n);
    std::vector<const void*> data(n);
    for (uint32_t i = 0; i < n; ++i) {
      const at::Tensor& t = w->inputs_[i];
      metas[i].dtype = static_cast<uint8_t>(t.scalar_type());
      metas[i].ndim = static_cast<int>(t.dim());
      for (int64_t d = 0; d < t.dim(); ++d) metas[i].shape[d] = t.size(d);
      metas[i].nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
      data[i] = t.data_ptr();
    }
    channels.send_message(peer, tag, metas.data(), data.data(), n,
                          p2p_context(Collective::kSend, seq, timeout()));
  };
  submit_p2p(dst, false, work, async_op);
  return work;
}

void Communicator::send_failure(int dst, const std::string& why, bool async_op, bool last) {
  const auto target = p2p_peer(dst, Collective::kSend);
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kSend;
  work->desc_.root = dst;
  work->body_ = [this, channels = target.first, peer = target.second, why, last](uint64_t seq) {
    channels->send_failure(peer, why, p2p_context(Collective::kSend, seq, timeout()), last);
  };
  submit_p2p(dst, false, std::move(work), async_op);
}

void Communicator::abort_remote_p2p(const std::string& why, Blame blame) {
  PgChannels* remote = transports_.remote_p2p();
  if (!remote) return;
  // Ranks of other hosts learn of an abort from shared memory no more:
  // every remote rank gets the reason as the last message of this rank's
  // stream to it, and its receive raises at once instead of waiting for the
  // timeout. Where a lane carries messages (the pair exchanged some), the
  // reason is queued behind them, so the stream stays in step; every other
  // remote rank gets it unasked, as its stream's only message, for a
  // receive it may be waiting in already.
  std::set<int> laned;  // ranks with a lane, either way
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    for (const auto& [key, lane] : lanes_) laned.insert(key.first);
  }
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_ || p2p_peer(peer, Collective::kSend).first != remote) continue;
    try {
      if (laned.count(peer))
        send_failure(peer, why, /*async_op=*/true, /*last=*/true);
      else
        remote->send_unasked_failure(peer, why, p2p_context(Collective::kSend, 0, timeout()));
    } catch (const std::exception&) {
      // Shut down already, or the peer is gone: nothing to tell.
    }
  }
  // Receives from other hosts stop waiting (this rank's own lanes).
  remote->abort(why, blame);
}

std::shared_ptr<Work> Communicator::recv(const std::vector<at::Tensor>& out, int src, uint32_t tag, bool async_op) {
  const auto target = p2p_peer(src, Collective::kRecv);
  MessageChannels* channels = target.first;
  const int peer = target.second;
  const std::string why = check_recv(out);
  if (!why.empty()) throw CommError(p2p_prefix(Collective::kRecv) + why);
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kRecv;
  work->desc_.root = src;
  work->outputs_ = out;
  const bool allocate = out.empty();
  work->body_ = [this, w = work.get(), channels, peer, tag, allocate](uint64_t) {
    recv_body(*w, *channels, peer, tag, allocate);
  };
  submit_p2p(src, true, work, async_op);
  return work;
}

namespace {

// Places a message's tensors: new tensors of the shapes sent, or the
// caller's `out` tensors after checking they match what was sent.
class TensorSink : public MessageSink {
 public:
  TensorSink(std::vector<at::Tensor>& outputs, bool allocate, int src)
      : outputs_(outputs), allocate_(allocate), src_(src) {}

  void* place(uint32_t i, uint32_t total, const TensorMeta& meta, std::string* why) override {
    if (meta.dtype >= static_cast<uint8_t>(at::ScalarType::NumOptions)) {
      *why = "the channel is out of step (corrupt message header)";
      return nullptr;
    }
    const auto dtype = static_cast<at::ScalarType>(meta.dtype);
    const std::vector<int64_t> shape(meta.shape, meta.shape + meta.ndim);
    if (i == 0 && !allocate_ && outputs_.size() != total) {
      *why = "rank " + std::to_string(src_) + " sent " + std::to_string(total) + " tensors but " +
             std::to_string(outputs_.size()) + " out tensors were given";
      return nullptr;
    }
    if (allocate_) {
      outputs_.push_back(at::empty(shape, at::TensorOptions().dtype(dtype)));
    } else {
      const at::Tensor& t = outputs_[i];
      if (t.scalar_type() != dtype || t.sizes() != at::IntArrayRef(shape)) {
        std::ostringstream os;
        os << "rank " << src_ << " sent tensor " << i << " as " << c10::getDtypeNames(dtype).first
           << at::IntArrayRef(shape) << " but out tensor " << i << " is "
           << c10::getDtypeNames(t.scalar_type()).first << t.sizes();
        *why = os.str();
        return nullptr;
      }
    }
    return outputs_[i].data_ptr();
  }

 private:
  std::vector<at::Tensor>& outputs_;
  bool allocate_;
  int src_;
};

}  // namespace

void Communicator::recv_body(Work& work, MessageChannels& channels, int peer, uint32_t tag, bool allocate) {
  TensorSink sink(work.outputs_, allocate, work.desc_.root);
  channels.recv_message(peer, tag, sink,
                                  p2p_context(Collective::kRecv, work.seq_, timeout()));
}

}  // namespace pycomm
