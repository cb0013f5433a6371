#include "communicator.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstring>
#include <future>
#include <optional>
#include <sstream>

#include "algorithms/algorithms.h"
#include "compression/quantized_allreduce.h"
#include "compression/sparse_allreduce.h"
#include "torch_dtype.h"
#include "transport/futex.h"

namespace pycomm {

namespace {

// "" when `t` can take part in a collective, else why not.
std::string check_tensor(const at::Tensor& t, const char* role, Collective coll) {
  std::ostringstream os;
  os << "pycomm." << collective_name(coll) << ": ";
  if (!t.defined()) {
    os << role << " is undefined";
    return os.str();
  }
  if (!t.device().is_cpu()) {
    os << role << " is on device '" << t.device() << "', but this pycomm build handles CPU tensors only";
    return os.str();
  }
  DType dt;
  if (!to_dtype(t.scalar_type(), &dt)) {
    os << role << " has dtype torch." << c10::getDtypeNames(t.scalar_type()).first
       << ", which is not supported (use float32, float64, float16, bfloat16, int32, int64 or uint8)";
    return os.str();
  }
  if (!t.is_contiguous()) {
    os << role << " is not contiguous (shape " << t.sizes() << ", strides " << t.strides()
       << "); pass tensor.contiguous()";
    return os.str();
  }
  if (t.is_sparse() || t.is_quantized()) {
    os << role << " must be a dense tensor";
    return os.str();
  }
  return "";
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  const char* a1 = a0 + a.numel() * a.element_size();
  const char* b1 = b0 + b.numel() * b.element_size();
  return a0 < b1 && b0 < a1;
}

}  // namespace

// ---------------------------------------------------------------- Work

void Work::finish(std::exception_ptr error) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    std::lock_guard<std::mutex> lk(mu_);
    finished_ = std::chrono::steady_clock::now();
    done_ = true;
    error_ = error;
    fut = future_;
  }
  cv_.notify_all();
  // Completed outside the lock: the future's callbacks (a DDP hook's
  // continuation, say) run right here, on the progress thread.
  if (fut) {
    if (error) {
      fut->setError(error);
    } else {
      fut->markCompleted(c10::IValue(outputs_));
    }
  }
  inputs_.clear();
  body_ = nullptr;
  before_ = nullptr;
  after_ = nullptr;
  caller_state_.reset();
}

double Work::run_seconds() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_ ? std::chrono::duration<double>(finished_ - started_).count() : 0.0;
}

bool Work::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return done_; });
  } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done_; })) {
    std::ostringstream os;
    os << "pycomm: Work.wait timed out after " << timeout_s << " s; " << collective_name(desc_.coll) << " #"
       << seq_ << " is still in progress";
    throw CommError(os.str());
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

bool Work::is_completed() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool Work::is_success() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_ && !error_;
}

std::string Work::error_message() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_) return "";
  try {
    std::rethrow_exception(error_);
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::exception_ptr Work::error() {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

c10::intrusive_ptr<c10::ivalue::Future> Work::get_future() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    if (done_) {
      if (error_) {
        future_->setError(error_);
      } else {
        future_->markCompleted(c10::IValue(outputs_));
      }
    }
  }
  return future_;
}

// ------------------------------------------------------- point-to-point

namespace {

constexpr uint32_t kP2PErrorMagic = 0x52524550u;  // "PERR": the sender failed; a message follows

std::string p2p_prefix(Collective coll) { return std::string("pycomm.") + collective_name(coll) + ": "; }

}  // namespace

// The messages of one direction with one peer run in order on their own
// thread: a receive waiting for its data never holds up collectives or
// traffic with other peers, and a send blocked on a full ring never holds
// up receives (so two ranks can send each other large messages at once).
struct Communicator::Lane {
  explicit Lane(Communicator* comm) : thread([this, comm] { loop(comm); }) {}
  ~Lane() { stop(); }

  void push(std::shared_ptr<Work> work) {
    {
      std::lock_guard<std::mutex> lk(mu);
      queue.push_back(std::move(work));
    }
    cv.notify_one();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stopping = true;
    }
    cv.notify_one();
    if (thread.joinable()) thread.join();
  }
  void loop(Communicator* comm) {
    std::unique_lock<std::mutex> lk(mu);
    while (true) {
      cv.wait(lk, [&] { return !queue.empty() || stopping; });
      if (queue.empty()) return;
      auto work = std::move(queue.front());
      queue.pop_front();
      lk.unlock();
      comm->execute(*work);
      lk.lock();
    }
  }

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Work>> queue;
  bool stopping = false;
  uint64_t messages = 0;  // numbers this direction's messages, for errors
  std::thread thread;
};

