// Helpers shared by the CUDA kernel files (not part of the kernel API).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../../common.h"
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

}  // namespace cuda_detail
}  // namespace kernels
}  // namespace pycomm
