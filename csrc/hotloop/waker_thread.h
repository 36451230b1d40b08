// waker_thread: one sleep on futex words and file descriptors together where io_uring is refused.
//
// Roles. wait_any's park, when a wait has both doorbells and descriptors and io_uring cannot be used
// (seccomp filters such as container runtimes' default, kernel.io_uring_disabled). The waiting thread sleeps
// in futex_waitv on the doorbells' words plus its helper's word; its descriptors are armed in the thread's
// fd_watch (an epoll instance), and a helper thread, while armed, sleeps in poll() on that watch. A ring
// from any process wakes the waiter directly (a futex wake: nothing else on its path). A readable descriptor
// wakes the helper, which bumps its word and wakes the waiter (two wake-ups: helper, then waiter), then
// stays idle until a park arms it again. A doorbell's wake-up leaves the helper armed for the next park, so
// nothing is stopped or drained on that path; the helper watches only the thread's own epoll descriptor, which
// holds no reference to the caller's files.
//
// Thread-safety. One helper per waiting thread, created at that thread's first park here and reused until
// the thread exits (then stopped and joined); it blocks every signal. A forked child starts its own helper.
//
// Signals. A signal to the waiting thread ends its sleep in futex_waitv (EINTR). One that reaches it while its
// first park starts the helper (created under a full signal mask; the park sleeps until the helper runs) has
// been handled by then, so that park returns EINTR once the helper runs instead of sleeping through it.
//
// What blocks: park(), until an event, the deadline or a signal (EINTR). Cost per park: one epoll_ctl per
// descriptor; a futex wake to arm the helper after it fired. One thread (its stack) and one eventfd per
// waiting thread (to end the helper's poll at exit), plus the watch.
//
// Needs futex_waitv (Linux >= 5.16); without it, wait_any keeps its sliced park (see wait_any.h).
#pragma once

#include <poll.h>

#include <cstdint>

#include "hotloop/futex.h"

namespace hotloop::waker_thread {

// Whether this kernel has futex_waitv (the helper's sleep).
bool available() noexcept;

// Starts the calling thread's helper now (a park does it on first use) and returns once it runs, so a fork()
// right after never copies a thread mid-start-up. Returns 0 or an errno.
int prepare() noexcept;

// Sleeps until a futex word differs from its expected value or is woken, a descriptor is readable (or hung
// up, in error), the deadline (absolute CLOCK_MONOTONIC ns, kForever: none) or a signal. Fills fds[i].revents
// after a descriptor's event. Returns 0 when an event ended it (or possibly none: the caller re-checks its
// sources), ETIMEDOUT, EINTR (also for a signal during the helper's start-up), or an errno when the helper
// could not be started. At most 64 futexes and 64 descriptors.
int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept;

}  // namespace hotloop::waker_thread
