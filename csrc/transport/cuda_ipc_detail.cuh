// What the CUDA IPC kernels share (cuda_ipc.cu: one-shot and two-shot;
// cuda_schedule.cu: the executor of schedules; compression/ipc_quantized.cu:
// the fused quantized all-reduce): the signal block every rank maps, the
// flag protocol, and the bounded wait that gives up on a dead or hung peer
// instead of spinning until the process is killed.
//
// Memory ordering. A block publishes with __syncthreads() (its threads'
// writes are ordered before the barrier at block scope), then one thread per
// peer stores the flag with st.release.sys: release is cumulative, so the
// whole block's writes are visible to a peer that reads the flag with
// ld.acquire.sys and then passes its own __syncthreads(). This is vLLM's
// protocol; it needs sm_70 or newer. Flags are pushed into the reader's own
// signal block, so every spin reads local memory.
//
// Flags never reset: they carry counters the same on every rank (every rank
// makes the same launches in the same order), compared modulo 2^32. The
// one-shot and two-shot kernels keep theirs in device memory (`launches`),
// one per block, so a launch's arguments never change and a CUDA graph can
// replay it (the fused quantized kernel keeps its own, in rows of its own);
// the executor of schedules and barrier() still count on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "../kernels/reduce.h"
#include "cuda_ipc.h"

