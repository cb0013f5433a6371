// Host-callable kernel entry points. Kernels know nothing about
// communication: they take raw pointers, a dtype and a count.
#pragma once

#include <cstddef>

#include "../common.h"

namespace pycomm {
namespace kernels {

// out0[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], combined in
// exactly that order (so every rank that reduces the same sources in the same
// order gets the same bits). out1, when non-null, receives the same values in
// the same pass. Destinations may alias a source element for element.
void reduce_cpu(DType dtype, RedOp op, void* out0, void* out1, const void* const* srcs, int nsrc,
                size_t count);

// out0 (and out1 when non-null) = src. Destinations may not overlap src
// partially; out0 == src is a no-op.
void copy_cpu(void* out0, void* out1, const void* src, size_t bytes);

// data[i] /= divisor, computed in float32 for 16-bit types (floating dtypes only).
void divide_cpu(DType dtype, void* data, size_t count, double divisor);

}  // namespace kernels
}  // namespace pycomm
