// Helpers shared by the C++ tests: a counting source and the stress scale.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>

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

}  // namespace hotloop::test
