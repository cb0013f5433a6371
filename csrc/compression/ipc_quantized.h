// The quantized all-reduce over a CUDA IPC group (CUDA builds only): the
// communicator's QuantizedAllReduce (quantized_allreduce.h) with its codes,
// scales, shards, rounding keys and error-feedback contract (a worker
// residual over the whole tensor, a server residual over this rank's
// shard), its exchanges done through the group's staging buffers instead of
// a transport:
//   quantize every shard into this rank's buffer -> barrier -> each rank
//   dequantizes, reduces and requantizes its shard from every rank's buffer
//   -> barrier -> every rank dequantizes every reduced shard -> barrier,
// as one kernel (the usual blocks) or a kernel per step.
// The same CUDA kernels as the group path, which decode bit for bit like the
// CPU ones: equal, on the same inputs and sequence numbers, to the CPU
// communicator's compressed all-reduce. For GPU boxes without NVLink: each
// byte over PCIe is a quarter (int8) or an eighth (int4) of float32's.
// Torch-free: device pointers, an explicit stream. Both forms ran on an
// H200, bit for bit the CPU communicator's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../transport/cuda_ipc.h"

namespace pycomm {

struct IpcQuantCall {
  const void* input = nullptr;
  void* output = nullptr;  // may alias input
  size_t n = 0;
  DType dtype = DType::kFloat32;  // float32, float16 or bfloat16
  bool avg = false;               // else sum
  int bits = 8;
  int block = 256;
  bool stochastic = false;
  // rounding_seed(codec seed, seq, rank, 0) and (..., 1): the communicator's
  // keys for the call with this sequence number.
  uint64_t seed_quantize = 0, seed_requantize = 0;
  float* worker_residual = nullptr;  // n floats, or null
  float* server_residual = nullptr;  // shard floats, or null
  // One fused kernel where the codec's block is 64, 128, 256 or 512
  // elements (ipc_quantized.cu says why); false: a kernel per step, as
  // for other blocks. The same bits either way.
  bool fused = true;
};

// Whether the call runs as the fused kernel (fused, and a block it takes).
bool ipc_quantized_fused(const IpcQuantCall& call);

// The fused kernel loads and stores runs of elements: its tensors (input,
// output, residuals) start at kIpcQuantAlign bytes, as allocations do; a
// caller stages others (offset views) through aligned copies. The kernels
// per step take any start.
constexpr size_t kIpcQuantAlign = 16;
bool ipc_quantized_aligned(const void* p);

// The most blocks a launch of the fused kernel takes in `group` (its grid
// is fewer where the call has fewer quantization blocks): 3 per SM of the
// smallest GPU, over the most ranks on one GPU, or the group's
// fused_blocks if fewer; the same on every rank.
int fused_grid_cap(const CudaIpcAllReduce::KernelView& group);

// Staging bytes one call needs per rank: world + 1 payload slots.
size_t ipc_quantized_bytes(size_t n, int world, int bits, int block);

// Enqueues the call on `stream`. Every rank calls with the same n, dtype,
// codec and op, in the same order. Throws CommError when the group's buffer
// is too small for it, or the group failed.
void ipc_quantized_all_reduce(CudaIpcAllReduce& group, const IpcQuantCall& call, cudaStream_t stream);

}  // namespace pycomm
