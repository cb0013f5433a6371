// The tuner: which concrete algorithm a call runs, from its size, the world
// size and the topology. Deterministic in its arguments, so every rank
// resolves a call the same way without talking. The thresholds are measured
// (benchmarks/RESULTS.md); a new algorithm is one more line here.
#pragma once

#include <cstddef>

#include "../core/collective.h"

namespace pycomm {

// Resolve kAuto / kDirect to a concrete schedule for `bytes` per rank on
// `world` ranks of one host.
Algorithm tune(Algorithm requested, Collective coll, size_t bytes, int world);

// The same between hosts (over a process group), where a hop costs a
// network round trip instead of a cache-line handshake.
Algorithm tune_network(Algorithm requested, Collective coll, size_t bytes, int world);

// Several hosts of `local_size` ranks each (0: hosts differ in size):
// flat over the process group, or hierarchical, and the schedule between
// hosts. `requested` is kAuto, kHier or a flat algorithm.
struct Resolved {
  Algorithm algo;
  Algorithm inter;
};
Resolved tune_multihost(Algorithm requested, Collective coll, size_t bytes, int hosts, int local_size);

}  // namespace pycomm
