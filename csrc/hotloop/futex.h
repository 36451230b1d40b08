// Thin wrappers over the Linux futex system calls (futex(2), futex_waitv(2)).
// Deadlines are absolute CLOCK_MONOTONIC nanoseconds (kForever = no deadline). `shared` selects a
// process-shared futex (the word lives in shared memory) instead of a process-private one, which the
// kernel hashes more cheaply. Each call returns 0 or a positive errno (EAGAIN: the word no longer held
// the expected value; ETIMEDOUT; EINTR: a signal arrived). Nothing here retries.
// Ordering: the kernel reads *word under the futex hash bucket's lock after queueing the waiter, and FUTEX_WAKE
// issues a full barrier (smp_mb) before it looks for waiters, on every architecture. So a store to the word
// sequenced before wake() is either seen by wait()'s comparison or the waiter is queued and woken; callers need no
// fence of their own around these calls. What the word publishes (the data behind it) is the callers' business:
// Doorbell's contract says how it is ordered.
#pragma once

#include <atomic>
#include <cstdint>

namespace hotloop::futex {

// Sleeps while *word == expected, until woken or the deadline.
int wait(const std::atomic<uint32_t>* word, uint32_t expected, bool shared, int64_t deadline_ns) noexcept;

// Wakes up to `count` threads sleeping on word; returns how many were woken (or -errno).
int wake(const std::atomic<uint32_t>* word, int count, bool shared) noexcept;

struct WaitEntry {
  const std::atomic<uint32_t>* word;
  uint32_t expected;
  bool shared;
};

// Sleeps while every entry's word holds its expected value (futex_waitv, Linux >= 5.16), at most 128
// entries. Returns 0 when woken (or when a word already differed: EAGAIN), ENOSYS where the kernel lacks
// futex_waitv, ETIMEDOUT, EINTR.
int wait_many(const WaitEntry* entries, int n, int64_t deadline_ns) noexcept;

// Whether futex_waitv exists on this kernel (asked once).
bool wait_many_supported() noexcept;

}  // namespace hotloop::futex
