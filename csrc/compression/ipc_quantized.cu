// The quantized all-reduce over a CUDA IPC group (ipc_quantized.h): one
// fused kernel where the codec's block is one the warp kernels take (64 to
// 512 elements), else a kernel per step with barriers between them.
//
// Why fused. Split into steps, a call is 2 world + 1 kernels and 3 barrier
// kernels; under MPS with 2 ranks on one H200 it took 78 us at 4 KB (the
// one-shot 13 us), and that fixed cost was most of the gap to the plain
// two-shot at 64 MB. The fused kernel makes the steps phases of one launch,
// separated by block barriers (block b of every rank meets block b of every
// other rank), which suffice because every phase maps quantization blocks to
// warps the same way (for_warp_blocks_batched over the same shard, grid and
// block shape on every rank): block b of each rank writes exactly the codes
// and scales that block b of each rank reads next.
//
// Why 256 threads with 3 blocks resident per SM, and a grid of 3 blocks per
// SM shared by the ranks on one GPU. A warp holds a quantization block at a
// time, so the kernel needs many warps: on the group's 36 to 72 blocks (8
// warps each, about one block per SM of an H200) it reached 10 % of the
// copy bandwidth. Every rank's blocks of a launch must be resident at once
// (they wait for each other), so the grid is what 3 blocks per SM of the
// smallest GPU give each of the ranks on one GPU, the same on every rank
// (KernelView). 3 blocks of 256 threads bound a thread to 85 registers, so
// a warp keeps kU quantization blocks' loads in flight instead of taking
// more threads.
#include "ipc_quantized.h"

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "../kernels/cuda/common.cuh"
#include "../kernels/cuda/quant_warp.cuh"
#include "../kernels/dtype_dispatch.h"
#include "../kernels/kernels_cuda.h"
#include "../kernels/quant.h"
#include "../transport/cuda_ipc_detail.cuh"
#include "quantized_allreduce.h"

