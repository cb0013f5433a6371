// The transports of one communicator, built from its topology in one place:
// shared memory among the ranks of this host, a process group over every
// rank (when there are several hosts, or when asked to), a second one over
// this local rank's peers on the other hosts (hierarchical collectives), the
// multi-host transport that combines them, and the point-to-point channels.
// Also the one place that knows which algorithm a call runs on this
// topology, and the communicator's timeout.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../algorithms/tuner.h"
#include "multihost.h"
#include "p2p.h"
#include "pg_channels.h"
#include "process_group.h"
#include "shm.h"

namespace pycomm {

struct TopologyConfig {
  int rank = 0;  // in the communicator
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
  // h by local rank, `host` is ours, and `link` carries the traffic between
  // hosts; its rank r is the communicator's rank r.
  int host = 0;
  std::vector<std::vector<int>> host_ranks;
  std::shared_ptr<PeerLink> link;
  size_t pg_round_bytes = 4 << 20;
  int pg_window = 4;
  // Bytes of each point-to-point ring (one per ordered pair that talks).
  size_t p2p_bytes = 4 << 20;
};

class Transports {
 public:
  explicit Transports(const TopologyConfig& config);
  Transports(const Transports&) = delete;
  Transports& operator=(const Transports&) = delete;

  // What collectives run on.
  Transport& top() const { return *top_; }
  // Shared memory of this host (null with use_shm false).
  ShmTransport* local() const { return local_.get(); }
  // Point-to-point channels to this host's ranks (null without shared memory).
  ShmChannels* p2p() const { return p2p_.get(); }
  // Point-to-point channels over the process group, to any rank (null
  // without one: a single host with shared memory).
  PgChannels* remote_p2p() const { return remote_p2p_.get(); }
  // The local rank of communicator rank `rank`; -1 on another host.
  int local_rank_of(int rank) const { return local_of_.at(rank); }

  // Resolves `requested` (kAuto, kDirect, kHier or a concrete algorithm the
  // collective supports) for `bytes` per rank on this topology.
  Resolved choose(Algorithm requested, Collective coll, size_t bytes) const;

  // The transports' timeout (they all share one).
  double timeout() const { return local_ ? local_->timeout() : flat_->timeout(); }
  // Safe while other threads run operations: every transport keeps its
  // timeout in an atomic and reads it once per operation.
  void set_timeout(double seconds);
  // "shm", "process_group" or "shm+process_group": what carries the data.
  std::string name() const;
  // Blocks until every local rank has mapped the segment.
  void wait_ready();
  // The same for at most `seconds`: true once every local rank has mapped
  // it. abandon_ready() gives the bootstrap up and says how many had.
  bool wait_ready_for(double seconds);
  uint32_t abandon_ready();
  // Tells peers this rank is gone (after the caller finished its queued
  // operations): unlinks channel names nobody mapped, marks the rank exited.
  // `failed(rank)`: whether a rank of another host failed (PgChannels::flush).
  void shutdown(const std::function<bool(int)>& failed = {});

 private:
  int world_;
  std::unique_ptr<ShmTransport> local_;
  std::unique_ptr<PgTransport> flat_;
  std::unique_ptr<PgTransport> cross_;
  std::unique_ptr<MultiHostTransport> multi_;
  Transport* top_ = nullptr;
  std::unique_ptr<ShmChannels> p2p_;
  std::unique_ptr<PgChannels> remote_p2p_;
  std::vector<int> local_of_;
};

}  // namespace pycomm
