// The torch dtypes pycomm's kernels and transports take (torch glue only).
#pragma once

#include <c10/core/ScalarType.h>

#include "../core/common.h"

namespace pycomm {

// False for a dtype pycomm cannot move (the sub-byte shell dtypes, the
// quantized ones). Every other dtype moves as bytes; which of them reduce is
// the core's table (dtype_kind, check_reducible).
inline bool to_dtype(at::ScalarType t, DType* out) {
  switch (t) {
    case at::kFloat: *out = DType::kFloat32; return true;
    case at::kDouble: *out = DType::kFloat64; return true;
    case at::kHalf: *out = DType::kFloat16; return true;
    case at::kBFloat16: *out = DType::kBFloat16; return true;
    case at::kInt: *out = DType::kInt32; return true;
    case at::kLong: *out = DType::kInt64; return true;
    case at::kByte: *out = DType::kUInt8; return true;
    case at::kChar: *out = DType::kInt8; return true;
    case at::kBool: *out = DType::kBool; return true;
    case at::kShort: *out = DType::kInt16; return true;
    case at::kUInt16: *out = DType::kUInt16; return true;
    case at::kUInt32: *out = DType::kUInt32; return true;
    case at::kUInt64: *out = DType::kUInt64; return true;
    case at::kComplexHalf: *out = DType::kComplex32; return true;
    case at::kComplexFloat: *out = DType::kComplex64; return true;
    case at::kComplexDouble: *out = DType::kComplex128; return true;
    case at::kFloat8_e5m2: *out = DType::kFloat8E5M2; return true;
    case at::kFloat8_e4m3fn: *out = DType::kFloat8E4M3FN; return true;
    case at::kFloat8_e5m2fnuz: *out = DType::kFloat8E5M2FNUZ; return true;
    case at::kFloat8_e4m3fnuz: *out = DType::kFloat8E4M3FNUZ; return true;
    case at::kFloat8_e8m0fnu: *out = DType::kFloat8E8M0FNU; return true;
    case at::kFloat4_e2m1fn_x2: *out = DType::kFloat4E2M1FNx2; return true;
    case at::kBits8: *out = DType::kBits8; return true;
    case at::kBits16: *out = DType::kBits16; return true;
    case at::kBits1x8: *out = DType::kBits1x8; return true;
    case at::kBits2x4: *out = DType::kBits2x4; return true;
    case at::kBits4x2: *out = DType::kBits4x2; return true;
    default: return false;
  }
}

}  // namespace pycomm
