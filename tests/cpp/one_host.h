// Ranks of one host as threads of one test process: the topology of local
// rank `rank` of `world` over the shared-memory segment `name` (rank 0
// creates it), with small rounds so that tests stay quick.
#pragma once

#include <string>

#include "transport/setup.h"

namespace pycomm {

inline TopologyConfig one_host_config(int rank, int world, const std::string& name, const std::string& token,
                                      double timeout_s) {
  TopologyConfig c;
  c.rank = rank;
  c.world = world;
  c.timeout_s = timeout_s;
  c.local_rank = rank;
  c.local_size = world;
  c.shm_name = name;
  c.token = token;
  c.create = rank == 0;
  c.round_bytes = 64 * 1024;
  c.p2p_bytes = 64 * 1024;
  return c;
}

}  // namespace pycomm
