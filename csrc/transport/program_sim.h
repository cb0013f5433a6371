// The CPU twin of the CUDA executor of schedules: every rank's program
// (algorithms/program.h) run in this one process over host mailboxes, the
// ranks interleaved cooperatively (a rank runs until a wait it cannot pass,
// then the next one). It resolves every pointer with the functions the
// kernel uses and reduces with the CPU kernels, so its output is what the
// CUDA executor must produce, bit for bit, and it is checked against the
// shared-memory executor in CI, where no GPU runs the kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../core/collective.h"

namespace pycomm {

// outputs[r] = rank r's output of `coll` run with schedule `algo` (a
// concrete one: ring, tree, one-shot or two-shot) over `inputs`, cut into
// rounds of `round_bytes` as a communicator with that round size cuts it.
// Throws CommError on a deadlock (a program that waits forever).
//
// `seed` 0 interleaves greedily: each rank in turn runs as far as it can.
// Any other seed interleaves at random: a random rank runs a random number
// of ops (1 to 8), so that any rank may run ahead of any other and refill a
// mailbox slot before a slow reader got to it, as blocks on a GPU may. A
// program whose waits do not protect every slot gives a wrong output under
// some seed.
void simulate_program(Algorithm algo, Collective coll, int root, DType dtype, RedOp op, size_t count,
                      const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                      size_t round_bytes, uint64_t seed = 0);

// The device memory one rank's program reads and writes for such a call
// (bytes: every copy reads and writes its chunk, every reduction reads each
// source and writes each destination), the sum over ranks: what a GPU's
// memory must carry when the ranks share it (benchmarks/gpu/allreduce.py
// sets it against the device's copy bandwidth).
uint64_t program_traffic(Algorithm algo, Collective coll, int world, int root, DType dtype, size_t count,
                         size_t round_bytes);

}  // namespace pycomm
