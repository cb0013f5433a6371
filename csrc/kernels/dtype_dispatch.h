// Host-side dispatch from a floating wire dtype to its storage type, shared
// by the CPU and CUDA kernel entry points (host code only).
#pragma once

#include <string>

#include "../core/common.h"
#include "reduce.h"

namespace pycomm {
namespace kernels {

// Calls f(static_cast<T*>(nullptr)) with the storage type of a floating dtype
// the compression kernels take; CommError naming `what` for any other dtype.
template <typename F>
void with_float_type(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(static_cast<float*>(nullptr)); return;
    case DType::kFloat16: f(static_cast<Half*>(nullptr)); return;
    case DType::kBFloat16: f(static_cast<BFloat16*>(nullptr)); return;
    default:
      throw CommError(std::string("pycomm: ") + what + " takes float32, float16 or bfloat16 tensors, got " +
                      dtype_name(dtype));
  }
}

}  // namespace kernels
}  // namespace pycomm
