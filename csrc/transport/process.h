// Processes of this host, told apart from a later process that reuses a pid:
// what the shared-memory transport and the CUDA IPC group's watchdog use to
// see a peer die at once (its kernels or its flags just stop moving).
#pragma once

#include <cstdint>

namespace pycomm {

struct ProcessId {
  int32_t pid = 0;
  uint64_t starttime = 0;  // clock ticks since boot (/proc/<pid>/stat field 22)
  uint64_t pidns = 0;      // the pid namespace (an inode number); 0: unknown
};

ProcessId this_process();

// State and start time of a process from /proc/<pid>/stat; false if there is
// no such process.
bool read_proc_stat(int pid, char* state, uint64_t* starttime);

// The pid namespace of this process.
uint64_t pid_namespace_id();

// Whether `p` has exited: no such process, a zombie its parent has not
// reaped yet, or another process under its pid. False when `p` lives in
// another pid namespace (its pid means nothing here).
bool process_gone(const ProcessId& p);

}  // namespace pycomm
