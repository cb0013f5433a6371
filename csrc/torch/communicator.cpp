// The communicator's definitions, in the order a call meets them:
// lifecycle, the progress engine, the collectives (plain and compressed),
// then point-to-point lanes. About 500 lines: the parts share the queue,
// the lanes and the transports, and the checks, Work, blame and transport
// set-up already live in units of their own.
#include "communicator.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include "../algorithms/schedule.h"
#include "../compression/quantized_allreduce.h"
#include "../compression/sparse_allreduce.h"
#include "../transport/futex.h"
#include "dtype.h"
#include "peer_link.h"
#include "tensor_checks.h"

namespace pycomm {

namespace {

// How long a failing rank looks for its peers' reasons (transport/blame.h).
// Peers that detect a death publish it within microseconds of raising; a
// store that does not answer (its host died) must not delay the error much.
constexpr auto kExplainBudget = std::chrono::milliseconds(500);

std::string p2p_prefix(Collective coll) { return std::string("pycomm.") + collective_name(coll) + ": "; }

// What a point-to-point message's waits report and how long they may take.
OpContext p2p_context(Collective coll, uint64_t seq, double timeout_s) {
  return OpContext{coll, seq, 0, deadline_after(timeout_s), timeout_s};
}

// A registered tensor's storage context: it keeps the allocation mapped.
struct RegisteredStorage {
  std::shared_ptr<ShmAllocation> allocation;
};
void release_registered(void* ctx) { delete static_cast<RegisteredStorage*>(ctx); }

const ShmAllocation* allocation_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& p = t.storage().data_ptr();
  if (p.get_deleter() != &release_registered) return nullptr;
  return static_cast<const RegisteredStorage*>(p.get_context())->allocation.get();
}

TopologyConfig topology_of(const CommunicatorOptions& o, std::shared_ptr<PeerLink> link) {
  TopologyConfig t = o.topology;
  t.link = std::move(link);
  return t;
}

}  // namespace

