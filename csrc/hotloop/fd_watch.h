// fd_watch: the descriptors of a mixed park, watched by one epoll instance per waiting thread.
//
// Roles. The two park backends of waits over doorbells and descriptors together (uring_park, waker_thread)
// both sleep in futex_waitv on the doorbells' words plus one word of their own, and turn "this thread's epoll
// instance became readable" into a change of that word. The watch is that epoll instance. A park arms its
// descriptors (EPOLL_CTL_MOD, ADD the first time, DEL for those an earlier park watched and this one does
// not); after a wake-up that came from the watch, collect() reads which descriptors are ready (poll with no
// timeout). A doorbell's wake-up touches nothing here: the registrations stay for the next park.
//
// Why epoll: it holds no reference to a watched file (closing a file's last descriptor drops it from the
// set), so a caller's socket never stays open because a park watched it; and a descriptor number reused for
// another file is noticed (MOD fails with ENOENT for the new file) and added again, never waited on stale.
//
// Thread-safety. One Watch per thread (this_thread()), created at its first park and closed when the thread
// exits; a forked child makes its own and leaves the inherited copy untouched (the epoll instance is shared
// with the parent through fork, so the child must not change it).
//
// What blocks: nothing. Cost per park: one epoll_ctl per descriptor (before the sleep, never on the wake-up
// path); one poll after a descriptor's wake-up. One descriptor per waiting thread.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>

#include "hotloop/futex.h"

namespace hotloop::fd_watch {

constexpr int kMaxFds = 64;
constexpr int kMaxFutexes = 64;

class Watch {
 public:
  Watch() = default;
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;
  ~Watch();

  // Creates the epoll instance now (arm() does it on first use). Returns 0 or an errno.
  int prepare() noexcept;

  // The epoll descriptor (after prepare() or arm() succeeded in this process).
  int fd() const noexcept { return epfd_; }

  // Watches fds[0..n) for POLLIN (hang-up and error are always reported) and nothing else. Returns 0 or an
  // errno (EINVAL: n > kMaxFds). Sets *ready, with revents filled, when a descriptor needs no sleep: one that
  // is not open (POLLNVAL), or a file epoll cannot watch (regular files: always readable, POLLIN).
  int arm(pollfd* fds, int n, bool* ready) noexcept;

  // Fills fds[0..n).revents with their state now; returns whether any is ready.
  bool collect(pollfd* fds, int n) noexcept;

  // The park both backends share once armed: sleeps in futex_waitv on fx[0..n_fx) plus `word` (which their
  // bridge changes when the watch becomes readable; asleep only while it holds `seen`), then collects the
  // descriptors' state if `word` moved. Returns 0 (an event, or possibly none: the caller re-checks its
  // sources), ETIMEDOUT, EINTR, or another errno. At most kMaxFutexes futexes.
  int sleep(const futex::WaitEntry* fx, int n_fx, const std::atomic<uint32_t>* word, uint32_t seen, pollfd* fds,
            int n_fds, int64_t deadline_ns) noexcept;

 private:
  int epfd_ = -1;
  pid_t pid_ = 0;
  int watched_[kMaxFds];
  int n_watched_ = 0;
};

// The calling thread's watch.
Watch& this_thread() noexcept;

}  // namespace hotloop::fd_watch
