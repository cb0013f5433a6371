// Helpers shared by the CPU kernel files (not part of the kernel API).
#pragma once

#include <string>

#include "../../common.h"
#include "../reduce.h"

// Clone hot loops for AVX2+F16C machines: float16 conversions become single
// instructions and float math runs 8 wide. The default clone keeps the
// extension loadable on any x86-64 (and the attribute is skipped elsewhere).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYCOMM_MULTIVERSION __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define PYCOMM_MULTIVERSION
#endif

namespace pycomm {
namespace kernels {

// Calls f(static_cast<T*>(nullptr)) with the storage type of a floating dtype
// the compression kernels take; CommError for any other dtype.
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
