// All-reduce of top-k sparsified tensors (DGC-style): every rank selects its
// k largest-magnitude entries (with error feedback), the (value, index)
// lists are all-gathered, and every rank scatter-adds all of them, in rank
// order, into a float32 accumulator. Result: the sum (or average) of the
// ranks' sparse tensors, bit-identical on every rank.
#pragma once

#include "../transport/transport.h"
#include "compressed_allreduce.h"

namespace pycomm {

class SparseAllReduce : public CompressedAllReduce {
 public:
  SparseAllReduce(Transport& transport, Workspace& workspace, const Codec& codec, const CompressedCall& call);
  // Entries each rank selects from n: round(ratio * n) (halves away from
  // zero), at least 1, at most n.
  static size_t entries(size_t n, double ratio);
  void run(uint64_t seq) override;
  int seq_span() const override { return 1; }
  CompressionStats stats() const override;

 private:
  size_t k_ = 0;
  size_t cap_ = 0;
  size_t slot_ = 0;  // bytes: 8-byte count, values, indices, padded
};

}  // namespace pycomm
