// The c10d Backend's collectives, one method each, and the staging they
// share (flat buffers for tensor lists, contiguous copies for tensors that
// are not contiguous). About 600 lines: each method is a few lines of the
// same pattern, and splitting them would part the helpers from their users.
#include "backend.h"

#include <ATen/MemoryOverlap.h>

#include "tensor_checks.h"

namespace pycomm {

namespace {

// Pieces of a flat buffer: tensor i is elements [offsets[i], offsets[i+1]).
std::vector<int64_t> offsets_of(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> off{0};
  for (const auto& t : tensors) off.push_back(off.back() + t.numel());
  return off;
}

at::Tensor flat_like(const at::Tensor& like, int64_t numel) {
  return at::empty({numel}, like.options());
}

// Element-wise copy from a flat slice into a tensor of any layout.
void copy_out(const at::Tensor& t, const at::Tensor& flat, int64_t offset) {
  t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
}

// The tensors, back to back, into the start of `flat` (and back out): a
// list of world_size equal tensors lands in the blocks of ranks 0, 1, ...
void pack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    flat.narrow(0, offset, t.numel()).view(t.sizes()).copy_(t);
    offset += t.numel();
  }
}
void unpack(const std::vector<at::Tensor>& tensors, const at::Tensor& flat) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    copy_out(t, flat, offset);
    offset += t.numel();
  }
}

std::string name_of(const char* what) { return std::string("pycomm backend: ") + what; }

// c10d's per-call timeout (each Options.timeout, unset when not positive) in
// seconds; 0 leaves the group's timeout.
double call_timeout(std::chrono::milliseconds t) { return t.count() > 0 ? t.count() / 1000.0 : 0.0; }

// The staging of a call that only needs its own timeout carried.
Staging timed(std::chrono::milliseconds t) {
  Staging s;
  s.timeout_s = call_timeout(t);
  return s;
}

}  // namespace

// ------------------------------------------------------------------ C10dWork

C10dWork::C10dWork(std::shared_ptr<pycomm::Work> work, int rank, c10d::OpType type, const char* title)
    : c10d::Work(rank, type, title), work_(std::move(work)) {}

bool C10dWork::isCompleted() { return work_->is_completed(); }

bool C10dWork::isSuccess() const { return work_->is_success(); }

std::exception_ptr C10dWork::exception() const { return work_->error(); }

std::vector<at::Tensor> C10dWork::result() { return work_->result(); }

bool C10dWork::wait(std::chrono::milliseconds timeout) {
  // c10d's "no timeout" is 0 ms; the communicator's own timeout still
  // bounds every wait on a peer.
  return work_->wait(timeout == ::kNoTimeout ? -1.0 : timeout.count() / 1000.0);
}

c10::intrusive_ptr<c10::ivalue::Future> C10dWork::getFuture() { return work_->get_future(); }

// Tensors of any layout reach a backend: a transposed view, channels_last,
// every other element of a buffer. Gloo reads and writes such a tensor's
// memory as if it were contiguous, so a strided view gets wrong elements
// (and its gaps are overwritten), and ranks whose layouts differ combine
// unrelated elements. pycomm's collectives move contiguous memory; a tensor
// that is not contiguous travels through a contiguous copy of it.
bool needs_dense_copy(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_quantized() && t.device().is_cpu() && !t.is_contiguous();
}

// `f` after what `step` (a Staging's before or after) already does.
void chain(std::function<void()>& step, std::function<void()> f) {
  step = [prev = std::move(step), f = std::move(f)] {
    if (prev) prev();
    f();
  };
}

// --------------------------------------------------------------- C10dBackend

C10dBackend::C10dBackend(std::shared_ptr<Communicator> comm, c10::intrusive_ptr<c10d::Backend> peer,
                         const std::vector<Algorithm>& algorithms)
    : c10d::Backend(comm->rank(), comm->world()), comm_(std::move(comm)), peer_(std::move(peer)) {
  for (size_t i = 0; i < algorithms.size() && i < 4; ++i) algorithms_[i] = algorithms[i];
}

