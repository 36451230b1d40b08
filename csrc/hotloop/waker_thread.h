// waker_thread: one sleep on futex words and file descriptors together where io_uring cannot do it.
//
// Roles. wait_any's park, when a wait has both doorbells and descriptors, on kernels without
// IORING_OP_FUTEX_WAIT (before 6.7) or where io_uring is refused (seccomp, kernel.io_uring_disabled). The
// waiting thread sleeps in ppoll on its descriptors plus a private eventfd; a helper thread sleeps in
// futex_waitv on the futex words plus a private "stop" word, and writes the eventfd when it returns because
// a word changed. So a ring from any process (the futex wake reaches the helper) or a readable descriptor
// (it reaches ppoll) ends the park within microseconds. Before returning, the waiter stops the helper (bumps
// the stop word, unless a doorbell already ended its wait) and waits until the helper is idle again: no
// futex wait outlives the park (a futex word may be unmapped right after), and the eventfd is drained.
//
// Thread-safety. One helper per waiting thread, created at that thread's first park here and reused until
// the thread exits (then stopped and joined); it blocks every signal. A forked child starts its own helper.
//
// What blocks: park(), until an event, the deadline or a signal (EINTR). Cost per park: a futex wake to hand
// the helper its job; a doorbell's wake-up costs two context switches (helper, then waiter) instead of one
// (~5 us each on bare metal, ~30 us on small VMs); a descriptor's wake-up adds a stop round trip to the
// helper before the wait returns. One thread (its stack) and one eventfd per waiting thread.
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
// up, in error), the deadline (absolute CLOCK_MONOTONIC ns, kForever: none) or a signal. `fds` must have room
// for n_fds + 1 entries (the eventfd goes last); fds[0..n_fds) get their revents. Returns 0 when an event
// ended it, ETIMEDOUT, EINTR, or an errno when the helper could not be started. At most 64 futexes.
int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept;

}  // namespace hotloop::waker_thread
