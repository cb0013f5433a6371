// CUDA IPC all-reduce (cuda_ipc.h): the one-shot and two-shot kernels, and
// the group's setup, watchdog and failure reporting.
// The flag protocol and its memory ordering are in cuda_ipc_detail.cuh.
// Each phase has its own flag row, so a fast peer already in the next
// launch's start barrier cannot disturb a slow one still waiting at this
// launch's end. Their flag values come from device memory, not from the
// launch's arguments: a CUDA graph that captured the call replays it.
#include "cuda_ipc.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "../algorithms/schedule.h"
#include "../kernels/cuda/common.cuh"
#include "../kernels/reduce.h"
#include "cuda_ipc_detail.cuh"
#include "process.h"
#include "thread_name.h"

namespace pycomm {
namespace {

using ipc_detail::IpcSignal;
using ipc_detail::kPhases;
using ipc_detail::kThreads;
using ipc_detail::st_release;
using ipc_detail::WaitCtx;

// The peers' signal blocks, the wait, rank and world (IpcPeers), and:
struct IpcArgs : ipc_detail::IpcPeers {
  const void* buf[kIpcMaxRanks];  // every rank's staging buffer (ours at [rank])
  void* own;
  // Double-buffered (all_blocks): packs of 16 bytes in half the buffer; a
  // launch uses the half its epoch's parity names, and has no end barrier.
  size_t half_packs;
  bool two_shot;
  bool avg;
};

using kernels::cuda_detail::check;
using kernels::cuda_detail::Pack;
using kernels::cuda_detail::reduce_elem;

__device__ __forceinline__ bool barrier(const IpcArgs& a, int phase, uint32_t epoch) {
  return ipc_detail::block_barrier(a, phase, epoch);
}

// The CPU transports' bits: sum in the accumulator type, store, and for avg
// divide the stored value (finish_average).
template <typename T>
__device__ __forceinline__ T finish(typename kernels::Acc<T>::type acc, bool avg, int world) {
  using namespace kernels;
  const T t = store_acc<T>(acc);
  if (!avg) return t;
  return store_acc<T>(load_acc(t) / static_cast<typename Acc<T>::type>(world));
}

// Whether a thread takes two packs at a time: their loads from each rank go
// out together. One load in flight per thread, with 36 blocks per rank,
// left HBM under-used when 2 ranks share a GPU (two-shot 64 % of the copy
// rate at 64 MB, 92 % with 4 ranks; H200 under MPS). Packs of 8 or 16
// elements (16- and 8-bit types) would need more registers than
// __launch_bounds__' 3 blocks per SM leave (every rank's blocks of a launch
// must be resident at once, since they wait for each other: see
// ipc_blocks_for).
template <typename T>
constexpr bool kTwoPacks = Pack<T>::kPer <= 4;

// Pack i, and with kTwoPacks<T> pack i + stride when `two`, reduced over the
// ranks' buffers (from pack `shift` of each: the launch's half) in rank order
// (the CPU kernel's order, hence its bits), finished.
template <typename T, RedOp kOp>
__device__ __forceinline__ void reduce_packs(const IpcArgs& a, size_t shift, size_t i, size_t stride, bool two,
                                             Pack<T>* v, Pack<T>* v2) {
  using namespace kernels;
  constexpr int kPer = Pack<T>::kPer;
  constexpr int kN = kTwoPacks<T> ? 2 : 1;
  const size_t at[2] = {shift + i, shift + (two ? i + stride : i)};
  typename Acc<T>::type acc[kN][kPer];
  for (int q = 0; q < a.world; ++q) {
    Pack<T> x[kN];
#pragma unroll
    for (int u = 0; u < kN; ++u) x[u] = static_cast<const Pack<T>*>(a.buf[q])[at[u]];
#pragma unroll
    for (int u = 0; u < kN; ++u)
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        acc[u][j] = q == 0 ? load_acc(x[u].e[j]) : combine<kOp>(acc[u][j], load_acc(x[u].e[j]));
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) v->e[j] = finish<T>(acc[0][j], a.avg, a.world);
  if constexpr (kN == 2) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) v2->e[j] = finish<T>(acc[1][j], a.avg, a.world);
  }
}

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* in, size_t i, bool aligned) {
  if (aligned) return reinterpret_cast<const Pack<T>*>(in)[i];
  Pack<T> v;
#pragma unroll
  for (int j = 0; j < Pack<T>::kPer; ++j) v.e[j] = in[i * Pack<T>::kPer + j];
  return v;
}