C10dBackend::~C10dBackend() {
  // A fork() child's copy: the point-to-point group's threads, like the
  // communicator's, are the parent's, and destroying it there would wait for
  // them forever (transport/process.h). Both copies stay undestroyed.
  if (comm_->forked_copy()) {
    (void)peer_.release();
    return;
  }
  try {
    comm_->shutdown();
  } catch (...) {
  }
}

c10::intrusive_ptr<c10d::Backend::Options> C10dBackend::getBackendOptions() {
  return c10::make_intrusive<Options>(
      "pycomm", std::chrono::milliseconds(static_cast<int64_t>(comm_->timeout() * 1000)));
}

void C10dBackend::setTimeout(std::chrono::milliseconds timeout) {
  comm_->set_timeout(timeout.count() / 1000.0);
  if (peer_) peer_->setTimeout(timeout);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::wrap(std::shared_ptr<pycomm::Work> work, c10d::OpType type,
                                                 const char* title) {
  ++calls_;
  return c10::make_intrusive<C10dWork>(std::move(work), getRank(), type, title);
}

std::pair<RedOp, at::Tensor> C10dBackend::reduction(const c10d::ReduceOp& op, const at::Tensor& in, Staging& s,
                                                    bool own, const char* what) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {RedOp::kSum, in};
    case c10d::ReduceOp::AVG: return {RedOp::kAvg, in};
    case c10d::ReduceOp::PRODUCT: return {RedOp::kProduct, in};
    case c10d::ReduceOp::MIN: return {RedOp::kMin, in};
    case c10d::ReduceOp::MAX: return {RedOp::kMax, in};
    case c10d::ReduceOp::BAND: return {RedOp::kBand, in};
    case c10d::ReduceOp::BOR: return {RedOp::kBor, in};
    case c10d::ReduceOp::BXOR: return {RedOp::kBxor, in};
    case c10d::ReduceOp::PREMUL_SUM: break;
    default:
      comm_->reject(name_of(what) + ": unknown ReduceOp " + std::to_string(static_cast<int>(op.op_)) +
                    "; use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR or PREMUL_SUM");
  }
  // As NCCL: each rank's input times the factor that rank gave, then a plain
  // sum, so every rank still gets the same bits. The factor comes with the op
  // (torch's supplement; PREMUL_SUM is the only op that has one, and torch
  // refuses to make one without it: the check guards against a null factor).
  const auto* factor = static_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  if (!factor)
    comm_->reject(name_of(what) + ": ReduceOp.PREMUL_SUM came without its factor; pass "
                  "dist._make_nccl_premul_sum(factor)");
  const at::ScalarType dt = in.scalar_type();
  if (dt != at::kFloat && dt != at::kDouble && dt != at::kHalf && dt != at::kBFloat16)
    comm_->reject(name_of(what) + " with ReduceOp.PREMUL_SUM takes float16, bfloat16, float32 and float64 tensors, "
                  "got " + std::string(c10::toString(dt)));
  const at::Tensor tensor_factor = factor->tensor_factor;
  if (tensor_factor.defined() && (tensor_factor.numel() != 1 || tensor_factor.is_complex() ||
                                  tensor_factor.layout() != at::kStrided))
    comm_->reject(name_of(what) + ": the factor of ReduceOp.PREMUL_SUM must be a number or a tensor of one real "
                  "element");
  const double double_factor = factor->double_factor;
  // A tensor factor is read when the op takes its turn, as NCCL reads it
  // when its kernel runs: what the caller queued before may still write it.
  auto times = [tensor_factor, double_factor] {
    return tensor_factor.defined() ? tensor_factor.item() : at::Scalar(double_factor);
  };
  if (own) {
    chain(s.before, [in, times] { in.mul_(times()); });
    return {RedOp::kSum, in};
  }
  at::Tensor scaled = at::empty(in.sizes(), in.options());
  chain(s.before, [scaled, in, times] {
    at::Tensor out = scaled;
    at::mul_out(out, in, times());
  });
  s.keep.push_back(in);
  return {RedOp::kSum, scaled};
}

