// The device executor of schedules: ring, tree and direct all-reduce over
// the CUDA IPC group's buffers, one kernel per call. Its program
// (algorithms/program.h) runs on the CPU in CI (transport/program_sim.cpp),
// bit for bit against the shared-memory executor, and tests/test_cuda.py
// checks this kernel against that program's CPU run (it passed at 2 to 4
// ranks on an H200, benchmarks/RESULTS.md "GPU").
//
// Each rank runs its flattened plan; the staging buffer is its mailbox (two
// halves of kNumPhases regions of K chunk slots). A send copies a chunk into
// the rank's own slot, a receive reads the sender's slot through IPC.
//
// Parallelism without a grid-wide barrier: every chunk is cut into gridDim
// contiguous segments, and block b handles segment b of every chunk in every
// op, on every rank (the cut depends only on the chunk's length, which every
// rank agrees on). So block b of one rank only ever reads what block b of
// another wrote, and it synchronises with it alone: per-block step and round
// flags, pushed into the reader's signal block (cuda_ipc_detail.cuh).
//
// Flag values: a post of step t of round j carries steps_done + j*T + t + 1,
// a finished round rounds_done + j + 1, both counted by the host per call
// and the same on every rank.
#include <cuda_runtime.h>

#include <algorithm>

#include "../algorithms/program.h"
#include "../algorithms/tuner.h"
#include "../kernels/cuda/common.cuh"
#include "../kernels/reduce.h"
#include "cuda_ipc.h"
#include "cuda_ipc_detail.cuh"
#include "layout.h"

