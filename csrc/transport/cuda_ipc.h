// All-reduce among the processes of one host through CUDA IPC, as vLLM's
// custom all-reduce does it: each rank registers one device staging buffer
// and one signal block once, peers map them through IPC handles (exchanged
// by the caller, through the Store), and each call is one kernel that reads
// the peers' buffers directly. Several ranks may share one GPU (NCCL refuses
// that); their kernels then time-slice, which the flag waits tolerate.
//
// Besides the hand-written one-shot and two-shot kernels, the group runs
// the schedules of algorithms/ (ring, tree, direct) with one kernel per call
// (cuda_schedule.cu), each rank's reduction in the order of the CPU executor
// of the same schedule, hence its bits.
//
// No wait spins forever: every wait on a peer gives up after the timeout,
// or at once when the host's watchdog sees a peer process gone; the kernel
// then returns, the group is failed for good, and the next call (or
// check()) raises CommError naming the peer.
//
// Torch-free: device pointers, an explicit stream. The one-shot and
// two-shot kernels ran on one H100 (2 and 4 ranks sharing it); the bounded
// waits and the executor of schedules are written and compiled without a
// GPU: tests/test_cuda.py and benchmarks/gpu/run.sh are where they first run.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/common.h"
#include "process.h"

namespace pycomm {

// Ranks one IPC group can hold: the kernel arguments carry one pointer per
// rank, and every block's flag row has one slot per rank.
constexpr int kIpcMaxRanks = 8;
// Blocks per launch. Each block synchronises only with the same block on
// the other ranks (its own flag row), so there is no grid-wide barrier.
// A rank alone on its GPU launches kIpcBlocks (36 blocks of 512 threads read
// enough in flight to saturate one GPU's HBM); ranks that share a GPU split
// kIpcSharedGpuBlocks between them, up to kIpcMaxBlocks each: 2 ranks
// sharing an H200 under MPS, 36 blocks each, held 72 of its 132 SMs and
// reached 62 % of the copy bandwidth at 64 MB (two-shot), where 4 ranks' 144
// blocks reached 99 %. Every rank's blocks of a launch must be resident at
// once (they wait for each other): 144 blocks of 3 per SM fit any GPU of 48
// SMs or more.
constexpr int kIpcBlocks = 36;
constexpr int kIpcSharedGpuBlocks = 144;
constexpr int kIpcMaxBlocks = 72;
// Blocks per launch, at most, of a kernel composed over the group that
// sizes its grid by the GPU instead (the fused quantized all-reduce: its
// warps each hold a quantization block, and the group's 36 to 72 blocks
// left it at 10 % of the copy bandwidth on an H200). It has flag rows and
// launch counts of its own, so its grid is free of the group's: 512 covers
// 3 blocks per SM of any GPU up to 170 SMs.
constexpr int kIpcFusedMaxBlocks = 512;

// The blocks per launch of a group whose busiest GPU runs `ranks_per_gpu`
// of its ranks (the same on every rank: all see the same handles).
inline int ipc_blocks_for(int ranks_per_gpu) {
  if (ranks_per_gpu <= 1) return kIpcBlocks;
  const int share = kIpcSharedGpuBlocks / ranks_per_gpu;
  return share < kIpcBlocks ? kIpcBlocks : (share > kIpcMaxBlocks ? kIpcMaxBlocks : share);
}

// Why a kernel gave up, in the host-mapped status block.
constexpr uint32_t kIpcTimedOut = 1;
constexpr uint32_t kIpcAborted = 2;
// What it was waiting for.
constexpr int kIpcWaitBarrier = 0;
constexpr int kIpcWaitStep = 1;
constexpr int kIpcWaitRound = 2;

// Host-mapped (pinned) memory every launch of the group can read and write.
struct IpcStatus {
  uint32_t abort;  // set by the host: every wait gives up
  uint32_t code;   // 0, or why the first wait gave up
  int32_t peer;    // whom it waited for
  int32_t what;    // kIpcWait*
  uint32_t target;
};

enum class IpcAlgo : uint8_t {
  kAuto = 0,
  // Every rank reads every buffer and reduces all of it: one barrier, world
  // x the reads; best while latency dominates.
  kOneShot = 1,
  // Reduce-scatter then all-gather through the buffers: each rank reduces
  // 1/world of the data; two more barriers, far fewer bytes.
  kTwoShot = 2,
  // The schedules of algorithms/, run by the device executor: bit for bit
  // the CPU communicator's result with the same algorithm and round size.
  kRing = 3,
  kTree = 4,
  kDirect = 5,  // resolved to the one-shot or two-shot schedule by the tuner
};
constexpr int kLastIpcAlgo = static_cast<int>(IpcAlgo::kDirect);

class CudaIpcAllReduce {
 public:
  // Allocates this rank's staging buffer (`buffer_bytes`, the most one
  // kernel launch reduces; larger calls run in several) and its signal
  // block, on the current device. The schedules cut a call into rounds of
  // `round_bytes` (0: the most the buffer holds, a quarter of it: two
  // halves of two phases), as a CPU communicator with that round size does.
  // A wait on a peer gives up after `timeout_s`.
  //
  // `double_buffer`: the one-shot and two-shot kernels stage into one half
  // of the buffer or the other by the parity of the group's launch count,
  // and end without a barrier (one of one-shot's two): the next launch's
  // start barrier already tells that every peer finished the launch before
  // it, hence its reads of the half the launch after writes. Calls then
  // carry half the buffer each, and a call of another kind (schedules, the
  // quantized all-reduce) first waits for the peers' reads with a barrier
  // (settle()). Every rank makes the same choice.
  CudaIpcAllReduce(int rank, int world, size_t buffer_bytes, size_t round_bytes = 0, double timeout_s = 300.0,
                   bool double_buffer = false);
  ~CudaIpcAllReduce();
  CudaIpcAllReduce(const CudaIpcAllReduce&) = delete;
  CudaIpcAllReduce& operator=(const CudaIpcAllReduce&) = delete;

