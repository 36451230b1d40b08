#include "hotloop/wait_policy.h"

#include <algorithm>

namespace hotloop {

WaitPolicy::WaitPolicy(const WaitPolicy& o) noexcept
    : spin_ns_(o.spin_ns_), yield_ns_(o.yield_ns_), adaptive_(o.adaptive_), min_spin_ns_(o.min_spin_ns_),
      fd_check_ns_(o.fd_check_ns_), ema_ns_(o.ema_ns_.load(std::memory_order_relaxed)) {}

WaitPolicy& WaitPolicy::operator=(const WaitPolicy& o) noexcept {
  spin_ns_ = o.spin_ns_;
  yield_ns_ = o.yield_ns_;
  adaptive_ = o.adaptive_;
  min_spin_ns_ = o.min_spin_ns_;
  fd_check_ns_ = o.fd_check_ns_;
  ema_ns_.store(o.ema_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  return *this;
}

WaitBudgets WaitPolicy::budgets() const noexcept {
  if (!adaptive_) return {spin_ns_, yield_ns_};
  int64_t ema = ema_ns_.load(std::memory_order_relaxed);
  if (ema < 0) return {spin_ns_, yield_ns_};  // no history: behave like the fixed policy
  if (ema <= spin_ns_) {
    // Events come quickly: spin long enough to catch a typical one (2x the average), never past the cap.
    int64_t spin = std::clamp<int64_t>(2 * ema, min_spin_ns_, spin_ns_);
    return {spin, yield_ns_};
  }
  // Events are far apart: spinning would mostly be wasted, so park almost at once.
  return {std::min(min_spin_ns_, spin_ns_), 0};
}

void WaitPolicy::record(int64_t waited_ns) noexcept {
  if (!adaptive_) return;
  waited_ns = std::max<int64_t>(waited_ns, 0);
  // Cap the sample so one long idle period does not keep the policy parking for dozens of waits after the
  // traffic resumes: anything above 4x the spin budget means "slow" just as well.
  waited_ns = std::min<int64_t>(waited_ns, 4 * std::max<int64_t>(spin_ns_, min_spin_ns_));
  int64_t ema = ema_ns_.load(std::memory_order_relaxed);
  int64_t next = ema < 0 ? waited_ns : ema + (waited_ns - ema) / 8;
  ema_ns_.store(next, std::memory_order_relaxed);
}

}  // namespace hotloop
