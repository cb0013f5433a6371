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

// fork() copies only the calling thread. An object that owns threads, made
// before a fork, is a copy in the child: its threads do not exist there, its
// mutexes may have been copied locked, and its shared memory and peers are
// the parent's. The child can neither use it (a call would wait for a thread
// that is not there) nor end it (joining its threads, or destroying a
// condition variable a parent thread waited on, never returns; marking its
// rank exited would end the parent's job). Such objects keep the pid of the
// process that made them and ask forked_from(owner).
// current_pid() is a load (kept current across fork() by an atfork handler).
int32_t current_pid();
inline bool forked_from(int32_t owner) { return current_pid() != owner; }

// Whether `p` has exited: no such process, a zombie its parent has not
// reaped yet, or another process under its pid. False when `p` lives in
// another pid namespace (its pid means nothing here).
bool process_gone(const ProcessId& p);

}  // namespace pycomm
