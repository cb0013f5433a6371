// Process-group transport: runs the same schedules as shared memory, with
// every transfer an isend/irecv of a wrapped torch.distributed backend (Gloo
// for CPU tensors). pycomm opens no sockets of its own; between hosts the
// wrapped backend moves the bytes.
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

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../algorithms/algorithms.h"
#include "../collective.h"
#include "transport.h"

namespace pycomm {

struct PgConfig {
  c10::intrusive_ptr<c10d::Backend> backend;
  // Backend ranks taking part, in this transport's rank order; this process
  // is members[rank].
  std::vector<int> members;
  int rank = 0;
  size_t round_bytes = 4 << 20;
  int window = 4;
  // Transports sharing one backend use different tag spaces (0 or 1).
  int tag_space = 0;
  double timeout_s = 300;
  // The communicator's rank of each member, for messages (empty: members).
  std::vector<int> names;
};

struct PgPlan;
struct PgRound;
struct RoundLayout;

class PgTransport : public Transport {
 public:
  explicit PgTransport(const PgConfig& config);
  ~PgTransport() override;
  PgTransport(const PgTransport&) = delete;
  PgTransport& operator=(const PgTransport&) = delete;

  void run(const CollectiveDesc& desc, uint64_t seq) override;
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double seconds) { timeout_s_.store(seconds); }
  // Makes this rank's later operations fail with `why` (peers learn of it
  // from their own waits; see the reliability notes in README).
  void abort(const std::string& why) override;

 private:
  struct Ctx {
    const CollectiveDesc* desc;
    uint64_t seq;
    uint64_t op;
    std::chrono::steady_clock::time_point deadline;
  };

  void exchange_headers(const Ctx& ctx);
  void execute(const Ctx& ctx);
  const PgPlan& plan_for(const Schedule& s);
  void start_round(PgRound& r, const PgPlan& plan, const RoundLayout& layout, const Ctx& ctx);
  void post_sends(PgRound& r, const PgPlan& plan, int step, const Ctx& ctx);
  void run_step(PgRound& r, const PgPlan& plan, const Ctx& ctx);
  void finish_round(PgRound& r, const PgPlan& plan, const Ctx& ctx);
  c10::intrusive_ptr<c10d::Work> send(const void* data, size_t bytes, int peer, uint32_t tag);
  c10::intrusive_ptr<c10d::Work> recv(void* data, size_t bytes, int peer, uint32_t tag);
  std::string unreachable(int peer, const std::string& error) const;
  void wait(c10::intrusive_ptr<c10d::Work>& work, int peer, const char* what, const Ctx& ctx);
  int name(int r) const { return names_[r]; }

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::vector<int> members_;
  std::vector<int> names_;
  int rank_ = 0;
  int world_ = 1;
  size_t round_bytes_ = 0;
  int window_ = 1;
  int tag_space_ = 0;
  std::atomic<double> timeout_s_{300};
  uint64_t ops_ = 0;
  std::string broken_;  // set by the first failure: later calls fail at once
  std::vector<std::unique_ptr<PgPlan>> plans_;
  std::vector<std::unique_ptr<PgRound>> slots_;
  std::vector<char> headers_;  // the header exchange's buffer
  std::vector<c10::intrusive_ptr<c10d::Work>> header_works_;
  // Transfers abandoned by a failed call stay referenced: the backend may
  // still touch their buffers.
  std::vector<c10::intrusive_ptr<c10d::Work>> abandoned_;
  std::vector<std::vector<char>> abandoned_buffers_;
};

}  // namespace pycomm
