// All-reduce among the processes of one host through CUDA IPC, as vLLM's
// custom all-reduce does it: each rank registers one device staging buffer
// and one signal block once, peers map them through IPC handles (exchanged
// by the caller, through the Store), and each call is one kernel that reads
// the peers' buffers directly. Several ranks may share one GPU (NCCL refuses
// that); their kernels then time-slice, which the flag waits tolerate.
//
// Torch-free: device pointers, an explicit stream. NOT YET RUN ON A GPU:
// written and compiled without one; tests/test_cuda.py and
// benchmarks/gpu/run.sh are where it will first run.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../core/common.h"

namespace pycomm {

// Ranks one IPC group can hold: the kernel arguments carry one pointer per
// rank, and every block's flag row has one slot per rank.
constexpr int kIpcMaxRanks = 8;
// Blocks per launch. Each block synchronises only with the same block on
// the other ranks (its own flag row), so there is no grid-wide barrier; 36
// blocks of 512 threads read enough in flight to saturate HBM on one GPU.
constexpr int kIpcMaxBlocks = 36;

enum class IpcAlgo : uint8_t {
  kAuto = 0,
  // Every rank reads every buffer and reduces all of it: one barrier, world
  // x the reads; best while latency dominates.
  kOneShot = 1,
  // Reduce-scatter then all-gather through the buffers: each rank reduces
  // 1/world of the data; two more barriers, far fewer bytes.
  kTwoShot = 2,
};

class CudaIpcAllReduce {
 public:
  // Allocates this rank's staging buffer (`buffer_bytes`, the most one
  // kernel launch reduces; larger calls run in several) and its signal
  // block, on the current device.
  CudaIpcAllReduce(int rank, int world, size_t buffer_bytes);
  ~CudaIpcAllReduce();
  CudaIpcAllReduce(const CudaIpcAllReduce&) = delete;
  CudaIpcAllReduce& operator=(const CudaIpcAllReduce&) = delete;

  // This rank's IPC handles as bytes, to publish; then open() with every
  // rank's, in rank order (this rank's own entry is not opened).
  std::string handles() const;
  void open(const std::vector<std::string>& all);

  // out = in reduced over the ranks (`count` elements of `dtype`; avg
  // divides the sum, like the CPU transports). Every rank calls with the
  // same arguments, in the same order, each on its own stream; in and out
  // are device pointers and may alias. Sources are combined in rank order,
  // so every rank gets the bits the CPU transports compute. Refused while
  // `stream` is capturing a CUDA graph (see the .cu).
  void all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, IpcAlgo algo,
                  cudaStream_t stream);

  // What kAuto picks for a call of `bytes` among `world` ranks.
  static IpcAlgo choose(size_t bytes, int world);

  int rank() const { return rank_; }
  int world() const { return world_; }
  size_t buffer_bytes() const { return buffer_bytes_; }

 private:
  int rank_, world_, device_ = -1;
  size_t buffer_bytes_;
  void* buffer_ = nullptr;
  void* signal_ = nullptr;
  std::vector<void*> peer_buffers_, peer_signals_;  // [world]; ours at [rank_]
  bool opened_ = false;
  // Flag value of the next launch: the same on every rank, because every
  // rank makes the same launches in the same order.
  uint32_t epoch_ = 0;
};

}  // namespace pycomm