// Copies this thread's packs of [lo, end), those it (and the same thread of
// every peer) reads below, from the input into this rank's buffer: the loop
// of the reduction it stages for, pack for pack.
template <typename T>
__device__ __forceinline__ void stage_packs(const T* in, Pack<T>* own, size_t lo, size_t end, size_t stride,
                                            size_t step, bool aligned) {
  for (size_t i = lo; i < end; i += step) {
    const bool two = kTwoPacks<T> && i + stride < end;
    const Pack<T> v = load_pack(in, i, aligned), v2 = load_pack(in, two ? i + stride : i, aligned);
    own[i] = v;
    if (two) own[i + stride] = v2;
  }
}

template <typename T>
__device__ __forceinline__ void store_pack(T* out, size_t i, const Pack<T>& v, bool aligned) {
  if (aligned) {
    reinterpret_cast<Pack<T>*>(out)[i] = v;
  } else {
#pragma unroll
    for (int j = 0; j < Pack<T>::kPer; ++j) out[i * Pack<T>::kPer + j] = v.e[j];
  }
}

// kDouble: the group is double-buffered (a separate instantiation, so that
// the other keeps its registers: these kernels spill at __launch_bounds__'
// 40 registers already).
template <typename T, RedOp kOp, bool kDouble>
__global__ void __launch_bounds__(kThreads, 3) ipc_all_reduce_kernel(IpcArgs a, const T* in, T* out, size_t count) {
  using namespace kernels;
  constexpr int kPer = Pack<T>::kPer;
  const size_t nvec = count / kPer;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const size_t step = kTwoPacks<T> ? 2 * stride : stride;  // a thread's packs: i, i + stride, then i + step
  const size_t part = (nvec + a.world - 1) / a.world;     // two-shot: rank r reduces part r

  // 1. Every rank stages its input in its buffer, each thread the positions
  //    that it, and the same thread of every peer, reads in step 2 (and 5):
  //    the start barrier, which pairs the same blocks of every rank, then
  //    orders them before the peers' reads. (A copy on the stream before the
  //    kernel did this, one more operation per call; the buffer is free, as
  //    before: the previous launch's last barrier on this stream waited for
  //    every peer's reads of it, in every block.)
  //    Double-buffered, into the half of the launch's parity (every block
  //    has the same epoch then): peers may still read the other half.
  uint32_t epoch = 0;
  size_t shift = 0;  // in packs
  if constexpr (kDouble) {
    epoch = ipc_detail::next_epoch<true>(a);
    shift = a.half_packs * (epoch & 1u);
  }
  {
    Pack<T>* own = static_cast<Pack<T>*>(a.own) + shift;
    const bool in_aligned = (reinterpret_cast<uintptr_t>(in) & 15u) == 0;
    if (!a.two_shot) {
      stage_packs(in, own, tid, nvec, stride, step, in_aligned);
    } else {
      for (int r = 0; r < a.world; ++r)
        stage_packs(in, own, r * part + tid, min(nvec, (r + 1) * part), stride, step, in_aligned);
    }
    for (size_t i = nvec * kPer + tid; i < count; i += stride) static_cast<T*>(a.own)[shift * kPer + i] = in[i];
  }
  if constexpr (!kDouble) epoch = ipc_detail::next_epoch<false>(a);
  if (!barrier(a, 0, epoch)) return;
  if (!a.two_shot) {
    // 2. One-shot: reduce everything from every buffer.
    for (size_t i = tid; i < nvec; i += step) {
      const bool two = kTwoPacks<T> && i + stride < nvec;
      Pack<T> v, v2;
      reduce_packs<T, kOp>(a, shift, i, stride, two, &v, &v2);
      store_pack(out, i, v, aligned);
      if (two) store_pack(out, i + stride, v2, aligned);
    }
  } else {
    // 2. Two-shot, reduce-scatter: this rank reduces its part into its own
    //    buffer, in place (only this rank reads its part in this phase).
    const size_t end = min(nvec, (a.rank + 1) * part);
    Pack<T>* own = static_cast<Pack<T>*>(a.own) + shift;
    for (size_t i = a.rank * part + tid; i < end; i += step) {
      const bool two = kTwoPacks<T> && i + stride < end;
      Pack<T> v, v2;
      reduce_packs<T, kOp>(a, shift, i, stride, two, &v, &v2);
      own[i] = v;
      if (two) own[i + stride] = v2;
    }
    // 3. Every part is reduced (by the same thread index that reads it next).
    if (!barrier(a, 1, epoch)) return;
    // 4. All-gather: part q from rank q's buffer.
    for (int q = 0; q < a.world; ++q) {
      const Pack<T>* src = static_cast<const Pack<T>*>(a.buf[q]) + shift;
      const size_t end = min(nvec, (q + 1) * part);
      for (size_t i = q * part + tid; i < end; i += step) {
        const bool two = kTwoPacks<T> && i + stride < end;
        const Pack<T> v = src[i], v2 = src[two ? i + stride : i];
        store_pack(out, i, v, aligned);
        if (two) store_pack(out, i + stride, v2, aligned);
      }
    }
  }
  // 5. The tail after the last whole pack, element by element, from every
  //    buffer (reads only: safe in either algorithm).
  for (size_t i = nvec * kPer + tid; i < count; i += stride)
    out[i] = finish<T>(reduce_elem<T, kOp>(a.buf, a.world, shift * kPer + i), a.avg, a.world);
  // 6. Nobody refills its buffer (the next launch's staging) before every
  //    rank has read it. Double-buffered, the next launch stages into the
  //    other half, and its start barrier tells that every peer finished
  //    this launch (a rank starts a launch once its last one is done) before
  //    the launch after it refills this half.
  if constexpr (!kDouble) barrier(a, 2, epoch);
}

