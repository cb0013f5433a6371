// The collective vocabulary: which collectives and algorithms exist, one
// call as every transport sees it (raw pointers, no torch), and the header
// ranks compare before any data moves.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"

namespace pycomm {

// Numeric values travel in collective headers: never reorder.
enum class Algorithm : uint8_t {
  kAuto = 0,
  kRing = 1,
  kTree = 2,
  kDirect = 3,   // user-facing; resolved to one of the two below
  kOneShot = 4,  // direct: every rank reads every input (small messages)
  kTwoShot = 5,  // direct: reduce-scatter then all-gather, each one hop
  // Several hosts: reduce inside each host over shared memory, across hosts
  // over the process-group transport, then share the result inside the host.
  kHier = 6,        // user-facing; resolved to one of the two below
  kHierShard = 7,   // every local rank runs the inter-host part on its shard
  kHierLeader = 8,  // one leader per host runs it on the whole tensor
};
constexpr int kLastAlgorithm = static_cast<int>(Algorithm::kHierLeader);

enum class Collective : uint8_t {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kBroadcast = 3,
  kBarrier = 4,
  // A call one rank rejected (bad tensor, bad argument). It still takes its
  // place in the sequence so that peers fail fast instead of waiting.
  kInvalid = 5,
  // Rank r sends block p of its input to rank p, which stores it as block r
  // of its output (torch's all_to_all_single with equal splits).
  kAllToAll = 6,
  // Point-to-point messages. They never run on a transport's schedules (no
  // schedule supports them): the names serve the Work, messages and profiler.
  kSend = 7,
  kRecv = 8,
};
constexpr int kLastCollective = static_cast<int>(Collective::kRecv);

const char* algorithm_name(Algorithm a);
const char* collective_name(Collective c);

// The algorithms a user may ask for by name, in the order the documentation
// lists them ("hier" is a short alias of "hierarchical"). Python reads this
// table instead of restating it.
struct AlgorithmChoice {
  const char* name;
  Algorithm algo;
};
constexpr AlgorithmChoice kAlgorithmChoices[] = {
    {"auto", Algorithm::kAuto},   {"ring", Algorithm::kRing},         {"tree", Algorithm::kTree},
    {"direct", Algorithm::kDirect}, {"hierarchical", Algorithm::kHier}, {"hier", Algorithm::kHier},
};

// The tag of the agreement steps of a registered allocation (comm.empty);
// bit 31 clear, so never a codec's tag (core/codec.h).
constexpr uint32_t kAllocateTag = 1;

struct CollectiveDesc {
  Collective coll = Collective::kBarrier;
  Algorithm algo = Algorithm::kOneShot;  // resolved, never kAuto/kDirect/kHier
  // The schedule between hosts when algo is kHierShard/kHierLeader.
  Algorithm inter = Algorithm::kAuto;
  DType dtype = DType::kFloat32;
  RedOp op = RedOp::kSum;
  int root = 0;
  // all_reduce, broadcast: elements of input and output.
  // reduce_scatter: elements of the output shard (input has world * count).
  // all_gather: elements of the input shard (output has world * count).
  uint64_t count = 0;
  // Part of a composite operation (a compressed all-reduce): which codec and
  // step, so ranks that disagree on them fail like any other mismatch.
  // 0 for plain collectives; see core/codec.h.
  uint32_t tag = 0;
  // Compare headers only, move no data: the multi-host entry check.
  bool check_only = false;
  // How long this call's waits may take, in seconds; 0 keeps the transport's
  // timeout. c10d's per-call options carry one (barrier(timeout=...)). Not
  // part of the header: ranks may bound their own waits differently.
  double timeout_s = 0;
  // The caller already checked that every rank runs this call: a transport
  // may skip its own header exchange (the process-group transport does).
  bool checked = false;
  const void* input = nullptr;
  void* output = nullptr;
};

// "all_reduce(count=10, dtype=float32, op=sum, algorithm=ring)", or with a
// compressed step's tag "all_to_all(count=1040, dtype=uint8,
// compression=Int8(block=256) step=scatter, algorithm=direct(two-shot))",
// for the messages that report ranks disagreeing.
std::string describe_call(const CollectiveDesc& d);

// What ranks of one job must share before they exchange anything: the ids
// of the enums above, CallHeader's layout and the messages built on them
// (the compressed steps' payloads and tags). Bump it with any change to
// these; ranks of different versions refuse each other at setup, by name,
// instead of misreading each other's bytes.
constexpr uint32_t kWireVersion = 1;

// A call as ranks compare it before any data moves: shared memory keeps one
// per header slot, the process-group transport sends it. No padding holes,
// so two headers compare byte for byte.
struct CallHeader {
  uint64_t op;   // the transport's operation counter
  uint64_t seq;  // the communicator's number of the user call
  uint64_t count;
  uint32_t tag;
  int32_t root;
  uint8_t coll, algo, inter, dtype, redop, check_only, pad[2];

  static CallHeader of(const CollectiveDesc& d, uint64_t seq, uint64_t op);
  CollectiveDesc desc() const;  // without buffers
  bool same(const CallHeader& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
static_assert(sizeof(CallHeader) == 40, "no padding holes");

// What two disagreeing headers say about blame: the rank whose call was one
// it rejected (kRejected) names the cause; otherwise nobody is to blame.
// `rank_a` called `a`, `rank_b` called `b`.
Blame mismatch_blame(const CallHeader& a, int rank_a, const CallHeader& b, int rank_b);

}  // namespace pycomm
