#include "hotloop/doorbell.h"

#include <unistd.h>

#include <climits>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "hotloop/futex.h"

namespace hotloop {
namespace {

// Process-local map doorbell -> eventfds of waiters sleeping in ppoll. Touched only when a waiter with file
// descriptors parks, and by rings that find watchers_ > 0; never on the fast path.
struct WatchRegistry {
  std::mutex mu;
  std::unordered_multimap<const Doorbell*, int> fds;
};

WatchRegistry& registry() {
  static WatchRegistry* r = new WatchRegistry();  // leaked on purpose: usable during static destruction
  return *r;
}

}  // namespace

int Doorbell::park(uint32_t seen, int64_t deadline_ns) noexcept {
  return futex::wait(&seq_, seen, shared_ != 0, deadline_ns);
}

void Doorbell::wake_parked() noexcept {
  rung_ns_.store(now_ns(), std::memory_order_relaxed);  // before the wake: the woken waiter reads it
  futex::wake(&seq_, INT_MAX, shared_ != 0);
  if (watchers_.load(std::memory_order_seq_cst) == 0) return;
  WatchRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto [begin, end] = r.fds.equal_range(this);
  for (auto it = begin; it != end; ++it) {
    uint64_t one = 1;
    // An eventfd write only fails when its counter would overflow, which a waiter's read resets.
    [[maybe_unused]] ssize_t n = ::write(it->second, &one, sizeof(one));
  }
}

void Doorbell::watch(int eventfd) noexcept {
  WatchRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.fds.emplace(this, eventfd);
  watchers_.fetch_add(1, std::memory_order_seq_cst);
}

void Doorbell::unwatch(int eventfd) noexcept {
  WatchRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto [begin, end] = r.fds.equal_range(this);
  for (auto it = begin; it != end; ++it) {
    if (it->second == eventfd) {
      r.fds.erase(it);
      watchers_.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
  }
}

}  // namespace hotloop
