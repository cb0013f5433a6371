// The words every layer of pycomm speaks: wire dtypes, reduce ops and the
// error type. Torch-free and CUDA-free: kernels, schedules and transports
// include this and compile in seconds.
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

// Why a rank failed, as far as it can tell, in a form other ranks act on
// without reading English: the blame chain between hosts (transport/blame.h)
// follows `rank` from one failure report to the next until it reaches a
// death. The message stays free to change wording.
enum class FailureKind : uint8_t {
  kNone = 0,      // nobody to blame (bad input, an internal error, a user abort)
  kDied = 1,      // `rank` died: the root cause
  kShutDown = 2,  // `rank` closed its communicator while we needed it
  kWaiting = 3,   // we timed out or lost the connection waiting for `rank`
  kRejected = 4,  // `rank` rejected its own call (bad input on that rank)
  kSilent = 5,    // `rank` stopped without reporting why: died, killed or hung
};
const char* failure_kind_name(FailureKind kind);

struct Blame {
  FailureKind kind = FailureKind::kNone;
  int rank = -1;  // the communicator's rank; -1 with kNone
};

// Raised for every communication failure a user can act on: bad input,
// ranks that disagree, a dead peer, a timeout. Surfaces as pycomm.CommError.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what, Blame blame = {}) : std::runtime_error(what), blame_(blame) {}
  const Blame& blame() const { return blame_; }

 private:
  Blame blame_;
};

}  // namespace pycomm