int Communicator::p2p_peer(int peer, Collective coll) const {
  const char* dir = coll == Collective::kSend ? "dst" : "src";
  if (peer < 0 || peer >= world_)
    throw CommError(p2p_prefix(coll) + dir + "=" + std::to_string(peer) + " is not a rank of this communicator (0.." +
                    std::to_string(world_ - 1) + ")");
  if (peer == rank_) throw CommError(p2p_prefix(coll) + dir + " is this rank itself (" + std::to_string(rank_) + ")");
  if (!p2p_ || local_of_[peer] < 0)
    throw CommError(p2p_prefix(coll) + "rank " + std::to_string(peer) +
                    (p2p_ ? " is on another host" : " is reachable through the process group only (transport='pg')") +
                    "; pycomm's point-to-point runs over shared memory between ranks of one host "
                    "(use torch.distributed.send/recv across hosts)");
  return local_of_[peer];
}

void Communicator::submit_p2p(int peer, bool incoming, std::shared_ptr<Work> work, bool async_op) {
  Lane* lane;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    if (stop_) throw CommError("pycomm: the communicator has been shut down");
    auto& slot = lanes_[{peer, incoming}];
    if (!slot) slot = std::make_unique<Lane>(this);
    lane = slot.get();
    // Numbered at submission, in the order the caller issued them.
    work->seq_ = ++lane->messages;
  }
  if (at::hasCallbacks()) work->caller_state_ = std::make_shared<at::ThreadLocalState>();
  lane->push(work);
  if (!async_op) work->wait();
}

std::shared_ptr<Work> Communicator::send(const std::vector<at::Tensor>& tensors, int dst, uint32_t tag,
                                         bool async_op) {
  const int peer = p2p_peer(dst, Collective::kSend);
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kSend;
  work->desc_.root = dst;
  // A send this rank cannot make still goes out, as an error message, so
  // that the receiver raises now instead of waiting for the timeout.
  std::string why;
  if (tensors.empty()) why = "nothing to send (an empty list of tensors)";
  for (size_t i = 0; i < tensors.size() && why.empty(); ++i) {
    const at::Tensor& t = tensors[i];
    std::ostringstream os;
    if (!t.defined()) {
      os << "tensor " << i << " is undefined";
    } else if (!t.device().is_cpu()) {
      os << "tensor " << i << " is on device '" << t.device() << "'; this pycomm build sends CPU tensors only";
    } else if (t.is_sparse() || t.is_quantized() || t.layout() != at::kStrided) {
      os << "tensor " << i << " must be a dense tensor";
    } else if (t.dim() > kP2PMaxDims) {
      os << "tensor " << i << " has " << t.dim() << " dimensions; at most " << kP2PMaxDims << " are supported";
    }
    why = os.str();
  }
  if (!why.empty()) {
    why = p2p_prefix(Collective::kSend) + why;
    work->body_ = [this, peer, why](uint64_t seq) {
      P2PHeader h{};
      h.magic = kP2PErrorMagic;
      h.nbytes = why.size();
      OpContext ctx{Collective::kSend, seq, 0, deadline_after(timeout_s_)};
      p2p_->write(peer, &h, sizeof h, ctx);
      p2p_->write(peer, why.data(), why.size(), ctx);
    };
    try {
      submit_p2p(dst, false, work, /*async_op=*/false);
    } catch (const CommError&) {
      // The peer is gone too; our own reason is the useful one.
    }
    throw CommError(why);
  }
  // Non-contiguous tensors travel as contiguous copies, made now: the data
  // sent is the data at the time of the call, as for collectives.
  for (const auto& t : tensors) work->inputs_.push_back(t.contiguous());
  work->body_ = [this, w = work.get(), peer, tag](uint64_t) { send_body(*w, peer, tag); };
  submit_p2p(dst, false, work, async_op);
  return work;
}

void Communicator::send_body(Work& work, int peer, uint32_t tag) {
  OpContext ctx{Collective::kSend, work.seq_, 0, deadline_after(timeout_s_)};
  const auto n = static_cast<uint32_t>(work.inputs_.size());
  for (uint32_t i = 0; i < n; ++i) {
    const at::Tensor& t = work.inputs_[i];
    P2PHeader h{};
    h.magic = kP2PMagic;
    h.tag = tag;
    h.index = i;
    h.total = n;
    h.nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    h.dtype = static_cast<uint8_t>(t.scalar_type());
    h.ndim = static_cast<uint8_t>(t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) h.shape[d] = t.size(d);
    p2p_->write(peer, &h, sizeof h, ctx);
    if (h.nbytes) p2p_->write(peer, t.data_ptr(), h.nbytes, ctx);
  }
}

