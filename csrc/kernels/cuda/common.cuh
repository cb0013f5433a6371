// Helpers shared by the CUDA kernel files (not part of the kernel API).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../../common.h"
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

// Calls f(static_cast<T*>(nullptr)) with the storage type of a floating dtype.
template <typename F>
void with_float_type(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(static_cast<float*>(nullptr)); return;
    case DType::kFloat16: f(static_cast<Half*>(nullptr)); return;
    case DType::kBFloat16: f(static_cast<BFloat16*>(nullptr)); return;
    default:
      throw CommError(std::string("pycomm: CUDA ") + what + " takes float32, float16 or bfloat16, got " +
                      dtype_name(dtype));
  }
}

}  // namespace cuda_detail
}  // namespace kernels
}  // namespace pycomm
