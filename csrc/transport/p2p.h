// Point-to-point messages between the ranks of one host, over shared memory.
//
// Every ordered pair (src -> dst) that talks gets its own channel: a small
// segment holding one single-producer single-consumer byte ring. Messages on
// a channel arrive in the order they were sent (no tag matching, as between
// two NCCL or Gloo ranks with one tag); each tensor travels as a fixed-size
// header (tag, dtype, shape) followed by its bytes, so a receiver needs no
// declared shapes.
//
// Channels are mapped on first use by whichever side comes first (O_EXCL
// create, else attach) and unlinked as soon as both sides mapped them. A
// sender blocks only while the ring is full, so two ranks may send to each
// other at the same time; waits are bounded by the transport's timeout,
// watch the peer's liveness and the segment's abort state like collectives.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "shm.h"

namespace pycomm {

constexpr int kP2PMaxDims = 8;

// One tensor's description on the wire. No padding holes.
struct P2PHeader {
  uint32_t magic;
  uint32_t tag;
  uint32_t index;  // this tensor's position in its message
  uint32_t total;  // tensors in the message
  uint64_t nbytes;
  uint8_t dtype;
  uint8_t ndim;
  uint8_t pad[6];
  int64_t shape[kP2PMaxDims];
  uint8_t pad2[32];
};
static_assert(sizeof(P2PHeader) == 128, "two cache lines");

constexpr uint32_t kP2PMagic = 0x50325031u;  // "1P2P"

struct ChannelSegment;

class ShmChannels {
 public:
  // `prefix` names the segments ("<prefix>.<src>.<dst>", local ranks);
  // `capacity` is each ring's size in bytes (a power of two).
  ShmChannels(ShmTransport& shm, std::string prefix, std::string token, size_t capacity);
  ~ShmChannels();
  ShmChannels(const ShmChannels&) = delete;
  ShmChannels& operator=(const ShmChannels&) = delete;

  // Streams `n` bytes to local rank `peer`; returns once they are all in the
  // ring (the receiver may not have read them yet). Throws CommError.
  void write(int peer, const void* data, size_t n, const OpContext& ctx);
  // Reads the next `n` bytes sent by local rank `peer`. Throws CommError.
  void read(int peer, void* data, size_t n, const OpContext& ctx);

  // Unlinks channel names a peer never mapped (it never talked to us).
  void close();
  size_t capacity() const { return capacity_; }

 private:
  struct Channel {
    ChannelSegment* seg = nullptr;
    char* data = nullptr;
    size_t size = 0;
    std::string name;
  };
  Channel& channel(int src, int dst, const OpContext& ctx);
  template <typename Ready>
  void wait(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters, int peer, const OpContext& ctx,
            const char* what, Ready ready);

  ShmTransport& shm_;
  std::string prefix_;
  std::string token_;
  size_t capacity_;
  std::mutex mu_;  // guards channels_ (each channel is used by one thread per side)
  std::map<std::pair<int, int>, Channel> channels_;
};

}  // namespace pycomm
