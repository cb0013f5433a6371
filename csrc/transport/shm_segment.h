// The shared-memory segment's layout, private to the shared-memory
// transport (shm.cpp and its registered-memory part, shm_registered.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "../core/collective.h"
#include "shm.h"

namespace pycomm {

constexpr uint64_t kMagic = 0x314d4d4f43595075ull;  // "uPYCOMM1"
// 3: the abort state carries the blamed rank and why (a structured Blame).
// 4: each header slot has a registered-memory record beside it.
// 5: each rank's heartbeat.
constexpr uint32_t kLayoutVersion = 5;
constexpr size_t kPage = 4096;
// Header slots per rank, indexed by the transport's operation counter modulo
// kHeaderSlots. A rank finishes operation s only after every peer has
// published its header for s, so no two ranks are ever more than one
// operation apart: two slots would do, four leave slack.
constexpr int kHeaderSlots = 4;

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t world;
  uint64_t round_bytes;
  uint64_t total_size;
  char token[64];
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> abort_state;  // 0: healthy, 1: message being written, 2: aborted
  int32_t abort_rank;                 // the first abort's Blame, written before state 2
  uint8_t abort_kind;
  char abort_msg[2048];
};

// `call.op` counts this transport's operations (the same on every local
// rank); `call.seq` is the communicator's number of the user call it
// serves, which several operations may share (a hierarchical or compressed
// collective).
struct HeaderSlot {
  std::atomic<uint32_t> op;  // futex word: low bits of call.op, stored last
  uint32_t unused;
  CallHeader call;
  char pad[64 - 48];
};
static_assert(sizeof(HeaderSlot) == 64, "one header per cache line");

// Each group of fields written by one party sits on its own cache line, so
// a rank polling a peer's flag does not bounce the line its owner writes.
struct RankControl {
  alignas(64) std::atomic<uint32_t> step_flag;   // owner: sends done through step flag-1
  alignas(64) std::atomic<uint32_t> round_done;  // owner: rounds completed
  alignas(64) std::atomic<uint32_t> waiters;     // peers sleeping on this rank's words
  // CLOCK_MONOTONIC nanoseconds of the owner's last heartbeat (0: none yet).
  alignas(64) std::atomic<uint64_t> heartbeat_ns;
  alignas(64) std::atomic<int32_t> pid;
  std::atomic<uint32_t> exited;
  uint64_t starttime;
  uint64_t pidns;
  alignas(64) HeaderSlot headers[kHeaderSlots];
  // Beside headers[s]: where that call's buffers lie in registered memory,
  // written before the header's `op` (whose release publishes both).
  alignas(64) RegisteredCall registered[kHeaderSlots];
};

}  // namespace pycomm
