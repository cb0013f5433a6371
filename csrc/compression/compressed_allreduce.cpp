#include "compressed_allreduce.h"

#include <algorithm>
#include <cstdlib>

#include "../kernels/quant.h"

namespace pycomm {

CollectiveDesc payload_step(Collective coll, const Codec& codec, CodecStep step, RedOp op, size_t bytes,
                            const void* input, void* output) {
  CollectiveDesc d;
  d.coll = coll;
  d.algo = Algorithm::kTwoShot;
  d.dtype = DType::kUInt8;
  d.op = op;  // so ranks that disagree on sum vs avg fail like any mismatch
  d.count = bytes;
  d.tag = codec_tag(codec, step);
  d.input = input;
  d.output = output;
  return d;
}

uint8_t* Workspace::get(size_t bytes) {
  if (bytes > size_ || !data_) {
    const size_t size = std::max<size_t>(Carver::align(bytes), 64);
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, size)));
    if (!data_) throw CommError("pycomm: out of memory for " + std::to_string(size) + " bytes of workspace");
    size_ = size;
  }
  return data_.get();
}

uint64_t rounding_seed(uint64_t user_seed, uint64_t seq, int rank, int which) {
  using kernels::mix64;
  return mix64(mix64(user_seed ^ mix64(seq)) ^ (static_cast<uint64_t>(rank) << 2 | static_cast<uint64_t>(which)));
}

void Workspace::Free::operator()(uint8_t* p) const { std::free(p); }

}  // namespace pycomm
