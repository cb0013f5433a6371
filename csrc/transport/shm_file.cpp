#include "shm_file.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace pycomm {

namespace {

std::string mib(size_t bytes) { return std::to_string((bytes + (1u << 20) - 1) >> 20) + " MiB"; }

}  // namespace

std::string size_shm_file(int fd, size_t bytes, const std::string& what) {
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0)
    return "cannot size " + what + " to " + mib(bytes) + ": " + std::strerror(errno);
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  // A file system that cannot preallocate (EOPNOTSUPP, EINVAL) keeps the
  // sparse file: tmpfs, where /dev/shm lives, always can.
  if (err == 0 || err == EOPNOTSUPP || err == EINVAL) return "";
  std::string why = "cannot size " + what + " to " + mib(bytes) + ": " + std::strerror(err);
  if (err == ENOSPC || err == EFBIG) {
    struct statvfs fs;
    if (fstatvfs(fd, &fs) == 0) {
      const size_t total = static_cast<size_t>(fs.f_blocks) * fs.f_frsize;
      const size_t avail = static_cast<size_t>(fs.f_bavail) * fs.f_frsize;
      why += " (/dev/shm: " + mib(avail) + " free of " + mib(total) + ")";
    }
    why += ". Give /dev/shm more room (docker run --shm-size=1g; on Kubernetes an emptyDir volume with "
           "medium: Memory at /dev/shm), lower PYCOMM_SHM_ROUND_BYTES or PYCOMM_P2P_BYTES, or send "
           "through the process group instead (PYCOMM_TRANSPORT=pg)";
  }
  return why;
}

}  // namespace pycomm
