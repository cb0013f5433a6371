// One entry point over every schedule, plus the tuner. Adding an algorithm
// is one new header beside this one and one case in each switch below.
#pragma once

#include <algorithm>
#include <vector>

#include "direct.h"
#include "ring.h"
#include "schedule.h"
#include "tree.h"

namespace pycomm {

// A schedule bound to one collective on one communicator.
struct Schedule {
  Algorithm algo;
  Collective coll;
  int world;
  int root;

  int num_chunks() const;
  int num_steps() const;
  int max_ops() const;
  // The ops of `rank` at `step`, sends first.
  void ops(int rank, int step, std::vector<ScheduleOp>& out) const;
};

// Which concrete algorithms can run a collective (kAuto and kDirect resolve
// to one of them).
bool algorithm_supports(Algorithm algo, Collective coll);

// Resolve kAuto / kDirect to a concrete schedule for `bytes` per rank on
// `world` ranks of one host. Deterministic in its arguments, so every rank
// resolves the same way.
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
