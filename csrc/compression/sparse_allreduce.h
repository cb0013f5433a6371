// All-reduce of top-k sparsified tensors (DGC-style): every rank selects its
// k largest-magnitude entries (with error feedback), the (value, index)
// lists are all-gathered, and every rank scatter-adds all of them, in rank
// order, into a float32 accumulator. Result: the sum (or average) of the
// ranks' sparse tensors, bit-identical on every rank.
#pragma once

#include "../transport/transport.h"
#include "codec.h"

namespace pycomm {

class SparseAllReduce {
 public:
  static constexpr int kSeqSpan = 1;

  SparseAllReduce(Transport& transport, Workspace& workspace, const Codec& codec, const CompressedCall& call);
  void run(uint64_t seq);
  CompressionStats stats() const;
  // Entries a rank may send: k, plus the approximate selection's tolerance.
  size_t capacity() const { return cap_; }

 private:
  Transport& transport_;
  Workspace& workspace_;
  Codec codec_;
  CompressedCall call_;
  int rank_, world_;
  size_t k_ = 0;
  size_t cap_ = 0;
  size_t slot_ = 0;  // bytes: 8-byte count, values, indices, padded
};

}  // namespace pycomm