// barrier(): thread q pushes this rank's arrival to rank q, then waits for
// rank q's. The stream orders the earlier kernels' writes before this one
// starts; the fence makes them visible to the other processes before the
// release, and the acquire orders the later kernels after the peers'.
struct SignalTable {
  IpcSignal* sig[kIpcMaxRanks];
};

// A barrier that gave up also sets `gave_up` (device memory, sticky): the
// kernels after it on the stream read peers' buffers only while it is 0.
__global__ void barrier_kernel(SignalTable t, int rank, int world, uint32_t epoch, WaitCtx wait,
                               uint32_t* gave_up) {
  uint32_t* slots[kIpcMaxRanks];
  for (int q = 0; q < world; ++q) {
    if (threadIdx.x == q) {
      __threadfence_system();
      st_release(&t.sig[q]->bar[rank], epoch);
    }
    slots[q] = q == rank ? nullptr : &t.sig[rank]->bar[q];
  }
  if (!ipc_detail::block_wait_each(wait, slots, world, epoch, kIpcWaitBarrier) && threadIdx.x == 0) *gave_up = 1;
}

}  // namespace

void CudaIpcAllReduce::order(cudaStream_t waiter, cudaStream_t producer) {
  std::lock_guard<std::mutex> lock(order_mu_);
  check(cudaEventRecord(order_event_, producer), "ordering event");
  check(cudaStreamWaitEvent(waiter, order_event_, 0), "ordering event");
}

bool CudaIpcAllReduce::ordered_done() {
  std::lock_guard<std::mutex> lock(order_mu_);
  const cudaError_t e = cudaEventQuery(order_event_);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it
    return false;
  }
  check(e, "ordering event");
  return true;
}

bool CudaIpcAllReduce::capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &status), "capture status");
  return status != cudaStreamCaptureStatusNone;
}

IpcAlgo CudaIpcAllReduce::choose(size_t bytes, int world) {
  // A starting point to tune on the GPU (vLLM's crossovers are of this
  // order): one-shot reads world x the bytes but has one barrier instead of
  // three; two ranks read only twice the bytes, so they keep it longer.
  const size_t one_shot_max = world <= 2 ? (1u << 20) : (256u << 10);
  return bytes <= one_shot_max ? IpcAlgo::kOneShot : IpcAlgo::kTwoShot;
}

