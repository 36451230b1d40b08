#include "hotloop/process_exit.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <new>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture (asm-generic), since Linux 5.3
#endif

namespace hotloop {

std::unique_ptr<ProcessExit> ProcessExit::open(int pid) noexcept {
  if (pid <= 0) return nullptr;
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);  // close-on-exec by default
  if (fd < 0) return nullptr;  // ENOSYS (old kernel, or a seccomp filter), ESRCH (no such process), EPERM
  try {
    return std::unique_ptr<ProcessExit>(new ProcessExit(int(fd)));
  } catch (...) {  // fstat of a descriptor just opened does not fail; allocation might
    ::close(int(fd));
    return nullptr;
  }
}

ProcessExit::ProcessExit(int fd) : fd_(fd), source_(fd) {}

ProcessExit::~ProcessExit() { ::close(fd_); }

}  // namespace hotloop
