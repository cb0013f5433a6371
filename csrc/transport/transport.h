// What every collective transport offers the communicator and the
// composite operations built on it: run one collective, the same on every
// rank, in sequence order. Shared memory (shm.h), a wrapped process group
// (process_group.h) and their combination across hosts (multihost.h)
// implement it. The CUDA IPC all-reduce (cuda_ipc.h) does not: it moves
// device memory on a stream and has an interface of its own.
#pragma once

#include <cstdint>
#include <string>

#include "../core/collective.h"

namespace pycomm {

class Transport {
 public:
  virtual ~Transport() = default;
  // Runs one collective, the same on every rank, in the same order. `seq`
  // numbers the user call it belongs to (for messages; a hierarchical or
  // compressed call runs several collectives under one or a few numbers);
  // each transport counts its own operations. Throws CommError.
  virtual void run(const CollectiveDesc& desc, uint64_t seq) = 0;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Makes this rank's later operations fail with `why` (and `blame`), and
  // its peers' too where the transport can reach them without waiting
  // (shared memory can).
  virtual void abort(const std::string& why, Blame blame = {}) = 0;
};

}  // namespace pycomm
