#include "codec.h"

#include <sstream>

namespace pycomm {

const char* codec_kind_name(CodecKind kind) {
  switch (kind) {
    case CodecKind::kNone: return "none";
    case CodecKind::kInt8: return "int8";
    case CodecKind::kInt4: return "int4";
    case CodecKind::kTopK: return "topk";
  }
  return "?";
}

std::string Codec::check() const {
  std::ostringstream os;
  switch (kind) {
    case CodecKind::kInt8:
    case CodecKind::kInt4:
      if (block < 8 || block % 8 != 0 || block > (1 << 20))
        os << name() << ": block must be a multiple of 8 between 8 and 1048576, got " << block;
      break;
    case CodecKind::kTopK:
      if (!(ratio > 0 && ratio <= 1)) os << "TopK: ratio must be in (0, 1], got " << ratio;
      else if (!(tolerance >= 0 && tolerance < 1)) os << "TopK: tolerance must be in [0, 1), got " << tolerance;
      else if (!(sample_fraction > 0 && sample_fraction <= 1))
        os << "TopK: sample_fraction must be in (0, 1], got " << sample_fraction;
      break;
    case CodecKind::kNone: os << "no codec given"; break;
  }
  return os.str();
}

std::string Codec::name() const {
  std::ostringstream os;
  switch (kind) {
    case CodecKind::kInt8:
    case CodecKind::kInt4:
      os << (kind == CodecKind::kInt8 ? "Int8" : "Int4") << "(block=" << block
         << (stochastic ? ", stochastic" : "") << ")";
      break;
    case CodecKind::kTopK: os << "TopK(ratio=" << ratio << (exact ? ", exact" : "") << ")"; break;
    case CodecKind::kNone: os << "none"; break;
  }
  return os.str();
}

// Layout: bit 31 marks a composite step, bits 27-30 the codec kind, 24-26
// the step, 23 stochastic (quantizers) or exact (top-k), 0-22 block / 8.
uint32_t codec_tag(const Codec& c, CodecStep step) {
  const bool flag = c.quantized() ? c.stochastic : c.exact;
  const uint32_t block = c.quantized() ? static_cast<uint32_t>(c.block / 8) : 0u;
  return (1u << 31) | (static_cast<uint32_t>(c.kind) << 27) | (static_cast<uint32_t>(step) << 24) |
         (static_cast<uint32_t>(flag) << 23) | (block & 0x7fffffu);
}

std::string describe_tag(uint32_t tag) {
  if (!(tag >> 31)) return "";
  Codec c;
  c.kind = static_cast<CodecKind>((tag >> 27) & 0xf);
  const bool flag = (tag >> 23) & 1;
  if (c.quantized()) {
    c.block = static_cast<int>((tag & 0x7fffffu) * 8);
    c.stochastic = flag;
  } else {
    c.exact = flag;
  }
  const auto step = static_cast<CodecStep>((tag >> 24) & 0x7);
  std::ostringstream os;
  // The tag does not carry TopK's ratio (it changes the payload's size,
  // which the header's count already compares).
  os << "compression=" << (c.kind == CodecKind::kTopK ? (flag ? "TopK(exact)" : "TopK") : c.name())
     << " step=" << (step == CodecStep::kScatter ? "scatter" : "gather");
  return os.str();
}

}  // namespace pycomm
