#pragma once
// Names pycomm's threads as `top -H`, gdb, py-spy and /proc/<pid>/task/*/comm
// show them ("pycomm-<role>"), beside torch's "pt_gloo_runloop": a user who
// finds a thread left running, spinning or stuck can tell whose it is.

#include <pthread.h>

#include <cstdio>
#include <thread>
#include <utility>

namespace pycomm {

// A thread running fn, named before the caller goes on (so that whoever
// lists the threads next sees the name). Linux keeps 15 characters of a
// name: roles of up to 8 fit after "pycomm-".
template <typename Fn>
std::thread named_thread(const char* role, Fn&& fn) {
  std::thread t(std::forward<Fn>(fn));
#ifdef __linux__
  char name[16];
  std::snprintf(name, sizeof name, "pycomm-%s", role);
  pthread_setname_np(t.native_handle(), name);  // fails only for a thread that already ended
#else
  (void)role;
#endif
  return t;
}

}  // namespace pycomm
