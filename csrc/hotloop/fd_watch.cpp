#include "hotloop/fd_watch.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace hotloop::fd_watch {

Watch::~Watch() {
  if (epfd_ >= 0 && pid_ == getpid()) ::close(epfd_);
}

int Watch::prepare() noexcept {
  if (epfd_ >= 0 && pid_ == getpid()) return 0;
  // A forked child's copy names its parent's epoll instance (shared through fork), or a number the child has
  // reused since: forget it without closing it.
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) return errno;
  pid_ = getpid();
  n_watched_ = 0;
  return 0;
}

int Watch::arm(pollfd* fds, int n, bool* ready) noexcept {
  *ready = false;
  if (n < 0 || n > kMaxFds) return EINVAL;
  if (int err = prepare()) return err;
  int now[kMaxFds];
  int n_now = 0;
  for (int i = 0; i < n; ++i) {
    fds[i].revents = 0;
    bool repeated = false;
    for (int k = 0; k < i && !repeated; ++k) repeated = fds[k].fd == fds[i].fd;
    if (repeated) continue;  // watched once; collect() polls every copy
    bool known = false;
    for (int k = 0; k < n_watched_ && !known; ++k) known = watched_[k] == fds[i].fd;
    epoll_event ev{};
    ev.events = EPOLLIN;
    int rc = epoll_ctl(epfd_, known ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fds[i].fd, &ev);
    if (rc < 0 && errno == (known ? ENOENT : EEXIST)) {
      // MOD: the number now names a file this set does not hold (the old one was closed). ADD: it is held.
      rc = epoll_ctl(epfd_, known ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, fds[i].fd, &ev);
    }
    if (rc < 0) {
      if (errno == EBADF) {
        fds[i].revents = POLLNVAL;
      } else if (errno == EPERM) {
        fds[i].revents = POLLIN;  // a regular file or directory: poll() calls it always readable
      } else {
        return errno;
      }
      *ready = true;
      continue;
    }
    now[n_now++] = fds[i].fd;
  }
  // Stop watching what an earlier park watched and this one does not (errors: already gone with its file).
  for (int k = 0; k < n_watched_; ++k) {
    bool kept = false;
    for (int i = 0; i < n_now && !kept; ++i) kept = now[i] == watched_[k];
    if (!kept) epoll_ctl(epfd_, EPOLL_CTL_DEL, watched_[k], nullptr);
  }
  for (int i = 0; i < n_now; ++i) watched_[i] = now[i];
  n_watched_ = n_now;
  return 0;
}

bool Watch::collect(pollfd* fds, int n) noexcept {
  // poll() rather than epoll_wait: it reads each descriptor's state now, by number, so no event of a file
  // an earlier park watched under the same number can be reported for the one watched now.
  int rc;
  do rc = ::poll(fds, nfds_t(n), 0);
  while (rc < 0 && errno == EINTR);
  if (rc <= 0) {
    for (int i = 0; i < n; ++i) fds[i].revents = 0;
    return false;
  }
  return true;
}

int Watch::sleep(const futex::WaitEntry* fx, int n_fx, const std::atomic<uint32_t>* word, uint32_t seen,
                 pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  if (n_fx < 0 || n_fx > kMaxFutexes) return EINVAL;
  futex::WaitEntry entries[kMaxFutexes + 1];
  std::copy(fx, fx + n_fx, entries);
  entries[n_fx] = {word, seen, false};
  const int rc = futex::wait_many(entries, n_fx + 1, deadline_ns);
  if (word->load(std::memory_order_acquire) != seen) collect(fds, n_fds);
  return rc == EAGAIN ? 0 : rc;
}

Watch& this_thread() noexcept {
  static thread_local Watch w;
  return w;
}

}  // namespace hotloop::fd_watch
