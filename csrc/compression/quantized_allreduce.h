// All-reduce with blockwise int8/int4 quantization: a quantized direct
// reduce-scatter, then a quantized all-gather.
//
// Why gather-then-reduce and not a compressed ring (benchmarks/RESULTS.md):
// both put the same bytes on the wire, but a ring requantizes a shard at
// every one of its world-1 hops, so its error grows with the world size, and
// it needs world-1 synchronised steps instead of one. The direct form
// quantizes each contribution once, reduces in float32 and quantizes the
// sum once.
#pragma once

#include "../transport/transport.h"
#include "compressed_allreduce.h"

namespace pycomm {

class QuantizedAllReduce : public CompressedAllReduce {
 public:

  // Elements of each rank's shard: ceil(n / world) rounded up to whole
  // blocks, so no block straddles two shards. The server residual has this
  // many elements.
  static size_t shard_elems(size_t n, int world, int block);

  QuantizedAllReduce(Transport& transport, Workspace& workspace, const Codec& codec, const CompressedCall& call);
  void run(uint64_t seq) override;
  // Transport runs one call uses: seq and seq + 1.
  int seq_span() const override { return 2; }
  CompressionStats stats() const override;

 private:
  size_t shard_len(int q) const;
  void clear_slot_tail(uint8_t* slot, size_t len) const;

  size_t shard_ = 0;  // elements per shard
  size_t slot_ = 0;   // bytes per shard payload, padded
};

}  // namespace pycomm