  // This rank's IPC handles (and process id, its GPU, its SM count and the
  // most fused blocks it asks for: 1..kIpcFusedMaxBlocks, 0 none; see
  // KernelView) as bytes, to publish; then
  // open() with every rank's, in rank order (this rank's own entry is not
  // opened). open() starts the watchdog: a peer process gone aborts every
  // wait of this group.
  std::string handles(int fused_blocks = 0) const;
  void open(const std::vector<std::string>& all);

  // Makes every wait of this group give up now (and every later call fail),
  // with `why` as the reason.
  void abort(const std::string& why);
  // "" unless a wait of a launch gave up (a peer gone or late, or abort()):
  // then why. Reads the host-mapped status: called once the stream is done,
  // "" says that every result so far is whole. After an abort() or a
  // failure every call raises CommError.
  std::string failure() const;

  // out = in reduced over the ranks (`count` elements of `dtype`; avg
  // divides the sum, like the CPU transports). Every rank calls with the
  // same arguments, in the same order, each on its own stream; in and out
  // are device pointers and may alias. Sources are combined in rank order,
  // so every rank gets the bits the CPU transports compute. One-shot and
  // two-shot (and kAuto) may be captured in a CUDA graph and replayed (their
  // flag values live in device memory); the schedules are refused while
  // `stream` is capturing.
  void all_reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, IpcAlgo algo,
                  cudaStream_t stream);

  // For code that composes its own collectives over the group (the
  // quantized IPC all-reduce, compression/): rank q's staging buffer
  // (mapped into this process), and a barrier among the ranks enqueued on
  // `stream` (every rank's earlier work on its stream is done, and visible,
  // before any rank's later work starts). Throws CommError when the group
  // failed or was aborted.
  void* peer_buffer(int q) const { return peer_buffers_.at(q); }
  void barrier(cudaStream_t stream);
  void check_usable() const { throw_if_failed(); }
  // A word in device memory that is non-zero once a barrier() of this group
  // gave up: kernels reading peers' buffers check it and do nothing (a dead
  // peer's memory may be gone). Not the host-mapped status: every thread
  // block reads this word, and a read of host-mapped memory is a trip over
  // PCIe (about 2 us each, one after another, on an H200: the quantized
  // all-reduce of 64 MB took 205 ms reading the status, 98k reads).
  const uint32_t* failure_word() const { return gave_up_; }

