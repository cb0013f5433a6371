// process_gone (transport/process.h), what the shared-memory transport and
// the CUDA IPC watchdog see a dead peer by:
//   - a live process is not gone, this one neither;
//   - a killed child its parent has not reaped yet (a zombie: kill(pid, 0)
//     still succeeds) is gone, and so it is once reaped;
//   - a live process with another start time (its pid reused) is gone;
//   - a process of another pid namespace, or of none known, is never taken
//     for gone (its pid means nothing here).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "transport/process.h"

using namespace pycomm;

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what);
    ++failures;
  }
}

// Waits (bounded) until the child has become a zombie.
bool wait_zombie(int pid) {
  for (int i = 0; i < 2000; ++i) {
    char state = 0;
    uint64_t start = 0;
    if (read_proc_stat(pid, &state, &start) && state == 'Z') return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

}  // namespace

int main() {
  const ProcessId self = this_process();
  check(self.pid == getpid() && self.starttime > 0 && self.pidns > 0, "this_process reads pid, start, namespace");
  check(!process_gone(self), "this process is not gone");

  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  ProcessId c;
  c.pid = child;
  c.pidns = self.pidns;
  char state = 0;
  check(read_proc_stat(child, &state, &c.starttime), "the child's stat is readable");
  check(!process_gone(c), "a live child is not gone");

  ProcessId reused = c;
  reused.starttime += 1;
  check(process_gone(reused), "another start time under the pid: gone");
  ProcessId foreign = c;
  foreign.pidns += 1;
  check(!process_gone(foreign), "another pid namespace: never taken for gone");
  ProcessId unknown = c;
  unknown.pidns = 0;
  check(!process_gone(unknown), "no namespace known: never taken for gone");

  kill(child, SIGKILL);
  check(wait_zombie(child), "the killed child becomes a zombie");
  check(process_gone(c), "a zombie not yet reaped is gone");
  waitpid(child, nullptr, 0);
  check(process_gone(c), "a reaped child is gone");

  if (failures) return 1;
  std::printf("ok\n");
  return 0;
}
