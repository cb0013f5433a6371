// The communicator: validates calls, orders them, runs them on a transport
// and hands back a Work whose torch Future completes when the data is ready.
//
// Ordering: every op gets a sequence number at submission and runs in that
// order, on the progress thread, or, for a synchronous op submitted while
// nothing is queued or running, directly on the caller's thread (which
// saves two thread hand-offs on small messages and changes no ordering).
#pragma once

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective.h"
#include "compression/codec.h"
#include "transport/multihost.h"
#include "transport/p2p.h"
#include "transport/process_group.h"
#include "transport/shm.h"

namespace pycomm {

// Extra steps of one call, for callers whose tensors are not the flat
// buffers a collective takes (the c10d backend's tensor lists, coalesced
// calls): `before` fills the flat input, `after` scatters the flat output.
// Both run on the thread that runs the collective, in its turn, so they see
// the data as it is when the op runs, like every other input. `keep` stays
// alive until the op completes; `result`, when not empty, is what the Work's
// future holds instead of the flat output.
struct Staging {
  std::function<void()> before;
  std::function<void()> after;
  std::vector<at::Tensor> keep;
  std::vector<at::Tensor> result;
};

class Work {
 public:
  // Blocks until the op finished (or `timeout_s` passed, if >= 0); rethrows
  // its error.
  bool wait(double timeout_s = -1);
  bool is_completed();
  bool is_success();
  // The error message, or "" when there is none (yet).
  std::string error_message();
  std::exception_ptr error();
  const std::vector<at::Tensor>& result() const { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> get_future();
  uint64_t seq() const { return seq_; }
  Algorithm algorithm() const { return desc_.algo; }
  // Bytes this rank sends, and what the uncompressed collective would send
  // (compressed all-reduce only; zeros otherwise).
  const CompressionStats& stats() const { return stats_; }
  // Seconds the op itself ran (from its turn to its completion, without the
  // time it queued behind earlier ops); 0 until it completed.
  double run_seconds();

 private:
  friend class Communicator;
  void finish(std::exception_ptr error);

  CollectiveDesc desc_;
  uint64_t seq_ = 0;
  // A composite op (compressed all-reduce) runs `body_` instead of one
  // transport call, and uses sequence numbers seq_ .. seq_ + seq_span_ - 1.
  std::function<void(uint64_t seq)> body_;
  int seq_span_ = 1;
  CompressionStats stats_;
  std::vector<at::Tensor> inputs_;   // kept alive until the op completes
  std::vector<at::Tensor> outputs_;
  std::function<void()> before_, after_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  // The submitting thread's profiler and record-function state, when it has
  // any: the op's ranges then show up in torch.profiler even though the op
  // runs on the progress thread (as autograd does for its worker threads).
  std::shared_ptr<at::ThreadLocalState> caller_state_;
  std::chrono::steady_clock::time_point started_, finished_;
};

struct CommunicatorOptions {
  int rank = 0;   // in the communicator
  int world = 1;
  double timeout_s = 300;
  // Shared memory among this host's ranks (use_shm false: every transfer
  // goes through the process group, even on one host).
  bool use_shm = true;
  int local_rank = 0;
  int local_size = 1;
  std::string shm_name;
  std::string token;
  bool create = false;
  size_t round_bytes = 1 << 20;
  // Several hosts (or use_shm false): host_ranks[h] lists the ranks of host
  // h by local rank, `host` is ours, and `backend` carries the traffic
  // between hosts; its rank r is the communicator's rank r.
  int host = 0;
  std::vector<std::vector<int>> host_ranks;
  c10::intrusive_ptr<c10d::Backend> backend;
  size_t pg_round_bytes = 4 << 20;
  int pg_window = 4;
  // The communicator's bootstrap store (optional). Between hosts, a rank
  // that fails leaves its reason there, so that ranks which only see the
  // consequences (a closed connection, a peer that gave up) can name the
  // cause: "rank 3 died", not "rank 2 left".
  c10::intrusive_ptr<c10d::Store> store;
  // Bytes of each point-to-point ring (one per ordered pair that talks).
  size_t p2p_bytes = 4 << 20;
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
  std::shared_ptr<Work> barrier(bool async_op);

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

  // Rejects a call made with bad arguments: it still takes its turn in the
  // sequence (so every rank raises, none hangs), then throws CommError(why).
  [[noreturn]] std::shared_ptr<Work> reject(const std::string& why);

  // The concrete algorithm a call of `bytes` per rank would run, e.g.
  // "direct(two-shot)" or "hier(shard)+ring".
  std::string resolve(Collective coll, Algorithm algo, size_t bytes) const;

  // Returns once every local rank has joined (see ShmTransport::wait_all_attached).
  void wait_ready() {
    if (local_) local_->wait_all_attached();
  }

  // Finishes queued ops, then tells peers this rank is gone. Idempotent.
  void shutdown();
  void abort(const std::string& why);

  int rank() const { return rank_; }
  int world() const { return world_; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double seconds);
  size_t round_bytes() const { return local_ ? local_->round_bytes() : 0; }
  // "shm", "process_group" or "shm+process_group": what carries the data.
  std::string transport_name() const;

 private:
  std::shared_ptr<Work> submit(std::shared_ptr<Work> work, bool async_op);
  std::string check_io(Collective coll, const at::Tensor& input, const at::Tensor& output, int64_t in_mult,
                       int64_t out_mult) const;
  std::string check_all_reduce_io(const at::Tensor& input, const at::Tensor& output) const;
  // Describes the call (count as in CollectiveDesc), resolves the algorithm
  // and submits; op and root matter only where the collective has them.
  std::shared_ptr<Work> launch(Collective coll, RedOp op, int root, uint64_t count, const at::Tensor& input,
                               const at::Tensor& output, Algorithm algo, bool strict, bool async_op,
                               Staging staging);
  void execute(Work& work);
  // Publishes this rank's failure and returns it, or a peer's failure that
  // names a dead rank, with this rank's view appended.
  std::exception_ptr explain(std::exception_ptr error);
  void progress_loop();
  // Resolves `algo` (and, between hosts, the inter-host schedule).
  Algorithm choose(Collective coll, Algorithm algo, bool strict, size_t bytes, Algorithm* inter) const;
  // Point-to-point: the local rank of `peer` (checked), and the lane that
  // runs the messages of one direction with one peer, in order.
  int p2p_peer(int peer, Collective coll) const;
  struct Lane;
  void submit_p2p(int peer, bool incoming, std::shared_ptr<Work> work, bool async_op);
  void send_body(Work& work, int peer, uint32_t tag);
  void recv_body(Work& work, int peer, uint32_t tag, bool allocate);

  int rank_ = 0;
  int world_ = 1;
  double timeout_s_ = 300;
  std::unique_ptr<ShmTransport> local_;
  std::unique_ptr<PgTransport> flat_;
  std::unique_ptr<PgTransport> cross_;
  std::unique_ptr<MultiHostTransport> multi_;
  Transport* top_ = nullptr;  // what collectives run on
  Workspace workspace_;  // used by composite ops, which run one at a time
  c10::intrusive_ptr<c10d::Store> store_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  uint64_t next_seq_ = 1;
  std::thread progress_;

  std::unique_ptr<ShmChannels> p2p_;
  std::vector<int> local_of_;  // communicator rank -> local rank, -1 on other hosts
  std::mutex lanes_mu_;
  std::map<std::pair<int, bool>, std::unique_ptr<Lane>> lanes_;  // (peer, incoming)
};

}  // namespace pycomm