  // What a kernel composed over the group (the fused quantized all-reduce,
  // compression/) needs to meet its peers as the group's own kernels do:
  // every rank's staging buffer and signal block (ours at [rank]; the
  // blocks are cuda_ipc_detail.cuh's IpcSignal), the status its waits
  // report to, their timeout, and what sizes its grid. Such a kernel meets
  // its peers block b to block b on the fused flag rows
  // (ipc_detail::block_barrier<FusedRows>), and leaves every peer's reads
  // of this rank's buffer done when it ends, as the group's kernels do.
  //
  // Its grid must be the same on every rank and must fit on the GPU with
  // every other rank's on that GPU (they wait for each other): `sms` is the
  // fewest SMs of any rank's GPU, `ranks_per_gpu` the most ranks on one GPU,
  // and `fused_blocks` the most blocks per launch the ranks asked for in
  // handles() (the least any rank asked; 0: none did), all agreed at open().
  struct KernelView {
    void* buf[kIpcMaxRanks];
    void* sig[kIpcMaxRanks];
    IpcStatus* status;
    uint64_t timeout_ns;
    int rank, world, blocks;
    int sms, ranks_per_gpu, fused_blocks;
    bool double_buffer;
  };
  KernelView kernel_view() const;
  // For code that writes this rank's buffer before it meets its peers (the
  // schedules, the quantized all-reduce): in a double-buffered group, a
  // barrier on `stream` when a one-shot or two-shot launch may have left
  // peers reading it (always, once one was captured in a CUDA graph: its
  // replays are not seen here). Not while capturing.
  void settle(cudaStream_t stream);
  bool double_buffer() const { return double_buffer_; }

  // Makes `waiter`'s later work wait for `producer`'s work so far, with an
  // event of the group's recorded and waited for at once (so one event
  // serves every call: a wait takes the event's state when it is enqueued,
  // and a fresh event per call cost a create and a destroy). Legal while
  // capturing a CUDA graph. ordered_done(): whether the producer of the last
  // order() has finished that work (not while capturing).
  void order(cudaStream_t waiter, cudaStream_t producer);
  bool ordered_done();

  // What kAuto picks for a call of `bytes` among `world` ranks.
  static IpcAlgo choose(size_t bytes, int world);
  // Whether `stream` is capturing a CUDA graph.
  static bool capturing(cudaStream_t stream);

  int rank() const { return rank_; }
  size_t round_bytes() const { return round_bytes_; }
  int world() const { return world_; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  // Blocks per launch (ipc_blocks_for), known after open().
  int blocks() const { return blocks_; }

 private:
  int rank_, world_, device_ = -1;
  size_t buffer_bytes_;
  void* buffer_ = nullptr;
  void* signal_ = nullptr;
  std::vector<void*> peer_buffers_, peer_signals_;  // [world]; ours at [rank_]
  bool opened_ = false;

  // The executor of schedules (cuda_schedule.cu).
  struct DeviceProgram {
    void* ops = nullptr;  // ProgOp[nops] in device memory
    int nops = 0, num_chunks = 0, num_steps = 0;
  };
  const DeviceProgram& program(int algo);
  void run_schedule(const void* in, void* out, size_t count, DType dtype, RedOp op, int algo, cudaStream_t stream);
  size_t round_bytes_;
  int blocks_ = kIpcBlocks;
  int sms_ = 0, ranks_per_gpu_ = 1, fused_blocks_ = 0;  // KernelView's, from open()
  std::map<int, DeviceProgram> programs_;
  // Steps posted and rounds finished by this rank's schedule launches so
  // far (the same on every rank).
  uint32_t steps_done_ = 0, rounds_done_ = 0;
  uint32_t barriers_ = 0;  // barrier() calls so far
  // Double-buffered: whether peers may still read this rank's buffer (a
  // one-shot or two-shot launch since the last barrier), and whether such a
  // launch was ever captured.
  bool double_buffer_ = false, reads_pending_ = false, captured_ = false;

  // Failure handling: the host-mapped status, the wait bound, the watchdog.
  void throw_if_failed() const;
  IpcStatus* status_ = nullptr;      // host view
  IpcStatus* status_dev_ = nullptr;  // the same memory, as the device sees it
  uint32_t* gave_up_ = nullptr;      // device memory: failure_word()
  cudaEvent_t order_event_ = nullptr;  // order(), ordered_done(); guarded by order_mu_
  std::mutex order_mu_;
  uint64_t timeout_ns_;
  std::vector<ProcessId> peers_;  // [world], from their handles
  mutable std::mutex mu_;
  std::string abort_why_;  // guarded by mu_
  std::atomic<bool> stop_watch_{false};
  std::thread watch_;
};

}  // namespace pycomm
