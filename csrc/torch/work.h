// The handle of one queued operation: its state, its result tensors, and a
// torch Future that the progress engine completes (DDP comm hooks return
// it). Also the profiler ranges an operation shows in torch.profiler.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../compression/compressed_allreduce.h"
#include "../core/collective.h"
#include "../transport/process.h"

namespace pycomm {

// Extra steps of one call, for callers whose tensors are not the flat
// buffers a collective takes (the c10d backend's tensor lists, coalesced
// calls): `before` fills the flat input, `after` scatters the flat output.
// Both run on the thread that runs the collective, in its turn, so they see
// the data as it is when the op runs, like every other input. `keep` stays
// alive until the op completes; `result`, when not empty, is what the Work's
// future holds instead of the flat output. `timeout_s`, when positive,
// bounds this call's waits instead of the communicator's timeout (c10d's
// per-call Options.timeout).
struct Staging {
  std::function<void()> before;
  std::function<void()> after;
  std::vector<at::Tensor> keep;
  std::vector<at::Tensor> result;
  double timeout_s = 0;
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
  // Marks the op started, on the thread that runs it.
  void start() { started_ = std::chrono::steady_clock::now(); }
  // Completes the op (and its future, whose callbacks run here) and drops
  // what it kept alive.
  void finish(std::exception_ptr error);

  CollectiveDesc desc_;
  uint64_t seq_ = 0;
  // A composite op (compressed all-reduce) or a point-to-point message runs
  // `body_` instead of one transport call, and uses sequence numbers
  // seq_ .. seq_ + seq_span_ - 1.
  std::function<void(uint64_t seq)> body_;
  int seq_span_ = 1;
  CompressionStats stats_;
  std::vector<at::Tensor> inputs_;  // kept alive until the op completes
  std::vector<at::Tensor> outputs_;
  std::function<void()> before_, after_;
  // Runs the op on the waiting thread if nobody started it yet (a receive
  // queued on its lane); true if it ran. Set before the op is published.
  std::function<bool()> help_;
  // The process that made it: in a fork() child, a work pending at the fork
  // never completes (its thread stayed with the parent; transport/process.h).
  const int32_t owner_pid_ = current_pid();
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

// Profiler range of an operation ("pycomm::all_reduce", ...). RecordFunction
// keeps the pointer, so these are literals.
const char* range_name(Collective coll);

// One profiler range at a time for the stages of a composite op: entering
// a stage closes the previous one; nullptr closes the last.
class StageRanges {
 public:
  void enter(const char* name);

 private:
  std::unique_ptr<at::RecordFunction> current_;
};

}  // namespace pycomm