namespace pycomm {

namespace {

using namespace kernels::quant_detail;
using kernels::quant_num_blocks;

// Payload bytes per shard slot, aligned like the communicator's slots.
size_t slot_bytes(size_t shard, int bits, int block) {
  return Carver::align(kernels::quant_payload_bytes(shard, bits, block));
}

constexpr int kFusedThreads = 256;
constexpr int kFusedBlocksPerSm = 3;  // __launch_bounds__' promise

struct FusedArgs {
  ipc_detail::IpcPeers peers;
  uint8_t* buf[kIpcMaxRanks];  // every rank's staging buffer (ours at [rank])
  size_t n, shard, slot;
  int bits;
  bool stochastic;
  uint64_t key_quantize;   // mix64 of the call's quantize seed
  float* worker_residual;  // n floats, or null
  // Step 3's sum: this rank's slot of every rank's buffer (rank order),
  // post_scale, the server residual; its rounding key.
  SumValue<float, 16> sum;
  float* server_residual;  // shard floats (sum.r, writable), or null
  uint64_t key_requantize;
};

// Shard q of n elements in shards of `shard`: [*lo, *lo + returned count)
// (the last shards may be short or empty). Host and device.
PYCOMM_HOST_DEVICE size_t shard_span(size_t n, size_t shard, int q, size_t* lo) {
  *lo = n < q * shard ? n : q * shard;
  return (n < *lo + shard ? n : *lo + shard) - *lo;
}

__device__ __forceinline__ size_t shard_span(const FusedArgs& a, int q, size_t* lo) {
  return shard_span(a.n, a.shard, q, lo);
}

// Step 5 of the fused kernel: every rank's reduced shard decoded into out.
template <int E, int kBits, int kV, int kU, typename T>
__device__ __forceinline__ void decode_shards(const FusedArgs& a, T* out, int lane) {
  constexpr int kBlock = 32 * E;
  const int world = a.peers.world;
  for (int q = 0; q < world; ++q) {
    size_t lo;
    const size_t len = shard_span(a, q, &lo);
    const uint8_t* payload = a.buf[q] + world * a.slot;
    const uint8_t* codes = payload + quant_num_blocks(len, kBlock) * 4;
    LaneCodes<E, kBits, kV> lc[kU];
    const float none[E] = {};
    for_warp_blocks_batched<kBlock, kU>(
        len,
        [&](int u, size_t blk, size_t base, int m) {
          with_block_full<E, kBits, kV>(m, [&](auto kind) {
            load_codes<E, decltype(kind)>(payload, codes, blk, base, m, lane, lc[u]);
          });
        },
        [&](int u, size_t, size_t base, int m) {
          with_block_full<E, kBits, kV>(m, [&](auto kind) {
            store_decoded<E, decltype(kind)>(lc[u], base, m, lane, out + lo, false, none);
          });
        });
  }
}

// One instantiation per codec (kBits): with the bits a runtime value every
// phase held both codecs' code, and at 80 registers blocks of 512 spilled.
// Lanes hold runs of kRunOf<E> elements (quant_warp.cuh): a run is one load
// or store, and a lane's codes of a source fit a register or two, where one
// element a lane spilled at blocks of 256 (int4) and 512; tensors start at
// kIpcQuantAlign bytes (the caller stages others), so there is no other
// layout to build.
template <int E, int kBits, typename T>
__global__ void __launch_bounds__(kFusedThreads, kFusedBlocksPerSm) ipc_quantized_kernel(FusedArgs a, const T* in, T* out) {
  constexpr int kBlock = 32 * E, kV = kRunOf<E>;
  // Blocks per batch: 16 values a lane for blocks of 128 to 512 (4, 2 and 1
  // blocks), 4 blocks of 64 (8 spilled 15 registers). Under
  // __launch_bounds__' 80 registers, with runs of 4 (ptxas -v): no spills at
  // 128 and 256, 8 bytes at 64, 84 at 512 for int4 (none for int8).
  constexpr int kU = E >= 16 ? 1 : (E >= 4 ? 16 / E : 4);
  const int lane = threadIdx.x % 32, world = a.peers.world, rank = a.peers.rank;
  uint8_t* own = a.buf[rank];
  // 1. Quantize every shard of (input + worker residual) into slot q of this
  //    rank's buffer, for rank q; the residual keeps what rounding lost. The
  //    buffer is free: the launch before on this stream ended with every
  //    peer's reads of it done.
  for (int q = 0; q < world; ++q) {
    size_t lo;
    const size_t len = shard_span(a, q, &lo);
    uint8_t* payload = own + q * a.slot;
    float* scales = reinterpret_cast<float*>(payload);
    uint8_t* codes = payload + quant_num_blocks(len, kBlock) * 4;
    float* res = a.worker_residual ? a.worker_residual + lo : nullptr;
    const InputValue<T> value{in + lo, res};
    float v[kU][E];
    for_warp_blocks_batched<kBlock, kU>(
        len,
        [&](int u, size_t blk, size_t base, int m) {
          with_block_full<E, kBits, kV>(m, [&](auto kind) {
            value.template lane_values<E, decltype(kind)>(blk, base, lane, m, v[u]);
          });
        },
        [&](int u, size_t blk, size_t base, int m) {
          with_block_full<E, kBits, kV>(m, [&](auto kind) {
            quantize_values<E, decltype(kind)>(v[u], blk, base, m, lane, a.stochastic, a.key_quantize, lo, scales,
                                               codes, res);
          });
        });
    zero_payload_tail(payload, len, kBits, kBlock);
  }
  // 2. Every rank's slots are written (this block's quantization blocks).
  const uint32_t epoch = ipc_detail::next_epoch<false, ipc_detail::FusedRows>(a.peers);
  if (!ipc_detail::block_barrier<ipc_detail::FusedRows>(a.peers, 0, epoch)) return;
  // 3. Reduce this rank's shard from every rank's slot for it, in rank order
  //    (the communicator's order), average if asked, and requantize it with
  //    the server residual, into this rank's last slot.
  {
    size_t lo;
    const size_t len = shard_span(a, rank, &lo);
    uint8_t* payload = own + world * a.slot;
    float* scales = reinterpret_cast<float*>(payload);
    uint8_t* codes = payload + quant_num_blocks(len, kBlock) * 4;
    float v[kU][E];
    for_warp_blocks_batched<kBlock, kU>(
        len,
        [&](int u, size_t blk, size_t base, int m) {
          with_block_full<E, kBits, kV>(m, [&](auto kind) {
            a.sum.template lane_values<E, decltype(kind)>(blk, base, lane, m, v[u]);
          });
        },
        [&](int u, size_t blk, size_t base, int m) {
          with_block_full<E, kBits, kV>(m, [&](auto kind) {
            quantize_values<E, decltype(kind)>(v[u], blk, base, m, lane, a.stochastic, a.key_requantize,
                                               rank * a.shard, scales, codes, a.server_residual);
          });
        });
    zero_payload_tail(payload, len, kBits, kBlock);
  }
  // 4. Every rank's reduced shard is written (and this block's part of every
  //    slot of step 1 read).
  if (!ipc_detail::block_barrier<ipc_detail::FusedRows>(a.peers, 1, epoch)) return;
  // 5. Every rank decodes the same bytes: the same result everywhere.
  decode_shards<E, kBits, kV, kU>(a, out, lane);
  // 6. Nobody writes its buffer again (the next launch) before every rank
  //    has read this block's part of it.
  ipc_detail::block_barrier<ipc_detail::FusedRows>(a.peers, 2, epoch);
}

}  // namespace

int fused_grid_cap(const CudaIpcAllReduce::KernelView& v) {
  const int fit = kFusedBlocksPerSm * std::max(1, v.sms) / std::max(1, v.ranks_per_gpu);
  const int cap = v.fused_blocks > 0 ? std::min(v.fused_blocks, fit) : fit;
  return std::max(1, std::min(cap, kIpcFusedMaxBlocks));
}

namespace {

// The fused kernel, where the codec's block is a warp kernel's; false
// otherwise (the caller runs the steps as separate kernels).
bool launch_fused(CudaIpcAllReduce& group, const IpcQuantCall& c, size_t shard, size_t slot, cudaStream_t stream) {
  if (!ipc_quantized_fused(c)) return false;
  const CudaIpcAllReduce::KernelView view = group.kernel_view();
  FusedArgs a{};
  a.peers = ipc_detail::peers_of(view);
  for (int q = 0; q < view.world; ++q) {
    a.buf[q] = static_cast<uint8_t*>(view.buf[q]);
    a.sum.s.p[q] = a.buf[q] + view.rank * slot;
  }
  a.n = c.n;
  a.shard = shard;
  a.slot = slot;
  a.bits = c.bits;
  a.stochastic = c.stochastic;
  a.key_quantize = kernels::mix64(c.seed_quantize);
  a.worker_residual = c.worker_residual;
  a.sum.s.n = view.world;
  a.sum.dense = nullptr;
  a.sum.post_scale = c.avg ? 1.0f / static_cast<float>(view.world) : 1.0f;
  a.sum.r = c.server_residual;
  a.server_residual = c.server_residual;
  size_t mine_lo;
  a.sum.nblocks = kernels::quant_num_blocks(shard_span(c.n, shard, view.rank, &mine_lo), c.block);
  a.sum.bits = c.bits;
  a.sum.block = c.block;
  a.sum.cancel = nullptr;  // the barrier before step 3 is the check
  a.key_requantize = kernels::mix64(c.seed_requantize);
  // Enough warps for the largest shard's blocks, at most fused_grid_cap:
  // the same on every rank (n, world, codec, what the group agreed).
  const size_t warps = kFusedThreads / 32;
  const size_t need = (kernels::quant_num_blocks(shard, c.block) + warps - 1) / warps;
  const unsigned grid = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(fused_grid_cap(view), need)));
  return with_warp_block(c.block, [&](auto e) {
    constexpr int E = decltype(e)::value;
    kernels::with_float_type(c.dtype, "the quantized CUDA IPC all-reduce", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      auto* o = static_cast<T*>(c.output);
      const auto* i = static_cast<const T*>(c.input);
      if (c.bits == 8)
        ipc_quantized_kernel<E, 8, T><<<grid, kFusedThreads, 0, stream>>>(a, i, o);
      else
        ipc_quantized_kernel<E, 4, T><<<grid, kFusedThreads, 0, stream>>>(a, i, o);
    });
    kernels::cuda_detail::check(cudaGetLastError(), "quantized all-reduce launch");
  });
}

}  // namespace

bool ipc_quantized_fused(const IpcQuantCall& c) {
  return c.fused && with_warp_block(c.block, [](auto) {});
}

bool ipc_quantized_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kIpcQuantAlign == 0;
}

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
  // Checked before anything is enqueued, as the buffer's size is (a call
  // refused on one rank still leaves its peers to their timeout).
  if (ipc_quantized_fused(c))
    for (const void* p : {c.input, static_cast<const void*>(c.output), static_cast<const void*>(c.worker_residual),
                          static_cast<const void*>(c.server_residual)})
      if (!ipc_quantized_aligned(p))
        throw CommError("pycomm: the fused quantized CUDA IPC all-reduce takes tensors that start at " +
                        std::to_string(kIpcQuantAlign) + " bytes; stage others through an aligned copy");
  // Both forms write this rank's buffer before they meet the peers.
  group.settle(stream);
  if (launch_fused(group, c, shard, slot, stream)) return;
  const size_t es = dtype_size(c.dtype);
  auto span = [&](int q, size_t* lo) { return shard_span(c.n, shard, q, lo); };
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
