// WaitPolicy: how long a wait spins, then yields, before it parks in the kernel.
//
// Phases. spin: check the sources, `pause`, repeat (reacts in tens of ns, burns a core). yield: check,
// sched_yield(), repeat (lets other threads on this core run; still burns CPU if none). park: sleep in the
// kernel (futex or ppoll) until a doorbell rings, a descriptor is readable, or the deadline (costs ~0 CPU, but
// a wake-up costs a context switch: ~5 us on bare metal, ~30 us on small VMs).
//
// Defaults (spin 20 us, yield 10 us): spinning for about as long as a park + wake round trip costs means a
// wait never spends more than ~2x the ideal (the ski-rental argument), while waits that end within the budget
// (a message under load, a short GPU step) never pay the context switch.
//
// Adaptive mode sizes the spin from recent history: it keeps an exponential moving average of how long
// waits took (EMA, weight 1/8). When waits end quickly (EMA within the spin budget) it spins for up to 2x the
// EMA; when they take longer (events are periodic and far apart: idle engines, streaming at human speed) it
// spins only `min_spin_ns` and parks, so a loop woken every few ms costs ~0 CPU. The statistics are per
// WaitPolicy object: give each waiting thread its own. Updates are relaxed atomics, so sharing one across
// threads is safe, only less precise.
#pragma once

#include <atomic>
#include <cstdint>

namespace hotloop {

struct WaitBudgets {
  int64_t spin_ns;
  int64_t yield_ns;
};

class WaitPolicy {
 public:
  static constexpr int64_t kDefaultSpinNs = 20'000;
  static constexpr int64_t kDefaultYieldNs = 10'000;
  static constexpr int64_t kDefaultMinSpinNs = 1'000;
  // While spinning, file descriptors are polled (a system call) at most once per this interval.
  static constexpr int64_t kDefaultFdCheckNs = 20'000;

  WaitPolicy() = default;
  WaitPolicy(int64_t spin_ns, int64_t yield_ns, bool adaptive) noexcept
      : spin_ns_(spin_ns), yield_ns_(yield_ns), adaptive_(adaptive) {}
  WaitPolicy(const WaitPolicy& other) noexcept;
  WaitPolicy& operator=(const WaitPolicy& other) noexcept;

  // The budgets for the next wait (adaptive: derived from the recent history).
  WaitBudgets budgets() const noexcept;
  // Feed back how long a wait lasted (until ready, or until its deadline).
  void record(int64_t waited_ns) noexcept;

  int64_t spin_ns() const noexcept { return spin_ns_; }
  int64_t yield_ns() const noexcept { return yield_ns_; }
  bool adaptive() const noexcept { return adaptive_; }
  int64_t min_spin_ns() const noexcept { return min_spin_ns_; }
  int64_t fd_check_ns() const noexcept { return fd_check_ns_; }
  int64_t recent_wait_ns() const noexcept { return ema_ns_.load(std::memory_order_relaxed); }

  void set_spin_ns(int64_t v) noexcept { spin_ns_ = v; }
  void set_yield_ns(int64_t v) noexcept { yield_ns_ = v; }
  void set_adaptive(bool v) noexcept { adaptive_ = v; }
  void set_min_spin_ns(int64_t v) noexcept { min_spin_ns_ = v; }
  void set_fd_check_ns(int64_t v) noexcept { fd_check_ns_ = v; }

 private:
  int64_t spin_ns_ = kDefaultSpinNs;
  int64_t yield_ns_ = kDefaultYieldNs;
  bool adaptive_ = false;
  int64_t min_spin_ns_ = kDefaultMinSpinNs;
  int64_t fd_check_ns_ = kDefaultFdCheckNs;
  std::atomic<int64_t> ema_ns_{-1};  // -1: no history yet
};

}  // namespace hotloop
