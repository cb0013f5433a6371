#include "ipc_quantized.h"

#include <algorithm>
#include <string>
#include <vector>

#include "../kernels/kernels_cuda.h"
#include "../kernels/quant.h"
#include "quantized_allreduce.h"

namespace pycomm {

namespace {

// Payload bytes per shard slot, aligned like the communicator's slots.
size_t slot_bytes(size_t shard, int bits, int block) {
  return Carver::align(kernels::quant_payload_bytes(shard, bits, block));
}

}  // namespace

size_t ipc_quantized_bytes(size_t n, int world, int bits, int block) {
  return (world + 1) * slot_bytes(QuantizedAllReduce::shard_elems(n, world, block), bits, block);
}

void ipc_quantized_all_reduce(CudaIpcAllReduce& group, const IpcQuantCall& c, cudaStream_t stream) {
  group.check_usable();
  if (CudaIpcAllReduce::capturing(stream))
    throw CommError(
        "pycomm: the quantized CUDA IPC all-reduce cannot be captured in a CUDA graph: its barriers, rounding keys "
        "and error feedback advance per call on the host, which every replay would repeat; run it outside the "
        "captured region");
  const int world = group.world(), rank = group.rank();
  const size_t shard = QuantizedAllReduce::shard_elems(c.n, world, c.block);
  const size_t slot = slot_bytes(shard, c.bits, c.block);
  const size_t need = ipc_quantized_bytes(c.n, world, c.bits, c.block);
  if (need > group.buffer_bytes())
    throw CommError("pycomm: a quantized CUDA IPC all-reduce of " + std::to_string(c.n) + " elements needs " +
                    std::to_string(need) + " bytes of staging per rank; this group has " +
                    std::to_string(group.buffer_bytes()) +
                    " (make the group with a larger buffer_bytes)");
  if (c.n == 0) return;
  const size_t es = dtype_size(c.dtype);
  auto span = [&](int q, size_t* lo) {
    *lo = std::min(c.n, q * shard);
    return std::min(c.n, *lo + shard) - *lo;
  };
  auto* own = static_cast<uint8_t*>(group.peer_buffer(rank));
  auto buffer = [&](int q) { return static_cast<uint8_t*>(group.peer_buffer(q)); };

  // 1. Quantize every shard of (input + worker residual) into slot q of this
  //    rank's buffer, for rank q; the residual keeps what rounding lost.
  const kernels::QuantSpec spec{c.bits, c.block, c.stochastic, c.seed_quantize};
  for (int q = 0; q < world; ++q) {
    size_t lo;
    const size_t len = span(q, &lo);
    kernels::quantize_cuda(spec, c.dtype, static_cast<const char*>(c.input) + lo * es,
                           c.worker_residual ? c.worker_residual + lo : nullptr, len, own + q * slot, lo, stream);
  }
  // 2. Every rank's slots are written.
  group.barrier(stream);

  // 3. Reduce this rank's shard from every rank's slot for it, in rank order
  //    (the communicator's order), average if asked, and requantize it with
  //    the server residual, in one pass, into this rank's last slot.
  std::vector<const uint8_t*> srcs(world);
  for (int q = 0; q < world; ++q) srcs[q] = buffer(q) + rank * slot;
  kernels::DequantReduce red;
  red.bits = c.bits;
  red.block = c.block;
  red.srcs = srcs.data();
  red.nsrc = world;
  size_t mine_lo;
  red.n = span(rank, &mine_lo);
  red.post_scale = c.avg ? 1.0f / static_cast<float>(world) : 1.0f;
  red.out_payload = own + world * slot;
  red.requant = kernels::QuantSpec{c.bits, c.block, c.stochastic, c.seed_requantize};
  red.residual = c.server_residual;
  red.index_base = rank * shard;
  red.cancel = group.failure_word();  // a barrier gave up: the peers' slots may be gone
  kernels::dequant_reduce_cuda(red, stream);
  // 4. Every rank's reduced shard is written (and every slot of step 1 read).
  group.barrier(stream);

  // 5. Every rank decodes the same bytes: the same result everywhere.
  for (int q = 0; q < world; ++q) {
    size_t lo;
    const size_t len = span(q, &lo);
    kernels::dequantize_cuda(c.bits, c.block, buffer(q) + world * slot, len, c.dtype,
                             static_cast<char*>(c.output) + lo * es, false, stream, group.failure_word());
  }
  // 6. Nobody refills its buffer (the next call) before every rank read it.
  group.barrier(stream);
}

}  // namespace pycomm
