// Several hosts: shared memory inside each host, a process group between
// them. Every call first checks that the whole job agrees on it (a header
// check inside the host, then one between hosts), then runs flat over the
// process group or hierarchically:
//
//   hier(shard)   all-reduce: reduce-scatter inside the host, every local
//                 rank all-reduces its shard with the same local rank of
//                 every other host, all-gather inside the host (Horovod's
//                 and NCCL's hierarchical scheme; the inter-host traffic is
//                 spread over all local ranks).
//                 reduce-scatter / all-gather / broadcast: the same idea,
//                 one block per host.
//   hier(leader)  all-reduce inside the host, one leader per host
//                 all-reduces the whole tensor between hosts, broadcast
//                 inside the host (fewer, larger messages: small tensors).
#pragma once

#include <memory>
#include <vector>

#include "transport.h"

namespace pycomm {

struct MultiHostConfig {
  Transport* local = nullptr;  // shared memory among this host's ranks
  Transport* flat = nullptr;   // process group: every rank
  Transport* cross = nullptr;  // process group: this local rank on every host; null if hosts differ in size
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  // host_ranks[h][j]: the communicator rank of local rank j on host h.
  std::vector<std::vector<int>> host_ranks;
  // A sharded all-reduce larger than this is cut into segments whose
  // shared-memory and network steps overlap.
  size_t segment_bytes = 4 << 20;
};

class MultiHostTransport : public Transport {
 public:
  explicit MultiHostTransport(const MultiHostConfig& config);

  void run(const CollectiveDesc& desc, uint64_t seq) override;
  int rank() const override { return c_.rank; }
  int world() const override { return c_.world; }
  void abort(const std::string& why, Blame blame = {}) override;
  int hosts() const { return hosts_; }
  // Ranks per host, 0 where hosts differ in size (no hierarchical collectives).
  int uniform_local_size() const { return c_.cross ? local_size_ : 0; }

 private:
  // The ranks of each host agree, then the hosts (throws CommError).
  void entry_check(const CollectiveDesc& desc, uint64_t seq);
  void dispatch(const CollectiveDesc& d, uint64_t seq);
  void all_reduce_shard(const CollectiveDesc& d, uint64_t seq);
  void all_reduce_leader(const CollectiveDesc& d, uint64_t seq);
  void reduce_scatter(const CollectiveDesc& d, uint64_t seq);
  void all_gather(const CollectiveDesc& d, uint64_t seq);
  void broadcast(const CollectiveDesc& d, uint64_t seq);
  // A collective among this host's ranks, algorithm chosen by the tuner.
  void local(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in, void* out, int root,
             uint64_t seq);
  // A collective among this local rank's peers on the other hosts.
  void cross(Collective coll, const CollectiveDesc& outer, uint64_t count, const void* in, void* out, int root,
             uint64_t seq);
  char* workspace(size_t bytes);

  MultiHostConfig c_;
  int hosts_;
  int local_size_;
  std::vector<char> ws_;
};

}  // namespace pycomm
