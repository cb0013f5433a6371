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
// reorder them. Copies (broadcast, gathers, scatter, all-to-all) move any of
// them as bytes; reductions take the kinds of dtype_kind() that have
// arithmetic (Gloo's set: floating, int8/uint8/int32/int64 and bool).
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  // Raw bytes: compressed payloads travel as uint8; sums wrap like torch's.
  kUInt8 = 6,
  kInt8 = 7,
  // One byte, 0 or 1: reductions are logical (see RedOp) so results stay 0/1.
  kBool = 8,
  // Copy-only from here on: no reduction kernel takes them.
  kInt16 = 9,
  kUInt16 = 10,
  kUInt32 = 11,
  kUInt64 = 12,
  kComplex32 = 13,
  kComplex64 = 14,
  kComplex128 = 15,
  kFloat8E5M2 = 16,
  kFloat8E4M3FN = 17,
  kFloat8E5M2FNUZ = 18,
  kFloat8E4M3FNUZ = 19,
  kFloat8E8M0FNU = 20,
  kFloat4E2M1FNx2 = 21,
  kBits8 = 22,
  kBits16 = 23,
  kBits1x8 = 24,
  kBits2x4 = 25,
  kBits4x2 = 26,
};
constexpr int kLastDType = static_cast<int>(DType::kBits4x2);

// What a reduction may do with a dtype.
enum class DTypeKind : uint8_t {
  kFloating = 0,  // every op but the bitwise ones
  kIntegral = 1,  // every op; avg refused (integer division would truncate)
  kBool = 2,      // every op but avg, logically
  kCopyOnly = 3,  // no reduction
};

struct DTypeInfo {
  const char* name;  // torch's name without "torch."
  uint8_t size;      // bytes per element
  DTypeKind kind;
};

// Indexed by DType: the one table of names, sizes and kinds.
constexpr DTypeInfo kDTypes[] = {
    {"float32", 4, DTypeKind::kFloating},       {"float64", 8, DTypeKind::kFloating},
    {"float16", 2, DTypeKind::kFloating},       {"bfloat16", 2, DTypeKind::kFloating},
    {"int32", 4, DTypeKind::kIntegral},         {"int64", 8, DTypeKind::kIntegral},
    {"uint8", 1, DTypeKind::kIntegral},         {"int8", 1, DTypeKind::kIntegral},
    {"bool", 1, DTypeKind::kBool},              {"int16", 2, DTypeKind::kCopyOnly},
    {"uint16", 2, DTypeKind::kCopyOnly},        {"uint32", 4, DTypeKind::kCopyOnly},
    {"uint64", 8, DTypeKind::kCopyOnly},        {"complex32", 4, DTypeKind::kCopyOnly},
    {"complex64", 8, DTypeKind::kCopyOnly},     {"complex128", 16, DTypeKind::kCopyOnly},
    {"float8_e5m2", 1, DTypeKind::kCopyOnly},   {"float8_e4m3fn", 1, DTypeKind::kCopyOnly},
    {"float8_e5m2fnuz", 1, DTypeKind::kCopyOnly}, {"float8_e4m3fnuz", 1, DTypeKind::kCopyOnly},
    {"float8_e8m0fnu", 1, DTypeKind::kCopyOnly}, {"float4_e2m1fn_x2", 1, DTypeKind::kCopyOnly},
    {"bits8", 1, DTypeKind::kCopyOnly},         {"bits16", 2, DTypeKind::kCopyOnly},
    {"bits1x8", 1, DTypeKind::kCopyOnly},       {"bits2x4", 1, DTypeKind::kCopyOnly},
    {"bits4x2", 1, DTypeKind::kCopyOnly},
};
static_assert(sizeof(kDTypes) / sizeof(kDTypes[0]) == kLastDType + 1, "one row per DType");

inline bool dtype_valid(DType t) { return static_cast<int>(t) <= kLastDType; }
inline size_t dtype_size(DType t) { return dtype_valid(t) ? kDTypes[static_cast<int>(t)].size : 0; }
inline DTypeKind dtype_kind(DType t) {
  return dtype_valid(t) ? kDTypes[static_cast<int>(t)].kind : DTypeKind::kCopyOnly;
}
inline bool dtype_is_floating(DType t) { return dtype_kind(t) == DTypeKind::kFloating; }

// Numeric values travel in collective headers: append only. PRODUCT and the
// bitwise ops follow Gloo; bitwise ops take integral and bool dtypes only.
// On bool, sum and max are OR, product and min are AND.
enum class RedOp : uint8_t { kSum = 0, kAvg = 1, kMax = 2, kMin = 3, kProduct = 4, kBand = 5, kBor = 6, kBxor = 7 };
constexpr int kLastRedOp = static_cast<int>(RedOp::kBxor);

// Empty when `op` can reduce `t`, else why not ("op=band needs an integral
// or bool dtype, got float32").
std::string check_reducible(DType t, RedOp op);

const char* dtype_name(DType t);

// "Timed out waiting 1500ms": the words Gloo and torch.distributed use for
// an expired wait, which users' error handling and torch's own tests match
// on. Every pycomm timeout message contains them.
std::string timed_out_waiting(double seconds);
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
  // The blamed rank will never post again: its process died, or it stopped
  // beating (frozen). Other kinds name a rank that may still be alive.
  bool gone() const { return kind == FailureKind::kDied || kind == FailureKind::kSilent; }
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
