#include "process.h"

#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace pycomm {

bool read_proc_stat(int pid, char* state, uint64_t* starttime) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // The command name may contain spaces and parentheses: fields start after
  // the last ')'.
  char* p = std::strrchr(buf, ')');
  if (!p || p[1] == '\0') return false;
  p += 2;
  *state = *p;
  // starttime is field 22; the state is field 3.
  int field = 3;
  char* save = nullptr;
  for (char* tok = strtok_r(p, " ", &save); tok; tok = strtok_r(nullptr, " ", &save), ++field) {
    if (field == 22) {
      *starttime = std::strtoull(tok, nullptr, 10);
      return true;
    }
  }
  return false;
}

uint64_t pid_namespace_id() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

namespace {

// getpid() is a system call (glibc stopped caching it in 2.25), and the
// fork checks ask for the pid on every operation: ~0.3 us each, a tenth of
// a small all-reduce. The pid changes only in a fork() child, and there
// pthread_atfork's child handler runs before fork() returns, so a copy
// refreshed by it is always this process's pid.
std::atomic<int32_t> cached_pid{0};

void refresh_pid() { cached_pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed); }

}  // namespace

int32_t current_pid() {
  // Registered when the library loads (below); a process forked from one
  // that had not loaded it yet registers its own on first use.
  static const bool registered = [] {
    refresh_pid();
    pthread_atfork(nullptr, nullptr, refresh_pid);
    return true;
  }();
  (void)registered;
  return cached_pid.load(std::memory_order_relaxed);
}

namespace {
// While the library loads, no other thread can be inside the registration
// above, so no fork() can copy it half done.
const int32_t pid_at_load = current_pid();
}  // namespace

ProcessId this_process() {
  ProcessId p;
  p.pid = current_pid();
  char state = 0;
  read_proc_stat(p.pid, &state, &p.starttime);
  p.pidns = pid_namespace_id();
  return p;
}

bool process_gone(const ProcessId& p) {
  if (p.pid <= 0 || p.pidns == 0 || p.pidns != pid_namespace_id()) return false;
  char state = 0;
  uint64_t starttime = 0;
  if (!read_proc_stat(p.pid, &state, &starttime)) return true;
  return state == 'Z' || state == 'X' || starttime != p.starttime;
}

}  // namespace pycomm
