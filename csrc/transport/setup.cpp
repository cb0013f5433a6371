#include "setup.h"

namespace pycomm {

Transports::Transports(const TopologyConfig& o) : world_(o.world) {
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    throw CommError("pycomm: invalid rank " + std::to_string(o.rank) + " of " + std::to_string(o.world));
  // 1. Shared memory among this host's ranks.
  if (o.use_shm) {
    ShmConfig cfg;
    cfg.name = o.shm_name;
    cfg.token = o.token;
    cfg.create = o.create;
    cfg.rank = o.local_rank;
    cfg.world = o.local_size;
    cfg.round_bytes = o.round_bytes;
    cfg.timeout_s = o.timeout_s;
    if (!o.host_ranks.empty()) cfg.global_ranks = o.host_ranks.at(o.host);
    local_ = std::make_unique<ShmTransport>(cfg);
    top_ = local_.get();
  }
  // 2. Flat over the process group: every rank, in communicator order.
  PgConfig flat;
  if (o.link) {
    flat.link = o.link;
    for (int r = 0; r < o.world; ++r) flat.members.push_back(r);
    flat.rank = o.rank;
    flat.round_bytes = o.pg_round_bytes;
    flat.window = o.pg_window;
    flat.timeout_s = o.timeout_s;
    flat.tag_space = 0;
    flat_ = std::make_unique<PgTransport>(flat);
    top_ = flat_.get();
  }
  // 3. Several hosts. With the same number of ranks on every host, local
  //    rank j of every host forms a cross group (hierarchical collectives).
  if (local_ && flat_) {
    bool uniform = true;
    for (const auto& h : o.host_ranks) uniform = uniform && h.size() == o.host_ranks[0].size();
    MultiHostConfig mh;
    mh.local = local_.get();
    mh.flat = flat_.get();
    mh.rank = o.rank;
    mh.world = o.world;
    mh.local_rank = o.local_rank;
    mh.host_ranks = o.host_ranks;
    // Four shared-memory rounds: long enough that the shared-memory steps
    // run at full speed, short next to the segment's time on the network.
    mh.segment_bytes = 4 * o.round_bytes;
    if (uniform) {
      PgConfig cross = flat;
      cross.members.clear();
      for (const auto& h : o.host_ranks) cross.members.push_back(h[o.local_rank]);
      cross.rank = o.host;
      cross.tag_space = 1;
      cross_ = std::make_unique<PgTransport>(cross);
      mh.cross = cross_.get();
    }
    multi_ = std::make_unique<MultiHostTransport>(mh);
    top_ = multi_.get();
  }
  if (!top_) throw CommError("pycomm: a communicator needs shared memory or a process group");
  // 4. Point-to-point channels among this host's ranks.
  local_of_.assign(o.world, -1);
  if (local_) {
    if (o.host_ranks.empty()) {
      for (int r = 0; r < o.world; ++r) local_of_[r] = r;
    } else {
      const auto& mine = o.host_ranks.at(o.host);
      for (size_t j = 0; j < mine.size(); ++j) local_of_.at(mine[j]) = static_cast<int>(j);
    }
    p2p_ = std::make_unique<ShmChannels>(*local_, o.shm_name + ".p2p", o.token, o.p2p_bytes);
  }
  // 5. Point-to-point over the process group, to the ranks of other hosts
  //    (every rank with transport='pg').
  if (o.link) remote_p2p_ = std::make_unique<PgChannels>(o.link, o.rank);
}

Resolved Transports::choose(Algorithm algo, Collective coll, size_t bytes) const {
  if (multi_) return tune_multihost(algo, coll, bytes, multi_->hosts(), multi_->uniform_local_size());
  // One host: "hierarchical" is simply the host's own algorithm.
  if (algo == Algorithm::kHier) algo = Algorithm::kAuto;
  const Algorithm a = local_ ? tune(algo, coll, bytes, world_) : tune_network(algo, coll, bytes, world_);
  return {a, a};
}

void Transports::set_timeout(double seconds) {
  if (local_) local_->set_timeout(seconds);
  if (flat_) flat_->set_timeout(seconds);
  if (cross_) cross_->set_timeout(seconds);
}

std::string Transports::name() const {
  if (multi_) return "shm+process_group";
  return local_ ? "shm" : "process_group";
}

void Transports::wait_ready() {
  if (local_) local_->wait_all_attached();
}

bool Transports::wait_ready_for(double seconds) {
  return !local_ || local_->wait_all_attached_for(seconds);
}

uint32_t Transports::abandon_ready() {
  return local_ ? local_->abandon_attach() : 0;
}

void Transports::shutdown(const std::function<bool(int)>& failed) {
  // Sends to other hosts may still wait for their receivers (see
  // pg_channels.h); leaving now would close the connections under them.
  if (remote_p2p_) remote_p2p_->flush(timeout(), failed);
  if (p2p_) p2p_->close();
  if (local_) local_->shutdown();
}

}  // namespace pycomm
