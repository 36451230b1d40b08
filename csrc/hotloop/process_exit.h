// ProcessExit: a wait_any source that becomes ready when one process exits: a pidfd (pidfd_open(2), Linux >= 5.3),
// which the kernel makes readable as the process ends (a zombie not yet reaped counts as ended).
//
// Contract. open(pid) returns null where there is no pidfd to be had: a kernel without pidfd_open, no process with
// that pid in this PID namespace, or no permission; the caller then keeps whatever check it had (a queue's reader
// looks at /proc at the end of each liveness slice). A pidfd names the process that held the pid when it was
// opened, so a caller that means one particular process opens first and then confirms that process still holds
// the pid (shm_ring.cpp compares its start time); a pid reused after that cannot make the source ready or quiet.
// The object owns the descriptor (close-on-exec) and closes it on destruction. Not copyable; movable by pointer.
#pragma once

#include <memory>

#include "hotloop/fd_source.h"

namespace hotloop {

class ProcessExit {
 public:
  static std::unique_ptr<ProcessExit> open(int pid) noexcept;
  ~ProcessExit();
  ProcessExit(const ProcessExit&) = delete;
  ProcessExit& operator=(const ProcessExit&) = delete;

  // Ready (readable) once the process has exited.
  Source& source() noexcept { return source_; }

 private:
  explicit ProcessExit(int fd);
  int fd_;
  FdSource source_;
};

}  // namespace hotloop
