// The torch dtypes pycomm's kernels and transports take (torch glue only).
#pragma once

#include <c10/core/ScalarType.h>

#include "../core/common.h"

namespace pycomm {

// False for a dtype pycomm cannot move or reduce.
inline bool to_dtype(at::ScalarType t, DType* out) {
  switch (t) {
    case at::kFloat: *out = DType::kFloat32; return true;
    case at::kDouble: *out = DType::kFloat64; return true;
    case at::kHalf: *out = DType::kFloat16; return true;
    case at::kBFloat16: *out = DType::kBFloat16; return true;
    case at::kInt: *out = DType::kInt32; return true;
    case at::kLong: *out = DType::kInt64; return true;
    case at::kByte: *out = DType::kUInt8; return true;
    default: return false;
  }
}

}  // namespace pycomm
