#include "multihost.h"

#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "../algorithms/tuner.h"
#include "../kernels/kernels.h"
#include "thread_name.h"
#include "layout.h"

namespace pycomm {

namespace {

// Sub-collectives sum where the call averages; the average is taken once,
// over the whole job, at the end (finish_average).
RedOp inner_op(RedOp op) { return op == RedOp::kAvg ? RedOp::kSum : op; }

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
  //    the whole job agrees before any data moves. A host whose ranks
  //    disagree still joins the check between hosts, as "invalid": that
  //    fails every cross group, so every rank of the job raises.
  //    Skipped when the caller already checked the call (a later step of
  //    a compressed all-reduce): one round trip between hosts fewer.
  if (!desc.checked) entry_check(desc, seq);
  if (desc.check_only || desc.coll == Collective::kBarrier || desc.coll == Collective::kInvalid) return;
  CollectiveDesc d = desc;
  d.checked = true;
  try {
    dispatch(d, seq);
  } catch (const CommError& e) {
    // The host's other ranks may wait on us inside the host: fail them now
    // rather than at their timeout.
    c_.local->abort(e.what(), e.blame());
    throw;
  }
}

void MultiHostTransport::entry_check(const CollectiveDesc& desc, uint64_t seq) {
  CollectiveDesc check = desc;
  check.check_only = true;
  std::optional<CommError> local_error;
  try {
    c_.local->run(check, seq);
  } catch (const CommError& e) {
    local_error = e;
    check.coll = Collective::kInvalid;
  }
  if (!local_error) {
    c_.cross->run(check, seq);
  } else {
    // The other hosts learn of the failure from the invalid header; what
    // they answer adds nothing to the reason we already have.
    try {
      c_.cross->run(check, seq);
    } catch (const CommError&) {
    }
    throw *local_error;
  }
}

void MultiHostTransport::abort(const std::string& why, Blame blame) {
  c_.local->abort(why, blame);
  c_.flat->abort(why, blame);
  if (c_.cross) c_.cross->abort(why, blame);
}

void MultiHostTransport::dispatch(const CollectiveDesc& d, uint64_t seq) {
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

namespace {

// One step of a hierarchical call: the call's dtype, its op as the steps run
// it, the step's own buffers.
CollectiveDesc step_desc(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in, void* out,
                         int root) {
  CollectiveDesc d;
  d.coll = coll;
  d.dtype = outer.dtype;
  d.op = inner_op(outer.op);
  d.root = root;
  d.count = count;
  d.timeout_s = outer.timeout_s;
  d.input = in;
  d.output = out;
  return d;
}

}  // namespace

void MultiHostTransport::local(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in,
                               void* out, int root, uint64_t seq) {
  CollectiveDesc d = step_desc(coll, outer, count, in, out, root);
  const bool sharded = coll == Collective::kReduceScatter || coll == Collective::kAllGather;
  d.algo = tune(Algorithm::kAuto, coll, count * dtype_size(d.dtype) * (sharded ? local_size_ : 1), local_size_);
  c_.local->run(d, seq);
}

void MultiHostTransport::cross(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in,
                               void* out, int root, uint64_t seq) {
  CollectiveDesc d = step_desc(coll, outer, count, in, out, root);
  d.algo = outer.inter;
  d.checked = true;  // by the entry check
  c_.cross->run(d, seq);
}

void MultiHostTransport::all_reduce_shard(const CollectiveDesc& d, uint64_t seq) {
  const size_t es = dtype_size(d.dtype);
  const uint64_t n = d.count;
  const uint64_t L = local_size_;
  // Segments of a multiple of L elements (only the last may be padded);
  // their steps overlap: shared memory works on one segment while the
  // network carries another.
  // At least 8 segments where they stay above 256 KiB: the first reduce and
  // the last gather do not overlap anything, so they should be short.
  const size_t sb = std::min(c_.segment_bytes, std::max<size_t>(256 << 10, n * es / 8));
  const uint64_t P = std::max<uint64_t>(1, std::min<uint64_t>((n * es + sb - 1) / sb, n / L));
  const uint64_t seg = (n + P - 1) / P;
  const uint64_t seg_elems = (seg + L - 1) / L * L;
  struct Segment {
    uint64_t first, count, m;
    size_t full_off, shard_off;  // in the workspace
    char* full;                  // padded copy, or null
    char* shard;                 // this rank's shard of it
  };
  std::vector<Segment> segs;
  size_t bytes = 0;
  for (uint64_t first = 0; first < n; first += seg_elems) {
    const uint64_t cnt = std::min<uint64_t>(seg_elems, n - first);
    const uint64_t m = (cnt + L - 1) / L;
    const size_t full_bytes = m * L != cnt ? m * L * es : 0;
    segs.push_back({first, cnt, m, bytes, bytes + full_bytes, nullptr, nullptr});
    bytes += full_bytes + m * es;
  }
  char* ws = workspace(bytes);
  for (Segment& g : segs) {
    if (g.shard_off != g.full_off) g.full = ws + g.full_off;
    g.shard = ws + g.shard_off;
  }
  const auto* in = static_cast<const char*>(d.input);
  auto* out = static_cast<char*>(d.output);

  // 1. Inside the host: local rank j gets the host's reduction of shard j.
  auto reduce_in_host = [&](const Segment& g) {
    const void* src = in + g.first * es;
    if (g.full) {
      // Shards must be equal: pad with zeros, which reduce to zeros and are
      // dropped at the end.
      std::memcpy(g.full, src, g.count * es);
      std::memset(g.full + g.count * es, 0, (g.m * L - g.count) * es);
      src = g.full;
    }
    local(Collective::kReduceScatter, d, g.m, src, g.shard, 0, seq);
  };
  // 2. Between hosts: reduce shard j with local rank j of every other host.
  auto reduce_across = [&](const Segment& g) { cross(Collective::kAllReduce, d, g.m, g.shard, g.shard, 0, seq); };
  // 3. Inside the host: gather the finished shards.
  auto gather_in_host = [&](const Segment& g) {
    local(Collective::kAllGather, d, g.m, g.shard, g.full ? g.full : out + g.first * es, 0, seq);
    if (g.full) std::memcpy(out + g.first * es, g.full, g.count * es);
  };

  if (segs.size() == 1) {
    reduce_in_host(segs[0]);
    reduce_across(segs[0]);
    gather_in_host(segs[0]);
  } else {
    // Step 2 runs on a helper thread, segment after segment as step 1 hands
    // them over. This thread issues the shared-memory steps in a fixed
    // order (reduce k+1, then gather k), the same on every local rank
    // whatever the timing.
    std::mutex mu;
    std::condition_variable cv;
    size_t reduced = 0, crossed = 0;
    bool stop = false;
    std::exception_ptr cross_error;
    std::thread helper = named_thread("cross", [&] {
      try {
        for (size_t k = 0; k < segs.size(); ++k) {
          {
            std::unique_lock<std::mutex> lk(mu);
            cv.wait(lk, [&] { return reduced > k || stop; });
            if (stop) return;
          }
          reduce_across(segs[k]);
          std::lock_guard<std::mutex> lk(mu);
          crossed = k + 1;
          cv.notify_all();
        }
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        cross_error = std::current_exception();
        cv.notify_all();
      }
    });
    auto handed = [&](size_t k) {
      std::lock_guard<std::mutex> lk(mu);
      reduced = k + 1;
      cv.notify_all();
    };
    auto wait_crossed = [&](size_t k) {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return crossed > k || cross_error; });
      if (cross_error) std::rethrow_exception(cross_error);
    };
    try {
      reduce_in_host(segs[0]);
      handed(0);
      for (size_t k = 1; k < segs.size(); ++k) {
        reduce_in_host(segs[k]);
        handed(k);
        wait_crossed(k - 1);
        gather_in_host(segs[k - 1]);
      }
      wait_crossed(segs.size() - 1);
      gather_in_host(segs.back());
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(mu);
        stop = true;
        cv.notify_all();
      }
      helper.join();
      throw;
    }
    helper.join();
  }
  finish_average(d, c_.world);
}

void MultiHostTransport::all_reduce_leader(const CollectiveDesc& d, uint64_t seq) {
  // 1. Inside the host: every local rank gets the host's reduction.
  local(Collective::kAllReduce, d, d.count, d.input, d.output, 0, seq);
  // 2. Between hosts: the leaders (local rank 0) reduce the host results.
  if (c_.local_rank == 0) cross(Collective::kAllReduce, d, d.count, d.output, d.output, 0, seq);
  // 3. Inside the host: the leader shares the result.
  local(Collective::kBroadcast, d, d.count, d.output, d.output, 0, seq);
  finish_average(d, c_.world);
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
  finish_average(d, c_.world);
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
