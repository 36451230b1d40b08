// Monotonic time in nanoseconds and the spin-loop hint: the two things every wait needs.
// now_ns() reads CLOCK_MONOTONIC through the vDSO (~20 ns, no syscall); cpu_relax() is one `pause`
// (x86) or `yield` (arm64), which tells the core a spin loop is running and saves power.
#pragma once

#include <cstdint>
#include <ctime>

namespace hotloop {

inline int64_t now_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  asm volatile("" ::: "memory");
#endif
}

// A deadline on the CLOCK_MONOTONIC clock, or none (kForever).
constexpr int64_t kForever = INT64_MAX;

// The same from a time the caller has just read (one clock read for both).
inline int64_t deadline_after(int64_t timeout_ns, int64_t now) noexcept {
  if (timeout_ns < 0) return kForever;
  return timeout_ns > kForever - now ? kForever : now + timeout_ns;
}

inline int64_t deadline_after(int64_t timeout_ns) noexcept {
  return timeout_ns < 0 ? kForever : deadline_after(timeout_ns, now_ns());
}

inline constexpr size_t kCacheLine = 64;

}  // namespace hotloop
