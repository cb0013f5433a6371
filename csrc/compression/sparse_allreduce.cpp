#include "sparse_allreduce.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../kernels/kernels.h"
#include "../kernels/quant.h"

namespace pycomm {

namespace {
constexpr size_t kCountBytes = 8;  // uint64 entry count leads each slot
}

SparseAllReduce::SparseAllReduce(Transport& transport, Workspace& workspace, const Codec& codec,
                                 const CompressedCall& call)
    : CompressedAllReduce(transport, workspace, codec, call) {
  const size_t n = call.n;
  k_ = entries(n, codec.ratio);
  cap_ = kernels::topk_capacity(k_, n, codec.exact, codec.tolerance);
  slot_ = Carver::align(kCountBytes + kernels::topk_payload_bytes(cap_, dtype_size(call.dtype)));
}

size_t SparseAllReduce::entries(size_t n, double ratio) {
  return n == 0 ? 0 : std::min(n, std::max<size_t>(1, static_cast<size_t>(std::llround(ratio * n))));
}

CompressionStats SparseAllReduce::stats() const {
  CompressionStats s;
  s.bytes_sent = static_cast<uint64_t>(world_ - 1) * slot_;
  s.bytes_uncompressed = plain_allreduce_bytes(call_.n, call_.dtype, world_);
  return s;
}

void SparseAllReduce::run(uint64_t seq) {
  const size_t n = call_.n;
  const size_t es = dtype_size(call_.dtype);
  const size_t values_bytes = kernels::topk_values_bytes(cap_, es);
  Carver carve(workspace_.get(slot_ + world_ * slot_ + n * sizeof(float) + 3 * 64));
  uint8_t* mine = carve.take(slot_);
  uint8_t* gathered = carve.take(world_ * slot_);
  auto* acc = reinterpret_cast<float*>(carve.take(n * sizeof(float)));

  // 1. Select this rank's top-k of (input + residual); the residual keeps
  //    everything not sent.
  stage("pycomm::compress");
  kernels::TopK spec;
  spec.k = k_;
  spec.exact = codec_.exact;
  spec.tolerance = codec_.tolerance;
  spec.sample_fraction = codec_.sample_fraction;
  spec.seed = rounding_seed(codec_.seed, seq, rank_, 2);
  std::memset(mine, 0, slot_);
  const uint64_t count = kernels::topk_cpu(spec, call_.dtype, call_.input, call_.worker_residual, n, cap_,
                                           mine + kCountBytes,
                                           reinterpret_cast<int32_t*>(mine + kCountBytes + values_bytes));
  std::memcpy(mine, &count, sizeof count);

  // 2. Everybody gets everybody's (value, index) list.
  stage("pycomm::communicate");
  transport_.run(payload_step(Collective::kAllGather, codec_, CodecStep::kGather, call_.op, slot_, mine, gathered),
                 seq);

  // 3. Scatter-add all lists in rank order into float32, then average if
  //    asked and round once into the output dtype.
  stage("pycomm::decompress");
  std::fill(acc, acc + n, 0.f);
  for (int q = 0; q < world_; ++q) {
    const uint8_t* slot = gathered + q * slot_;
    uint64_t cnt;
    std::memcpy(&cnt, slot, sizeof cnt);
    if (cnt > cap_)
      throw CommError("pycomm: rank " + std::to_string(q) + " sent " + std::to_string(cnt) +
                      " top-k entries, more than the " + std::to_string(cap_) + " agreed on");
    kernels::scatter_add_cpu(call_.dtype, slot + kCountBytes,
                             reinterpret_cast<const int32_t*>(slot + kCountBytes + values_bytes), cnt,
                             DType::kFloat32, acc, n);
  }
  if (call_.op == RedOp::kAvg) kernels::divide_cpu(DType::kFloat32, acc, n, static_cast<double>(world_));
  kernels::convert_cpu(DType::kFloat32, acc, call_.dtype, call_.output, n);
  stage(nullptr);
}

}  // namespace pycomm
