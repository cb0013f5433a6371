// Sizing a freshly created /dev/shm file so that running out of room is an
// error at setup, never a SIGBUS later.
#pragma once

#include <cstddef>
#include <string>

namespace pycomm {

// ftruncate alone leaves a tmpfs file sparse: pages are taken only when
// first touched, and a touch the tmpfs cannot back (a container's 64 MiB
// /dev/shm, a full one) kills the process with SIGBUS, inside a collective
// or inside mmap's MAP_POPULATE. posix_fallocate takes every page now, so
// "no room" comes back as ENOSPC here. Returns "" or what went wrong,
// naming `what` (e.g. "shared memory segment /pycomm...") and, when the
// tmpfs is full, how much room it had and what to do about it.
std::string size_shm_file(int fd, size_t bytes, const std::string& what);

}  // namespace pycomm
