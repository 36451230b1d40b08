// FdSource: a file descriptor (socket, pipe, eventfd, ...) as a wait_any source; ready when readable.
//
// wait_any checks descriptors with poll(2) at a bounded rate while it spins and lets the kernel watch them
// while it parks. The source remembers which file the descriptor named when it was created (device and
// inode), so a descriptor closed (or closed and reused for another file) while waited on is reported with a
// SourceError instead of a hang. The source does not own the descriptor: it never closes it.
#pragma once

#include <sys/types.h>

#include "hotloop/source.h"

namespace hotloop {

class FdSource final : public Source {
 public:
  // Throws std::invalid_argument if fd is negative, SourceError if it is not an open descriptor.
  explicit FdSource(int fd);

  int fd() const noexcept override { return fd_; }
  // Doorbell-less sources are checked by wait_any through poll(2); ready() polls just this one.
  bool ready() const noexcept override;

  // Throws SourceError if the descriptor was closed or now names another file.
  void check_still_open() const;

 private:
  int fd_;
  dev_t dev_;
  ino_t ino_;
};

}  // namespace hotloop