const at::Tensor& C10dBackend::single(const std::vector<at::Tensor>& tensors, const char* what) {
  if (tensors.size() != 1) {
    comm_->reject(name_of(what) + " takes exactly one tensor per call, got " + std::to_string(tensors.size()) +
                  " (for several, use the coalesced call)");
  }
  check_same_dtype(tensors, what);  // rejects sparse tensors
  return tensors[0];
}

void C10dBackend::check_same_dtype(const std::vector<at::Tensor>& tensors, const char* what) {
  for (const auto& t : tensors) {
    if (t.is_sparse()) comm_->reject(name_of(what) + " does not support sparse tensors");
    if (t.scalar_type() != tensors[0].scalar_type() || t.device() != tensors[0].device())
      comm_->reject(name_of(what) + " needs every tensor of one call to have the same dtype and device");
  }
}

void C10dBackend::check_coalesced(const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& wholes,
                                  const char* what) {
  check_same_dtype(shards, what);
  check_same_dtype(wholes, what);
  if (shards.size() != wholes.size()) comm_->reject(name_of(what) + ": as many outputs as inputs are needed");
  for (size_t i = 0; i < shards.size(); ++i) {
    if (wholes[i].numel() != shards[i].numel() * getSize() || wholes[i].scalar_type() != shards[i].scalar_type())
      comm_->reject(name_of(what) + ": tensor pair " + std::to_string(i) +
                    " needs world_size x as many elements in the whole as in the shard, and one dtype");
  }
}

std::vector<at::Tensor> C10dBackend::rank_list(const std::vector<std::vector<at::Tensor>>& lists,
                                               const at::Tensor& like, const char* what, const char* role) {
  if (lists.size() != 1 || static_cast<int>(lists[0].size()) != getSize())
    comm_->reject(name_of(what) + " needs one " + role + " list of world_size (" + std::to_string(getSize()) +
                  ") tensors");
  check_same_dtype(lists[0], what);  // rejects sparse tensors
  for (const auto& t : lists[0]) {
    if (t.numel() != like.numel() || t.scalar_type() != like.scalar_type())
      comm_->reject(name_of(what) + ": every " + role + " tensor must have the size and dtype of the " +
                    (std::string(role) == "output" ? "input" : "output"));
  }
  return lists[0];
}

int C10dBackend::root_of(int64_t root, const char* what) {
  if (root < 0 || root >= getSize())
    comm_->reject(name_of(what) + ": root " + std::to_string(root) + " is not a rank of this group (size " +
                  std::to_string(getSize()) + ")");
  return static_cast<int>(root);
}

c10d::Backend& C10dBackend::peer(const char* what) {
  comm_->refuse_in_fork();  // the group's threads stayed with the parent: it would wait forever
  TORCH_CHECK(peer_, name_of(what), " needs the point-to-point group, which this backend was created without");
  return *peer_;
}

at::Tensor C10dBackend::dense_input(const at::Tensor& t, Staging& s) {
  if (!needs_dense_copy(t)) return t;
  at::Tensor dense = at::empty(t.sizes(), t.options());
  // Copied in the op's turn, as the op itself would read `t`.
  chain(s.before, [dense, t] { dense.copy_(t); });
  s.keep.push_back(t);
  return dense;
}

