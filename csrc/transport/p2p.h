// Point-to-point messages: the message protocol (MessageChannels, over any
// ordered byte stream per peer), and its shared-memory streams between the
// ranks of one host (ShmChannels). Between hosts the same protocol runs over
// the process group (pg_channels.h).
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
#include <optional>
#include <string>
#include <utility>

#include "shm.h"

namespace pycomm {

constexpr int kP2PMaxDims = 8;

// One tensor of a message. `dtype` is the caller's own dtype code (the torch
// layer passes torch's ScalarType): the protocol carries it and the
// receiver's sink interprets it.
struct TensorMeta {
  uint8_t dtype = 0;
  int ndim = 0;
  int64_t shape[kP2PMaxDims] = {};
  uint64_t nbytes = 0;
};

// Where a received message's tensors go.
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  // Tensor `index` of `total` is `meta`: returns where its nbytes go, or
  // sets *why when it cannot take it (the channel is then out of step with
  // the sender, and the communicator fails on every local rank).
  virtual void* place(uint32_t index, uint32_t total, const TensorMeta& meta, std::string* why) = 0;
};

// The message protocol. Each tensor travels as a fixed-size header (magic,
// tag, index in the message, dtype, shape) followed by its bytes, so a
// receiver needs no declared shapes. `tag` is checked, not matched: messages
// between two ranks arrive in the order they were sent. All three throw
// CommError.
class MessageChannels {
 public:
  virtual ~MessageChannels() = default;
  // Raises at once when `peer`'s stream to this rank ended with its abort
  // (ended()): it receives nothing more, and the bytes would wait for it
  // until the close.
  void send_message(int peer, uint32_t tag, const TensorMeta* metas, const void* const* data, uint32_t count,
                    const OpContext& ctx);
  // A send this rank cannot make still reaches the receiver, as an error
  // message: its recv raises at once instead of waiting for the timeout.
  // `last`: this rank aborted and sends `peer` nothing more, so every later
  // receive from it raises `why` at once too (a receive waiting for bytes
  // that never come would hold its lane, and the communicator's close that
  // joins it, for the whole timeout).
  void send_failure(int peer, const std::string& why, const OpContext& ctx, bool last);
  // Receives the next message from `peer` into what `sink` places.
  void recv_message(int peer, uint32_t tag, MessageSink& sink, const OpContext& ctx);
  // Whether `peer`'s stream ended with its abort's failure message (read).
  bool ended(int peer) const;

  // The byte streams: `write` returns once the receiver's side holds (or
  // has taken) the bytes; `read` returns the next `n` bytes `peer` wrote.
  virtual void write(int peer, const void* data, size_t n, const OpContext& ctx) = 0;
  virtual void read(int peer, void* data, size_t n, const OpContext& ctx) = 0;
  // A tensor's header and bytes, in that order on the stream (a stream may
  // publish them at once; the reader still reads them as two).
  virtual void write_tensor(int peer, const void* header, size_t header_bytes, const void* data, size_t n,
                            const OpContext& ctx) {
    write(peer, header, header_bytes, ctx);
    if (n) write(peer, data, n, ctx);
  }

 protected:
  // The stream from `peer` is out of step with its sender (a mismatch was
  // found after the header was consumed): never deliver later bytes.
  [[noreturn]] virtual void out_of_step(const std::string& why) = 0;
  // The communicator's rank of stream peer `peer`, and of this rank.
  virtual int name(int peer) const = 0;
  virtual int self_name() const = 0;

 private:
  // `peer`'s last failure message, if its stream ended.
  std::optional<std::string> ended_reason(int peer) const;

  // Every send and receive asks whether its peer ended; until one did (an
  // abort, so almost never) the answer is one relaxed load, not a lock.
  std::atomic<bool> any_ended_{false};
  mutable std::mutex ended_mu_;
  std::map<int, std::string> ended_;  // stream peer -> its last failure message
};

struct ChannelSegment;

class ShmChannels : public MessageChannels {
 public:
  // `prefix` names the segments ("<prefix>.<src>.<dst>", local ranks);
  // `capacity` is each ring's size in bytes (a power of two).
  ShmChannels(ShmTransport& shm, std::string prefix, std::string token, size_t capacity);
  ~ShmChannels();
  ShmChannels(const ShmChannels&) = delete;
  ShmChannels& operator=(const ShmChannels&) = delete;

  // Streams `n` bytes to local rank `peer`; returns once they are all in the
  // ring (the receiver may not have read them yet). Throws CommError.
  void write(int peer, const void* data, size_t n, const OpContext& ctx) override;
  // Reads the next `n` bytes sent by local rank `peer`. Throws CommError.
  void read(int peer, void* data, size_t n, const OpContext& ctx) override;
  // Small tensors go out with their header in one publication: the reader
  // wakes once and finds the whole tensor.
  void write_tensor(int peer, const void* header, size_t header_bytes, const void* data, size_t n,
                    const OpContext& ctx) override;
  // True once `peer` has written bytes this rank has not read yet; waits up
  // to `max_wait` for them, asleep (it only watches: whoever reads next may
  // be another thread).
  bool await_readable(int peer, std::chrono::microseconds max_wait, const OpContext& ctx);

  // Unlinks channel names a peer never mapped (it never talked to us, or
  // died first), and those of channels with this rank it never mapped.
  void close();

 protected:
  // Fails the communicator on every local rank, as collectives whose headers disagree do.
  [[noreturn]] void out_of_step(const std::string& why) override;
  int name(int peer) const override;
  int self_name() const override;

 private:
  struct Channel {
    ChannelSegment* seg = nullptr;
    char* data = nullptr;
    size_t size = 0;
    std::string name;
  };
  Channel& channel(int src, int dst, const OpContext& ctx);
  std::string channel_name(int src, int dst) const;
  template <typename Ready>
  void wait(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters, const std::atomic<uint32_t>& peer_cpu,
            int peer, const OpContext& ctx, const char* what, Ready ready);

  ShmTransport& shm_;
  std::string prefix_;
  std::string token_;
  size_t capacity_;
  std::mutex mu_;  // guards channels_ (each channel is used by one thread per side)
  std::map<std::pair<int, int>, Channel> channels_;
};

}  // namespace pycomm