namespace pycomm {
namespace ipc_detail {

// 512 threads: 16 warps per block keep enough 16-byte loads in flight.
constexpr int kThreads = 512;
constexpr int kPhases = 3;  // one-shot / two-shot: start, middle, end

struct IpcSignal {
  // flag[phase][block][src]: written by rank src into this rank's block.
  alignas(128) uint32_t flag[kPhases][kIpcMaxBlocks][kIpcMaxRanks];
  // The executor of schedules: the last step src posted, and the rounds it
  // finished, per block.
  alignas(128) uint32_t step[kIpcMaxBlocks][kIpcMaxRanks];
  alignas(128) uint32_t round[kIpcMaxBlocks][kIpcMaxRanks];
  // barrier(): the last barrier src entered (one row serves every barrier:
  // values only grow, and a wait is for "at least").
  alignas(128) uint32_t bar[kIpcMaxRanks];
  // One-shot / two-shot: the launches block b of this rank has made, read
  // and advanced only by that block (stream order separates the launches).
  // Block b of every rank runs the same launches, so the counts agree.
  alignas(128) uint32_t launches[kIpcMaxBlocks];
  // The same two for a kernel composed over the group whose grid fills the
  // GPU (KernelView): its own rows, as its grid is not the group's.
  alignas(128) uint32_t fused_flag[kPhases][kIpcFusedMaxBlocks][kIpcMaxRanks];
  alignas(128) uint32_t fused_launches[kIpcFusedMaxBlocks];
};

// Which flag rows and launch counts a kernel meets its peers on: the
// one-shot and two-shot kernels' (GroupRows), or the fused rows.
struct GroupRows {
  static constexpr int kBlocks = kIpcMaxBlocks;
  __device__ static uint32_t* flag(IpcSignal* s, int phase, int block, int src) {
    return &s->flag[phase][block][src];
  }
  __device__ static uint32_t* launches(IpcSignal* s) { return s->launches; }
};
struct FusedRows {
  static constexpr int kBlocks = kIpcFusedMaxBlocks;
  __device__ static uint32_t* flag(IpcSignal* s, int phase, int block, int src) {
    return &s->fused_flag[phase][block][src];
  }
  __device__ static uint32_t* launches(IpcSignal* s) { return s->fused_launches; }
};

__device__ __forceinline__ void st_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(v), "l"(p) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool reached(uint32_t v, uint32_t target) {
  return static_cast<int32_t>(v - target) >= 0;
}

// What every wait needs to give up: the host-mapped status (its abort word
// set by the host's watchdog when a peer dies; the first failure recorded
// there) and the call's timeout.
struct WaitCtx {
  IpcStatus* status;
  uint64_t timeout_ns;
};

// One thread waits until *slot reaches target. Gives up (false) when the
// host asked to abort, when another block already failed, or after the
// timeout; the first to give up records why. Ranks sharing a GPU time-slice,
// so a waiter backs off: it yields issue slots (it cannot yield the GPU to
// the peer's context), and reads the host-mapped words only now and then
// (each is a trip over PCIe).
__device__ inline bool wait_reached(const WaitCtx& w, const uint32_t* slot, uint32_t target, int peer,
                                    int what) {
  if (reached(ld_acquire(slot), target)) return true;
  const uint64_t t0 = global_ns();
  for (uint32_t n = 1;; ++n) {
    __nanosleep(256);
    if (reached(ld_acquire(slot), target)) return true;
    if ((n & 255) != 0) continue;
    const volatile IpcStatus* s = w.status;
    int code = 0;
    if (s->abort != 0) code = kIpcAborted;
    else if (s->code != 0) code = kIpcAborted;  // another block gave up first
    else if (global_ns() - t0 > w.timeout_ns) code = kIpcTimedOut;
    if (code == 0) continue;
    if (atomicCAS_system(&w.status->code, 0u, static_cast<unsigned>(code)) == 0u) {
      w.status->peer = peer;
      w.status->what = what;
      w.status->target = target;
      __threadfence_system();
    }
    return false;
  }
}

// All threads of the block: thread 0 waits, the others learn the outcome
// (and, through the barrier, see what the peer published before the flag).
// Returns false when the block must leave the kernel.
__device__ inline bool block_wait(const WaitCtx& w, const uint32_t* slot, uint32_t target, int peer, int what) {
  __shared__ int ok;
  __syncthreads();  // everyone read the previous wait's outcome
  if (threadIdx.x == 0) ok = wait_reached(w, slot, target, peer, what);
  __syncthreads();
  return ok != 0;
}

// All threads of the block: thread q < n waits for slots[q] (nullptr: no
// wait), then everyone learns whether all of them passed.
__device__ inline bool block_wait_each(const WaitCtx& w, uint32_t* const* slots, int n, uint32_t target, int what) {
  __shared__ int failed;
  __syncthreads();
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < n && slots[threadIdx.x] && !wait_reached(w, slots[threadIdx.x], target, threadIdx.x, what))
    failed = 1;
  __syncthreads();
  return failed == 0;
}

// A launch's view of its peers: their signal blocks (ours at [rank]) and
// how to give up waiting for them. all_blocks: the group is double-buffered
// (CudaIpcAllReduce), and every launch advances every block's count.
struct IpcPeers {
  IpcSignal* sig[kIpcMaxRanks];
  WaitCtx wait;
  int rank;
  int world;
  bool all_blocks;
};

// The peers as a group's KernelView gives them.
inline IpcPeers peers_of(const CudaIpcAllReduce::KernelView& v) {
  IpcPeers p{};
  for (int q = 0; q < v.world; ++q) p.sig[q] = static_cast<IpcSignal*>(v.sig[q]);
  p.wait = WaitCtx{v.status, v.timeout_ns};
  p.rank = v.rank;
  p.world = v.world;
  p.all_blocks = v.double_buffer;
  return p;
}

// Block b of every rank meets block b of every other rank, on the flag row
// of `phase`. A kernel whose same block index on every rank touches the same
// data (the element-to-thread mapping is identical on every rank) needs no
// other ordering. False: a peer did not come within the timeout (or the
// host aborted); the block leaves the kernel and the failure is in the
// status.
template <typename Rows = GroupRows>
__device__ inline bool block_barrier(const IpcPeers& p, int phase, uint32_t epoch) {
  __syncthreads();
  uint32_t* slots[kIpcMaxRanks];
  for (int q = 0; q < p.world; ++q) {
    if (threadIdx.x == q) st_release(Rows::flag(p.sig[q], phase, blockIdx.x, p.rank), epoch);
    slots[q] = Rows::flag(p.sig[p.rank], phase, blockIdx.x, q);
  }
  return block_wait_each(p.wait, slots, p.world, epoch, kIpcWaitBarrier);
}

// This block's flag value for the launch: its launch count, advanced. Only
// this block of this rank touches the word, one launch after another, and
// block b of every rank makes the same launches: the counts agree. With
// all_blocks, block b also advances the counts of the blocks this launch
// does not have (b + grid, b + 2 grid, ...), so every count is the group's
// launch count, the same in every block: a double-buffered group takes the
// half of its buffer by its parity.
// (kAllBlocks: p.all_blocks known at compile time; the IPC kernels keep
// every register they can.)
template <bool kAllBlocks, typename Rows = GroupRows>
__device__ inline uint32_t next_epoch(const IpcPeers& p) {
  __shared__ uint32_t epoch;
  if (threadIdx.x == 0) {
    uint32_t* count = Rows::launches(p.sig[p.rank]) + blockIdx.x;
    epoch = *count + 1;
    *count = epoch;
    if constexpr (kAllBlocks) {
      for (unsigned j = blockIdx.x + gridDim.x; j < Rows::kBlocks; j += gridDim.x) count[j - blockIdx.x] = epoch;
    }
  }
  __syncthreads();
  return epoch;
}

// The kernels' element types and reductions, in one place for every IPC
// kernel: f(T*) with a null pointer of the element type, and g(Op) with an
// std::integral_constant of the reduction (avg sums; the caller divides).
template <typename F>
void with_ipc_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(static_cast<float*>(nullptr));
    case DType::kFloat64: return f(static_cast<double*>(nullptr));
    case DType::kFloat16: return f(static_cast<kernels::Half*>(nullptr));
    case DType::kBFloat16: return f(static_cast<kernels::BFloat16*>(nullptr));
    case DType::kInt32: return f(static_cast<int32_t*>(nullptr));
    case DType::kInt64: return f(static_cast<int64_t*>(nullptr));
    case DType::kUInt8: return f(static_cast<uint8_t*>(nullptr));
    default:
      throw CommError(std::string("pycomm: CUDA IPC all-reduce takes float32, float64, float16, bfloat16, int32, "
                                  "int64 and uint8 tensors, got ") + dtype_name(dtype));
  }
}

template <typename G>
void with_ipc_op(RedOp op, G&& g) {
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: return g(std::integral_constant<RedOp, RedOp::kSum>{});
    case RedOp::kMax: return g(std::integral_constant<RedOp, RedOp::kMax>{});
    case RedOp::kMin: return g(std::integral_constant<RedOp, RedOp::kMin>{});
    default:
      throw CommError(std::string("pycomm: CUDA IPC all-reduce takes op sum, avg, max or min, got ") + redop_name(op));
  }
}

}  // namespace ipc_detail
}  // namespace pycomm