namespace pycomm {
namespace {

using ipc_detail::IpcSignal;
using ipc_detail::kThreads;
using ipc_detail::st_release;
using ipc_detail::WaitCtx;
using kernels::cuda_detail::check;
using kernels::cuda_detail::Pack;
using kernels::cuda_detail::reduce_elem;
using kernels::cuda_detail::reduce_pack;

// The peers' signal blocks, the wait, rank and world (IpcPeers), and:
struct ScheduleArgs : ipc_detail::IpcPeers {
  const ProgOp* ops;
  int nops;
  uint32_t steps;  // per round
  RoundLayout layout;
  const char* in;
  char* out;
  char* mailbox[kIpcMaxRanks];  // every rank's buffer (ours at [rank])
  uint32_t steps_done, rounds_done;
  bool avg;
  bool packs;  // every pointer 16-byte aligned: 16-byte loads and stores
};

// Block b's segment of a chunk of `len` elements: [lo, hi). Segments are
// multiples of 16 elements (a whole number of packs for every dtype), so a
// segment of an aligned chunk starts aligned.
__device__ __forceinline__ void segment(size_t len, size_t* lo, size_t* hi) {
  const size_t per = ((len + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  *lo = min(len, static_cast<size_t>(blockIdx.x) * per);
  *hi = min(len, *lo + per);
}

template <typename T>
__device__ void copy_segment(T* dst, const T* src, size_t len, bool packs) {
  size_t lo, hi;
  segment(len, &lo, &hi);
  size_t i = lo + threadIdx.x;
  if (packs) {
    constexpr int kPer = Pack<T>::kPer;
    const size_t np = (hi - lo) / kPer;
    const auto* s = reinterpret_cast<const Pack<T>*>(src + lo);
    auto* d = reinterpret_cast<Pack<T>*>(dst + lo);
    for (size_t p = threadIdx.x; p < np; p += blockDim.x) d[p] = s[p];
    i = lo + np * kPer + threadIdx.x;
  }
  for (; i < hi; i += blockDim.x) dst[i] = src[i];
}

// dst (and dst2) <- srcs combined in order, in the accumulator type: the
// CPU kernels' order, hence their bits.
template <typename T, RedOp kOp>
__device__ void reduce_segment(T* dst, T* dst2, const void* const* srcs, int n, size_t len, bool packs) {
  using namespace kernels;
  size_t lo, hi;
  segment(len, &lo, &hi);
  size_t i = lo + threadIdx.x;
  if (packs) {
    constexpr int kPer = Pack<T>::kPer;
    const size_t p0 = lo / kPer, np = (hi - lo) / kPer;
    for (size_t p = p0 + threadIdx.x; p < p0 + np; p += blockDim.x) {
      typename Acc<T>::type acc[kPer];
      reduce_pack<T, kOp>(srcs, n, p, acc);
      Pack<T> v;
#pragma unroll
      for (int k = 0; k < kPer; ++k) v.e[k] = store_acc<T>(acc[k]);
      reinterpret_cast<Pack<T>*>(dst)[p] = v;
      if (dst2) reinterpret_cast<Pack<T>*>(dst2)[p] = v;
    }
    i = lo + np * kPer + threadIdx.x;
  }
  for (; i < hi; i += blockDim.x) {
    const T v = store_acc<T>(reduce_elem<T, kOp>(srcs, n, i));
    dst[i] = v;
    if (dst2) dst2[i] = v;
  }
}

// op=avg: each output chunk divided once, when its round is done (the CPU
// executors divide the whole output at the end: the same bits).
template <typename T>
__device__ void divide_segment(T* data, size_t len, int world) {
  using namespace kernels;
  size_t lo, hi;
  segment(len, &lo, &hi);
  const auto d = static_cast<typename Acc<T>::type>(world);
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) data[i] = store_acc<T>(load_acc(data[i]) / d);
}

// Pushes `value` into slot [block][rank] of every peer's row `row` (after
// the block's writes: the caller passed __syncthreads).
__device__ __forceinline__ void post(const ScheduleArgs& a, uint32_t (IpcSignal::*row)[kIpcMaxBlocks][kIpcMaxRanks],
                                     uint32_t value) {
  const int q = threadIdx.x;
  if (q < a.world && q != a.rank) st_release(&(a.sig[q]->*row)[blockIdx.x][a.rank], value);
}

__device__ bool wait_rounds(const ScheduleArgs& a, uint32_t target) {
  uint32_t* slots[kIpcMaxRanks];
  for (int q = 0; q < a.world; ++q) slots[q] = q == a.rank ? nullptr : &a.sig[a.rank]->round[blockIdx.x][q];
  return ipc_detail::block_wait_each(a.wait, slots, a.world, target, kIpcWaitRound);
}

// 3 blocks per SM (40 registers): every rank's blocks of a launch must be
// resident at once, since they wait for each other; with up to 60 registers
// 8 ranks' 36 blocks each would not all fit a GPU of 132 SMs under MPS.
template <typename T, RedOp kOp>
__global__ void __launch_bounds__(kThreads, 3) schedule_kernel(ScheduleArgs a) {
  __shared__ RoundPointers p;
  for (uint64_t j = 0; j < a.layout.rounds; ++j) {
    const uint32_t round_id = a.rounds_done + static_cast<uint32_t>(j);
    const uint32_t step_base = a.steps_done + static_cast<uint32_t>(j) * a.steps;
    // 1. Every peer is done with the round two before, which used the same
    //    half of this rank's mailbox (earlier calls ended with step 5).
    if (j >= 2 && !wait_rounds(a, round_id - 1)) return;
    // 2. This round's chunks, and every rank's mailbox half for it.
    if (threadIdx.x == 0) point_round(p, a.layout, round_id, j, a.rank, a.world, a.mailbox, a.in, a.out);
    __syncthreads();
    // 3. The program's ops, in order.
    for (int k = 0; k < a.nops; ++k) {
      const ProgOp& o = a.ops[k];
      switch (o.kind) {
        case ProgKind::kCopy:
          copy_segment<T>(reinterpret_cast<T*>(resolve(p, o.dst, o.chunk, a.rank)),
                          reinterpret_cast<const T*>(resolve(p, o.src[0], o.chunk, a.rank)), p.len[o.chunk], a.packs);
          break;
        case ProgKind::kReduce: {
          const void* srcs[kProgMaxSrcs];
          for (int s = 0; s < o.nsrc; ++s) srcs[s] = resolve(p, o.src[s], o.chunk, a.rank);
          reduce_segment<T, kOp>(reinterpret_cast<T*>(resolve(p, o.dst, o.chunk, a.rank)),
                                 reinterpret_cast<T*>(resolve(p, o.dst2, o.chunk, a.rank)), srcs, o.nsrc,
                                 p.len[o.chunk], a.packs);
          break;
        }
        case ProgKind::kPost:
          __syncthreads();
          post(a, &IpcSignal::step, step_base + o.step + 1);
          break;
        case ProgKind::kWait:
          if (!ipc_detail::block_wait(a.wait, &a.sig[a.rank]->step[blockIdx.x][o.peer], step_base + o.step + 1,
                                      o.peer, kIpcWaitStep))
            return;
          break;
      }
    }
    // 4. avg divides the round's output chunks.
    if (a.avg) {
      __syncthreads();
      for (int c = 0; c < a.layout.K; ++c)
        if (p.out[c]) divide_segment<T>(reinterpret_cast<T*>(p.out[c]), p.len[c], a.world);
    }
    // 5. The round is done: its mailbox half may be refilled.
    __syncthreads();
    post(a, &IpcSignal::round, round_id + 1);
  }
  // 6. Nobody returns while a peer may still read its mailbox: the next
  //    call (of any algorithm) refills it.
  if (a.layout.rounds > 0) wait_rounds(a, a.rounds_done + static_cast<uint32_t>(a.layout.rounds));
}

}  // namespace

const CudaIpcAllReduce::DeviceProgram& CudaIpcAllReduce::program(int algo) {
  auto it = programs_.find(algo);
  if (it != programs_.end()) return it->second;
  const Schedule schedule{static_cast<Algorithm>(algo), Collective::kAllReduce, world_, 0};
  const Program prog = flatten_plan(*build_plan(schedule, rank_));
  DeviceProgram d;
  d.nops = static_cast<int>(prog.ops.size());
  d.num_chunks = prog.num_chunks;
  d.num_steps = prog.num_steps;
  const size_t bytes = std::max<size_t>(1, prog.ops.size()) * sizeof(ProgOp);
  check(cudaMalloc(&d.ops, bytes), "schedule program");
  // Once per schedule: a synchronous copy is fine.
  if (!prog.ops.empty()) check(cudaMemcpy(d.ops, prog.ops.data(), bytes, cudaMemcpyHostToDevice), "schedule program");
  return programs_.emplace(algo, d).first->second;
}

void CudaIpcAllReduce::run_schedule(const void* in, void* out, size_t count, DType dtype, RedOp op, int algo,
                                    cudaStream_t stream) {
  const size_t es = dtype_size(dtype);
  if (world_ == 1) {
    if (in != out) check(cudaMemcpyAsync(out, in, count * es, cudaMemcpyDeviceToDevice, stream), "copy");
    return;
  }
  // 1. The concrete schedule: "direct" as the CPU communicator resolves it
  //    (the tuner sees the call's bytes), so both run the same one.
  Algorithm a_ = algo == static_cast<int>(IpcAlgo::kRing)   ? Algorithm::kRing
                 : algo == static_cast<int>(IpcAlgo::kTree) ? Algorithm::kTree
                                                            : tune(Algorithm::kDirect, Collective::kAllReduce,
                                                                   count * es, world_);
  const DeviceProgram& prog = program(static_cast<int>(a_));
  CollectiveDesc d;
  d.coll = Collective::kAllReduce;
  d.op = op;
  d.count = count;
  d.dtype = dtype;
  // 2. The call's layout: the CPU communicator's for the same round size.
  ScheduleArgs a{};
  a.layout = RoundLayout(d, prog.num_chunks, world_, round_bytes_);
  a.ops = static_cast<const ProgOp*>(prog.ops);
  a.nops = prog.nops;
  a.steps = static_cast<uint32_t>(prog.num_steps);
  a.in = static_cast<const char*>(in);
  a.out = static_cast<char*>(out);
  const KernelView view = kernel_view();
  static_cast<ipc_detail::IpcPeers&>(a) = ipc_detail::peers_of(view);
  for (int q = 0; q < world_; ++q) a.mailbox[q] = static_cast<char*>(view.buf[q]);
  a.steps_done = steps_done_;
  a.rounds_done = rounds_done_;
  a.avg = op == RedOp::kAvg;
  a.packs = ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) & 15u) == 0;
  // 3. The grid: from what every rank agrees on (the chunk size), so that
  //    segment b of a chunk is block b's on every rank; at least 4 packs
  //    per thread before another block joins.
  const unsigned grid = static_cast<unsigned>(
      std::max<size_t>(1, std::min<size_t>(blocks_, a.layout.chunk_max * es / (kThreads * 16 * 4))));
  ipc_detail::with_ipc_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    ipc_detail::with_ipc_op(op, [&](auto k) {
      schedule_kernel<T, decltype(k)::value><<<grid, kThreads, 0, stream>>>(a);
    });
  });
  check(cudaGetLastError(), "schedule launch");
  // 4. The counters every rank advances alike.
  steps_done_ += static_cast<uint32_t>(a.layout.rounds * prog.num_steps);
  rounds_done_ += static_cast<uint32_t>(a.layout.rounds);
}

}  // namespace pycomm