CudaIpcAllReduce::CudaIpcAllReduce(int rank, int world, size_t buffer_bytes, size_t round_bytes, double timeout_s,
                                   bool double_buffer)
    : rank_(rank), world_(world), buffer_bytes_(buffer_bytes / 16 * 16), double_buffer_(double_buffer) {
  if (world < 1 || world > kIpcMaxRanks || rank < 0 || rank >= world)
    throw CommError("pycomm: a CUDA IPC group holds 1.." + std::to_string(kIpcMaxRanks) + " ranks; got rank " +
                    std::to_string(rank) + " of " + std::to_string(world));
  if (buffer_bytes_ < 4096) throw CommError("pycomm: the CUDA IPC staging buffer must be at least 4 KiB");
  // Two halves (round parity) of kNumPhases regions hold one round each.
  const size_t most = buffer_bytes_ / (2 * kNumPhases) / 64 * 64;
  round_bytes_ = round_bytes == 0 ? most : round_bytes;
  if (round_bytes_ < 4096 || round_bytes_ > most)
    throw CommError("pycomm: the CUDA IPC round size must be 4 KiB to a quarter of the staging buffer (" +
                    std::to_string(most) + " bytes), got " + std::to_string(round_bytes_));
  if (!(timeout_s > 0)) throw CommError("pycomm: the CUDA IPC timeout must be positive");
  timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  check(cudaGetDevice(&device_), "current device");
  check(cudaMalloc(&buffer_, buffer_bytes_), "staging buffer");
  check(cudaMalloc(&signal_, sizeof(IpcSignal)), "signal block");
  check(cudaMemset(signal_, 0, sizeof(IpcSignal)), "signal block");
  check(cudaHostAlloc(reinterpret_cast<void**>(&status_), sizeof(IpcStatus), cudaHostAllocMapped), "status block");
  std::memset(status_, 0, sizeof(IpcStatus));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_dev_), status_, 0), "status block");
  check(cudaMalloc(reinterpret_cast<void**>(&gave_up_), sizeof(uint32_t)), "failure word");
  check(cudaMemset(gave_up_, 0, sizeof(uint32_t)), "failure word");
  check(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming), "ordering event");
  check(cudaDeviceSynchronize(), "signal block");
  peer_buffers_.assign(world_, nullptr);
  peer_signals_.assign(world_, nullptr);
  peer_buffers_[rank_] = buffer_;
  peer_signals_[rank_] = signal_;
}

CudaIpcAllReduce::~CudaIpcAllReduce() {
  stop_watch_ = true;
  if (watch_.joinable()) watch_.join();
  // Errors are ignored here: a destructor cannot report them, and the
  // process may be tearing down its context already.
  for (auto& kv : programs_) cudaFree(kv.second.ops);
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    if (peer_buffers_[q]) cudaIpcCloseMemHandle(peer_buffers_[q]);
    if (peer_signals_[q]) cudaIpcCloseMemHandle(peer_signals_[q]);
  }
  if (buffer_) cudaFree(buffer_);
  if (signal_) cudaFree(signal_);
  if (status_) cudaFreeHost(status_);
  if (gave_up_) cudaFree(gave_up_);
  if (order_event_) cudaEventDestroy(order_event_);
}

namespace {
// What a rank publishes: its two IPC handles, its process, its GPU's SM
// count, the fused blocks it asks for (KernelView), and its GPU.
constexpr size_t kHandlesBytes =
    2 * sizeof(cudaIpcMemHandle_t) + sizeof(ProcessId) + 2 * sizeof(int32_t) + sizeof(cudaUUID_t);
constexpr size_t kSmsAt = 2 * sizeof(cudaIpcMemHandle_t) + sizeof(ProcessId);
}  // namespace

std::string CudaIpcAllReduce::handles(int fused_blocks) const {
  if (fused_blocks < 0 || fused_blocks > kIpcFusedMaxBlocks)
    throw CommError("pycomm: fused_blocks (or PYCOMM_IPC_FUSED_BLOCKS) must be 1 to " +
                    std::to_string(kIpcFusedMaxBlocks) + " (0: as the GPU fits), got " +
                    std::to_string(fused_blocks));
  cudaIpcMemHandle_t h[2];
  check(cudaIpcGetMemHandle(&h[0], buffer_), "handle of the staging buffer");
  check(cudaIpcGetMemHandle(&h[1], signal_), "handle of the signal block");
  const ProcessId self = this_process();
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device_), "device properties");
  const int32_t ints[2] = {prop.multiProcessorCount, fused_blocks};
  return std::string(reinterpret_cast<const char*>(h), sizeof h) +
         std::string(reinterpret_cast<const char*>(&self), sizeof self) +
         std::string(reinterpret_cast<const char*>(ints), sizeof ints) +
         std::string(reinterpret_cast<const char*>(&prop.uuid), sizeof prop.uuid);
}

