#include "hotloop/fd_source.h"

#include <poll.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "hotloop/errors.h"

namespace hotloop {

FdSource::FdSource(int fd) : fd_(fd) {
  if (fd < 0) throw std::invalid_argument("FdSource: file descriptor must be >= 0, got " + std::to_string(fd));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    throw SourceError("FdSource: file descriptor " + std::to_string(fd) + " is not open (" +
                      std::strerror(errno) + "); pass the fileno() of an open socket, pipe or eventfd");
  }
  dev_ = st.st_dev;
  ino_ = st.st_ino;
}

bool FdSource::ready() const noexcept {
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

void FdSource::check_still_open() const {
  struct stat st;
  if (fstat(fd_, &st) != 0 || st.st_dev != dev_ || st.st_ino != ino_) {
    throw SourceError("file descriptor " + std::to_string(fd_) +
                      " was closed while waited on; stop waiting on a socket before closing it "
                      "(or set a Flag that the waiter also watches)");
  }
}

}  // namespace hotloop