// Failure reports in the bootstrap store, one key per rank.
class Communicator::StoreBoard : public FailureBoard {
 public:
  explicit StoreBoard(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void publish(int rank, const std::string& report) override { store_->set(key(rank), report); }
  std::optional<std::string> lookup(int rank) override {
    if (!store_->check({key(rank)})) return std::nullopt;
    const auto v = store_->get(key(rank));
    return std::string(v.begin(), v.end());
  }

 private:
  static std::string key(int rank) { return "failure/" + std::to_string(rank); }
  c10::intrusive_ptr<c10d::Store> store_;
};

// Heartbeat counters in the bootstrap store, one key per rank, over the
// connection of the store object the communicator was given. Not one of
// their own: opening a store connection took seconds at times, and held up
// this process's other calls on the store meanwhile (the blame chain's). A
// caller's blocking call on the same store object (a wait for a key that
// does not come) holds the beats up; README says what to do about it.
class Communicator::StoreBeats : public BeatBoard {
 public:
  explicit StoreBeats(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void beat(int rank) override { store_->add(key(rank), 1); }
  void mark(int rank, int64_t mark) override {
    const std::string v = std::to_string(mark);
    store_->set(key(rank), std::vector<uint8_t>(v.begin(), v.end()));
  }
  std::vector<int64_t> read(const std::vector<int>& ranks) override {
    std::vector<std::string> keys;
    for (int r : ranks) keys.push_back(key(r));
    std::vector<int64_t> out(ranks.size(), 0);
    // multiGet waits for keys that do not exist yet (a peer that did not
    // beat yet): read only what is there.
    if (store_->check(keys)) {
      const auto values = store_->multiGet(keys);
      for (size_t i = 0; i < values.size() && i < out.size(); ++i) out[i] = parse(values[i]);
    } else {
      for (size_t i = 0; i < keys.size(); ++i)
        if (store_->check({keys[i]})) out[i] = parse(store_->get(keys[i]));
    }
    return out;
  }

 private:
  static std::string key(int rank) { return "beat/" + std::to_string(rank); }
  static int64_t parse(const std::vector<uint8_t>& v) {
    try {
      return std::stoll(std::string(v.begin(), v.end()));
    } catch (const std::exception&) {
      return 0;
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
};

// ------------------------------------------------------------ lifecycle

Communicator::Communicator(const CommunicatorOptions& o)
    : rank_(o.topology.rank),
      world_(o.topology.world),
      link_(o.backend ? std::make_shared<C10dLink>(o.backend) : nullptr),
      transports_(topology_of(o, link_)) {
  if (o.backend && o.store) board_ = std::make_shared<StoreBoard>(o.store);
  progress_ = std::thread([this] { progress_loop(); });
  // Heartbeats between hosts (this host's peers beat in shared memory).
  std::vector<int> remote;
  for (int r = 0; r < world_; ++r)
    if (r != rank_ && transports_.local_rank_of(r) < 0) remote.push_back(r);
  if (!board_ || remote.empty()) return;
  auto beats = std::make_shared<StoreBeats>(o.store);
  const double bound = heartbeat_setting();
  if (bound <= 0) {
    try {
      beats->mark(rank_, BeatBoard::kOptedOut);
    } catch (const std::exception&) {
      // Peers never judge a rank that did not beat either.
    }
    return;
  }
  PeerWatchConfig w;
  w.board = beats;
  w.rank = rank_;
  w.peers = std::move(remote);
  w.bound_s = bound;
  w.on_silent = [this](int peer, double silent_s, double bound_s) { declare_silent(peer, silent_s, bound_s); };
  watch_ = std::make_unique<PeerWatch>(std::move(w));
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
  std::map<std::pair<int, bool>, std::shared_ptr<Lane>> lanes;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    lanes.swap(lanes_);
  }
  lanes.clear();  // each lane finishes its queue, then joins its thread
  // Peers stop judging this rank before its process may exit.
  if (watch_) watch_->stop(/*leave=*/true);
  transports_.shutdown();
}

double Communicator::heartbeat_timeout() const {
  if (transports_.local()) return transports_.local()->heartbeat_timeout();
  return watch_ ? watch_->bound() : 0;
}

void Communicator::set_heartbeat_timeout(double seconds) {
  if (transports_.local()) transports_.local()->set_heartbeat_timeout(seconds);
  if (watch_) watch_->set_bound(seconds);
}

void Communicator::declare_silent(int peer, double silent_s, double bound_s) {
  std::ostringstream os;
  os.precision(3);
  if (peer == rank_) {
    os << "pycomm: rank " << rank_ << " was declared failed by its peers: its heartbeat stopped for longer than "
       << bound_s << " s (this process was stopped or frozen, or its machine stalled); they went on "
       << "without it, and it may not take part in this communicator again";
  } else {
    os << "pycomm: rank " << peer << " stopped responding: no heartbeat on the Store for ";
    if (silent_s > 0)
      os << silent_s << " s";
    else
      os << "longer than the bound";
    os << " (stopped, frozen, or its machine stalled; the bound is " << bound_s
       << " s); detected by rank " << rank_;
    std::lock_guard<std::mutex> lk(silent_mu_);
    silent_.push_back(peer);
  }
  abort(os.str(), Blame{FailureKind::kSilent, peer});
}

void Communicator::abort(const std::string& why, Blame blame) {
  transports_.top().abort(why, blame);
  // Ranks of other hosts that lose their connection to this one read why on
  // the failure board (blame.h), even if the messages below never reach them.
  // A report already there stays: it is the cause (a failure, a peer found
  // silent), and what follows it (the fence of a shrink) only a consequence.
  if (board_) {
    try {
      if (!board_->lookup(rank_)) board_->publish(rank_, encode_failure(CommError(why, blame)));
    } catch (const std::exception&) {
      // The store is gone: the messages below are all that is left.
    }
  }
  PgChannels* remote = transports_.remote_p2p();
  if (!remote) return;
  // Ranks of other hosts learn of an abort from shared memory no more: every
  // remote rank this one exchanged messages with gets the reason as its next
  // message (queued behind what was already sent, so the stream stays in
  // step), and its receive raises at once instead of waiting for the timeout.
  std::vector<int> peers;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    for (const auto& [key, lane] : lanes_)
      if (p2p_peer(key.first, Collective::kSend).first == remote) peers.push_back(key.first);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  for (int peer : peers) {
    try {
      send_failure(peer, why, /*async_op=*/true);
    } catch (const std::exception&) {
      // Shut down already, or the peer is gone: nothing to tell.
    }
  }
  // Receives from other hosts stop waiting (this rank's own lanes).
  remote->abort(why, blame);
  // A rank gone for good will not answer: wake the waits between hosts now
  // (they raise `why`, see PgTransport::abort) rather than at their deadline.
  if (blame.gone() && link_) link_->interrupt();
}

// ------------------------------------------------------ progress engine

std::shared_ptr<Work> Communicator::submit(std::shared_ptr<Work> work, bool async_op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) {
    // Closed after an abort (a shrink replaced it): the abort says why.
    const ShmTransport* shm = transports_.local();
    if (shm && shm->aborted()) throw shm->abort_error();
    throw CommError("pycomm: the communicator has been shut down");
  }
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

void Communicator::execute(Work& work) {
  work.start();
  std::optional<at::ThreadLocalStateGuard> caller_state;
  if (work.caller_state_) caller_state.emplace(*work.caller_state_);
  std::exception_ptr error;
  try {
    RECORD_USER_SCOPE(range_name(work.desc_.coll));
    if (work.before_) work.before_();
    if (work.body_) {
      work.body_(work.seq_);
    } else {
      transports_.top().run(work.desc_, work.seq_);
    }
    if (work.after_) work.after_();
  } catch (...) {
    error = std::current_exception();
  }
  if (error && board_) error = explain_failure(board_, rank_, error, kExplainBudget);
  work.finish(error);
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

// ---------------------------------------------------------- collectives

Resolved Communicator::choose(Collective coll, Algorithm algo, bool strict, size_t bytes) const {
  if (!algorithm_applies(algo, coll)) {
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
  return transports_.choose(algo, coll, bytes);
}

std::string Communicator::resolve(Collective coll, Algorithm algo, size_t bytes) const {
  const Resolved r = choose(coll, algo, /*strict=*/false, bytes);
  std::string name = algorithm_name(r.algo);
  if (r.algo == Algorithm::kHierShard || r.algo == Algorithm::kHierLeader)
    name += std::string("+") + algorithm_name(r.inter);
  return name;
}

at::Tensor Communicator::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  ShmTransport* shm = transports_.local();
  if (!shm || shm->world() == 1) return at::empty(sizes, options);
  int64_t numel = 1;
  for (int64_t s : sizes) {
    if (s < 0) throw CommError("pycomm: comm.empty: negative size in " + c10::str(sizes));
    numel *= s;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  // In the communicator's sequence, like any collective: the local ranks
  // agree on the segment in their n-th call.
  std::shared_ptr<ShmAllocation> allocation;
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kBarrier;
  work->body_ = [&](uint64_t seq) { allocation = shm->allocate(bytes, seq); };
  submit(work, /*async_op=*/false);  // waits; rethrows a failure
  c10::DataPtr data(allocation->region(allocation->rank()), new RegisteredStorage{allocation}, &release_registered,
                    at::Device(at::kCPU));
  // Not resizable: the memory peers read cannot move.
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, sizes);
}

at::Tensor Communicator::scratch(int slot, size_t bytes) {
  const auto bytes_of = at::TensorOptions().dtype(at::kByte);
  ShmTransport* shm = transports_.local();
  const bool worth = shm && shm->world() > 1 &&
                     transports_.choose(Algorithm::kAuto, Collective::kAllReduce, bytes).algo == Algorithm::kTwoShot;
  std::lock_guard<std::mutex> lk(scratch_mu_);
  if (!worth || scratch_failed_) return at::empty({static_cast<int64_t>(bytes)}, bytes_of);
  at::Tensor& s = scratch_[slot];
  if (!s.defined() || static_cast<size_t>(s.numel()) < bytes) {
    // Whole MiBs, so that sizes that grow a little do not reallocate each time.
    const size_t want = (bytes + (1 << 20) - 1) >> 20 << 20;
    s = at::Tensor();  // queued ops keep the old buffer alive as long as they need it
    try {
      s = empty({static_cast<int64_t>(want)}, at::kByte);
    } catch (const CommError& e) {
      scratch_failed_ = true;
      TORCH_WARN("pycomm: could not allocate ", want >> 20, " MiB of registered memory for coalesced calls (",
                 e.what(), "); they use ordinary memory from now on");
      return at::empty({static_cast<int64_t>(bytes)}, bytes_of);
    }
  }
  return s;
}

std::vector<int> Communicator::gone_ranks() {
  std::vector<int> out;
  if (ShmTransport* shm = transports_.local()) {
    out = shm->gone_ranks();
    const CommError e = shm->abort_error();
    const Blame b = e.blame();
    if (b.gone() && b.rank >= 0) out.push_back(b.rank);
  }
  {
    std::lock_guard<std::mutex> lk(silent_mu_);
    out.insert(out.end(), silent_.begin(), silent_.end());
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

int Communicator::registered_by(const at::Tensor& t) const {
  const ShmAllocation* a = allocation_of(t);
  if (!a) return 0;
  const ShmTransport* shm = transports_.local();
  return shm && a->owner() == shm->segment_name() ? 1 : 2;
}

std::shared_ptr<Work> Communicator::launch(Collective coll, RedOp op, int root, uint64_t count,
                                           const at::Tensor& input, const at::Tensor& output, Algorithm algo,
                                           bool strict, bool async_op, Staging staging) {
  for (const at::Tensor* t : {&input, &output}) {
    if (registered_by(*t) == 2)
      return reject(std::string("pycomm.") + collective_name(coll) + ": the " + (t == &input ? "input" : "output") +
                    " was allocated by another communicator's empty(); registered memory serves the "
                    "communicator that made it (use this one's empty(), or clone() the tensor)");
  }
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
    const Resolved r = choose(desc.coll, algo, strict, bytes);
    desc.algo = r.algo;
    desc.inter = r.inter;
  } catch (const CommError& e) {
    return reject(e.what());
  }
  if (desc.coll == Collective::kAllReduce || desc.coll == Collective::kReduceScatter) {
    const std::string why = check_reducible(desc.dtype, desc.op);
    if (!why.empty()) return reject(std::string("pycomm.") + collective_name(desc.coll) + ": " + why);
  }
  auto work = std::make_shared<Work>();
  work->desc_ = desc;
  if (input.data_ptr() != output.data_ptr()) work->inputs_ = {input};
  work->outputs_ = {output};
  work->inputs_.insert(work->inputs_.end(), staging.keep.begin(), staging.keep.end());
  if (!staging.result.empty()) work->outputs_ = std::move(staging.result);
  work->before_ = std::move(staging.before);
  work->after_ = std::move(staging.after);
  work->desc_.timeout_s = staging.timeout_s;
  return submit(std::move(work), async_op);
}

std::shared_ptr<Work> Communicator::all_reduce(const at::Tensor& input, const at::Tensor& output, RedOp op,
                                               Algorithm algo, bool strict, bool async_op,
                                               Staging staging) {
  const std::string why = check_all_reduce_io(input, output, world());
  if (!why.empty()) return reject(why);
  return launch(Collective::kAllReduce, op, 0, input.numel(), input, output, algo, strict, async_op,
                std::move(staging));
}

std::shared_ptr<Work> Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, RedOp op,
                                                   Algorithm algo, bool strict, bool async_op,
                                                   Staging staging) {
  const Collective coll = Collective::kReduceScatter;
  std::string why = check_io(coll, input, output, world(), 1, world());
  if (why.empty() && overlaps(input, output)) why = "pycomm.reduce_scatter: output overlaps input";
  if (!why.empty()) return reject(why);
  return launch(coll, op, 0, output.numel(), input, output, algo, strict, async_op, std::move(staging));
}

std::shared_ptr<Work> Communicator::all_gather(const at::Tensor& output, const at::Tensor& input, Algorithm algo,
                                               bool strict, bool async_op, Staging staging) {
  const Collective coll = Collective::kAllGather;
  std::string why = check_io(coll, input, output, 1, world(), world());
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
  std::string why = check_io(coll, input, output, 1, 1, world());
  if (why.empty() && input.numel() % world() != 0)
    why = "pycomm.all_to_all: input has " + std::to_string(input.numel()) +
          " elements, which does not split evenly into world_size (" + std::to_string(world()) + ") blocks";
  if (why.empty() && overlaps(input, output)) why = "pycomm.all_to_all: output overlaps input";
  if (!why.empty()) return reject(why);
  return launch(coll, RedOp::kSum, 0, input.numel() / world(), input, output, Algorithm::kAuto, false, async_op,
                std::move(staging));
}

std::shared_ptr<Work> Communicator::barrier(bool async_op, double timeout_s) {
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kBarrier;
  work->desc_.algo = Algorithm::kOneShot;
  work->desc_.timeout_s = timeout_s;
  return submit(std::move(work), async_op);
}

size_t Communicator::compressed_shard_elems(size_t n, int block) const {
  return QuantizedAllReduce::shard_elems(n, world(), block);
}

std::shared_ptr<Work> Communicator::all_reduce_compressed(const at::Tensor& input, const at::Tensor& output,
                                                          RedOp op, const Codec& codec,
                                                          const at::Tensor& worker_residual,
                                                          const at::Tensor& server_residual, bool async_op) {
  const std::string why = check_compressed(input, output, op, codec, worker_residual, server_residual, world());
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
  work->desc_.coll = Collective::kAllReduce;
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
    algo = std::make_shared<QuantizedAllReduce>(transports_.top(), workspace_, codec, call);
  } else {
    algo = std::make_shared<SparseAllReduce>(transports_.top(), workspace_, codec, call);
  }
  work->stats_ = algo->stats();
  work->seq_span_ = algo->seq_span();
  work->body_ = [algo](uint64_t seq) { algo->run(seq); };
  return submit(std::move(work), async_op);
}

// ------------------------------------------------------- point-to-point

// The messages of one direction with one peer run in order on their own
// thread: a receive waiting for its data never holds up collectives or
// traffic with other peers, and a send blocked on a full ring never holds
// up receives (so two ranks can send each other large messages at once).
struct Communicator::Lane {
  // `await_data` (incoming lanes over shared memory): waits up to a bound
  // for the next message's bytes; true once they are there.
  using AwaitData = std::function<bool(std::chrono::microseconds)>;
  Lane(Communicator* comm, AwaitData await) : comm_(comm), await_data(std::move(await)), thread([this] { loop(); }) {}
  // Finishes what was queued, then joins.
  ~Lane() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stopping = true;
    }
    cv.notify_one();
    if (thread.joinable()) thread.join();
  }

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
  // Notifies under the lock: a lane being destroyed waits (in loop) for
  // busy to clear, and may be freed as soon as this caller lets go of mu.
  void release() {
    std::lock_guard<std::mutex> lk(mu);
    busy = false;
    cv.notify_one();
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
      send_failure(dst, msg, /*async_op=*/false);
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

void Communicator::send_failure(int dst, const std::string& why, bool async_op) {
  const auto target = p2p_peer(dst, Collective::kSend);
  auto work = std::make_shared<Work>();
  work->desc_.coll = Collective::kSend;
  work->desc_.root = dst;
  work->body_ = [this, channels = target.first, peer = target.second, why](uint64_t seq) {
    channels->send_failure(peer, why, p2p_context(Collective::kSend, seq, timeout()));
  };
  submit_p2p(dst, false, std::move(work), async_op);
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
