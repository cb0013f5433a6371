// Helpers shared by the CUDA kernel files (not part of the kernel API).
#pragma once

#include <cuda_runtime.h>

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