std::shared_ptr<Work> Communicator::recv(const std::vector<at::Tensor>& out, int src, uint32_t tag, bool async_op) {
  const int peer = p2p_peer(src, Collective::kRecv);
  for (size_t i = 0; i < out.size(); ++i) {
    const at::Tensor& t = out[i];
    if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous())
      throw CommError(p2p_prefix(Collective::kRecv) + "out tensor " + std::to_string(i) +
                      " must be a defined, dense, contiguous CPU tensor");
  }
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kRecv;
  work->desc_.root = src;
  work->outputs_ = out;
  const bool allocate = out.empty();
  work->body_ = [this, w = work.get(), peer, tag, allocate](uint64_t) { recv_body(*w, peer, tag, allocate); };
  submit_p2p(src, true, work, async_op);
  return work;
}

void Communicator::recv_body(Work& work, int peer, uint32_t tag, bool allocate) {
  OpContext ctx{Collective::kRecv, work.seq_, 0, deadline_after(timeout_s_)};
  const int src = work.desc_.root;
  auto where = [&] {
    std::ostringstream os;
    os << "pycomm.recv #" << work.seq_ << " on rank " << rank_ << " from rank " << src << ": ";
    return os.str();
  };
  uint32_t total = 1;
  for (uint32_t i = 0; i < total; ++i) {
    P2PHeader h{};
    p2p_->read(peer, &h, sizeof h, ctx);
    if (h.magic == kP2PErrorMagic) {
      std::string msg(h.nbytes, '\0');
      p2p_->read(peer, msg.data(), msg.size(), ctx);
      throw CommError(where() + "the sender failed: " + msg);
    }
    // From here on a mismatch leaves the channel out of step with the
    // sender: it fails the communicator on every local rank (as collectives
    // whose headers disagree do) rather than deliver the wrong bytes later.
    if (h.magic != kP2PMagic || h.index != i || h.total == 0 || h.ndim > kP2PMaxDims ||
        h.dtype >= static_cast<uint8_t>(at::ScalarType::NumOptions))
      local_->fail(where() + "the channel is out of step (corrupt message header)");
    if (h.tag != tag)
      local_->fail(where() + "expected tag " + std::to_string(tag) + " but the next message from rank " +
                   std::to_string(src) + " has tag " + std::to_string(h.tag) +
                   " (messages between two ranks arrive in the order they were sent)");
    total = h.total;
    std::vector<int64_t> shape(h.shape, h.shape + h.ndim);
    const auto dtype = static_cast<at::ScalarType>(h.dtype);
    if (i == 0 && !allocate && work.outputs_.size() != total)
      local_->fail(where() + "rank " + std::to_string(src) + " sent " + std::to_string(total) +
                   " tensors but " + std::to_string(work.outputs_.size()) + " out tensors were given");
    if (allocate) {
      work.outputs_.push_back(at::empty(shape, at::TensorOptions().dtype(dtype)));
    } else {
      const at::Tensor& t = work.outputs_[i];
      if (t.scalar_type() != dtype || t.sizes() != at::IntArrayRef(shape)) {
        std::ostringstream os;
        os << where() << "rank " << src << " sent tensor " << i << " as "
           << c10::getDtypeNames(dtype).first << at::IntArrayRef(shape) << " but out tensor " << i << " is "
           << c10::getDtypeNames(t.scalar_type()).first << t.sizes();
        local_->fail(os.str());
      }
    }
    if (h.nbytes) p2p_->read(peer, work.outputs_[i].data_ptr(), h.nbytes, ctx);
  }
}

// ---------------------------------------------------------- Communicator