at::Tensor C10dBackend::dense_output(const at::Tensor& t, Staging& s, bool in_place, const char* what) {
  if (!needs_dense_copy(t)) return t;
  // An expanded tensor (stride 0) names one element several times: no
  // result can be written into it. Gloo writes one anyway.
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
    comm_->reject(name_of(what) + ": the output tensor has elements that share memory (shape " +
                  c10::str(t.sizes()) + ", strides " + c10::str(t.strides()) +
                  ", e.g. from expand()); pass a tensor with memory of its own");
  at::Tensor dense = at::empty(t.sizes(), t.options());
  if (in_place) chain(s.before, [dense, t] { dense.copy_(t); });
  chain(s.after, [dense, t] { t.copy_(dense); });
  s.keep.push_back(t);
  if (s.result.empty()) s.result = {t};
  return dense;
}

at::Tensor C10dBackend::apart_output(const at::Tensor& out, const at::Tensor& in, Staging& s) {
  auto plain = [](const at::Tensor& t) {
    return t.defined() && t.has_storage() && t.layout() == at::kStrided && t.device().is_cpu() && t.numel() > 0;
  };
  if (!plain(out) || !plain(in) || !overlaps(out, in)) return out;
  at::Tensor apart = at::empty_like(out);
  // The first of the after-steps: a copy-back staged before (dense_output's) may read `out`.
  s.after = [apart, out, then = std::move(s.after)] {
    out.copy_(apart);
    if (then) then();
  };
  s.keep.push_back(out);
  if (s.result.empty()) s.result = {out};
  return apart;
}

// ---------------------------------------------------------------- collectives

