// Flag: a settable boolean that wait_any can wait on (cancel, shutdown, "work available").
// set() and clear() are safe from any thread; set() rings the doorbell so parked waiters wake at once.
// is_set()/ready() is one atomic load.
// Ordering: set() stores the value (release) before ring()'s seq_cst increment, so a waiter that sees the new
// sequence, or is woken, sees the flag set (doorbell.h, "Ordering"); is_set() loads with acquire, so what the
// setter wrote before set() is visible to whoever sees it set. A clear() racing a set() is decided by the
// value's modification order alone (the last one wins); clear() does not ring.
#pragma once

#include <atomic>
#include <cstdint>

#include "hotloop/source.h"

namespace hotloop {

class Flag final : public Source {
 public:
  void set() noexcept;
  void clear() noexcept { value_.store(0, std::memory_order_release); }
  bool is_set() const noexcept { return value_.load(std::memory_order_acquire) != 0; }

  bool ready() const noexcept override { return is_set(); }
  Doorbell* doorbell() noexcept override { return &bell_; }

 private:
  Doorbell bell_;
  std::atomic<uint32_t> value_{0};
};

}  // namespace hotloop
