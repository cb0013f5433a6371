// The communicator: validates calls, orders them, runs them on its
// transports and hands back a Work whose torch Future completes when the
// data is ready.
//
// Ordering: every op gets a sequence number at submission and runs in that
// order, on the progress thread, or, for a synchronous op submitted while
// nothing is queued or running, directly on the caller's thread (which
// saves two thread hand-offs on small messages and changes no ordering).
// Point-to-point messages run on lanes of their own, one per peer and
// direction (see Lane in communicator_p2p.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/codec.h"
#include "../core/collective.h"
#include "../transport/blame.h"
#include "../transport/peer_watch.h"
#include "../transport/process.h"
#include "../transport/setup.h"
#include "work.h"

namespace pycomm {

class C10dLink;

struct CommunicatorOptions {
  // Ranks, hosts, segment names and sizes (the link is filled in from
  // `backend`).
  TopologyConfig topology;
  // Carries the traffic between hosts (or every transfer with use_shm
  // false); its rank r is the communicator's rank r. May be null on one host.
  c10::intrusive_ptr<c10d::Backend> backend;
  // The communicator's bootstrap store (optional). Between hosts, a rank
  // that fails leaves its reason there, so that ranks which only see the
  // consequences (a closed connection, a peer that gave up) can name the
  // cause: "rank 3 died", not "rank 2 left" (transport/blame.h).
  c10::intrusive_ptr<c10d::Store> store;
};

class Communicator {
 public:
  explicit Communicator(const CommunicatorOptions& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // `algo` may be kAuto; `strict` makes an algorithm the collective cannot
  // use an error instead of a fall-back to kAuto.
  std::shared_ptr<Work> all_reduce(const at::Tensor& input, const at::Tensor& output, RedOp op,
                                   Algorithm algo, bool strict, bool async_op, Staging staging = {});
  std::shared_ptr<Work> reduce_scatter(const at::Tensor& output, const at::Tensor& input, RedOp op,
                                       Algorithm algo, bool strict, bool async_op, Staging staging = {});
  std::shared_ptr<Work> all_gather(const at::Tensor& output, const at::Tensor& input, Algorithm algo,
                                   bool strict, bool async_op, Staging staging = {});
  std::shared_ptr<Work> broadcast(const at::Tensor& tensor, int src, Algorithm algo, bool strict,
                                  bool async_op, Staging staging = {});
  std::shared_ptr<Work> all_to_all(const at::Tensor& output, const at::Tensor& input, bool async_op,
                                   Staging staging = {});
  // `timeout_s` > 0 bounds this barrier's waits instead of the timeout.
  std::shared_ptr<Work> barrier(bool async_op, double timeout_s = 0);

  // Point-to-point, between ranks of one host (shared memory). Unlike
  // collectives these involve two ranks only and do not take a sequence
  // number: each ordered pair of ranks keeps its own order, in which a
  // rank's sends to a peer arrive at that peer's receives from it. `send`
  // completes once the data is in the channel. `tag` is checked, not
  // matched: a receive whose tag differs from the next message's raises on
  // both ranks. `recv` fills `out` when given (same number of tensors,
  // dtypes and shapes as sent) and otherwise allocates what the message
  // describes: the Work's result holds the tensors either way.
  std::shared_ptr<Work> send(const std::vector<at::Tensor>& tensors, int dst, uint32_t tag, bool async_op);
  std::shared_ptr<Work> recv(const std::vector<at::Tensor>& out, int src, uint32_t tag, bool async_op);

  // All-reduce (sum or avg) through a codec (Int8/Int4/TopK). The residuals
  // (float32, may be undefined) carry error feedback between calls: worker
  // residual has input.numel() elements, the server residual (quantizers
  // only) compressed_shard_elems() elements.
  std::shared_ptr<Work> all_reduce_compressed(const at::Tensor& input, const at::Tensor& output, RedOp op,
                                              const Codec& codec, const at::Tensor& worker_residual,
                                              const at::Tensor& server_residual, bool async_op);
  // Elements of this rank's reduced shard in a quantized all-reduce of n.
  size_t compressed_shard_elems(size_t n, int block) const;

  // Registered memory (comm.empty): a contiguous CPU tensor whose storage
  // lies in shared memory every local rank has mapped; collectives whose
  // tensors all lie there read peers' data in place (transport/shm.h). A
  // collective over the local ranks: each calls it with the same shape and
  // dtype, in the same order as its other calls. Its storage cannot grow
  // (resize_ beyond it raises) and stays mapped while any tensor uses it,
  // even after the communicator is closed. Without shared memory (one rank
  // per host, or use_shm false) it is an ordinary tensor.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  // Registered memory pycomm keeps for flat buffers it owns (the packed
  // tensors of coalesced calls): a uint8 tensor of at least `bytes`, the
  // same for every call on one `slot`, grown (through empty(), so every
  // local rank must ask in the same order with the same sizes) when a call
  // needs more. Ordinary memory where registration gains nothing: without
  // shared memory, below the size where an all-reduce runs two-shot, or
  // after an allocation failed (warned once; every rank sees the failure,
  // so every rank falls back alike). Slot kScratchBackend serves the c10d
  // backend, whose packing runs in the op's turn; kScratchCaller serves
  // synchronous calls that pack on the caller's thread, which must not
  // write a buffer a queued op will still pack into.
  static constexpr int kScratchBackend = 0;
  static constexpr int kScratchCaller = 1;
  at::Tensor scratch(int slot, size_t bytes);
  // `t`'s storage came from a communicator's empty(): 1 this one, 2 another
  // one, 0 none.
  int registered_by(const at::Tensor& t) const;
  // Ranks known to be gone for good: local peers whose process died or
  // whose heartbeat stopped, and the rank a failure blamed as dead (kDied)
  // or silent (kSilent) when this communicator aborted. What a shrink excludes
  // without waiting for it.
  std::vector<int> gone_ranks();
  // Why this communicator failed, as its next call would raise it, or "" while
  // it has not (as this host's shared memory or the heartbeat says): a cheap
  // poll for work that waits elsewhere (pycomm.elastic's epoch groups).
  std::string failure();
  // Collectives that ran in place on registered memory so far.
  uint64_t in_place_calls() const { return transports_.local() ? transports_.local()->in_place_calls() : 0; }

  // Rejects a call made with bad arguments: it still takes its turn in the
  // sequence (so every rank raises, none hangs), then throws CommError(why).
  [[noreturn]] std::shared_ptr<Work> reject(const std::string& why);

  // The concrete algorithm a call of `bytes` per rank would run, e.g.
  // "direct(two-shot)" or "hier(shard)+ring".
  std::string resolve(Collective coll, Algorithm algo, size_t bytes) const;

  // Returns once every local rank has joined (see ShmTransport::wait_all_attached).
  void wait_ready() { transports_.wait_ready(); }
  bool wait_ready_for(double seconds) { return transports_.wait_ready_for(seconds); }
  uint32_t abandon_ready() { return transports_.abandon_ready(); }

  // Finishes queued ops, then tells peers this rank is gone. Idempotent;
  // concurrent callers wait for the one that closes.
  // Not from the communicator's own threads (a future's callback runs
  // there): it raises CommError, since that thread runs the queue.
  void shutdown();
  // Whether the calling thread is this communicator's own: its progress
  // thread or a point-to-point lane's, where futures' callbacks run. Such a
  // thread can neither join itself nor outlive the object it runs in, so the
  // last reference dropped there must end the communicator elsewhere.
  bool on_own_thread() const;
  // Whether this process is a fork() child of the one that made the
  // communicator (transport/process.h says why that matters). There its
  // calls raise CommError, shutdown() and abort() leave the parent's
  // communicator alone, and the last reference leaves the copy undestroyed.
  bool forked_copy() const { return forked_from(owner_pid_); }
  // Raises CommError saying so in a fork() child, before any lock is taken:
  // the parent's threads may have held them at the fork.
  void refuse_in_fork() const;
  // Makes the current and later operations fail with `why`, here and (through
  // the segment, the failure board and the heartbeat board's mark) on every
  // rank. The collectives' waits between hosts in progress end at once; a
  // `blame` that names a rank gone for good (Blame::gone) ends the messages'
  // waits too, instead of at their deadline.
  void abort(const std::string& why, Blame blame = {});

  int rank() const { return rank_; }
  int world() const { return world_; }
  double timeout() const { return transports_.timeout(); }
  void set_timeout(double seconds) { transports_.set_timeout(seconds); }
  // The heartbeat bound: peers of this host are judged by the shared-memory
  // transport (transport/shm.h), peers of other hosts by a PeerWatch over
  // the store (transport/peer_watch.h); both use the same bound. 0 without
  // either.
  double heartbeat_timeout() const;
  void set_heartbeat_timeout(double seconds);
  size_t round_bytes() const { return transports_.local() ? transports_.local()->round_bytes() : 0; }
  // "shm", "process_group" or "shm+process_group": what carries the data.
  std::string transport_name() const { return transports_.name(); }

 private:
  struct Lane;

  std::shared_ptr<Work> submit(std::shared_ptr<Work> work, bool async_op);
  // Describes the call (count as in CollectiveDesc), resolves the algorithm
  // and submits; op and root matter only where the collective has them.
  std::shared_ptr<Work> launch(Collective coll, RedOp op, int root, uint64_t count, const at::Tensor& input,
                               const at::Tensor& output, Algorithm algo, bool strict, bool async_op,
                               Staging staging);
  void execute(Work& work);
  void progress_loop();
  // Resolves `algo` (and, between hosts, the inter-host schedule).
  Resolved choose(Collective coll, Algorithm algo, bool strict, size_t bytes) const;
  // Point-to-point: the local rank of `peer` (checked), and the lane that
  // runs the messages of one direction with one peer, in order.
  // The channels that reach communicator rank `peer`, and its index there.
  std::pair<MessageChannels*, int> p2p_peer(int peer, Collective coll) const;
  void submit_p2p(int peer, bool incoming, std::shared_ptr<Work> work, bool async_op);
  // Each lane finishes its queue and joins its thread (shutdown).
  void finish_lanes();
  void recv_body(Work& work, MessageChannels& channels, int peer, uint32_t tag, bool allocate);
  // Sends `why` to `dst` as a failure message: its receive raises it (and,
  // when `last`, every later receive from this rank: it aborted).
  void send_failure(int dst, const std::string& why, bool async_op, bool last);
  // Communicator::abort's part between hosts: the reason to every remote
  // rank as its stream's last message, and this rank's receives stopped.
  void abort_remote_p2p(const std::string& why, Blame blame);
  // The PeerWatch's verdict: `peer`, on another host, stopped beating.
  void declare_silent(int peer, double silent_s, double bound_s);
  // The PeerWatch's news: `peer`, on another host, aborted. This rank's
  // collectives fail with its reason (the failure board's), as they do at
  // once on its own host; messages from it end with its stream instead, so
  // that what it sent before is still delivered.
  void peer_aborted(int peer);

  const int32_t owner_pid_ = current_pid();
  int rank_ = 0;
  int world_ = 1;
  // Carries the traffic between hosts (null without a backend).
  std::shared_ptr<C10dLink> link_;
  Transports transports_;
  Workspace workspace_;  // used by composite ops, which run one at a time
  // Where failing ranks publish their reasons (multi-host only; null else).
  std::shared_ptr<FailureBoard> board_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  uint64_t next_seq_ = 1;
  std::thread progress_;

  std::mutex scratch_mu_;
  at::Tensor scratch_[2];
  bool scratch_failed_ = false;

  std::mutex shutdown_mu_;  // held through shutdown(): one closer at a time
  mutable std::mutex lanes_mu_;
  std::map<std::pair<int, bool>, std::shared_ptr<Lane>> lanes_;  // (peer, incoming)

  // Heartbeats between hosts (null on one host, without a store, or with
  // PYCOMM_HEARTBEAT_S=0), and the peers it declared silent.
  // (Declared last, so destroyed first: its verdicts use the members above.)
  std::mutex silent_mu_;
  std::vector<int> silent_;
  std::unique_ptr<PeerWatch> watch_;
};

}  // namespace pycomm
