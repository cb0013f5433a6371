// What the compressed all-reduces share: the call as they see it (raw
// pointers, no torch), their base class, the header of each payload step,
// the bytes they put on the wire, and the workspace their payloads live in.
// The codecs themselves (parameters, tags) are vocabulary: core/codec.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "../core/codec.h"
#include "../core/collective.h"
#include "../transport/transport.h"

namespace pycomm {

// One byte-payload step of a compressed collective (all-to-all or
// all-gather of `bytes` per rank), tagged with the codec and step.
CollectiveDesc payload_step(Collective coll, const Codec& codec, CodecStep step, RedOp op, size_t bytes,
                            const void* input, void* output);

// Bytes this rank hands to its peers in one compressed all-reduce, and what
// the uncompressed all-reduce would hand them (2(n-1)/n x the tensor).
struct CompressionStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_uncompressed = 0;
};

// What a plain all-reduce of n elements hands to peers from one rank.
inline uint64_t plain_allreduce_bytes(size_t n, DType dtype, int world) {
  return world > 1 ? 2ull * (world - 1) * n * dtype_size(dtype) / world : 0;
}

// Scratch memory of a communicator's composite operations: grows to the
// largest request and is reused, so steady-state calls touch no fresh pages
// (first-touch page faults cost as much as the compression itself). Only the
// thread that runs the communicator's ops uses it, one op at a time.
class Workspace {
 public:
  // At least `bytes`, 64-byte aligned; valid until the next get().
  uint8_t* get(size_t bytes);

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t size_ = 0;
};

// Carves 64-byte aligned sub-buffers out of one workspace request.
class Carver {
 public:
  static size_t align(size_t bytes) { return (bytes + 63) / 64 * 64; }
  explicit Carver(uint8_t* base) : base_(base) {}
  uint8_t* take(size_t bytes) {
    uint8_t* p = base_ + used_;
    used_ += align(bytes);
    return p;
  }

 private:
  uint8_t* base_;
  size_t used_ = 0;
};

// One compressed all-reduce as the composite algorithms see it: raw
// pointers, no torch.
struct CompressedCall {
  DType dtype = DType::kFloat32;  // of input and output
  RedOp op = RedOp::kSum;         // sum or avg
  size_t n = 0;
  const void* input = nullptr;
  void* output = nullptr;         // may equal input
  float* worker_residual = nullptr;  // n floats: error feedback of this rank's contribution
  float* server_residual = nullptr;  // shard floats: error feedback of the reduced shard
  // Called with a stage name ("pycomm::compress", "pycomm::communicate",
  // "pycomm::reduce", "pycomm::decompress") as each stage begins and with
  // nullptr when the call ends; the communicator turns these into profiler
  // ranges. May be empty.
  std::function<void(const char*)> stage;
};

// What the compressed all-reduces share: the call, its codec, the transport
// that runs their steps and the workspace their payloads live in. The
// communicator runs one as a composite op: run(seq) uses the transport with
// sequence numbers seq .. seq + seq_span() - 1.
class CompressedAllReduce {
 public:
  CompressedAllReduce(Transport& transport, Workspace& workspace, const Codec& codec, const CompressedCall& call)
      : transport_(transport),
        workspace_(workspace),
        codec_(codec),
        call_(call),
        rank_(transport.rank()),
        world_(transport.world()) {}
  virtual ~CompressedAllReduce() = default;
  virtual void run(uint64_t seq) = 0;
  virtual int seq_span() const = 0;
  // Bytes this rank sends, and what the uncompressed all-reduce would send.
  virtual CompressionStats stats() const = 0;

 protected:
  void stage(const char* name) const {
    if (call_.stage) call_.stage(name);
  }

  Transport& transport_;
  Workspace& workspace_;
  Codec codec_;
  CompressedCall call_;
  int rank_, world_;
};

// Stream key of stochastic rounding for one quantization of one call: fresh
// per call (seq is the same on every rank) and per rank, so rounding errors
// of different ranks are independent and average out.
uint64_t rounding_seed(uint64_t user_seed, uint64_t seq, int rank, int which);

}  // namespace pycomm
