// pycomm as a torch.distributed backend: `import pycomm` registers it as
// "pycomm", and dist.init_process_group("cpu:pycomm") routes a group's CPU
// collectives here.
//
// Collectives run on a pycomm Communicator, so they keep its guarantees:
// one call sequence checked across ranks (a mismatch raises on every rank),
// bounded waits, a dead peer named. Tensor lists and coalesced calls are
// staged through one flat buffer and run as a single collective.
// Point-to-point traffic (send/recv), all-to-all with uneven splits, sparse
// all-reduce and the monitored barrier go to a private Gloo group of the same
// ranks: pycomm's transports move fixed-size data in collective lock-step,
// and those calls are not fixed-size collectives.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>

#include "communicator.h"

namespace pycomm {

class C10dWork : public c10d::Work {
 public:
  C10dWork(std::shared_ptr<pycomm::Work> work, int rank, c10d::OpType type, const char* title);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return work_->seq(); }

 private:
  std::shared_ptr<pycomm::Work> work_;
};

class C10dBackend : public c10d::Backend {
 public:
  // `peer` (any backend over the same ranks, normally Gloo) carries send,
  // recv and uneven all-to-all; may be null, and then those raise.
  // `algorithms` are the preferred algorithms of all-reduce, reduce-scatter,
  // all-gather and broadcast (PYCOMM_ALGO); the tuner decides where one does
  // not apply.
  C10dBackend(std::shared_ptr<Communicator> comm, c10::intrusive_ptr<c10d::Backend> peer,
              const std::vector<Algorithm>& algorithms = {});
  ~C10dBackend() override;

  const std::string getBackendName() const override { return "pycomm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return calls_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  void abort() override;
  void shutdown() override;

  const std::shared_ptr<Communicator>& communicator() const { return comm_; }

 private:
  c10::intrusive_ptr<c10d::Work> wrap(std::shared_ptr<pycomm::Work> work, c10d::OpType type, const char* title);
  // What a reduction runs: pycomm's op for the c10d one, and the tensor it
  // reduces, `in` itself but for PREMUL_SUM (NCCL's scaled sum, FSDP2's
  // gradient divide factor): a sum of each rank's `in` times its own factor,
  // multiplied in the op's turn, in place where `own` (`in` is the call's own
  // buffer or its in-place output), else into a copy. Rejects what cannot
  // run, naming it.
  std::pair<RedOp, at::Tensor> reduction(const c10d::ReduceOp& op, const at::Tensor& in, Staging& s, bool own,
                                         const char* what);
  // One tensor per call (torch's multi-device lists are gone from CPU
  // backends); rejects anything else in turn.
  const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* what);
  // Rejects tensors of one call that cannot share a flat buffer (mixed
  // dtypes or devices) or are sparse.
  void check_same_dtype(const std::vector<at::Tensor>& tensors, const char* what);
  // Pairs of a coalesced call: shard i has 1/world_size of whole i's
  // elements (all-gather input/output, reduce-scatter output/input).
  void check_coalesced(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& wholes,
                       const char* what);
  // The one list of world_size tensors of a list collective (all_gather's
  // outputs, scatter's inputs, ...), each with the size and dtype of `like`.
  std::vector<at::Tensor> rank_list(const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& like,
                                    const char* what, const char* role);
  int root_of(int64_t root, const char* what);
  // What a collective reads and writes in place of a tensor that is not
  // contiguous (backend.cpp says why): a contiguous copy, filled in the op's
  // turn (input, or an output that is also read) and copied back into `t`
  // when the op completes (output). Contiguous tensors, and tensors the
  // communicator refuses anyway (device, layout), pass through unchanged.
  at::Tensor dense_input(const at::Tensor& t, Staging& s);
  at::Tensor dense_output(const at::Tensor& t, Staging& s, bool in_place, const char* what);
  // What a collective writes in place of `out`: where it overlaps the
  // input, a buffer of its own, copied into `out` when the op completes, so
  // that the input is read whole first (Gloo writes such an output as it
  // goes: an in-place all_to_all_single came out wrong on one rank of two);
  // else `out`.
  at::Tensor apart_output(const at::Tensor& out, const at::Tensor& in, Staging& s);
  c10::intrusive_ptr<c10d::Work> uneven_all_to_all(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                   const c10d::AllToAllOptions& opts);
  c10d::Backend& peer(const char* what);
  Algorithm algo(Collective coll) const { return algorithms_[static_cast<int>(coll)]; }

  std::shared_ptr<Communicator> comm_;
  c10::intrusive_ptr<c10d::Backend> peer_;
  std::atomic<uint64_t> calls_{0};
  Algorithm algorithms_[4] = {Algorithm::kAuto, Algorithm::kAuto, Algorithm::kAuto, Algorithm::kAuto};
};

}  // namespace pycomm