Communicator::Communicator(const CommunicatorOptions& o)
    : rank_(o.rank), world_(o.world), timeout_s_(o.timeout_s), store_(o.backend ? o.store : nullptr) {
  if (world_ < 1 || rank_ < 0 || rank_ >= world_)
    throw CommError("pycomm: invalid rank " + std::to_string(rank_) + " of " + std::to_string(world_));
  if (o.use_shm) {
    ShmConfig cfg;
    cfg.name = o.shm_name;
    cfg.token = o.token;
    cfg.create = o.create;
    cfg.rank = o.local_rank;
    cfg.world = o.local_size;
    cfg.round_bytes = o.round_bytes;
    cfg.timeout_s = o.timeout_s;
    if (!o.host_ranks.empty()) cfg.global_ranks = o.host_ranks.at(o.host);
    local_ = std::make_unique<ShmTransport>(cfg);
    top_ = local_.get();
  }
  PgConfig flat;
  if (o.backend) {
    // 1. Flat: every rank, in communicator order.
    flat.backend = o.backend;
    for (int r = 0; r < world_; ++r) flat.members.push_back(r);
    flat.rank = rank_;
    flat.round_bytes = o.pg_round_bytes;
    flat.window = o.pg_window;
    flat.timeout_s = o.timeout_s;
    flat.tag_space = 0;
    flat_ = std::make_unique<PgTransport>(flat);
    top_ = flat_.get();
  }
  if (local_ && flat_) {
    // 2. Several hosts. With the same number of ranks on every host, local
    //    rank j of every host forms a cross group (hierarchical collectives).
    bool uniform = true;
    for (const auto& h : o.host_ranks) uniform = uniform && h.size() == o.host_ranks[0].size();
    MultiHostConfig mh;
    mh.local = local_.get();
    mh.flat = flat_.get();
    mh.rank = rank_;
    mh.world = world_;
    mh.local_rank = o.local_rank;
    mh.host_ranks = o.host_ranks;
    // Four shared-memory rounds: long enough that the shared-memory steps
    // run at full speed, short next to the segment's time on the network.
    mh.segment_bytes = 4 * o.round_bytes;
    if (uniform) {
      PgConfig cross = flat;
      cross.members.clear();
      for (const auto& h : o.host_ranks) cross.members.push_back(h[o.local_rank]);
      cross.rank = o.host;
      cross.tag_space = 1;
      cross_ = std::make_unique<PgTransport>(cross);
      mh.cross = cross_.get();
    }
    multi_ = std::make_unique<MultiHostTransport>(mh);
    top_ = multi_.get();
  }
  if (!top_) throw CommError("pycomm: a communicator needs shared memory or a process group");
  local_of_.assign(world_, -1);
  if (local_) {
    if (o.host_ranks.empty()) {
      for (int r = 0; r < world_; ++r) local_of_[r] = r;
    } else {
      const auto& mine = o.host_ranks.at(o.host);
      for (size_t j = 0; j < mine.size(); ++j) local_of_.at(mine[j]) = static_cast<int>(j);
    }
    p2p_ = std::make_unique<ShmChannels>(*local_, o.shm_name + ".p2p", o.token, o.p2p_bytes);
  }
  progress_ = std::thread([this] { progress_loop(); });
}

void Communicator::set_timeout(double seconds) {
  timeout_s_ = seconds;
  if (local_) local_->set_timeout(seconds);
  if (flat_) flat_->set_timeout(seconds);
  if (cross_) cross_->set_timeout(seconds);
}

std::string Communicator::transport_name() const {
  if (multi_) return "shm+process_group";
  return local_ ? "shm" : "process_group";
}

Communicator::~Communicator() {
  try {
    shutdown();
  } catch (...) {
  }
}

void Communicator::shutdown() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stop_ && !progress_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  // Point-to-point lanes finish what was queued, like the progress thread.
  std::map<std::pair<int, bool>, std::unique_ptr<Lane>> lanes;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    lanes.swap(lanes_);
  }
  for (auto& [key, lane] : lanes) lane->stop();
  if (p2p_) p2p_->close();
  if (local_) local_->shutdown();
}

void Communicator::abort(const std::string& why) { top_->abort(why); }

void Communicator::progress_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    cv_.wait(lk, [&] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty() && !busy_); });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    auto work = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    execute(*work);
    lk.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

namespace {

// Profiler range names: RecordFunction keeps the pointer, so literals.
const char* range_name(Collective coll) {
  switch (coll) {
    case Collective::kAllReduce: return "pycomm::all_reduce";
    case Collective::kReduceScatter: return "pycomm::reduce_scatter";
    case Collective::kAllGather: return "pycomm::all_gather";
    case Collective::kBroadcast: return "pycomm::broadcast";
    case Collective::kAllToAll: return "pycomm::all_to_all";
    case Collective::kSend: return "pycomm::send";
    case Collective::kRecv: return "pycomm::recv";
    default: return "pycomm::barrier";
  }
}

// One profiler range at a time for the stages of a composite op: entering
// a stage closes the previous one.
class StageRanges {
 public:
  void enter(const char* name) {
    current_.reset();
    if (name == nullptr) return;
    current_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (current_->isActive()) current_->before(name);
  }

