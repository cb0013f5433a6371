// CUDA IPC all-reduce (cuda_ipc.h). NOT YET RUN ON A GPU: written and
// compiled without one.
//
// Memory ordering. A block publishes with __syncthreads() (its threads'
// writes are ordered before the barrier at block scope), then one thread per
// peer stores the flag with st.release.sys: release is cumulative, so the
// whole block's writes are visible to a peer that reads the flag with
// ld.acquire.sys and then passes its own __syncthreads(). This is vLLM's
// protocol; it needs sm_70 or newer.
//
// Flags never reset: launch e writes e (a host counter the same on every
// rank) and waiters wait until the slot reaches e, compared modulo 2^32.
// Each phase has its own row, so a fast peer already in the next launch's
// start barrier cannot disturb a slow one still waiting at this launch's end.
#include "cuda_ipc.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "../kernels/cuda/common.cuh"
#include "../kernels/reduce.h"

namespace pycomm {
namespace {

// 512 threads: 16 warps per block keep enough 16-byte loads in flight.
constexpr int kThreads = 512;
constexpr int kPhases = 3;  // start, middle (two-shot), end

struct IpcSignal {
  // flag[phase][block][src]: written by rank src into this rank's block.
  alignas(128) uint32_t flag[kPhases][kIpcMaxBlocks][kIpcMaxRanks];
};

struct IpcArgs {
  const void* buf[kIpcMaxRanks];  // every rank's staging buffer (ours at [rank])
  void* own;
  IpcSignal* sig[kIpcMaxRanks];
  int rank;
  int world;
  uint32_t epoch;
  bool two_shot;
  bool avg;
};

using kernels::cuda_detail::check;
using kernels::cuda_detail::Pack;
using kernels::cuda_detail::reduce_elem;
using kernels::cuda_detail::reduce_pack;

__device__ __forceinline__ void st_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(v), "l"(p) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block b of every rank meets block b of every other rank. Only the same
// block index ever exchanges data across ranks (the element-to-thread
// mapping is identical on every rank), so this is all the ordering needed.
__device__ void barrier(const IpcArgs& a, int phase) {
  __syncthreads();
  if (threadIdx.x < a.world) {
    const int q = threadIdx.x;
    st_release(&a.sig[q]->flag[phase][blockIdx.x][a.rank], a.epoch);
    const uint32_t* mine = &a.sig[a.rank]->flag[phase][blockIdx.x][q];
    // Ranks sharing a GPU time-slice: back off so a waiting kernel yields
    // issue slots (it cannot yield the GPU to the peer's context).
    while (static_cast<int32_t>(ld_acquire(mine) - a.epoch) < 0) __nanosleep(256);
  }
  __syncthreads();
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

// Pack i reduced over the ranks' buffers in rank order, finished.
template <typename T, RedOp kOp>
__device__ __forceinline__ Pack<T> reduce_ranks(const IpcArgs& a, size_t i) {
  typename kernels::Acc<T>::type acc[Pack<T>::kPer];
  reduce_pack<T, kOp>(a.buf, a.world, i, acc);
  Pack<T> v;
#pragma unroll
  for (int j = 0; j < Pack<T>::kPer; ++j) v.e[j] = finish<T>(acc[j], a.avg, a.world);
  return v;
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

template <typename T, RedOp kOp>
__global__ void __launch_bounds__(kThreads) ipc_all_reduce_kernel(IpcArgs a, T* out, size_t count) {
  using namespace kernels;
  constexpr int kPer = Pack<T>::kPer;
  const size_t nvec = count / kPer;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;

  // 1. Every rank's buffer holds its input.
  barrier(a, 0);
  if (!a.two_shot) {
    // 2. One-shot: reduce everything from every buffer.
    for (size_t i = tid; i < nvec; i += stride) store_pack(out, i, reduce_ranks<T, kOp>(a, i), aligned);
  } else {
    // 2. Two-shot, reduce-scatter: this rank reduces its part into its own
    //    buffer, in place (only this rank reads its part in this phase).
    const size_t part = (nvec + a.world - 1) / a.world;
    for (size_t j = tid; j < part; j += stride) {
      const size_t i = a.rank * part + j;
      if (i < nvec) static_cast<Pack<T>*>(a.own)[i] = reduce_ranks<T, kOp>(a, i);
    }
    // 3. Every part is reduced (by the same thread index that reads it next).
    barrier(a, 1);
    // 4. All-gather: part q from rank q's buffer.
    for (int q = 0; q < a.world; ++q)
      for (size_t j = tid; j < part; j += stride) {
        const size_t i = q * part + j;
        if (i < nvec) store_pack(out, i, static_cast<const Pack<T>*>(a.buf[q])[i], aligned);
      }
  }
  // 5. The tail after the last whole pack, element by element, from every
  //    buffer (reads only: safe in either algorithm).
  for (size_t i = nvec * kPer + tid; i < count; i += stride)
    out[i] = finish<T>(reduce_elem<T, kOp>(a.buf, a.world, i), a.avg, a.world);
  // 6. Nobody refills its buffer (the next launch's copy) before every rank
  //    has read it.
  barrier(a, 2);
}

template <typename T>
void launch_typed(const IpcArgs& a, RedOp op, void* out, size_t count, unsigned grid, cudaStream_t stream) {
  auto* o = static_cast<T*>(out);
  switch (op) {
    case RedOp::kSum:
    case RedOp::kAvg: ipc_all_reduce_kernel<T, RedOp::kSum><<<grid, kThreads, 0, stream>>>(a, o, count); break;
    case RedOp::kMax: ipc_all_reduce_kernel<T, RedOp::kMax><<<grid, kThreads, 0, stream>>>(a, o, count); break;
    case RedOp::kMin: ipc_all_reduce_kernel<T, RedOp::kMin><<<grid, kThreads, 0, stream>>>(a, o, count); break;
    default: throw CommError(std::string("pycomm: CUDA IPC all-reduce takes op sum, avg, max or min, got ") + redop_name(op));
  }
}

}  // namespace

IpcAlgo CudaIpcAllReduce::choose(size_t bytes, int world) {
  // A starting point to tune on the GPU (vLLM's crossovers are of this
  // order): one-shot reads world x the bytes but has one barrier instead of
  // three; two ranks read only twice the bytes, so they keep it longer.
  const size_t one_shot_max = world <= 2 ? (1u << 20) : (256u << 10);
  return bytes <= one_shot_max ? IpcAlgo::kOneShot : IpcAlgo::kTwoShot;
}

CudaIpcAllReduce::CudaIpcAllReduce(int rank, int world, size_t buffer_bytes)
    : rank_(rank), world_(world), buffer_bytes_(buffer_bytes / 16 * 16) {
  if (world < 1 || world > kIpcMaxRanks || rank < 0 || rank >= world)
    throw CommError("pycomm: a CUDA IPC group holds 1.." + std::to_string(kIpcMaxRanks) + " ranks; got rank " +
                    std::to_string(rank) + " of " + std::to_string(world));
  if (buffer_bytes_ < 4096) throw CommError("pycomm: the CUDA IPC staging buffer must be at least 4 KiB");
  check(cudaGetDevice(&device_), "current device");
  check(cudaMalloc(&buffer_, buffer_bytes_), "staging buffer");
  check(cudaMalloc(&signal_, sizeof(IpcSignal)), "signal block");
  check(cudaMemset(signal_, 0, sizeof(IpcSignal)), "signal block");
  check(cudaDeviceSynchronize(), "signal block");
  peer_buffers_.assign(world_, nullptr);
  peer_signals_.assign(world_, nullptr);
  peer_buffers_[rank_] = buffer_;
  peer_signals_[rank_] = signal_;
}

CudaIpcAllReduce::~CudaIpcAllReduce() {
  // Errors are ignored here: a destructor cannot report them, and the
  // process may be tearing down its context already.
  for (int q = 0; q < world_; ++q) {
    if (q == rank_) continue;
    if (peer_buffers_[q]) cudaIpcCloseMemHandle(peer_buffers_[q]);
    if (peer_signals_[q]) cudaIpcCloseMemHandle(peer_signals_[q]);
  }
  if (buffer_) cudaFree(buffer_);
  if (signal_) cudaFree(signal_);
}

std::string CudaIpcAllReduce::handles() const {
  cudaIpcMemHandle_t h[2];
  check(cudaIpcGetMemHandle(&h[0], buffer_), "handle of the staging buffer");
  check(cudaIpcGetMemHandle(&h[1], signal_), "handle of the signal block");
  return std::string(reinterpret_cast<const char*>(h), sizeof h);
}

void CudaIpcAllReduce::open(const std::vector<std::string>& all) {
  if (opened_) throw CommError("pycomm: CUDA IPC group opened twice");
  if (static_cast<int>(all.size()) != world_)
    throw CommError("pycomm: CUDA IPC open() needs " + std::to_string(world_) + " ranks' handles, got " +
                    std::to_string(all.size()));
  for (int q = 0; q < world_; ++q) {
    if (all[q].size() != 2 * sizeof(cudaIpcMemHandle_t))
      throw CommError("pycomm: rank " + std::to_string(q) + "'s CUDA IPC handles are malformed");
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
  opened_ = true;
}

void CudaIpcAllReduce::all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, IpcAlgo algo,
                                  cudaStream_t stream) {
  if (!opened_) throw CommError("pycomm: CUDA IPC all-reduce called before open()");
  if (op == RedOp::kAvg && !dtype_is_floating(dtype))
    throw CommError("pycomm: avg is only defined for floating-point dtypes");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capture), "capture status");
  if (capture != cudaStreamCaptureStatusNone)
    throw CommError(
        "pycomm: a CUDA IPC all-reduce cannot be captured in a CUDA graph yet: each launch carries its barrier "
        "epoch as an argument, which every replay would repeat; run the all-reduce outside the captured region");
  if (count == 0) return;
  const size_t es = dtype_size(dtype);
  const size_t per_launch = buffer_bytes_ / es;
  IpcArgs a{};
  for (int q = 0; q < world_; ++q) {
    a.buf[q] = peer_buffers_[q];
    a.sig[q] = static_cast<IpcSignal*>(peer_signals_[q]);
  }
  a.own = buffer_;
  a.rank = rank_;
  a.world = world_;
  a.avg = op == RedOp::kAvg;
  for (size_t off = 0; off < count; off += per_launch) {
    const size_t n = std::min(per_launch, count - off);
    // 1. Stage this rank's input; stream order keeps it after the previous
    //    launch, whose last barrier every peer passed after reading.
    check(cudaMemcpyAsync(buffer_, static_cast<const char*>(in) + off * es, n * es, cudaMemcpyDeviceToDevice,
                          stream),
          "staging copy");
    // 2. One kernel; the grid depends only on what every rank agrees on, so
    //    element i maps to the same thread index on every rank.
    const IpcAlgo use = algo == IpcAlgo::kAuto ? choose(n * es, world_) : algo;
    a.two_shot = use == IpcAlgo::kTwoShot && world_ > 1;
    a.epoch = ++epoch_;
    const size_t vec = 16 / es;
    const size_t work = a.two_shot ? ((n / vec + world_ - 1) / world_) : n / vec;
    const unsigned grid = static_cast<unsigned>(
        std::max<size_t>(1, std::min<size_t>(kIpcMaxBlocks, (std::max<size_t>(work, 1) + kThreads - 1) / kThreads)));
    void* o = static_cast<char*>(out) + off * es;
    switch (dtype) {
      case DType::kFloat32: launch_typed<float>(a, op, o, n, grid, stream); break;
      case DType::kFloat64: launch_typed<double>(a, op, o, n, grid, stream); break;
      case DType::kFloat16: launch_typed<kernels::Half>(a, op, o, n, grid, stream); break;
      case DType::kBFloat16: launch_typed<kernels::BFloat16>(a, op, o, n, grid, stream); break;
      case DType::kInt32: launch_typed<int32_t>(a, op, o, n, grid, stream); break;
      case DType::kInt64: launch_typed<int64_t>(a, op, o, n, grid, stream); break;
      case DType::kUInt8: launch_typed<uint8_t>(a, op, o, n, grid, stream); break;
      default:
        throw CommError(std::string("pycomm: CUDA IPC all-reduce takes float32, float64, float16, bfloat16, int32, "
                                    "int64 and uint8 tensors, got ") + dtype_name(dtype));
    }
    check(cudaGetLastError(), "all-reduce launch");
  }
}

}  // namespace pycomm
