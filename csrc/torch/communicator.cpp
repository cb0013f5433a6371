// The communicator's definitions, in the order a call meets them:
// lifecycle (failures and heartbeats included), the progress engine, the
// collectives (plain, registered and compressed). Point-to-point lanes are
// in communicator_p2p.cpp; the Store boards in store_boards.h; the checks,
// Work, blame and transport set-up in units of their own.
#include "communicator.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include "../algorithms/schedule.h"
#include "../core/race_window.h"
#include "../transport/thread_name.h"
#include "../compression/quantized_allreduce.h"
#include "../compression/sparse_allreduce.h"
#include "../transport/futex.h"
#include "dtype.h"
#include "peer_link.h"
#include "store_boards.h"
#include "tensor_checks.h"

namespace pycomm {

namespace {

// How long a failing rank looks for its peers' reasons (transport/blame.h).
// Peers that detect a death publish it within microseconds of raising; a
// store that does not answer (its host died) must not delay the error much.
constexpr auto kExplainBudget = std::chrono::milliseconds(500);

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

// ------------------------------------------------------------ lifecycle

Communicator::Communicator(const CommunicatorOptions& o)
    : rank_(o.topology.rank),
      world_(o.topology.world),
      link_(o.backend ? std::make_shared<C10dLink>(o.backend) : nullptr),
      transports_(topology_of(o, link_)) {
  if (o.backend && o.store) board_ = std::make_shared<StoreBoard>(o.store);
  progress_ = named_thread("progress", [this] { progress_loop(); });
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
  w.on_failed = [this](int peer) { peer_aborted(peer); };
  watch_ = std::make_unique<PeerWatch>(std::move(w));
}

Communicator::~Communicator() {
  try {
    shutdown();
  } catch (...) {
  }
}

void Communicator::shutdown() {
  // A fork() child's copy: the threads and the rank's place among its peers
  // are the parent's to end.
  if (forked_copy()) return;
  if (on_own_thread())
    throw CommError("pycomm: close() was called from a future's callback, which runs on the communicator's own "
                    "thread, the one that would finish its queue; close it from another thread");
  // One closer at a time: two joins of one thread never return (the second
  // waits on a thread already gone). A later closer finds it all done.
  std::lock_guard<std::mutex> closing(shutdown_mu_);
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (stop_ && !progress_.joinable()) return;
    stop_ = true;
  }
  race_window("shutdown: before waking the progress thread");
  cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  // Point-to-point lanes finish what was queued, like the progress thread.
  finish_lanes();
  // Peers stop judging this rank before its process may exit.
  if (watch_) watch_->stop(/*leave=*/true);
  race_window("shutdown: before the transports");
  transports_.shutdown([this](int rank) {
    try {
      return board_ && board_->lookup(rank).has_value();
    } catch (const std::exception&) {
      return false;  // the store is gone: wait for the sends as before
    }
  });
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

void Communicator::peer_aborted(int peer) {
  CommError error("pycomm: rank " + std::to_string(peer) + " aborted (its reason is not on the failure board); "
                  "seen by rank " + std::to_string(rank_));
  try {
    if (auto report = board_ ? board_->lookup(peer) : std::nullopt) decode_failure(*report, &error);
  } catch (const std::exception&) {
    // The store is gone: say what is known.
  }
  transports_.top().abort(error.what(), error.blame());
  if (link_) link_->interrupt(PeerLink::Waits::kCollectives);
}

void Communicator::abort(const std::string& why, Blame blame) {
  // A fork() child's copy is unusable already; aborting would end the
  // parent's job.
  if (forked_copy()) return;
  race_window("abort: before the transport");
  transports_.top().abort(why, blame);
  race_window("abort: before the failure board");
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
  // Then the mark that makes the peers' judges look there (after the report,
  // so that they find it): their collectives stop waiting for this rank.
  if (watch_) watch_->mark_failed();
  abort_remote_p2p(why, blame);
  // Wake the collectives' waits between hosts now (they raise `why`, see
  // PgTransport::abort) rather than at their deadline; a rank gone for good
  // will not answer messages either.
  if (link_) link_->interrupt(blame.gone() ? PeerLink::Waits::kAll : PeerLink::Waits::kCollectives);
}

// ------------------------------------------------------ progress engine

void Communicator::refuse_in_fork() const {
  if (!forked_copy()) return;
  const std::string owner = std::to_string(owner_pid_);
  throw CommError("pycomm: this communicator (rank " + std::to_string(rank_) + ") belongs to process " + owner +
                  ", and this process (" + std::to_string(current_pid()) + ") is a fork() of it: fork copies "
                  "only the calling thread, so the communicator's threads and its place among its peers stayed "
                  "with process " + owner + ". Call it there; start helper processes with multiprocessing's "
                  "'spawn' method, or let them exit without calling it");
}

std::shared_ptr<Work> Communicator::submit(std::shared_ptr<Work> work, bool async_op) {
  refuse_in_fork();
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
  refuse_in_fork();
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

std::string Communicator::failure() {
  if (ShmTransport* shm = transports_.local()) {
    if (shm->aborted()) return shm->abort_error().what();
  }
  std::lock_guard<std::mutex> lk(silent_mu_);
  if (!silent_.empty())
    return "pycomm: rank " + std::to_string(silent_.front()) + " stopped responding (no heartbeat on the Store)";
  return "";
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
  // NCCL's in-place form, which ZeRO-3 uses: the output is this rank's
  // block of the input.
  if (why.empty() && overlaps(input, output) && !is_rank_block(output, input, rank()))
    why = "pycomm.reduce_scatter: output overlaps input but is not this rank's block of it (in place, as with "
          "NCCL: output = input[rank * n:(rank + 1) * n] of a flat input)";
  if (!why.empty()) return reject(why);
  // In place runs as it is: only this rank reads its own block of the input
  // (peers take the other blocks, from its mailboxes or registered memory,
  // or through the process group), in the step that writes the same
  // elements of the output, or before; a multi-host call reads all of it in
  // its local phase, before its cross phase writes the output. The
  // collective matrix runs every algorithm in place, over several rounds.
  return launch(coll, op, 0, output.numel(), input, output, algo, strict, async_op, std::move(staging));
}

std::shared_ptr<Work> Communicator::all_gather(const at::Tensor& output, const at::Tensor& input, Algorithm algo,
                                               bool strict, bool async_op, Staging staging) {
  const Collective coll = Collective::kAllGather;
  std::string why = check_io(coll, input, output, 1, world(), world());
  // In place is allowed when the input is exactly this rank's slot.
  if (why.empty() && overlaps(input, output) && !is_rank_block(input, output, rank()))
    why = "pycomm.all_gather: input overlaps output but is not this rank's slot of it";
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

}  // namespace pycomm