 private:
  std::unique_ptr<at::RecordFunction> current_;
};

}  // namespace

void Communicator::execute(Work& work) {
  work.started_ = std::chrono::steady_clock::now();
  std::optional<at::ThreadLocalStateGuard> caller_state;
  if (work.caller_state_) caller_state.emplace(*work.caller_state_);
  std::exception_ptr error;
  try {
    RECORD_USER_SCOPE(range_name(work.desc_.coll));
    if (work.before_) work.before_();
    if (work.body_) {
      work.body_(work.seq_);
    } else {
      top_->run(work.desc_, work.seq_);
    }
    if (work.after_) work.after_();
  } catch (...) {
    error = std::current_exception();
  }
  if (error && store_) error = explain(error);
  work.finish(error);
}

namespace {

// How long a failing rank looks for its peers' reasons. Peers that detect a
// death publish it within microseconds of raising; a store that does not
// answer (its host died) must not delay the error much.
constexpr auto kExplainBudget = std::chrono::milliseconds(500);

// How the shared-memory transport reports a death it detected
// ("rank 3 (pid 4242) died; detected by ..."): a known root cause.
constexpr const char* kDiedMarker = ") died;";

std::string what_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

// The rank a failure message blames ("... waiting for rank 3 ...", "rank 3
// called something it could not run", "rank 3 shut down its communicator"),
// or -1.
int blamed_rank(const std::string& msg) {
  auto number_at = [&](size_t pos) {
    return pos < msg.size() && std::isdigit(static_cast<unsigned char>(msg[pos])) ? std::atoi(msg.c_str() + pos) : -1;
  };
  const std::string waiting = "waiting for rank ";
  size_t at = msg.find(waiting);
  if (at != std::string::npos) return number_at(at + waiting.size());
  for (at = msg.find("rank "); at != std::string::npos; at = msg.find("rank ", at + 1)) {
    const int r = number_at(at + 5);
    const size_t after = msg.find_first_not_of("0123456789", at + 5);
    if (r < 0 || after == std::string::npos) continue;
    for (const std::string tail : {" called something it could not run", " shut down its communicator"}) {
      if (msg.compare(after, tail.size(), tail) == 0) return r;
    }
  }
  return -1;
}

}  // namespace

// Between hosts a death shows as a cascade: the rank next to the dead one
// sees its connection close and raises; its own peers then see *that* rank's
// connection close, and so on. Every failing rank publishes its reason in
// the store before it raises (so before its connections close), and then
// follows the chain of blame: the rank it blames, the rank that one blames,
// ..., until a report that names a death, or a rank that published nothing:
// that rank is the one that died (or hangs).
std::exception_ptr Communicator::explain(std::exception_ptr error) {
  const std::string mine = what_of(error);
  auto store = store_;
  const int rank = rank_;
  // On a helper thread, so a store that does not answer (its host died)
  // cannot hold the error past the budget; the thread keeps what it uses.
  auto task = std::make_shared<std::packaged_task<std::string()>>([store, rank, mine] {
    auto key = [](int r) { return "failure/" + std::to_string(r); };
    try {
      store->set(key(rank), mine);
    } catch (...) {
      return std::string();
    }
    std::string msg = mine;
    std::vector<int> seen{rank};
    const auto deadline = std::chrono::steady_clock::now() + kExplainBudget;
    while (true) {
      if (msg.find(kDiedMarker) != std::string::npos) return msg;
      const int p = blamed_rank(msg);
      if (p < 0 || std::find(seen.begin(), seen.end(), p) != seen.end()) return std::string();
      try {
        while (!store->check({key(p)}) && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (!store->check({key(p)})) {
          return "pycomm: rank " + std::to_string(p) +
                 " stopped without reporting an error: it died, was killed or hangs";
        }
        const auto v = store->get(key(p));
        msg.assign(v.begin(), v.end());
      } catch (...) {
        return std::string();
      }
      seen.push_back(p);
    }
  });
  auto cause = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (cause.wait_for(kExplainBudget + std::chrono::milliseconds(300)) != std::future_status::ready) return error;
  const std::string root = cause.get();
  if (root.empty() || root == mine) return error;
  return std::make_exception_ptr(CommError(root + " [rank " + std::to_string(rank_) + " saw: " + mine + "]"));
}

std::shared_ptr<Work> Communicator::submit(std::shared_ptr<Work> work, bool async_op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) throw CommError("pycomm: the communicator has been shut down");
  work->seq_ = next_seq_;
  next_seq_ += work->seq_span_;
  if (!async_op && queue_.empty() && !busy_) {
    busy_ = true;
    lk.unlock();
    execute(*work);
    lk.lock();
    busy_ = false;
    if (!queue_.empty() || stop_) cv_.notify_all();
    lk.unlock();
  } else {
    if (at::hasCallbacks()) work->caller_state_ = std::make_shared<at::ThreadLocalState>();
    queue_.push_back(work);
    lk.unlock();
    cv_.notify_all();
  }
  if (!async_op) work->wait();
  return work;
}