void CudaIpcAllReduce::open(const std::vector<std::string>& all) {
  if (opened_) throw CommError("pycomm: CUDA IPC group opened twice");
  if (static_cast<int>(all.size()) != world_)
    throw CommError("pycomm: CUDA IPC open() needs " + std::to_string(world_) + " ranks' handles, got " +
                    std::to_string(all.size()));
  peers_.assign(world_, ProcessId{});
  int ranks_per_gpu = 1;
  for (int q = 0; q < world_; ++q) {
    if (all[q].size() != kHandlesBytes)
      throw CommError("pycomm: rank " + std::to_string(q) + "'s CUDA IPC handles are malformed");
    const char* uuid = all[q].data() + kHandlesBytes - sizeof(cudaUUID_t);
    int same = 0;
    for (int p = 0; p < world_; ++p)
      same += all[p].size() == kHandlesBytes &&
              std::memcmp(all[p].data() + kHandlesBytes - sizeof(cudaUUID_t), uuid, sizeof(cudaUUID_t)) == 0;
    ranks_per_gpu = std::max(ranks_per_gpu, same);
    int32_t ints[2];
    std::memcpy(ints, all[q].data() + kSmsAt, sizeof ints);
    sms_ = q == 0 ? ints[0] : std::min(sms_, ints[0]);
    if (ints[1] > 0) fused_blocks_ = fused_blocks_ == 0 ? ints[1] : std::min(fused_blocks_, ints[1]);
    // (A peer in another pid namespace: the watchdog cannot tell, and leaves
    // it to the timeout.)
    std::memcpy(&peers_[q], all[q].data() + 2 * sizeof(cudaIpcMemHandle_t), sizeof(ProcessId));
    if (q == rank_) continue;
    cudaIpcMemHandle_t h[2];
    std::memcpy(h, all[q].data(), sizeof h);
    // Lazy peer access: ranks on other GPUs of the host are reached over
    // NVLink/PCIe; ranks on this GPU map the memory directly.
    check(cudaIpcOpenMemHandle(&peer_buffers_[q], h[0], cudaIpcMemLazyEnablePeerAccess),
          ("opening rank " + std::to_string(q) + "'s staging buffer").c_str());
    check(cudaIpcOpenMemHandle(&peer_signals_[q], h[1], cudaIpcMemLazyEnablePeerAccess),
          ("opening rank " + std::to_string(q) + "'s signal block").c_str());
  }
  blocks_ = ipc_blocks_for(ranks_per_gpu);
  ranks_per_gpu_ = ranks_per_gpu;
  opened_ = true;
  // The watchdog: the ranks share this host, so a peer's death is seen from
  // its process id at once (its kernels' flags would just stop moving), a
  // zombie counted as dead.
  // 20 ms keeps its cost nil and a survivor's wait short.
  watch_ = named_thread("ipcwatch", [this] {
    while (!stop_watch_) {
      for (int q = 0; q < world_; ++q) {
        if (q == rank_) continue;
        if (process_gone(peers_[q])) {
          abort("rank " + std::to_string(q) + " (process " + std::to_string(peers_[q].pid) + ") is gone");
          return;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

void CudaIpcAllReduce::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_why_.empty()) abort_why_ = why;
  }
  reinterpret_cast<volatile IpcStatus*>(status_)->abort = 1;
}

std::string CudaIpcAllReduce::failure() const {
  const volatile IpcStatus* s = status_;
  if (s->code == 0) return "";
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = abort_why_;
  }
  std::string out = "pycomm: a CUDA IPC all-reduce on rank " + std::to_string(rank_) + " gave up";
  if (s->code == kIpcTimedOut)
    out += ": it waited more than the timeout for rank " + std::to_string(s->peer) +
           (s->what == kIpcWaitBarrier ? " to reach the same call" : " to hand over its data");
  if (!why.empty()) out += ": " + why;
  return out + "; its result is not whole, and the group cannot be used any more (make a new one)";
}

void CudaIpcAllReduce::throw_if_failed() const {
  std::string why = failure();
  if (why.empty() && reinterpret_cast<const volatile IpcStatus*>(status_)->abort != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    why = "pycomm: the CUDA IPC group of rank " + std::to_string(rank_) + " was aborted: " + abort_why_ +
          " (make a new group)";
  }
  if (!why.empty()) throw CommError(why);
}

void CudaIpcAllReduce::barrier(cudaStream_t stream) {
  if (!opened_) throw CommError("pycomm: CUDA IPC barrier called before open()");
  throw_if_failed();
  if (capturing(stream))
    throw CommError(
        "pycomm: a CUDA IPC barrier cannot be captured in a CUDA graph: it carries a count the host keeps per "
        "call, which every replay would repeat");
  if (world_ == 1) return;
  SignalTable t{};
  for (int q = 0; q < world_; ++q) t.sig[q] = static_cast<IpcSignal*>(peer_signals_[q]);
  barrier_kernel<<<1, 32, 0, stream>>>(t, rank_, world_, ++barriers_, WaitCtx{status_dev_, timeout_ns_}, gave_up_);
  check(cudaGetLastError(), "barrier launch");
}

CudaIpcAllReduce::KernelView CudaIpcAllReduce::kernel_view() const {
  if (!opened_) throw CommError("pycomm: CUDA IPC group used before open()");
  KernelView v{};
  for (int q = 0; q < world_; ++q) {
    v.buf[q] = peer_buffers_[q];
    v.sig[q] = peer_signals_[q];
  }
  v.status = status_dev_;
  v.timeout_ns = timeout_ns_;
  v.rank = rank_;
  v.world = world_;
  v.blocks = blocks_;
  v.sms = sms_;
  v.ranks_per_gpu = ranks_per_gpu_;
  v.fused_blocks = fused_blocks_;
  v.double_buffer = double_buffer_;
  return v;
}

void CudaIpcAllReduce::settle(cudaStream_t stream) {
  if (!double_buffer_ || !(reads_pending_ || captured_)) return;
  barrier(stream);
  reads_pending_ = false;
}

void CudaIpcAllReduce::all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, IpcAlgo algo,
                                  cudaStream_t stream) {
  if (!opened_) throw CommError("pycomm: CUDA IPC all-reduce called before open()");
  throw_if_failed();
  if (op == RedOp::kAvg && !dtype_is_floating(dtype))
    throw CommError("pycomm: avg is only defined for floating-point dtypes");
  const bool schedule = algo == IpcAlgo::kRing || algo == IpcAlgo::kTree || algo == IpcAlgo::kDirect;
  if (schedule && capturing(stream))
    throw CommError(
        "pycomm: the ring, tree and direct schedules of the CUDA IPC all-reduce cannot be captured in a CUDA graph: "
        "their flags carry step counts the host keeps per call, which every replay would repeat; capture "
        "algorithm=\"auto\", \"one_shot\" or \"two_shot\", or run the schedule outside the captured region");
  if (count == 0) return;
  if (schedule) {
    settle(stream);
    run_schedule(in, out, count, dtype, op, static_cast<int>(algo), stream);
    return;
  }
  const size_t es = dtype_size(dtype);
  const size_t half_packs = buffer_bytes_ / 2 / 16;
  const size_t per_launch = (double_buffer_ ? half_packs * 16 : buffer_bytes_) / es;
  const KernelView view = kernel_view();
  IpcArgs a{};
  static_cast<ipc_detail::IpcPeers&>(a) = ipc_detail::peers_of(view);
  for (int q = 0; q < world_; ++q) a.buf[q] = view.buf[q];
  a.own = buffer_;
  a.half_packs = half_packs;
  a.avg = op == RedOp::kAvg;
  for (size_t off = 0; off < count; off += per_launch) {
    const size_t n = std::min(per_launch, count - off);
    // One kernel, which stages its input too; the grid depends only on what
    // every rank agrees on, so element i maps to the same thread index on
    // every rank.
    const IpcAlgo use = algo == IpcAlgo::kAuto ? choose(n * es, world_) : algo;
    a.two_shot = use == IpcAlgo::kTwoShot && world_ > 1;
    const size_t vec = 16 / es;
    const size_t work = a.two_shot ? ((n / vec + world_ - 1) / world_) : n / vec;
    const unsigned grid = static_cast<unsigned>(
        std::max<size_t>(1, std::min<size_t>(blocks_, (std::max<size_t>(work, 1) + kThreads - 1) / kThreads)));
    void* o = static_cast<char*>(out) + off * es;
    const void* i = static_cast<const char*>(in) + off * es;
    ipc_detail::with_ipc_dtype(dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      ipc_detail::with_ipc_op(op, [&](auto k) {
        if (double_buffer_)
          ipc_all_reduce_kernel<T, decltype(k)::value, true>
              <<<grid, kThreads, 0, stream>>>(a, static_cast<const T*>(i), static_cast<T*>(o), n);
        else
          ipc_all_reduce_kernel<T, decltype(k)::value, false>
              <<<grid, kThreads, 0, stream>>>(a, static_cast<const T*>(i), static_cast<T*>(o), n);
      });
    });
    check(cudaGetLastError(), "all-reduce launch");
  }
  if (double_buffer_) {
    reads_pending_ = true;
    if (capturing(stream)) captured_ = true;
  }
}

}  // namespace pycomm
