#include "multihost.h"

#include <cstring>

#include "../algorithms/algorithms.h"
#include "../kernels/kernels.h"

namespace pycomm {

namespace {

// Sub-collectives sum where the call averages; the average is taken once,
// over the whole job, at the end.
RedOp inner_op(RedOp op) { return op == RedOp::kAvg ? RedOp::kSum : op; }

void finish_avg(const CollectiveDesc& d, void* out, uint64_t count, int world) {
  if (d.op == RedOp::kAvg) kernels::divide_cpu(d.dtype, out, count, static_cast<double>(world));
}

}  // namespace

MultiHostTransport::MultiHostTransport(const MultiHostConfig& config)
    : c_(config),
      hosts_(static_cast<int>(config.host_ranks.size())),
      local_size_(config.host_ranks.empty() ? 0 : static_cast<int>(config.host_ranks[0].size())) {
  if (!c_.local || !c_.flat) throw CommError("pycomm: the multi-host transport needs shared memory and a process group");
  if (c_.cross) {
    for (const auto& h : c_.host_ranks)
      if (static_cast<int>(h.size()) != local_size_)
        throw CommError("pycomm: hierarchical collectives need the same number of ranks on every host");
    if (c_.cross->world() != hosts_ || c_.local->world() != local_size_)
      throw CommError("pycomm: multi-host transport: inconsistent topology");
  }
}

char* MultiHostTransport::workspace(size_t bytes) {
  if (ws_.size() < bytes) ws_.resize(bytes);
  return ws_.data();
}

void MultiHostTransport::run(const CollectiveDesc& desc, uint64_t seq) {
  if (!c_.cross) {
    // Hosts of different sizes: flat only, and the process group checks the
    // headers of the whole job itself.
    c_.flat->run(desc, seq);
    return;
  }
  // 1. Entry check: the ranks of each host agree (shared memory), and each
  //    host agrees with every other (every cross group spans all hosts), so
  //    the whole job agrees before any data moves, and a mismatch raises on
  //    every rank.
  CollectiveDesc check = desc;
  check.check_only = true;
  c_.local->run(check, seq);
  c_.cross->run(check, seq);
  if (desc.check_only || desc.coll == Collective::kBarrier || desc.coll == Collective::kInvalid) return;
  CollectiveDesc d = desc;
  d.checked = true;
  // 2. Run it.
  if (d.algo == Algorithm::kHierLeader) {
    all_reduce_leader(d, seq);
  } else if (d.algo == Algorithm::kHierShard) {
    switch (d.coll) {
      case Collective::kAllReduce: all_reduce_shard(d, seq); break;
      case Collective::kReduceScatter: reduce_scatter(d, seq); break;
      case Collective::kAllGather: all_gather(d, seq); break;
      case Collective::kBroadcast: broadcast(d, seq); break;
      default: throw CommError("pycomm internal error: no hierarchical form of this collective");
    }
  } else {
    c_.flat->run(d, seq);
  }
}

void MultiHostTransport::local(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in,
                               void* out, int root, uint64_t seq) {
  CollectiveDesc d;
  d.coll = coll;
  d.dtype = outer.dtype;
  d.op = inner_op(outer.op);
  d.root = root;
  d.count = count;
  d.input = in;
  d.output = out;
  const size_t bytes = count * dtype_size(d.dtype) * (coll == Collective::kReduceScatter ||
                                                              coll == Collective::kAllGather
                                                          ? local_size_
                                                          : 1);
  d.algo = tune(Algorithm::kAuto, coll, bytes, local_size_);
  c_.local->run(d, seq);
}

void MultiHostTransport::cross(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in,
                               void* out, int root, uint64_t seq) {
  CollectiveDesc d;
  d.coll = coll;
  d.algo = outer.inter;
  d.dtype = outer.dtype;
  d.op = inner_op(outer.op);
  d.root = root;
  d.count = count;
  d.input = in;
  d.output = out;
  d.checked = true;
  c_.cross->run(d, seq);
}

void MultiHostTransport::all_reduce_shard(const CollectiveDesc& d, uint64_t seq) {
  const size_t es = dtype_size(d.dtype);
  const uint64_t n = d.count;
  const uint64_t L = local_size_;
  const uint64_t m = (n + L - 1) / L;  // shard elements
  const bool padded = m * L != n;
  char* ws = workspace((padded ? m * L * es : 0) + m * es);
  char* full = padded ? ws : nullptr;
  char* shard = ws + (padded ? m * L * es : 0);
  const void* src = d.input;
  if (padded) {
    // Shards must be equal: pad with zeros, which reduce to zeros and are
    // dropped at the end.
    std::memcpy(full, d.input, n * es);
    std::memset(full + n * es, 0, (m * L - n) * es);
    src = full;
  }
  // 1. Inside the host: local rank j gets the host's reduction of shard j.
  local(Collective::kReduceScatter, d, m, src, shard, 0, seq);
  // 2. Between hosts: reduce shard j with local rank j of every other host.
  cross(Collective::kAllReduce, d, m, shard, shard, 0, seq);
  // 3. Inside the host: gather the finished shards.
  local(Collective::kAllGather, d, m, shard, padded ? full : d.output, 0, seq);
  if (padded) std::memcpy(d.output, full, n * es);
  finish_avg(d, d.output, n, c_.world);
}

void MultiHostTransport::all_reduce_leader(const CollectiveDesc& d, uint64_t seq) {
  // 1. Inside the host: every local rank gets the host's reduction.
  local(Collective::kAllReduce, d, d.count, d.input, d.output, 0, seq);
  // 2. Between hosts: the leaders (local rank 0) reduce the host results.
  if (c_.local_rank == 0) cross(Collective::kAllReduce, d, d.count, d.output, d.output, 0, seq);
  // 3. Inside the host: the leader shares the result.
  local(Collective::kBroadcast, d, d.count, d.output, d.output, 0, seq);
  finish_avg(d, d.output, d.count, c_.world);
}

void MultiHostTransport::reduce_scatter(const CollectiveDesc& d, uint64_t seq) {
  const size_t block = d.count * dtype_size(d.dtype);
  const int H = hosts_, L = local_size_;
  char* a = workspace(2 * static_cast<size_t>(H) * L * block);
  char* b = a + static_cast<size_t>(H) * L * block;
  // 1. Order the input blocks by local rank, then host: local rank j's
  //    shard of the host reduction is then the blocks of ranks (., j).
  const auto* in = static_cast<const char*>(d.input);
  for (int j = 0; j < L; ++j)
    for (int h = 0; h < H; ++h)
      std::memcpy(a + (static_cast<size_t>(j) * H + h) * block, in + c_.host_ranks[h][j] * block, block);
  // 2. Inside the host: reduce, local rank j keeps the blocks of ranks (., j).
  local(Collective::kReduceScatter, d, d.count * H, a, b, 0, seq);
  // 3. Between hosts: host h's local rank j keeps block h, its own.
  cross(Collective::kReduceScatter, d, d.count, b, d.output, 0, seq);
  finish_avg(d, d.output, d.count, c_.world);
}

void MultiHostTransport::all_gather(const CollectiveDesc& d, uint64_t seq) {
  const size_t block = d.count * dtype_size(d.dtype);
  const int H = hosts_, L = local_size_;
  char* a = workspace((static_cast<size_t>(H) + static_cast<size_t>(H) * L) * block);
  char* b = a + static_cast<size_t>(H) * block;
  // 1. Between hosts: gather the blocks of ranks (., j), in host order.
  cross(Collective::kAllGather, d, d.count, d.input, a, 0, seq);
  // 2. Inside the host: gather those of every local rank.
  local(Collective::kAllGather, d, d.count * H, a, b, 0, seq);
  // 3. Put every block at its rank's place.
  auto* out = static_cast<char*>(d.output);
  for (int j = 0; j < L; ++j)
    for (int h = 0; h < H; ++h)
      std::memcpy(out + c_.host_ranks[h][j] * block, b + (static_cast<size_t>(j) * H + h) * block, block);
}

void MultiHostTransport::broadcast(const CollectiveDesc& d, uint64_t seq) {
  int root_host = -1, root_local = -1;
  for (int h = 0; h < hosts_; ++h)
    for (int j = 0; j < local_size_; ++j)
      if (c_.host_ranks[h][j] == d.root) root_host = h, root_local = j;
  if (root_host < 0) throw CommError("pycomm internal error: broadcast root on no host");
  // 1. Between hosts: the root's local rank on every host receives it.
  if (c_.local_rank == root_local) cross(Collective::kBroadcast, d, d.count, d.input, d.output, root_host, seq);
  // 2. Inside every host: that local rank passes it on.
  local(Collective::kBroadcast, d, d.count, d.input, d.output, root_local, seq);
}

}  // namespace pycomm