std::shared_ptr<Work> Communicator::reject(const std::string& why) {
  // The rejected call still takes its turn, so that peers that made the same
  // mistake stay in step and peers that did not fail at once.
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kInvalid;
  work->desc_.algo = Algorithm::kOneShot;
  try {
    submit(work, /*async_op=*/false);
  } catch (const CommError&) {
    // A peer disagreed; it has been told. Our own reason is the useful one.
  }
  throw CommError(why);
}

Algorithm Communicator::choose(Collective coll, Algorithm algo, bool strict, size_t bytes, Algorithm* inter) const {
  if (algo != Algorithm::kAuto && algo != Algorithm::kDirect && algo != Algorithm::kHier) {
    if (!algorithm_supports(algo, coll)) {
      if (strict) {
        std::ostringstream os;
        os << "pycomm." << collective_name(coll) << ": algorithm '" << algorithm_name(algo)
           << "' is not available for " << collective_name(coll) << "; use "
           << (coll == Collective::kBroadcast   ? "ring, tree, direct, hierarchical or auto"
               : coll == Collective::kAllToAll ? "direct or auto"
                                               : "ring, direct, hierarchical or auto");
        throw CommError(os.str());
      }
      algo = Algorithm::kAuto;
    }
  }
  if (multi_) {
    const Resolved r = tune_multihost(algo, coll, bytes, multi_->hosts(), multi_->uniform_local_size());
    *inter = r.inter;
    return r.algo;
  }
  // One host: "hierarchical" is simply the host's own algorithm.
  if (algo == Algorithm::kHier) algo = Algorithm::kAuto;
  const Algorithm a = local_ ? tune(algo, coll, bytes, world()) : tune_network(algo, coll, bytes, world());
  *inter = a;
  return a;
}

std::string Communicator::resolve(Collective coll, Algorithm algo, size_t bytes) const {
  Algorithm inter;
  const Algorithm a = choose(coll, algo, /*strict=*/false, bytes, &inter);
  std::string name = algorithm_name(a);
  if (a == Algorithm::kHierShard || a == Algorithm::kHierLeader) name += std::string("+") + algorithm_name(inter);
  return name;
}

// Checks shared by every collective with an input and an output tensor:
// each usable on its own, same dtype, and the element counts the collective
// needs: input.numel() * out_mult == output.numel() * in_mult.
std::string Communicator::check_io(Collective coll, const at::Tensor& input, const at::Tensor& output,
                                   int64_t in_mult, int64_t out_mult) const {
  std::string why = check_tensor(input, "input", coll);
  if (why.empty()) why = check_tensor(output, "output", coll);
  if (!why.empty()) return why;
  const std::string name = std::string("pycomm.") + collective_name(coll) + ": ";
  if (output.scalar_type() != input.scalar_type()) return name + "output dtype differs from input dtype";
  if (input.numel() * out_mult != output.numel() * in_mult) {
    std::ostringstream os;
    os << name;
    if (in_mult == out_mult) {
      os << "output has " << output.numel() << " elements but input has " << input.numel();
    } else if (in_mult > out_mult) {
      os << "input must have world_size (" << world() << ") x output.numel() (" << output.numel()
         << ") elements, got " << input.numel();
    } else {
      os << "output must have world_size (" << world() << ") x input.numel() (" << input.numel()
         << ") elements, got " << output.numel();
    }
    return os.str();
  }
  return "";
}

