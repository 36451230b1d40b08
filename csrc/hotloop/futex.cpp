#include "hotloop/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

#include "hotloop/clock.h"

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif

namespace hotloop::futex {
namespace {

// The kernel's struct futex_waitv (uapi/linux/futex.h); declared here so older headers build too.
struct KernelWaitv {
  uint64_t val;
  uint64_t uaddr;
  uint32_t flags;
  uint32_t reserved;
};
constexpr uint32_t kFutex32 = 2;            // FUTEX2_SIZE_U32
constexpr uint32_t kFutex2Private = 128;    // FUTEX2_PRIVATE

timespec to_timespec(int64_t ns) {
  return timespec{time_t(ns / 1'000'000'000), long(ns % 1'000'000'000)};
}

int result(long rc) { return rc < 0 ? errno : 0; }

}  // namespace

int wait(const std::atomic<uint32_t>* word, uint32_t expected, bool shared, int64_t deadline_ns) noexcept {
  // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline, so retries never stretch the wait.
  int op = FUTEX_WAIT_BITSET | (shared ? 0 : FUTEX_PRIVATE_FLAG);
  timespec ts;
  const timespec* tp = nullptr;
  if (deadline_ns != kForever) {
    ts = to_timespec(deadline_ns);
    tp = &ts;
  }
  return result(syscall(SYS_futex, word, op, expected, tp, nullptr, FUTEX_BITSET_MATCH_ANY));
}

int wake(const std::atomic<uint32_t>* word, int count, bool shared) noexcept {
  int op = FUTEX_WAKE | (shared ? 0 : FUTEX_PRIVATE_FLAG);
  long rc = syscall(SYS_futex, word, op, count, nullptr, nullptr, 0);
  return rc < 0 ? -errno : int(rc);
}

int wait_many(const WaitEntry* entries, int n, int64_t deadline_ns) noexcept {
  if (n <= 0 || n > 128) return EINVAL;
  KernelWaitv v[128];
  for (int i = 0; i < n; ++i) {
    v[i] = KernelWaitv{entries[i].expected, reinterpret_cast<uint64_t>(entries[i].word),
                       kFutex32 | (entries[i].shared ? 0 : kFutex2Private), 0};
  }
  timespec ts;
  const timespec* tp = nullptr;
  if (deadline_ns != kForever) {
    ts = to_timespec(deadline_ns);
    tp = &ts;
  }
  long rc = syscall(SYS_futex_waitv, v, n, 0, tp, CLOCK_MONOTONIC);
  return rc < 0 ? errno : 0;
}

bool wait_many_supported() noexcept {
  static const bool supported = [] {
    // Zero entries is invalid: EINVAL means the call exists, ENOSYS that it does not.
    long rc = syscall(SYS_futex_waitv, nullptr, 0, 0, nullptr, CLOCK_MONOTONIC);
    return !(rc < 0 && errno == ENOSYS);
  }();
  return supported;
}

}  // namespace hotloop::futex
