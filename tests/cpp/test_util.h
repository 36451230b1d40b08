// Helpers shared by the C++ tests: a counting source, the stress scale, and waits for a state (a parked
// waiter, a thread asleep in a given system call) in place of fixed sleeps.
#pragma once

#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "hotloop/clock.h"
#include "hotloop/doorbell.h"
#include "hotloop/source.h"

namespace hotloop::test {

// A source that is ready while `value` differs from what the waiter last saw.
struct CounterSource final : Source {
  explicit CounterSource(bool shared = false) : bell(shared) {}
  Doorbell bell;
  std::atomic<uint64_t> value{0};
  std::atomic<uint64_t> seen{0};
  void publish() {
    value.fetch_add(1, std::memory_order_release);
    bell.ring();
  }
  bool ready() const noexcept override {
    return value.load(std::memory_order_acquire) != seen.load(std::memory_order_relaxed);
  }
  Doorbell* doorbell() noexcept override { return &bell; }
};

inline int64_t stress_scale() {
  const char* s = std::getenv("HOTLOOP_STRESS_SCALE");
  long v = s ? std::atol(s) : 1;
  return v > 0 ? v : 1;
}

inline bool under_tsan() {
#if defined(__SANITIZE_THREAD__)
  return true;
#else
  return false;
#endif
}

// Checks `pred` every 100 us until it holds or `timeout_ns` passes; returns whether it held. Test code waiting
// for an observable state, so a loaded machine makes it slower, never wrong.
template <class Pred>
bool wait_until(Pred pred, int64_t timeout_ns = 10'000'000'000) {
  const int64_t until = now_ns() + timeout_ns;
  while (!pred()) {
    if (now_ns() >= until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

// Waits until at least `n` waiters are parked on `bell` (a parked waiter announced itself there: doorbell.h).
inline bool wait_parked(const Doorbell& bell, uint32_t n = 1, int64_t timeout_ns = 10'000'000'000) {
  return wait_until([&] { return bell.parked() >= n; }, timeout_ns);
}

inline pid_t this_tid() { return pid_t(::syscall(SYS_gettid)); }

// Whether thread `tid` of this process is blocked now in system call `nr` (SYS_ppoll, ...): what a wait on
// descriptors alone parks in, where no doorbell counts it.
inline bool blocked_in(pid_t tid, long nr) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/syscall", int(tid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  long got = -1;
  const bool read = std::fscanf(f, "%ld", &got) == 1;  // "running" when it is not in a system call
  std::fclose(f);
  return read && got == nr;
}

}  // namespace hotloop::test