std::shared_ptr<Work> Communicator::launch(Collective coll, RedOp op, int root, uint64_t count,
                                           const at::Tensor& input, const at::Tensor& output, Algorithm algo,
                                           bool strict, bool async_op, Staging staging) {
  CollectiveDesc desc;
  desc.coll = coll;
  desc.op = op;
  desc.root = root;
  desc.count = count;
  to_dtype(output.scalar_type(), &desc.dtype);
  desc.input = input.data_ptr();
  desc.output = output.data_ptr();
  // The tuner sees the larger of the two buffers, like nccl-tests' size.
  const size_t bytes = std::max(input.numel(), output.numel()) * dtype_size(desc.dtype);
  try {
    desc.algo = choose(desc.coll, algo, strict, bytes, &desc.inter);
  } catch (const CommError& e) {
    return reject(e.what());
  }
  if ((desc.coll == Collective::kAllReduce || desc.coll == Collective::kReduceScatter) &&
      desc.op == RedOp::kAvg && !dtype_is_floating(desc.dtype))
    return reject(std::string("pycomm.") + collective_name(desc.coll) +
                  ": op=avg needs a floating-point tensor, got " + dtype_name(desc.dtype));
  auto work = std::make_shared<Work>();
  work->desc_ = desc;
  if (input.data_ptr() != output.data_ptr()) work->inputs_ = {input};
  work->outputs_ = {output};
  work->inputs_.insert(work->inputs_.end(), staging.keep.begin(), staging.keep.end());
  if (!staging.result.empty()) work->outputs_ = std::move(staging.result);
  work->before_ = std::move(staging.before);
  work->after_ = std::move(staging.after);
  return submit(std::move(work), async_op);
}

// All-reduce takes the same tensor (in place) or a separate one of the same
// size, plain or compressed.
std::string Communicator::check_all_reduce_io(const at::Tensor& input, const at::Tensor& output) const {
  std::string why = check_io(Collective::kAllReduce, input, output, 1, 1);
  if (why.empty() && output.data_ptr() != input.data_ptr() && overlaps(input, output))
    why = "pycomm.all_reduce: output partially overlaps input; pass the same tensor or a separate one";
  return why;
}

std::shared_ptr<Work> Communicator::all_reduce(const at::Tensor& input, const at::Tensor& output, RedOp op,
                                               Algorithm algo, bool strict, bool async_op,
                                               Staging staging) {
  const Collective coll = Collective::kAllReduce;
  std::string why = check_all_reduce_io(input, output);
  if (!why.empty()) return reject(why);
  return launch(coll, op, 0, input.numel(), input, output, algo, strict, async_op, std::move(staging));
}

std::shared_ptr<Work> Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, RedOp op,
                                                   Algorithm algo, bool strict, bool async_op,
                                                   Staging staging) {
  const Collective coll = Collective::kReduceScatter;
  std::string why = check_io(coll, input, output, world(), 1);
  if (why.empty() && overlaps(input, output)) why = "pycomm.reduce_scatter: output overlaps input";
  if (!why.empty()) return reject(why);
  return launch(coll, op, 0, output.numel(), input, output, algo, strict, async_op, std::move(staging));
}

std::shared_ptr<Work> Communicator::all_gather(const at::Tensor& output, const at::Tensor& input, Algorithm algo,
                                               bool strict, bool async_op, Staging staging) {
  const Collective coll = Collective::kAllGather;
  std::string why = check_io(coll, input, output, 1, world());
  if (why.empty() && overlaps(input, output)) {
    // In place is allowed when the input is exactly this rank's slot.
    const char* slot = static_cast<const char*>(output.data_ptr()) + rank() * input.numel() * input.element_size();
    if (input.data_ptr() != slot) why = "pycomm.all_gather: input overlaps output but is not this rank's slot of it";
  }
  if (!why.empty()) return reject(why);
  return launch(coll, RedOp::kSum, 0, input.numel(), input, output, algo, strict, async_op, std::move(staging));
}

std::shared_ptr<Work> Communicator::broadcast(const at::Tensor& tensor, int src, Algorithm algo, bool strict,
                                              bool async_op, Staging staging) {
  const Collective coll = Collective::kBroadcast;
  std::string why = check_tensor(tensor, "tensor", coll);
  if (why.empty() && (src < 0 || src >= world()))
    why = "pycomm.broadcast: src=" + std::to_string(src) + " is not a rank of this communicator (world size " +
          std::to_string(world()) + ")";
  if (!why.empty()) return reject(why);
  return launch(coll, RedOp::kSum, src, tensor.numel(), tensor, tensor, algo, strict, async_op, std::move(staging));
}

std::shared_ptr<Work> Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input, bool async_op,
                                               Staging staging) {
  const Collective coll = Collective::kAllToAll;
  std::string why = check_io(coll, input, output, 1, 1);
  if (why.empty() && input.numel() % world() != 0)
    why = "pycomm.all_to_all: input has " + std::to_string(input.numel()) +
          " elements, which does not split evenly into world_size (" + std::to_string(world()) + ") blocks";
  if (why.empty() && overlaps(input, output)) why = "pycomm.all_to_all: output overlaps input";
  if (!why.empty()) return reject(why);
  return launch(coll, RedOp::kSum, 0, input.numel() / world(), input, output, Algorithm::kAuto, false, async_op,
                std::move(staging));
}

