#include "common.h"

namespace pycomm {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}

const char* redop_name(RedOp op) {
  switch (op) {
    case RedOp::kSum: return "sum";
    case RedOp::kAvg: return "avg";
    case RedOp::kMax: return "max";
    case RedOp::kMin: return "min";
  }
  return "?";
}

}  // namespace pycomm