c10::intrusive_ptr<c10d::Work> C10dBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  Staging s = timed(opts.timeout);
  const at::Tensor t = dense_output(single(tensors, "broadcast"), s, /*in_place=*/true, "broadcast");
  return wrap(comm_->broadcast(t, static_cast<int>(opts.rootRank), algo(Collective::kBroadcast), false, opts.asyncOp,
                               std::move(s)),
              c10d::OpType::BROADCAST, "pycomm:broadcast");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  Staging s = timed(opts.timeout);
  const at::Tensor t = dense_output(single(tensors, "all_reduce"), s, /*in_place=*/true, "all_reduce");
  const RedOp op = reduction(opts.reduceOp, t, s, /*own=*/true, "all_reduce").first;
  return wrap(comm_->all_reduce(t, t, op, algo(Collective::kAllReduce), false, opts.asyncOp, std::move(s)),
              c10d::OpType::ALLREDUCE,
              "pycomm:all_reduce");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  // A sparse tensor's size (its nnz) differs between ranks and is known only
  // to its owner, so the exchange is not one fixed-size checked collective:
  // Gloo's sparse all-reduce (sizes first, then indices and values, then a
  // coalesced sum) carries it. It stays ordered with this group's other
  // collectives as long as every rank calls them in one order, as c10d asks.
  return peer("sparse all_reduce").allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceCoalescedOptions& opts) {
  // One all-reduce of the concatenation: one sequence number, one header
  // check and full-size transfers instead of one small call per tensor.
  check_same_dtype(tensors, "all_reduce_coalesced");
  // An empty call still takes its turn, so a rank that passed tensors
  // where another passed none fails on both.
  if (tensors.empty())
    return wrap(comm_->barrier(opts.asyncOp, call_timeout(opts.timeout)), c10d::OpType::ALLREDUCE_COALESCED,
                "pycomm:all_reduce_coalesced");
  const int64_t numel = offsets_of(tensors).back();
  // CPU tensors pack into the communicator's registered scratch, where the
  // all-reduce runs in place: no staging copies besides the packing. Its
  // packing runs in the op's turn, so queued calls can share it.
  const size_t bytes = numel * tensors[0].element_size();
  at::Tensor flat = tensors[0].is_cpu()
                        ? comm_->scratch(Communicator::kScratchBackend, bytes).narrow(0, 0, bytes).view(tensors[0].scalar_type())
                        : flat_like(tensors[0], numel);
  Staging s = timed(opts.timeout);
  s.before = [flat, tensors] { pack(flat, tensors); };
  s.after = [flat, tensors] { unpack(tensors, flat); };
  s.keep = tensors;
  s.result = tensors;
  const RedOp op = reduction(opts.reduceOp, flat, s, /*own=*/true, "all_reduce_coalesced").first;
  return wrap(comm_->all_reduce(flat, flat, op, algo(Collective::kAllReduce), false, opts.asyncOp, std::move(s)),
              c10d::OpType::ALLREDUCE_COALESCED, "pycomm:all_reduce_coalesced");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  // An all-reduce whose result only the root keeps: the other ranks reduce
  // into scratch and leave their tensor untouched (as Gloo does).
  const at::Tensor& given = single(tensors, "reduce");
  Staging s = timed(opts.timeout);
  const bool root = root_of(opts.rootRank, "reduce") == getRank();
  const at::Tensor t = root ? dense_output(given, s, /*in_place=*/true, "reduce") : dense_input(given, s);
  const auto [op, in] = reduction(opts.reduceOp, t, s, /*own=*/root, "reduce");
  const at::Tensor out = root ? t : at::empty_like(t);
  return wrap(comm_->all_reduce(in, out, op, algo(Collective::kAllReduce), false, opts.asyncOp, std::move(s)),
              c10d::OpType::REDUCE,
              "pycomm:reduce");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  const at::Tensor& given = single(inputs, "all_gather");
  const std::vector<at::Tensor> outs = rank_list(outputs, given, "all_gather", "output");
  at::Tensor flat = flat_like(given, given.numel() * getSize());
  Staging s = timed(opts.timeout);
  const at::Tensor in = dense_input(given, s);
  s.after = [flat, outs] { unpack(outs, flat); };
  s.keep.insert(s.keep.end(), outs.begin(), outs.end());
  s.result = outs;
  return wrap(comm_->all_gather(flat, in, algo(Collective::kAllGather), false, opts.asyncOp, std::move(s)),
              c10d::OpType::ALLGATHER, "pycomm:all_gather");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  Staging s = timed(opts.timeout);
  const at::Tensor in = dense_input(input, s);
  at::Tensor out = dense_output(output, s, /*in_place=*/false, "all_gather_into_tensor");
  // In place, the input this rank's block of the output, the communicator runs as it is.
  if (!is_rank_block(in, out, getRank())) out = apart_output(out, in, s);
  return wrap(comm_->all_gather(out, in, algo(Collective::kAllGather), false, opts.asyncOp, std::move(s)),
              c10d::OpType::_ALLGATHER_BASE,
              "pycomm:all_gather_into_tensor");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  // Tensors of any shapes in one all-gather: rank r's block of the flat
  // output is rank r's inputs back to back; output list r gets them back.
  check_same_dtype(inputs, "all_gather_coalesced");
  if (static_cast<int>(outputs.size()) != getSize())
    comm_->reject(name_of("all_gather_coalesced") + " needs world_size (" + std::to_string(getSize()) +
                  ") output lists, got " + std::to_string(outputs.size()));
  for (const auto& list : outputs) {
    check_same_dtype(list, "all_gather_coalesced");
    bool ok = list.size() == inputs.size();
    for (size_t i = 0; ok && i < list.size(); ++i)
      ok = list[i].numel() == inputs[i].numel() && list[i].scalar_type() == inputs[i].scalar_type();
    if (!ok)
      comm_->reject(name_of("all_gather_coalesced") +
                    ": every output list must match the inputs tensor for tensor (count and dtype)");
  }
  if (inputs.empty())
    return wrap(comm_->barrier(opts.asyncOp, call_timeout(opts.timeout)), c10d::OpType::ALLGATHER_COALESCED,
                "pycomm:all_gather_coalesced");
  const int64_t total = offsets_of(inputs).back();
  at::Tensor flat_in = flat_like(inputs[0], total);
  at::Tensor flat_out = flat_like(inputs[0], total * getSize());
  Staging s = timed(opts.timeout);
  s.before = [flat_in, inputs] { pack(flat_in, inputs); };
  s.after = [flat_out, outputs, total] {
    for (size_t r = 0; r < outputs.size(); ++r) unpack(outputs[r], flat_out.narrow(0, r * total, total));
  };
  s.keep = inputs;
  for (const auto& list : outputs) {
    s.keep.insert(s.keep.end(), list.begin(), list.end());
    s.result.insert(s.result.end(), list.begin(), list.end());
  }
  return wrap(comm_->all_gather(flat_out, flat_in, algo(Collective::kAllGather), false, opts.asyncOp, std::move(s)),
              c10d::OpType::ALLGATHER_COALESCED, "pycomm:all_gather_coalesced");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions& opts) {
  // All pairs in one all-gather: rank r's block of the flat output holds
  // every input of rank r, back to back.
  check_coalesced(inputs, outputs, "all_gather_into_tensor_coalesced");
  if (inputs.empty())
    return wrap(comm_->barrier(opts.asyncOp, call_timeout(opts.timeout)), c10d::OpType::COALESCED,
                "pycomm:all_gather_coalesced");
  const auto off = offsets_of(inputs);
  const int64_t total = off.back();
  at::Tensor flat_in = flat_like(inputs[0], total);
  at::Tensor flat_out = flat_like(inputs[0], total * getSize());
  Staging s = timed(opts.timeout);
  s.before = [flat_in, inputs] { pack(flat_in, inputs); };
  s.after = [flat_out, outputs, off, total, world = getSize()] {
    for (size_t i = 0; i < outputs.size(); ++i) {
      const int64_t n = off[i + 1] - off[i];
      at::Tensor out = outputs[i].view({world, n});
      out.copy_(flat_out.view({world, total}).narrow(1, off[i], n));
    }
  };
  s.keep = inputs;
  s.keep.insert(s.keep.end(), outputs.begin(), outputs.end());
  s.result = outputs;
  return wrap(comm_->all_gather(flat_out, flat_in, algo(Collective::kAllGather), false, opts.asyncOp, std::move(s)),
              c10d::OpType::COALESCED, "pycomm:all_gather_into_tensor_coalesced");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  // An all-gather whose result only the root keeps.
  const at::Tensor& given = single(inputs, "gather");
  const int root = root_of(opts.rootRank, "gather");
  std::vector<at::Tensor> outs;
  if (getRank() == root) outs = rank_list(outputs, given, "gather", "output");
  at::Tensor flat = flat_like(given, given.numel() * getSize());
  Staging s = timed(opts.timeout);
  const at::Tensor in = dense_input(given, s);
  if (!outs.empty()) {
    s.after = [flat, outs] { unpack(outs, flat); };
    s.keep.insert(s.keep.end(), outs.begin(), outs.end());
    s.result = outs;
  }
  return wrap(comm_->all_gather(flat, in, algo(Collective::kAllGather), false, opts.asyncOp, std::move(s)),
              c10d::OpType::GATHER, "pycomm:gather");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions& opts) {
  // An all-to-all in which only the root's blocks matter: each rank keeps
  // block `root` of what it receives.
  const at::Tensor& out = single(outputs, "scatter");
  const int root = root_of(opts.rootRank, "scatter");
  std::vector<at::Tensor> ins;
  if (getRank() == root) ins = rank_list(inputs, out, "scatter", "input");
  const int64_t n = out.numel();
  at::Tensor flat_in = flat_like(out, n * getSize());
  at::Tensor flat_out = flat_like(out, n * getSize());
  Staging s = timed(opts.timeout);
  if (!ins.empty()) s.before = [flat_in, ins] { pack(flat_in, ins); };
  s.after = [flat_out, out, n, root] { copy_out(out, flat_out, static_cast<int64_t>(root) * n); };
  s.keep = ins;
  s.keep.push_back(out);
  s.result = {out};
  return wrap(comm_->all_to_all(flat_out, flat_in, opts.asyncOp, std::move(s)), c10d::OpType::SCATTER,
              "pycomm:scatter");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& given = single(outputs, "reduce_scatter");
  const std::vector<at::Tensor> ins = rank_list(inputs, given, "reduce_scatter", "input");
  const int64_t n = given.numel();
  at::Tensor flat = flat_like(given, n * getSize());
  Staging s = timed(opts.timeout);
  const at::Tensor out = dense_output(given, s, /*in_place=*/false, "reduce_scatter");
  chain(s.before, [flat, ins] { pack(flat, ins); });
  s.keep.insert(s.keep.end(), ins.begin(), ins.end());
  const RedOp op = reduction(opts.reduceOp, flat, s, /*own=*/true, "reduce_scatter").first;
  return wrap(comm_->reduce_scatter(out, flat, op, algo(Collective::kReduceScatter), false, opts.asyncOp, std::move(s)),
              c10d::OpType::REDUCE_SCATTER, "pycomm:reduce_scatter");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions& opts) {
  Staging s = timed(opts.timeout);
  const at::Tensor dense = dense_input(input, s);
  const auto [op, in] = reduction(opts.reduceOp, dense, s, /*own=*/false, "reduce_scatter_tensor");
  at::Tensor out = dense_output(output, s, /*in_place=*/false, "reduce_scatter_tensor");
  // In place, the output this rank's block of the input, the communicator runs as it is.
  if (!is_rank_block(out, in, getRank())) out = apart_output(out, in, s);
  return wrap(comm_->reduce_scatter(out, in, op, algo(Collective::kReduceScatter), false, opts.asyncOp, std::move(s)),
              c10d::OpType::_REDUCE_SCATTER_BASE, "pycomm:reduce_scatter_tensor");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  // All pairs in one reduce-scatter: block r of the flat input holds shard
  // r of every input, back to back, so rank r's flat output is its shards.
  check_coalesced(outputs, inputs, "reduce_scatter_tensor_coalesced");
  if (inputs.empty())
    return wrap(comm_->barrier(opts.asyncOp, call_timeout(opts.timeout)), c10d::OpType::COALESCED,
                "pycomm:reduce_scatter_coalesced");
  const auto off = offsets_of(outputs);
  const int64_t total = off.back();
  at::Tensor flat_in = flat_like(outputs[0], total * getSize());
  at::Tensor flat_out = flat_like(outputs[0], total);
  Staging s = timed(opts.timeout);
  s.before = [flat_in, inputs, off, total, world = getSize()] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t n = off[i + 1] - off[i];
      flat_in.view({world, total}).narrow(1, off[i], n).copy_(inputs[i].reshape({world, n}));
    }
  };
  s.after = [flat_out, outputs] { unpack(outputs, flat_out); };
  s.keep = inputs;
  s.keep.insert(s.keep.end(), outputs.begin(), outputs.end());
  s.result = outputs;
  const RedOp op = reduction(opts.reduceOp, flat_in, s, /*own=*/true, "reduce_scatter_tensor_coalesced").first;
  return wrap(comm_->reduce_scatter(flat_out, flat_in, op, algo(Collective::kReduceScatter), false, opts.asyncOp,
                                    std::move(s)),
              c10d::OpType::COALESCED, "pycomm:reduce_scatter_tensor_coalesced");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                          std::vector<int64_t>& output_splits,
                                                          std::vector<int64_t>& input_splits,
                                                          const c10d::AllToAllOptions& opts) {
  auto even = [&](const std::vector<int64_t>& splits, const at::Tensor& t) {
    if (splits.empty()) return true;
    for (int64_t s : splits)
      if (t.dim() == 0 || s * getSize() != t.size(0)) return false;
    return true;
  };
  if (even(output_splits, output) && even(input_splits, input)) {
    Staging s = timed(opts.timeout);
    const at::Tensor in = dense_input(input, s);
    const at::Tensor out = apart_output(dense_output(output, s, /*in_place=*/false, "all_to_all_single"), in, s);
    return wrap(comm_->all_to_all(out, in, opts.asyncOp, std::move(s)), c10d::OpType::ALLTOALL_BASE,
                "pycomm:all_to_all_single");
  }
  // Uneven splits: every rank knows only its own, so this cannot be one
  // checked collective; Gloo's all-to-all carries it.
  return peer("all_to_all_single with uneven splits").alltoall_base(output, input, output_splits, input_splits, opts);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions& opts) {
  check_same_dtype(inputs, "all_to_all");
  check_same_dtype(outputs, "all_to_all");
  if (static_cast<int>(inputs.size()) != getSize() || static_cast<int>(outputs.size()) != getSize())
    comm_->reject(name_of("all_to_all") + " needs world_size input and output tensors");
  const int64_t n = inputs[0].numel();
  bool even = true;
  for (int r = 0; r < getSize(); ++r) {
    if (outputs[r].scalar_type() != inputs[0].scalar_type())
      comm_->reject(name_of("all_to_all") + " needs inputs and outputs of one dtype");
    even = even && inputs[r].numel() == n && outputs[r].numel() == n;
  }
  if (!even) return uneven_all_to_all(outputs, inputs, opts);
  at::Tensor flat_in = flat_like(inputs[0], n * getSize());
  at::Tensor flat_out = flat_like(inputs[0], n * getSize());
  Staging s = timed(opts.timeout);
  s.before = [flat_in, inputs] { pack(flat_in, inputs); };
  s.after = [flat_out, outputs] { unpack(outputs, flat_out); };
  s.keep = inputs;
  s.keep.insert(s.keep.end(), outputs.begin(), outputs.end());
  s.result = outputs;
  return wrap(comm_->all_to_all(flat_out, flat_in, opts.asyncOp, std::move(s)), c10d::OpType::ALLTOALL,
              "pycomm:all_to_all");
}

