// Registered (symmetric) memory of the shared-memory transport: the
// allocations behind comm.empty, and the executor that runs collectives on
// them in place, reading peers' buffers where they lie instead of staging
// them in the mailboxes (no copy-in, no copy-out).
//
// The in-place protocol. Peers read a rank's registered buffers during a
// call (and the all-reduce writes into them), and the rank's user may touch
// them once the call returns, so:
//  1. A peer's buffer is touched only after its header for this call, and
//     the registration record beside it, is published and checked: same
//     call, and offsets inside the allocation's region (checked before any
//     access).
//  2. Every rank decides from the same headers whether the call runs in
//     place: only if, for each role peers touch (the input, or the
//     all-reduce's output), every rank's buffer lies in one and the same
//     allocation, so every rank maps it. Otherwise every rank runs the
//     staged executor.
//  3. Rank r writes into a peer's output only shard r, which only rank r
//     reads (as that peer's contribution, in the same block, before
//     writing it), and only after the peer posted that its data is in
//     place.
//  4. A rank returns only after every peer posted that it is done reading
//     and writing every buffer of the call.
// Steps are the transport's step counters: the staged and the in-place
// executors share them, like the header slots.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "../kernels/kernels.h"
#include "layout.h"
#include "shm.h"
#include "shm_file.h"
#include "shm_segment.h"

