// uring_park: one kernel sleep on futex words and file descriptors together, through futex_waitv and an
// io_uring poll (Linux >= 5.16, io_uring allowed).
//
// Roles. wait_any's park, when a wait has both doorbells and descriptors. The thread sleeps in futex_waitv
// on the doorbells' words plus one more: the tail of its own io_uring's completion queue. The descriptors
// are armed in the thread's fd_watch (an epoll instance) and one one-shot IORING_OP_POLL_ADD watches that.
// A ring from any process is a futex wake of the sleep itself, as when no descriptor is watched: nothing on
// its path but the futex. A readable descriptor makes the watch readable, the poll completes, and its task
// work (queued with TWA_SIGNAL, io_uring's default) wakes this thread to run it: the completion moves the
// tail, the interrupted futex_waitv restarts, sees the moved tail and returns. Either way one wake-up of
// this thread and no system call after it (but a poll() on the descriptor's path, to read which one).
//
// Why not IORING_OP_FUTEX_WAIT (6.7): a park then submits a wait per word and a poll per descriptor and
// must cancel and reap them before returning (a word may be unmapped right after, a polled file stays open
// while polled): a second io_uring_enter on every wake-up, ~1.2 us here beside a ~4 us futex wake-up. Here
// nothing is submitted per park but the watch's poll after it fired, and nothing is left to cancel: the
// poll stays armed on the thread's own epoll descriptor, which holds no reference to the caller's files.
//
// Thread-safety. Each thread parks on its own ring (thread_local, created at its first park, kept until the
// thread exits; a forked child makes a fresh one and leaves the inherited copy untouched). Nothing is shared
// between threads but the probe.
//
// What blocks: park(), until an event, the deadline or a signal (EINTR). Cost per park: one epoll_ctl per
// descriptor, one io_uring_enter only after a descriptor's event (re-arming the poll), the futex_waitv; no
// allocation. A small ring (~4 KiB) and two descriptors (the ring, the watch) per waiting thread.
//
// Support is probed once: io_uring_setup (refused under seccomp filters such as container runtimes' default,
// kernel.io_uring_disabled, before Linux 5.1), futex_waitv, IORING_REGISTER_PROBE for the opcodes, then real
// parks with known outcomes, one of them woken by another thread's write while asleep (which checks the
// task-work wake-up on the running kernel).
//
// Raw system calls, not liburing: three calls and one opcode, no library needed.
#pragma once

#include <poll.h>

#include <cstdint>

#include "hotloop/futex.h"

namespace hotloop::uring_park {

// Whether parks can use io_uring here (probed at the first call, thread-safe).
bool available() noexcept;
// Why not, in words ("" when available).
const char* unavailable_reason() noexcept;

// Sets up the calling thread's ring now (a park does it on first use). Returns 0 or an errno.
int prepare() noexcept;

// Sleeps until a futex word differs from its expected value or is woken, a descriptor is readable (or hung
// up, in error), the deadline (absolute CLOCK_MONOTONIC ns, kForever: none) or a signal. Fills fds[i].revents
// after a descriptor's event (POLLNVAL for one that was not open). Returns 0 when an event ended it (or
// possibly none: the caller re-checks its sources), ETIMEDOUT, EINTR, or another errno when the park failed
// (EFAULT: a futex word is not mapped). No futex wait outlives it. At most 64 futexes + 64 descriptors.
int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept;

}  // namespace hotloop::uring_park