size_t Communicator::compressed_shard_elems(size_t n, int block) const {
  return QuantizedAllReduce::shard_elems(n, world(), block);
}

std::shared_ptr<Work> Communicator::all_reduce_compressed(const at::Tensor& input, const at::Tensor& output,
                                                          RedOp op, const Codec& codec,
                                                          const at::Tensor& worker_residual,
                                                          const at::Tensor& server_residual, bool async_op) {
  const Collective coll = Collective::kAllReduce;
  std::string why = check_all_reduce_io(input, output);
  if (why.empty() && !(input.scalar_type() == at::kFloat || input.scalar_type() == at::kHalf ||
                       input.scalar_type() == at::kBFloat16))
    why = std::string("pycomm.all_reduce: compression needs a float32, float16 or bfloat16 tensor, got torch.") +
          std::string(c10::getDtypeNames(input.scalar_type()).first);
  if (why.empty() && op != RedOp::kSum && op != RedOp::kAvg)
    why = std::string("pycomm.all_reduce: compression supports op=sum and op=avg, not ") + redop_name(op);
  if (why.empty()) {
    why = codec.check();
    if (!why.empty()) why = "pycomm.all_reduce: " + why;
  }
  if (why.empty() && input.numel() > INT32_MAX && codec.kind == CodecKind::kTopK)
    why = "pycomm.all_reduce: TopK indexes with int32; the tensor has more than 2^31-1 elements";
  auto check_residual = [&](const at::Tensor& r, const char* name, int64_t want) {
    if (!why.empty() || !r.defined()) return;
    std::ostringstream os;
    if (r.scalar_type() != at::kFloat || !r.device().is_cpu() || !r.is_contiguous()) {
      os << "pycomm.all_reduce: the " << name << " residual must be a contiguous float32 CPU tensor";
    } else if (r.numel() != want) {
      os << "pycomm.all_reduce: the " << name << " residual has " << r.numel() << " elements, expected " << want;
    } else if (overlaps(r, input) || overlaps(r, output)) {
      os << "pycomm.all_reduce: the " << name << " residual overlaps the tensor";
    }
    why = os.str();
  };
  check_residual(worker_residual, "worker", input.numel());
  if (codec.quantized())
    check_residual(server_residual, "server",
                   static_cast<int64_t>(compressed_shard_elems(input.numel(), codec.block)));
  if (!why.empty()) return reject(why);

  CompressedCall call;
  to_dtype(input.scalar_type(), &call.dtype);
  call.op = op;
  call.n = static_cast<size_t>(input.numel());
  call.input = input.data_ptr();
  call.output = output.data_ptr();
  call.worker_residual = worker_residual.defined() ? worker_residual.data_ptr<float>() : nullptr;
  call.server_residual = codec.quantized() && server_residual.defined() ? server_residual.data_ptr<float>() : nullptr;
  // Stage ranges live with the call; the algorithm runs once, on one thread.
  auto ranges = std::make_shared<StageRanges>();
  call.stage = [ranges](const char* name) { ranges->enter(name); };

  auto work = std::make_shared<Work>();
  work->desc_.coll = coll;
  work->desc_.algo = Algorithm::kTwoShot;
  work->desc_.dtype = call.dtype;
  work->desc_.op = op;
  work->desc_.count = call.n;
  work->inputs_ = {input};
  if (worker_residual.defined()) work->inputs_.push_back(worker_residual);
  if (server_residual.defined()) work->inputs_.push_back(server_residual);
  work->outputs_ = {output};
  // The algorithm object lives in the body: the op may run later, on the
  // progress thread, and only then touches the workspace.
  std::shared_ptr<CompressedAllReduce> algo;
  if (codec.quantized()) {
    algo = std::make_shared<QuantizedAllReduce>(*top_, workspace_, codec, call);
  } else {
    algo = std::make_shared<SparseAllReduce>(*top_, workspace_, codec, call);
  }
  work->stats_ = algo->stats();
  work->seq_span_ = algo->seq_span();
  work->body_ = [algo](uint64_t seq) { algo->run(seq); };
  return submit(std::move(work), async_op);
}

std::shared_ptr<Work> Communicator::barrier(bool async_op) {
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kBarrier;
  work->desc_.algo = Algorithm::kOneShot;
  return submit(std::move(work), async_op);
}

}  // namespace pycomm
