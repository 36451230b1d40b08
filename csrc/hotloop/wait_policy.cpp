#include "hotloop/wait_policy.h"

#include "hotloop/clock.h"

#include <algorithm>
#include <cstdlib>

namespace hotloop {

WaitPolicy::WaitPolicy(const WaitPolicy& o) noexcept
    : spin_ns_(o.spin_ns_), yield_ns_(o.yield_ns_), adaptive_(o.adaptive_), min_spin_ns_(o.min_spin_ns_),
      fd_check_ns_(o.fd_check_ns_), ema_ns_(o.ema_ns_.load(std::memory_order_relaxed)), paced_(o.paced_),
      lead_ns_(o.lead_ns_), pace_(o.pace_) {}

WaitPolicy& WaitPolicy::operator=(const WaitPolicy& o) noexcept {
  spin_ns_ = o.spin_ns_;
  yield_ns_ = o.yield_ns_;
  adaptive_ = o.adaptive_;
  min_spin_ns_ = o.min_spin_ns_;
  fd_check_ns_ = o.fd_check_ns_;
  ema_ns_.store(o.ema_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  paced_ = o.paced_;
  lead_ns_ = o.lead_ns_;
  pace_ = o.pace_;
  return *this;
}

namespace {
template <class T>
void copy_relaxed(std::atomic<T>& to, const std::atomic<T>& from) noexcept {
  to.store(from.load(std::memory_order_relaxed), std::memory_order_relaxed);
}
}  // namespace

WaitPolicy::PaceState& WaitPolicy::PaceState::operator=(const PaceState& o) noexcept {
  copy_relaxed(anchor, o.anchor);
  copy_relaxed(srtt, o.srtt);
  copy_relaxed(rttvar, o.rttvar);
  copy_relaxed(late, o.late);
  copy_relaxed(steady, o.steady);
  copy_relaxed(miss_run, o.miss_run);
  copy_relaxed(predicted, o.predicted);
  copy_relaxed(hit, o.hit);
  copy_relaxed(early, o.early);
  copy_relaxed(late_n, o.late_n);
  copy_relaxed(samples, o.samples);
  copy_relaxed(misses, o.misses);
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

// ---- paced mode (wait_policy.h, "Paced mode") ----

bool WaitPolicy::predicting() const noexcept {
  return paced_ && pace_.srtt.load(std::memory_order_relaxed) > 0 &&
         pace_.steady.load(std::memory_order_relaxed) >= kPacedWarmup &&
         pace_.miss_run.load(std::memory_order_relaxed) < kPacedMaxMisses;
}

PacedPlan WaitPolicy::plan(int64_t now) const noexcept {
  PacedPlan p;
  const int64_t anchor = pace_.anchor.load(std::memory_order_relaxed);
  if (!predicting() || anchor < 0) return p;
  const int64_t srtt = pace_.srtt.load(std::memory_order_relaxed);
  const int64_t dev = pace_.rttvar.load(std::memory_order_relaxed);
  const int64_t late = pace_.late.load(std::memory_order_relaxed);
  // Spin from `half` before the predicted ready to `half` after it; the timed park ends `late` earlier still, as
  // its timer fires about that late. The window (2 x half) is at most a quarter of the interval.
  const int64_t due = anchor + srtt;
  const int64_t half = std::min({std::max(lead_ns_, kPacedDevMultiple * dev), srtt / 8, kPacedMaxWindowNs / 2});
  p.wake_ns = due - half - late;
  p.spin_end_ns = due + half;
  p.predicted = now < p.spin_end_ns;  // a wait that starts after the window has nothing to predict
  return p;
}

void WaitPolicy::restart_interval(int64_t sample) noexcept {
  pace_.srtt.store(sample, std::memory_order_relaxed);
  pace_.rttvar.store(sample / 4, std::memory_order_relaxed);
  pace_.steady.store(1, std::memory_order_relaxed);
}

void WaitPolicy::forget_interval() noexcept {
  pace_.srtt.store(-1, std::memory_order_relaxed);
  pace_.rttvar.store(0, std::memory_order_relaxed);
  pace_.steady.store(0, std::memory_order_relaxed);
  pace_.miss_run.store(0, std::memory_order_relaxed);
}

void WaitPolicy::observe_ready(int64_t ready) noexcept {
  const int64_t anchor = pace_.anchor.load(std::memory_order_relaxed);
  if (anchor < 0 || ready <= anchor) {
    pace_.anchor.store(std::max(anchor, ready), std::memory_order_relaxed);
    return;
  }
  const int64_t sample = ready - anchor;
  const int64_t srtt = pace_.srtt.load(std::memory_order_relaxed);
  const int64_t dev = pace_.rttvar.load(std::memory_order_relaxed);
  if (srtt <= 0) {  // the first sample (after a reset)
    restart_interval(sample);
    pace_.samples.fetch_add(1, std::memory_order_relaxed);
    pace_.anchor.store(ready, std::memory_order_relaxed);
    return;
  }
  const int64_t err = sample - srtt;
  if (std::abs(err) > std::max(srtt / 2, 4 * dev)) {
    // An outlier: an idle gap (long) or a ready that is not the periodic one (short). Not fed.
    pace_.misses.fetch_add(1, std::memory_order_relaxed);
    if (err > 0) pace_.anchor.store(ready, std::memory_order_relaxed);  // a short one keeps the anchor
    if (pace_.steady.load(std::memory_order_relaxed) < kPacedWarmup) {
      // Still learning: start again from this sample rather than from one that did not agree.
      if (err > 0) restart_interval(sample);
      return;
    }
    if (pace_.miss_run.fetch_add(1, std::memory_order_relaxed) + 1 >= kPacedMaxMisses) forget_interval();
    return;
  }
  pace_.samples.fetch_add(1, std::memory_order_relaxed);
  pace_.srtt.store(srtt + err / 8, std::memory_order_relaxed);
  pace_.rttvar.store(dev + (std::abs(err) - dev) / 4, std::memory_order_relaxed);
  pace_.steady.store(std::min(pace_.steady.load(std::memory_order_relaxed) + 1, 1 << 20), std::memory_order_relaxed);
  pace_.miss_run.store(0, std::memory_order_relaxed);
  pace_.anchor.store(ready, std::memory_order_relaxed);
}

void WaitPolicy::observe_ready_unknown(int64_t now) noexcept {
  const int64_t anchor = pace_.anchor.load(std::memory_order_relaxed);
  const int64_t srtt = pace_.srtt.load(std::memory_order_relaxed);
  if (anchor < 0 || srtt <= 0) return;
  if (now < 0) now = now_ns();
  const int64_t dev = pace_.rttvar.load(std::memory_order_relaxed);
  if (srtt - (now - anchor) > std::max(srtt / 2, 4 * dev)) return;  // a short one (an input): the anchor stays
  pace_.anchor.store(-1, std::memory_order_relaxed);
}

void WaitPolicy::record_timer_lateness(int64_t late_ns) noexcept {
  // Capped: one wake-up delayed by a busy core must not push the wake point far ahead for many waits.
  late_ns = std::clamp<int64_t>(late_ns, 0, 200'000);
  const int64_t late = pace_.late.load(std::memory_order_relaxed);
  pace_.late.store(late + (late_ns - late) / 8, std::memory_order_relaxed);
}

void WaitPolicy::count_paced(PacedOutcome o) noexcept {
  auto& c = o == PacedOutcome::kHit ? pace_.hit : o == PacedOutcome::kEarly ? pace_.early : pace_.late_n;
  c.fetch_add(1, std::memory_order_relaxed);
}

PacedStats WaitPolicy::paced_stats() const noexcept {
  PacedStats s;
  s.predicted = pace_.predicted.load(std::memory_order_relaxed);
  s.hit = pace_.hit.load(std::memory_order_relaxed);
  s.early = pace_.early.load(std::memory_order_relaxed);
  s.late = pace_.late_n.load(std::memory_order_relaxed);
  s.samples = pace_.samples.load(std::memory_order_relaxed);
  s.misses = pace_.misses.load(std::memory_order_relaxed);
  return s;
}

}  // namespace hotloop
