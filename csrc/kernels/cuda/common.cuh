// Helpers shared by the CUDA kernel files (not part of the kernel API).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "../../core/common.h"
#include "../dtype_dispatch.h"
#include "../reduce.h"

namespace pycomm {
namespace kernels {
namespace cuda_detail {

constexpr int kThreads = 256;

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CommError(std::string("pycomm: CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Grid for a grid-stride loop over `items`: enough blocks to fill the GPU,
// capped so huge tensors loop instead of launching millions of blocks.
inline unsigned grid_for(size_t items) {
  const size_t g = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 16 ? 65535 * 16 : g));
}

// The grid of `kernel` (blocks of kThreads) that fills the current device
// once, every SM holding as many blocks as fit: for a grid-stride kernel whose
// blocks end with work of their own, such as a shared-memory histogram merged
// into global memory with atomics. One block per 256 items would repeat that
// ending for every 256 items, and the atomics of a skewed histogram all hit
// the same few words. Cached per device: the occupancy query is not free.
template <typename K>
unsigned resident_grid(K kernel, size_t items) {
  constexpr int kMaxDevices = 64;
  static std::atomic<unsigned> cached[kMaxDevices];
  int dev = 0;
  check(cudaGetDevice(&dev), "get device");
  unsigned full = dev < kMaxDevices ? cached[dev].load(std::memory_order_relaxed) : 0u;
  if (full == 0) {
    int sms = 0, per_sm = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0), "occupancy");
    full = static_cast<unsigned>(std::max(1, sms) * std::max(1, per_sm));
    if (dev < kMaxDevices) cached[dev].store(full, std::memory_order_relaxed);
  }
  return std::min(full, grid_for(items));
}

// 16 bytes of T: the unit the memory-bound kernels load and store, so that
// every access is one 128-bit transaction. Callers check 16-byte alignment.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kPer = 16 / sizeof(T);
  T e[kPer];
};

// Element i of srcs[0 .. n) combined in source order, in the accumulator
// type (the CPU kernels' order, hence their bits once stored).
template <typename T, RedOp kOp>
__device__ __forceinline__ typename Acc<T>::type reduce_elem(const void* const* srcs, int n, size_t i) {
  auto acc = load_acc(static_cast<const T*>(srcs[0])[i]);
  for (int k = 1; k < n; ++k) acc = combine<kOp>(acc, load_acc(static_cast<const T*>(srcs[k])[i]));
  return acc;
}

// The same for pack i, into acc[0 .. kPer).
template <typename T, RedOp kOp>
__device__ __forceinline__ void reduce_pack(const void* const* srcs, int n, size_t i,
                                            typename Acc<T>::type (&acc)[Pack<T>::kPer]) {
  Pack<T> v = static_cast<const Pack<T>*>(srcs[0])[i];
#pragma unroll
  for (int j = 0; j < Pack<T>::kPer; ++j) acc[j] = load_acc(v.e[j]);
  for (int k = 1; k < n; ++k) {
    v = static_cast<const Pack<T>*>(srcs[k])[i];
#pragma unroll
    for (int j = 0; j < Pack<T>::kPer; ++j) acc[j] = combine<kOp>(acc[j], load_acc(v.e[j]));
  }
}

}  // namespace cuda_detail
}  // namespace kernels
}  // namespace pycomm