namespace pycomm {

namespace {

constexpr uint64_t kAllocMagic = 0x3147455243594d50ull;  // "PMYCREG1"

// Page 0 of an allocation's segment; the regions follow, one per local rank.
struct AllocHeader {
  uint64_t magic;
  uint64_t world;
  uint64_t region_bytes;
  char token[64];
};

// Bytes of a call's input and of its output on one rank: the sharded side
// of reduce-scatter, all-gather and all-to-all holds `world` blocks.
struct BufferBytes {
  size_t in, out;
};
BufferBytes buffer_bytes(const CollectiveDesc& d, int world) {
  const size_t es = dtype_size(d.dtype);
  const bool many_in = d.coll == Collective::kReduceScatter || d.coll == Collective::kAllToAll;
  const bool many_out = d.coll == Collective::kAllGather || d.coll == Collective::kAllToAll;
  return {d.count * (many_in ? world : 1) * es, d.count * (many_out ? world : 1) * es};
}

// The order in which the staged two-shot plan reduces this rank's shard:
// the in-place executor reduces in the same order, so both give the same
// bits.
std::vector<int> reduce_order(const Plan& plan) {
  std::vector<int> order;
  if (plan.steps.empty() || plan.steps[0].groups.size() != 1)
    throw CommError("pycomm internal error: a two-shot plan without exactly one reduction in its first step");
  for (const PlanSrc& s : plan.steps[0].groups[0].srcs) order.push_back(s.peer);
  return order;
}

}  // namespace

ShmAllocation::~ShmAllocation() {
  if (base_) munmap(base_, size_);
}

// ------------------------------------------------------------ allocation

std::shared_ptr<ShmAllocation> ShmTransport::allocate(size_t bytes, uint64_t seq) {
  check_abort();
  const uint64_t id = ++allocations_;
  const std::string seg = name_ + ".m" + std::to_string(id);
  std::shared_ptr<ShmAllocation> a(new ShmAllocation());
  a->id_ = id;
  a->owner_ = name_;
  a->rank_ = rank_;
  a->region_bytes_ = align_up(std::max<size_t>(bytes, 1), kPage);
  a->size_ = kPage + a->region_bytes_ * world_;

  // Every rank learns whether any failed, and whether all asked for the same
  // size, through one small staged all-reduce(max) of {failed rank + 1,
  // bytes, -bytes}. A failure raises on every rank and leaves the
  // transport healthy.
  auto agree = [&](const std::string& error, const char* what) {
    int64_t mine[3] = {error.empty() ? 0 : rank_ + 1, static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)};
    int64_t all[3];
    CollectiveDesc d;
    d.coll = Collective::kAllReduce;
    d.algo = Algorithm::kOneShot;
    d.dtype = DType::kInt64;
    d.op = RedOp::kMax;
    d.count = 3;
    d.tag = kAllocateTag;
    d.input = mine;
    d.output = all;
    try {
      run(d, seq);
    } catch (...) {
      shm_unlink(seg.c_str());  // a peer died: nobody else will remove the name
      throw;
    }
    if (all[0] == 0 && all[1] == -all[2]) return;
    shm_unlink(seg.c_str());
    if (!error.empty()) throw CommError(error);
    if (all[0] != 0)
      throw CommError("pycomm: comm.empty: local rank " + std::to_string(all[0] - 1) + " could not " + what +
                      " the registered segment (see the error on that rank)");
    throw CommError("pycomm: comm.empty: local ranks asked for different sizes (" + std::to_string(-all[2]) +
                    " and " + std::to_string(all[1]) + " bytes); every rank must call it with the same shape and "
                    "dtype");
  };
  auto map = [&](int fd) -> std::string {
    // MAP_POPULATE: the pages are faulted in here, not in the first timed
    // collectives.
    void* p = mmap(nullptr, a->size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    const int err = errno;
    close(fd);
    if (p == MAP_FAILED) return std::string("cannot map registered segment: ") + std::strerror(err);
    a->base_ = p;
    a->regions_ = static_cast<char*>(p) + kPage;
    return "";
  };

  // 1. Local rank 0 creates the segment (O_EXCL: never adopt somebody
  //    else's; 0600: only our uid) and writes its header, magic last.
  std::string error;
  if (rank_ == 0) {
    const int fd = shm_open(seg.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      error = "pycomm: comm.empty: cannot create registered segment " + seg + ": " + std::strerror(errno);
    } else if (std::string why = size_shm_file(fd, a->size_, "registered segment " + seg); !why.empty()) {
      error = "pycomm: comm.empty: " + why;
      close(fd);
    } else {
      error = map(fd);
      if (!error.empty()) error = "pycomm: comm.empty: " + error;
    }
    if (error.empty()) {
      auto* h = reinterpret_cast<AllocHeader*>(a->base_);
      h->world = static_cast<uint64_t>(world_);
      h->region_bytes = a->region_bytes_;
      std::strncpy(h->token, token_.c_str(), sizeof(h->token) - 1);
      __atomic_store_n(&h->magic, kAllocMagic, __ATOMIC_RELEASE);
    }
  }
  agree(error, "create");

  // 2. The others attach, checking size and header: a segment of another
  //    job or another allocation is refused.
  if (rank_ != 0) {
    const int fd = shm_open(seg.c_str(), O_RDWR, 0);
    struct stat st;
    if (fd < 0) {
      error = "pycomm: comm.empty: cannot open registered segment " + seg + ": " + std::strerror(errno);
    } else if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != a->size_) {
      close(fd);
      error = "pycomm: comm.empty: registered segment " + seg + " has the wrong size";
    } else {
      error = map(fd);
      if (!error.empty()) error = "pycomm: comm.empty: " + error;
    }
    if (error.empty()) {
      const auto* h = reinterpret_cast<const AllocHeader*>(a->base_);
      if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != kAllocMagic || h->world != static_cast<uint64_t>(world_) ||
          h->region_bytes != a->region_bytes_ || std::strncmp(h->token, token_.c_str(), sizeof(h->token)) != 0)
        error = "pycomm: comm.empty: registered segment " + seg + " does not belong to this job; refusing it";
    }
  }
  agree(error, "attach to");

  // 3. Everybody has mapped it: the name goes (every rank tries, so that it
  //    goes even if rank 0 dies right here), and a kill -9 leaves nothing.
  shm_unlink(seg.c_str());
  std::lock_guard<std::mutex> lk(registered_mu_);
  registered_[id] = a;
  return a;
}

std::shared_ptr<ShmAllocation> ShmTransport::find_registered(const void* p, size_t bytes, uint64_t* offset) {
  if (!p) return nullptr;
  const auto* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lk(registered_mu_);
  for (auto it = registered_.begin(); it != registered_.end();) {
    std::shared_ptr<ShmAllocation> a = it->second.lock();
    if (!a) {
      it = registered_.erase(it);  // its tensors are gone
      continue;
    }
    const char* lo = a->region(rank_);
    if (c >= lo && c + bytes <= lo + a->region_bytes()) {
      *offset = static_cast<uint64_t>(c - lo);
      return a;
    }
    ++it;
  }
  return nullptr;
}

