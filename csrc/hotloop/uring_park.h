// uring_park: one kernel sleep on futex words and file descriptors together, through io_uring (Linux >= 6.7).
//
// Roles. wait_any's park, when a wait has both doorbells and descriptors. A park submits one
// IORING_OP_FUTEX_WAIT per futex word (futex2 flags: 32-bit, private unless the word is process-shared;
// expected = the value seen after announcing; any bitset) and one IORING_OP_POLL_ADD per descriptor, in one
// io_uring_enter that also waits for the first completion or the deadline. Then it cancels the rest
// (IORING_OP_ASYNC_CANCEL, ANY | ALL) and reaps every completion it is owed before returning, so no operation
// survives into the next park (a futex word may be unmapped right after). A ring from another process wakes
// it like one from this process: the kernel's futex wake finds the io_uring waiter whoever calls it.
//
// Thread-safety. Each thread parks on its own ring (thread_local, created at its first park, kept until the
// thread exits; a forked child makes a fresh one and leaves the inherited copy untouched). Nothing is shared
// between threads but the probe.
//
// What blocks: park(), until an event, the deadline or a signal (EINTR). Cost: two io_uring_enter calls per
// park (submit + wait; cancel + reap), no allocation; ~32 KiB of ring memory and one descriptor per waiting thread.
//
// Support is probed once: io_uring_setup (refused under seccomp filters, kernel.io_uring_disabled, before
// Linux 5.1), IORING_REGISTER_PROBE for the opcodes, then a real park on a private word and an eventfd that
// must complete as expected (which also checks the SQE field mapping below against the running kernel).
//
// Raw system calls, not liburing: the distribution's liburing (2.3 on Debian bookworm) predates the futex
// operations (2.5) and its kernel headers (6.1) predate IORING_OP_FUTEX_WAIT (6.7), so the opcode and futex2
// flags are defined in uring_park.cpp from the upstream uapi headers; the three system calls need no library.
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
// from the completions (POLLNVAL for a descriptor that was not open). Returns 0 when an event ended it,
// ETIMEDOUT, EINTR, or another errno when the ring failed (EFAULT: a futex word is not mapped). Every
// operation it started has completed when it returns. At most 64 futexes + 64 descriptors.
int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept;

}  // namespace hotloop::uring_park
