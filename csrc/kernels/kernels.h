// Host-callable kernel entry points. Kernels know nothing about
// communication: they take raw pointers, a dtype and a count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/common.h"

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

// dst = src with non-temporal (streaming) stores on x86-64: the written lines
// go to memory instead of staying dirty in this core's cache, so that another
// core reading them soon after fetches them from memory rather than from this
// core's cache. Ends with a store fence: a flag stored after it is seen only
// after the data. Elsewhere a plain copy.
void copy_cpu_streaming(void* dst, const void* src, size_t bytes);

// reduce_cpu whose results go to `stream_out` with streaming stores (see
// copy_cpu_streaming), and to `out0` as well when it is non-null (cached).
// Computed block by block, each block written once to out0 (or a scratch
// block in L1) and streamed from there: the same bits as reduce_cpu.
void reduce_cpu_streaming(DType dtype, RedOp op, void* out0, void* stream_out, const void* const* srcs, int nsrc,
                          size_t count);

// data[i] /= divisor, computed in float32 for 16-bit types (floating dtypes only).
void divide_cpu(DType dtype, void* data, size_t count, double divisor);

// dst = src converted between floating dtypes (float32, float16, bfloat16),
// rounding to nearest even.
void convert_cpu(DType from, const void* src, DType to, void* dst, size_t n);

// ------------------------------------------------------------- compression
// Payload layouts and the per-element rules are in quant.h.

struct QuantSpec {
  int bits = 8;                     // 8 or 4
  int block = 256;                  // elements per absmax scale; a multiple of 8
  bool stochastic = false;          // floor(v + u), u uniform: unbiased
  uint64_t seed = 0;                // stochastic rounding stream
};

// payload = Q(x + residual), and with `residual` (float32, n elements,
// may be null) the error feedback in the same pass:
//     residual = x + residual - D(payload).
// `index_base` is x[0]'s position in the whole tensor: stochastic rounding
// draws by global position, so sharding the call changes no bits.
void quantize_cpu(const QuantSpec& spec, DType dtype, const void* x, float* residual, size_t n, uint8_t* payload,
                  uint64_t index_base);

// out = D(payload), or out += D(payload) with `accumulate` (computed in
// float32, rounded once into dtype).
void dequantize_cpu(int bits, int block, const uint8_t* payload, size_t n, DType dtype, void* out, bool accumulate);

// One fused pass over quantized sources, block by block, never holding more
// than one block in full precision:
//     sum = dense + D(srcs[0]) + ... + D(srcs[nsrc-1])    (in this order)
//     sum *= post_scale
//     out_payload = Q(sum + residual); residual = sum + residual - D(out_payload)
// With one source and a dense addend this is one hop of a compressed ring
// reduce-scatter (dequantize-accumulate-requantize); with world-1 sources it
// is the reduction of a direct (gather-then-reduce) one.
struct DequantReduce {
  int bits = 8;
  int block = 256;
  const uint8_t* const* srcs = nullptr;
  int nsrc = 0;
  const void* dense = nullptr;
  DType dense_dtype = DType::kFloat32;
  size_t n = 0;
  float post_scale = 1.f;
  uint8_t* out_payload = nullptr;
  QuantSpec requant;  // bits/block of out_payload; must equal the sources' for now
  float* residual = nullptr;
  uint64_t index_base = 0;
  // CUDA only (optional): a word in device memory; non-zero when the kernels
  // start, they do nothing, since the sources may be a dead peer's memory
  // (the quantized IPC all-reduce passes its group's failure word).
  const uint32_t* cancel = nullptr;
};
void dequant_reduce_cpu(const DequantReduce& args);

// Top-k by magnitude of x + residual (residual float32, optional). Writes
// the kept values (in dtype) and their int32 indices, ascending, and returns
// how many it kept (<= cap). With `residual`, the error feedback happens in
// the same passes: residual = x + residual - transmitted.
//   exact:  exactly min(k, n) entries, ties broken by lower index.
//   approx: samples `sample_fraction` of the elements for a threshold, then
//           refines it until the kept count is within [k, k * (1 + tolerance)]
//           (all keys at or above a threshold: a superset of the exact
//           top-k); cap must be >= k * (1 + tolerance).
struct TopK {
  size_t k = 0;
  bool exact = false;
  double tolerance = 0.1;
  double sample_fraction = 0.01;
  uint64_t seed = 0;
};
size_t topk_cpu(const TopK& spec, DType dtype, const void* x, float* residual, size_t n, size_t cap, void* values,
                int32_t* indices);

// dense[indices[j]] += values[j] for j < count (values in val_dtype, dense in
// dense_dtype, both floating). Throws CommError on an index outside [0, n).
void scatter_add_cpu(DType val_dtype, const void* values, const int32_t* indices, size_t count, DType dense_dtype,
                     void* dense, size_t n);

// ---------------------------------------------------------------- PowerSGD

// The columns of each of `batch` row-major rows x cols matrices (float32 or
// float64, contiguous) made orthonormal in place by modified Gram-Schmidt:
// column i /= (|column i| + epsilon), then removed from every later column.
// A zero column stays zero. cols <= rows.
void orthogonalize_cpu(DType dtype, void* data, size_t batch, size_t rows, size_t cols, double epsilon);

}  // namespace kernels
}  // namespace pycomm