c10::intrusive_ptr<c10d::Work> C10dBackend::uneven_all_to_all(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  // Blocks of different sizes: as all_to_all_single with splits on the
  // point-to-point group (each rank knows only its own sizes), staged
  // through flat buffers. Completes before returning: the copy-out must
  // follow the exchange, and this path is the rare one.
  std::vector<int64_t> in_splits, out_splits;
  for (const auto& t : inputs) in_splits.push_back(t.numel());
  for (const auto& t : outputs) out_splits.push_back(t.numel());
  at::Tensor flat_in = flat_like(inputs[0], offsets_of(inputs).back());
  at::Tensor flat_out = flat_like(inputs[0], offsets_of(outputs).back());
  pack(flat_in, inputs);
  auto work = peer("all_to_all with uneven blocks").alltoall_base(flat_out, flat_in, out_splits, in_splits, opts);
  work->wait();
  unpack(outputs, flat_out);
  return work;
}

c10::intrusive_ptr<c10d::Work> C10dBackend::barrier(const c10d::BarrierOptions& opts) {
  return wrap(comm_->barrier(opts.asyncOp, call_timeout(opts.timeout)), c10d::OpType::BARRIER, "pycomm:barrier");
}

void C10dBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  // Gloo's monitored barrier names the ranks that did not arrive; the
  // point-to-point group runs it as it is.
  peer("monitored_barrier").monitoredBarrier(opts, wait_all_ranks);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return peer("send").send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return peer("recv").recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> C10dBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return peer("recv").recvAnysource(tensors, tag);
}

void C10dBackend::abort() {
  if (comm_->forked_copy()) return;  // the parent's group, not this fork's to end
  comm_->abort("pycomm: rank " + std::to_string(getRank()) + ": the process group was aborted");
  if (peer_) peer_->abort();
}

void C10dBackend::shutdown() {
  if (comm_->forked_copy()) return;  // the parent's group, not this fork's to end
  comm_->shutdown();
  if (peer_) peer_->shutdown();
}

}  // namespace pycomm
