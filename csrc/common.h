// Types shared by every layer of pycomm. No torch headers here: kernels,
// schedules and transports include this and compile in seconds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define PYCOMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PYCOMM_HOST_DEVICE inline __attribute__((always_inline))
#endif

namespace pycomm {

// Wire dtypes. The numeric values travel in collective headers, so never
// reorder them.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  // Raw bytes: compressed payloads travel as uint8; sums wrap like torch's.
  kUInt8 = 6,
};
constexpr int kNumDTypes = 7;

enum class RedOp : uint8_t { kSum = 0, kAvg = 1, kMax = 2, kMin = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

inline bool dtype_is_floating(DType t) {
  return t != DType::kInt32 && t != DType::kInt64 && t != DType::kUInt8;
}

const char* dtype_name(DType t);
const char* redop_name(RedOp op);

// Raised for every communication failure a user can act on: bad input,
// ranks that disagree, a dead peer, a timeout. Surfaces as pycomm.CommError.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace pycomm
