#include "tuner.h"

#include <algorithm>

namespace pycomm {

// Thresholds measured with pycomm-bench on shared memory (see
// benchmarks/RESULTS.md). One-shot wins while a message is small enough that
// one synchronisation costs more than reading every peer's copy; beyond that
// two-shot reads each byte once per rank in two hops, which on one host beats
// the ring's 2(n-1) synchronised hops.
constexpr size_t kOneShotMaxBytes = 32 * 1024;

Algorithm tune(Algorithm requested, Collective coll, size_t bytes, int world) {
  if (coll == Collective::kBarrier || coll == Collective::kInvalid) return Algorithm::kOneShot;
  const bool direct = requested == Algorithm::kDirect || requested == Algorithm::kAuto;
  if (!direct) return requested;
  switch (coll) {
    case Collective::kAllReduce:
      return (bytes <= kOneShotMaxBytes || world <= 1) ? Algorithm::kOneShot : Algorithm::kTwoShot;
    case Collective::kReduceScatter:
    case Collective::kAllGather:
    case Collective::kAllToAll: return Algorithm::kTwoShot;
    case Collective::kBroadcast: return Algorithm::kOneShot;
    default: return Algorithm::kOneShot;
  }
}

// Between hosts every hop costs a network round trip, so the thresholds
// differ from shared memory's (benchmarks/RESULTS.md, "Several hosts"):
// one-shot while what it sends is small, the ring beyond that. One-shot sends
// the whole tensor to each of the n-1 peers in one hop; the ring sends
// 2(n-1)/n of it in 2(n-1) hops. So the crossover is a budget of bytes each
// rank sends, not a tensor size: at 1 Gbit/s one-shot won while it sent up to
// 96 KiB (4 hosts: 32 KiB 0.83-1.1 ms against the ring's 1.3; 64 KiB 2.6-3.7 ms
// against 1.3-1.6; 3 hosts: 64 KiB 1.1-3.7 ms against 0.8-0.9; 2 hosts: 64 KiB
// 0.4-0.5 ms against 0.5). Two-shot moves the ring's bytes in 2 hops instead of
// 2(n-1), but makes every rank stream to n-1 peers at once, and those flows
// fight over each host's link: at 64 MB on 4 hosts at 1 Gbit/s it reached
// 86-94% of the link where the ring reached 90-94%.
constexpr size_t kNetOneShotMaxSentBytes = 96 * 1024;
// Hierarchical all-reduce by size (2 hosts x 2 ranks at 1 Gbit/s, RESULTS.md):
// up to 16 KiB through one leader per host (3-9x faster than a flat call:
// one small message per host crosses the network); from 4 MiB sharded over
// every local rank (1.2-1.6x); in between a flat call wins, because the
// three hierarchical phases each cost a synchronisation that the data no
// longer hides.
constexpr size_t kHierLeaderMaxBytes = 16 * 1024;
constexpr size_t kHierShardMinBytes = 4 << 20;

Algorithm tune_network(Algorithm requested, Collective coll, size_t bytes, int world) {
  if (coll == Collective::kBarrier || coll == Collective::kInvalid) return Algorithm::kOneShot;
  if (requested == Algorithm::kDirect) return tune(requested, coll, bytes, world);
  if (requested != Algorithm::kAuto) return requested;
  const bool small = world <= 1 || bytes * static_cast<size_t>(world - 1) <= kNetOneShotMaxSentBytes;
  switch (coll) {
    case Collective::kAllReduce:
    case Collective::kBroadcast: return small ? Algorithm::kOneShot : Algorithm::kRing;
    case Collective::kReduceScatter:
    case Collective::kAllGather: return Algorithm::kRing;
    case Collective::kAllToAll: return Algorithm::kTwoShot;
    default: return Algorithm::kOneShot;
  }
}

Resolved tune_multihost(Algorithm requested, Collective coll, size_t bytes, int hosts, int local_size) {
  const int world = hosts * std::max(local_size, 1);
  const bool hier_coll = coll == Collective::kAllReduce || coll == Collective::kReduceScatter ||
                         coll == Collective::kAllGather || coll == Collective::kBroadcast;
  // local_size 0: hosts have different numbers of ranks; only flat runs.
  const bool hier_ok = hier_coll && local_size > 0 && hosts > 1;
  const bool auto_hier = requested == Algorithm::kAuto && local_size > 1 &&
                         (coll != Collective::kAllReduce || bytes <= kHierLeaderMaxBytes ||
                          bytes >= kHierShardMinBytes);
  const bool want_hier = hier_ok && (requested == Algorithm::kHier || auto_hier);
  if (!want_hier) {
    const Algorithm flat = tune_network(requested == Algorithm::kHier ? Algorithm::kAuto : requested, coll,
                                        bytes, world);
    return {flat, flat};
  }
  if (coll == Collective::kAllReduce && (bytes <= kHierLeaderMaxBytes || local_size == 1))
    return {Algorithm::kHierLeader, tune_network(Algorithm::kAuto, coll, bytes, hosts)};
  // Between hosts a sharded all-reduce, reduce-scatter or all-gather moves
  // 1/local_size of the tensor per rank; a broadcast moves all of it.
  const size_t inter_bytes = coll == Collective::kBroadcast ? bytes : bytes / local_size;
  return {Algorithm::kHierShard, tune_network(Algorithm::kAuto, coll, inter_bytes, hosts)};
}

}  // namespace pycomm
