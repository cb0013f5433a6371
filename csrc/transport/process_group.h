// Process-group transport: runs the same schedules (and plans) as shared
// memory, with every transfer a send/recv of a message-passing backend
// between processes. pycomm opens no sockets of its own: the backend is a
// wrapped torch.distributed ProcessGroup (Gloo between CPU hosts), reached
// through the small PeerLink interface below, which the torch layer
// implements (torch/peer_link.h). This file is torch-free.
//
// Execution (see schedule.h for the model every executor implements):
//   * A collective is cut into rounds of at most round_bytes; up to `window`
//     rounds are in flight at once, so the link carries round r+1 while
//     round r's chunks are being reduced.
//   * A round posts all of its receives when it starts (into staging
//     buffers), so a peer's send never waits for us to get there; sends of
//     step t go out as soon as step t-1's reductions produced their data.
//   * Every rank walks the rounds' steps in the same order, and each wait
//     depends only on sends posted earlier in that order: no deadlock.
//   * Before any data moves, every rank sends every other its call's header
//     (unless the caller already checked); ranks that disagree all raise.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../algorithms/plan.h"
#include "../core/collective.h"
#include "transport.h"

namespace pycomm {

// What the process-group transport needs from a backend: tagged,
// asynchronous point-to-point byte transfers between its ranks.
class PeerLink {
 public:
  // One posted transfer. The backend may touch its buffer until wait()
  // returned true; a transfer that is dropped unfinished must keep its
  // buffer alive (the transport keeps both referenced after a failure).
  class Transfer {
   public:
    virtual ~Transfer() = default;
    // True once complete; false if `timeout` passed first. Throws
    // std::exception when the transfer failed (a peer closed the connection).
    virtual bool wait(std::chrono::milliseconds timeout) = 0;
    // True once complete, without waiting (false also while it may fail).
    virtual bool done() = 0;
  };
  virtual ~PeerLink() = default;
  virtual int rank() const = 0;
  // Both throw std::exception when the backend refuses to post (the
  // connection to `peer` is gone). `tag` is below 2^31.
  virtual std::shared_ptr<Transfer> send(const void* data, size_t bytes, int peer, uint32_t tag) = 0;
  virtual std::shared_ptr<Transfer> recv(void* data, size_t bytes, int peer, uint32_t tag) = 0;
  // Which transfers interrupt() wakes: all, or only the collectives' (a
  // peer's abort ends the collectives; its messages end with its stream,
  // pg_channels.h, and those of other peers go on).
  enum class Waits { kAll, kCollectives };
  // Wakes every wait on a transfer posted so far (it returns false, now or
  // when it starts); what was posted stays posted. For a peer declared
  // gone, or one that aborted, while ranks wait for it: the failure is
  // final, the waits need not last until their deadline. Backends that
  // cannot leave waits to time out.
  virtual void interrupt(Waits which) { (void)which; }
};

struct PgConfig {
  std::shared_ptr<PeerLink> link;
  // Link ranks taking part, in this transport's rank order; this process
  // is members[rank].
  std::vector<int> members;
  int rank = 0;
  size_t round_bytes = 4 << 20;
  int window = 4;
  // Transports sharing one link use different tag spaces (0 or 1).
  int tag_space = 0;
  double timeout_s = 300;
  // The communicator's rank of each member, for messages (empty: members).
  std::vector<int> names;
};

struct PgRound;
struct RoundLayout;

// The tag of point-to-point messages over a link (pg_channels.h): one that no
// collective's transfer uses, in either tag space.
uint32_t pg_p2p_tag();

// Waits for `transfer` until `deadline`: "" once it completed, else why not
// (the backend's error, first line, or that the wait returned without
// completing). Shared by the collectives' and the messages' waits.
std::string wait_transfer(PeerLink::Transfer& transfer, std::chrono::steady_clock::time_point deadline);

class PgTransport : public Transport {
 public:
  explicit PgTransport(const PgConfig& config);
  ~PgTransport() override;
  PgTransport(const PgTransport&) = delete;
  PgTransport& operator=(const PgTransport&) = delete;

  void run(const CollectiveDesc& desc, uint64_t seq) override;
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  double timeout() const { return timeout_s_.load(std::memory_order_relaxed); }
  void set_timeout(double seconds) { timeout_s_.store(seconds, std::memory_order_relaxed); }
  // Makes this rank's operations fail with `why`: later ones at once, the
  // one in progress at its next wait (peers learn of it from the failure
  // board's mark, peer_watch.h, or from their own waits). The caller then
  // interrupts the link so that a wait in progress ends now, not at its
  // deadline.
  void abort(const std::string& why, Blame blame = {}) override;

 private:
  using TransferPtr = std::shared_ptr<PeerLink::Transfer>;
  struct Ctx {
    const CollectiveDesc* desc;
    uint64_t seq;
    uint64_t op;
    std::chrono::steady_clock::time_point deadline;
    double timeout_s;  // what `deadline` was set from, for the messages
  };

  void exchange_headers(const Ctx& ctx);
  void execute(const Ctx& ctx);
  void start_round(PgRound& r, const Plan& plan, const RoundLayout& layout, const Ctx& ctx);
  void post_sends(PgRound& r, const Plan& plan, int step, const Ctx& ctx);
  void run_step(PgRound& r, const Plan& plan, const Ctx& ctx);
  void finish_round(PgRound& r, const Plan& plan, const Ctx& ctx);
  TransferPtr send(const void* data, size_t bytes, int peer, uint32_t tag);
  TransferPtr recv(void* data, size_t bytes, int peer, uint32_t tag);
  CommError unreachable(int peer, const std::string& error) const;
  void wait(TransferPtr& work, int peer, const char* what, const Ctx& ctx);
  // Throws the abort or failure that ended this transport, if there was one.
  void throw_if_broken();
  int name(int r) const { return names_[r]; }

  std::shared_ptr<PeerLink> link_;
  std::vector<int> members_;
  std::vector<int> names_;
  int rank_ = 0;
  int world_ = 1;
  size_t round_bytes_ = 0;
  int window_ = 1;
  int tag_space_ = 0;
  std::atomic<double> timeout_s_{300};
  uint64_t ops_ = 0;
  // The first failure: later calls fail at once. abort() may come from
  // another thread than run(), hence the lock.
  std::mutex broken_mu_;
  std::optional<CommError> broken_;
  PlanCache plans_;
  std::vector<std::unique_ptr<PgRound>> slots_;
  std::vector<char> headers_;  // the header exchange's buffer
  std::vector<TransferPtr> header_works_;
  // Transfers abandoned by a failed call stay referenced: the backend may
  // still touch their buffers.
  std::vector<TransferPtr> abandoned_;
  std::vector<std::vector<char>> abandoned_buffers_;
};

}  // namespace pycomm
