// Codecs of the compressed collectives as a call names them: the kind, its
// parameters and their defaults (Python reads these), the check of a user's
// parameters, and the header tag that makes ranks which disagree on any of
// them fail like any other mismatch.
#pragma once

#include <cstdint>
#include <string>

namespace pycomm {

enum class CodecKind : uint8_t { kNone = 0, kInt8 = 1, kInt4 = 2, kTopK = 3 };
constexpr int kLastCodecKind = static_cast<int>(CodecKind::kTopK);

// "int8", "int4", "topk" ("none" for kNone).
const char* codec_kind_name(CodecKind kind);

struct Codec {
  CodecKind kind = CodecKind::kNone;
  // Int8 / Int4: one float32 scale per `block` elements. 256 keeps the
  // scales at 1/64 of an int8 payload while a block's absmax still tracks
  // the local magnitude of a gradient.
  int block = 256;
  bool stochastic = false;
  uint64_t seed = 0;
  // TopK
  double ratio = 0.01;
  bool exact = false;
  double tolerance = 0.1;
  double sample_fraction = 0.01;

  int bits() const { return kind == CodecKind::kInt4 ? 4 : 8; }
  bool quantized() const { return kind == CodecKind::kInt8 || kind == CodecKind::kInt4; }
  // "" when the parameters are usable, else why not.
  std::string check() const;
  // "Int8(block=256, stochastic)", "TopK(ratio=0.01, exact)".
  std::string name() const;
};

// The sub-steps of a composite operation, as they appear in header tags.
enum class CodecStep : uint8_t { kScatter = 1, kGather = 2 };

// Tag of one transport run of a compressed collective: codec, step and the
// parameters that change the payload layout without changing its size.
uint32_t codec_tag(const Codec& codec, CodecStep step);

// "compression=Int8(block=256) step=scatter" for a non-zero tag (error
// messages); "" for 0.
std::string describe_tag(uint32_t tag);

}  // namespace pycomm
