#include "quantized_allreduce.h"

#include <algorithm>
#include <vector>

#include "../kernels/kernels.h"
#include "../kernels/quant.h"

namespace pycomm {

size_t QuantizedAllReduce::shard_elems(size_t n, int world, int block) {
  const size_t per = (n + world - 1) / world;
  return (per + block - 1) / block * block;
}

QuantizedAllReduce::QuantizedAllReduce(Transport& transport, Workspace& workspace, const Codec& codec,
                                       const CompressedCall& call)
    : CompressedAllReduce(transport, workspace, codec, call) {
  shard_ = shard_elems(call.n, world_, codec.block);
  slot_ = Carver::align(kernels::quant_payload_bytes(shard_, codec.bits(), codec.block));
}

size_t QuantizedAllReduce::shard_len(int q) const {
  const size_t lo = std::min(call_.n, q * shard_);
  return std::min(call_.n, lo + shard_) - lo;
}

// The padding after a payload of `len` elements travels too: keep its bytes
// deterministic.
void QuantizedAllReduce::clear_slot_tail(uint8_t* slot, size_t len) const {
  const size_t used = kernels::quant_payload_bytes(len, codec_.bits(), codec_.block);
  std::fill(slot + used, slot + slot_, 0);
}

CompressionStats QuantizedAllReduce::stats() const {
  CompressionStats s;
  // Each step hands world-1 slots to peers (the all-to-all one per peer, the
  // all-gather the same slot to each).
  s.bytes_sent = 2ull * (world_ - 1) * slot_;
  s.bytes_uncompressed = plain_allreduce_bytes(call_.n, call_.dtype, world_);
  return s;
}

void QuantizedAllReduce::run(uint64_t seq) {
  const int bits = codec_.bits();
  const size_t es = dtype_size(call_.dtype);
  Carver carve(workspace_.get(3 * world_ * slot_ + slot_ + 3 * 64));
  uint8_t* send = carve.take(world_ * slot_);
  uint8_t* recv = carve.take(world_ * slot_);
  uint8_t* mine = carve.take(slot_);
  uint8_t* gathered = carve.take(world_ * slot_);

  // 1. Quantize every shard of (input + worker residual), one slot per
  //    destination rank; the worker residual keeps what rounding lost.
  stage("pycomm::compress");
  kernels::QuantSpec spec{bits, codec_.block, codec_.stochastic, rounding_seed(codec_.seed, seq, rank_, 0)};
  const auto* in = static_cast<const char*>(call_.input);
  for (int q = 0; q < world_; ++q) {
    const size_t off = q * shard_;
    const size_t len = shard_len(q);
    kernels::quantize_cpu(spec, call_.dtype, in + off * es, call_.worker_residual ? call_.worker_residual + off : nullptr,
                          len, send + q * slot_, off);
    clear_slot_tail(send + q * slot_, len);
  }

  // 2. Exchange: slot q goes to rank q; we receive every rank's version of
  //    our shard.
  stage("pycomm::communicate");
  transport_.run(payload_step(Collective::kAllToAll, codec_, CodecStep::kScatter, call_.op, slot_, send, recv), seq);

  // 3. Reduce our shard in float32 (rank order: deterministic), average if
  //    asked, and requantize it with the server residual, in one pass.
  stage("pycomm::reduce");
  std::vector<const uint8_t*> srcs(world_);
  for (int q = 0; q < world_; ++q) srcs[q] = recv + q * slot_;
  kernels::DequantReduce red;
  red.bits = bits;
  red.block = codec_.block;
  red.srcs = srcs.data();
  red.nsrc = world_;
  red.n = shard_len(rank_);
  red.post_scale = call_.op == RedOp::kAvg ? 1.0f / static_cast<float>(world_) : 1.0f;
  red.out_payload = mine;
  red.requant = kernels::QuantSpec{bits, codec_.block, codec_.stochastic, rounding_seed(codec_.seed, seq, rank_, 1)};
  red.residual = call_.server_residual;
  red.index_base = rank_ * shard_;
  kernels::dequant_reduce_cpu(red);
  clear_slot_tail(mine, red.n);

  // 4. Gather every rank's reduced shard. Step 2's header (codec, step,
  //    sizes) already matched on every rank, so this step is known to be
  //    the same call everywhere: transports skip their header exchange (one
  //    round trip between hosts fewer).
  stage("pycomm::communicate");
  CollectiveDesc gather =
      payload_step(Collective::kAllGather, codec_, CodecStep::kGather, call_.op, slot_, mine, gathered);
  gather.checked = true;
  transport_.run(gather, seq + 1);

  // 5. Every rank, this one included, decodes the same bytes: identical
  //    results everywhere.
  stage("pycomm::decompress");
  auto* out = static_cast<char*>(call_.output);
  for (int q = 0; q < world_; ++q)
    kernels::dequantize_cpu(bits, codec_.block, gathered + q * slot_, shard_len(q), call_.dtype,
                            out + q * shard_ * es, false);
  stage(nullptr);
}

}  // namespace pycomm