RegisteredCall ShmTransport::registration(const CollectiveDesc& d,
                                          std::vector<std::shared_ptr<ShmAllocation>>* keep) {
  RegisteredCall r;
  keep->assign(2, nullptr);
  if (d.count == 0 || d.coll == Collective::kBarrier || d.coll == Collective::kInvalid || world_ == 1) return r;
  const BufferBytes bytes = buffer_bytes(d, world_);
  (*keep)[0] = find_registered(d.input, bytes.in, &r.in_off);
  (*keep)[1] = find_registered(d.output, bytes.out, &r.out_off);
  if ((*keep)[0]) r.in_id = (*keep)[0]->id();
  if ((*keep)[1]) r.out_id = (*keep)[1]->id();
  return r;
}

void ShmTransport::wait_all_steps(uint64_t step, const OpContext& ctx, const char* what) {
  for (int q = 0; q < world_; ++q)
    if (q != rank_) wait_step(q, step, ctx, what);
}

// ------------------------------------------------------------ in place

bool ShmTransport::run_registered(const CollectiveDesc& d, const OpContext& ctx, std::vector<bool>& checked,
                                  uint64_t seq, const RegisteredCall& mine,
                                  const std::vector<std::shared_ptr<ShmAllocation>>& keep) {
  // 1. Calls with an in-place form: the two-shot ones, and the one-shot
  //    broadcast. An explicit ring or tree keeps its own schedule (and its
  //    own reduction order, so its bits), staged.
  if (world_ == 1 || d.count == 0) return false;
  const Collective c = d.coll;
  const bool two_shot = d.algo == Algorithm::kTwoShot;
  const bool ar = c == Collective::kAllReduce && two_shot;
  const bool eligible = ar || (two_shot && (c == Collective::kReduceScatter || c == Collective::kAllGather ||
                                            c == Collective::kAllToAll)) ||
                        (c == Collective::kBroadcast && d.algo == Algorithm::kOneShot);
  // Peers read the all-reduce's output (the reduced shards) and the others'
  // input. A rank without it registered declines here; its peers see its
  // record and decline too.
  if (!eligible || (ar ? mine.out_id : mine.in_id) == 0) return false;

  // 2. Every header first: the decision needs every rank's record.
  for (int q = 0; q < world_; ++q) {
    if (!checked[q]) {
      check_header(q, seq, ctx);
      checked[q] = true;
    }
  }
  const int slot = static_cast<int>(ctx.op % kHeaderSlots);
  auto rec = [&](int q) -> const RegisteredCall& { return controls_[q].registered[slot]; };
  auto shared = [&](uint64_t RegisteredCall::*id) {
    for (int q = 0; q < world_; ++q)
      if (rec(q).*id == 0 || rec(q).*id != rec(0).*id) return false;
    return true;
  };
  const bool in_shared = shared(&RegisteredCall::in_id);
  const bool out_shared = shared(&RegisteredCall::out_id);
  if (ar ? !out_shared : !in_shared) return false;

  in_place_calls_.fetch_add(1, std::memory_order_relaxed);
  const size_t es = dtype_size(d.dtype);
  const uint64_t n = d.count;
  const BufferBytes bytes = buffer_bytes(d, world_);
  // Offsets come from peers' memory: bounded before anything is read.
  for (int q = 0; q < world_; ++q) {
    const bool bad = (in_shared && rec(q).in_off + bytes.in > keep[0]->region_bytes()) ||
                     (ar && rec(q).out_off + bytes.out > keep[1]->region_bytes());
    if (bad)
      fail("pycomm: rank " + std::to_string(name(q)) + "'s registered buffer of " + collective_name(c) + " #" +
               std::to_string(seq) + " lies outside its registered region (corrupt shared memory)",
           Blame{FailureKind::kWaiting, name(q)});
  }
  auto input_of = [&](int q) -> const char* { return keep[0]->region(q) + rec(q).in_off; };
  // Peers' outputs are written only by the pushed all-reduce.
  auto output_of = [&](int q) -> char* { return keep[1]->region(q) + rec(q).out_off; };
  auto* out = static_cast<char*>(d.output);
  const uint64_t g0 = step_base_;
  const char* reading = "it to finish reading this rank's registered buffer";

  if (!ar) {
    // 3. One hop: read what this rank needs from every peer's input where
    //    it lies, then wait until the peers are done reading ours.
    const int me = rank_;
    if (c == Collective::kReduceScatter) {
      const Plan& plan = plans_.get(Schedule{d.algo, c, world_, d.root});
      std::vector<const void*> srcs;
      for (int q : reduce_order(plan)) srcs.push_back(input_of(q) + me * n * es);
      kernels::reduce_cpu(d.dtype, d.op, out, nullptr, srcs.data(), world_, n);
    } else if (c == Collective::kAllGather) {
      for (int q = 0; q < world_; ++q) {
        // In place, this rank's input already is its slot of the output.
        const char* src = input_of(q);
        if (src != out + q * n * es) kernels::copy_cpu(out + q * n * es, nullptr, src, n * es);
      }
    } else if (c == Collective::kAllToAll) {
      for (int q = 0; q < world_; ++q)
        kernels::copy_cpu(out + q * n * es, nullptr, input_of(q) + me * n * es, n * es);
    } else if (me != d.root) {
      kernels::copy_cpu(out, nullptr, input_of(d.root), n * es);
    }
    post_step(g0);
    // A broadcast's readers read only the root's buffer.
    if (c != Collective::kBroadcast || me == d.root) wait_all_steps(g0, ctx, reading);
    step_base_ += 1;
    finish_average(d, world_);
    return true;
  }

  // 4. All-reduce, pushed: rank r reduces shard r from every rank's source
  //    and writes the result into every rank's output at once. One pass
  //    over the data and two synchronisations per call: no rank waits for
  //    a peer's fresh result (the staged executor's per-round hand-offs,
  //    which cost most when the ranks' cores share no cache). The sources:
  //    the inputs where every rank's input is registered in one
  //    allocation, else the outputs, after each rank copied its input there
  //    (one copy instead of two).
  const bool from_inputs = in_shared;
  auto source_of = [&](int q) -> const char* { return from_inputs ? input_of(q) : output_of(q); };
  if (!from_inputs && d.input != d.output) kernels::copy_cpu(out, nullptr, d.input, n * es);
  post_step(g0);
  // Nobody writes into a peer's output before that peer's source is ready
  // (its own copy would overwrite the result).
  wait_all_steps(g0, ctx, "its input");

  // 5. This rank's chunk of every round of the staged two-shot layout:
  //    the same elements, reduced in the same order, as the staged
  //    executor reduces on this rank, so both give the same bits. A chunk
  //    is at most a round's share (256-512 KiB by default), so it stays in
  //    L2 between the reduction and the copies to the third and later
  //    ranks. Chunk r of rank q's output (its source too, in place) is read
  //    only by rank r, in the very call that overwrites it, so no write
  //    lands on data a peer has yet to read; chunks start on cache lines,
  //    so two ranks never write one line.
  const Plan& plan = plans_.get(Schedule{d.algo, c, world_, d.root});
  const RoundLayout layout(d, plan.num_chunks, world_, round_bytes_);
  const std::vector<int> order = reduce_order(plan);
  std::vector<const void*> srcs(world_);
  std::vector<const char*> chunk_in;
  std::vector<char*> chunk_out;
  std::vector<size_t> chunk_len;
  const int next = (rank_ + 1) % world_;  // written by the reduction itself, the rest by copies
  for (uint64_t j = 0; j < layout.rounds; ++j) {
    layout.chunks(j, rank_, d.output, d.output, chunk_in, chunk_out, chunk_len);
    const size_t m = chunk_len[rank_];
    if (m == 0) continue;
    const size_t at = static_cast<size_t>(chunk_out[rank_] - out);
    for (int k = 0; k < world_; ++k) srcs[k] = source_of(order[k]) + at;
    kernels::reduce_cpu(d.dtype, d.op, out + at, output_of(next) + at, srcs.data(), world_, m);
    for (int q = 0; q < world_; ++q)
      if (q != rank_ && q != next) kernels::copy_cpu(output_of(q) + at, nullptr, out + at, m * es);
  }
  // 6. Nobody returns (and lets its user read or overwrite the buffers)
  //    before every rank has written its shard everywhere and read its
  //    sources.
  post_step(g0 + 1);
  wait_all_steps(g0 + 1, ctx, reading);
  step_base_ += 2;
  finish_average(d, world_);
  return true;
}

}  // namespace pycomm
