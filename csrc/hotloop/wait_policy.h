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
//
// Paced mode (paced=true; off by default) is for messages that come at a steady period (a decode step every
// ~1.4 ms: the worker reads the step broadcast, the engine core the answer). It learns when the next ready is
// due and sleeps on a timer until shortly before it, then spins through the predicted arrival:
//  - anchor: the time the previous wait of this policy found something ready (the source's ready_since_ns() when
//    it keeps one, the ring's stamp when a park was woken, else the time the wait noticed it), or what the caller
//    set with anchor(t) (an engine core anchors when it broadcasts a step: its answer is due a step later). A
//    wait that finds a source ready at its first check feeds nothing (when it became ready is not known), and
//    drops the anchor unless it came too soon to be the periodic ready: a waiter that fell a period behind would
//    otherwise measure the next interval from two readies back.
//  - estimate: interval samples (ready - anchor) feed a smoothed interval and its mean deviation, as TCP's SRTT
//    and RTTVAR do (weights 1/8 and 1/4). A sample further than max(interval / 2, 4 x deviation) from the
//    interval (an idle gap, a burst, an input that is not the answer) is a miss and is not fed; a short one
//    leaves the anchor where it was. Predictions start after kPacedWarmup samples in a row that agree and stop
//    after kPacedMaxMisses misses in a row, until the intervals are steady again.
//  - the wait: half = max(lead_ns, 3 x deviation), at most an eighth of the interval and kPacedMaxWindowNs / 2.
//    If the wake point (anchor + interval - half - the timer's lateness, learned: how late this policy's timed
//    parks woke, EMA 1/8) is more than kPacedMinParkNs ahead, the wait first parks until it (a timed futex /
//    ppoll / io_uring sleep; a ring still wakes it at once: "early", which costs a normal park wake-up); then it
//    spins until half after the predicted ready, with a sched_yield() every kPacedYieldEveryNs ("hit" when the
//    message comes then: the window is at most a quarter of the interval); then it yields and parks as the fixed
//    policy does ("late"). Without a prediction
//    it is the fixed (or adaptive) policy. The caller's timeout always wins.
//  - timer slack: a thread's first paced park sets its timer slack to kPacedTimerSlackNs
//    (prctl(PR_SET_TIMERSLACK); per thread, and it stays: the thread's other timed sleeps get as precise). The
//    default slack (50 us) would add up to 50 us of lateness to every timed park.
// Measured (python -m hotloop.bench.queue_bench --only periodic --full: a writer process sends 64 B every 1.4 ms
// +-10 % to a reader process; 2-vCPU VM while other jobs ran (load 1.4-2.1); medians of 5 invocations of 3
// alternating runs, ranges in brackets): paced p50 31.0 us [26.6-37.4], p99 289 us, at 12.7 % [10.3-12.9] of an
// always-spinning reader's CPU; spinning 14.4 us [11.7-18.0] (p99 567); the fixed policy 34.8 us [32.0-54.8]
// (p99 801) at 3.7 %; adaptive 42.6 us. 83-95 % of the predicted waits saw the message in the spin window (54 % in
// one run). At 1 ms +-20 %: 27.9 us [26.1-36.1] at 12.8 %, against 16.1 and 37.4. So p50 is 1.5-2.6x a spinning
// reader's, not 1.2x: on this VM most hits find the writer woken onto the reader's own vCPU (68-96 % of hits in a
// C++ two-thread run), where a hit costs a hand-over (~10 us) instead of ~0.6 us; a spinning reader keeps its vCPU
// and never meets the writer there. Pinned to two CPUs in C++ (no other load), hits cost 0.5 us against 0.3 us
// spinning, and 86 % of waits were hits.
// The statistics (paced_stats()) count predicted waits and how they ended; a predicted wait that timed out is in
// none of hit / early / late.
#pragma once

#include <atomic>
#include <cstdint>

namespace hotloop {

struct WaitBudgets {
  int64_t spin_ns;
  int64_t yield_ns;
};

// A paced wait's plan (plan()): park until wake_ns, then spin until spin_end_ns.
struct PacedPlan {
  bool predicted = false;
  int64_t wake_ns = 0;
  int64_t spin_end_ns = 0;
};

// How the paced waits of a policy went (see "Paced mode").
struct PacedStats {
  uint64_t predicted = 0;  // waits that had a prediction
  uint64_t hit = 0;        // ready during the spin window
  uint64_t early = 0;      // a ring woke the timed park before the wake point
  uint64_t late = 0;       // the window passed: yielded / parked until the ready
  uint64_t samples = 0;    // interval samples fed into the estimate
  uint64_t misses = 0;     // interval samples rejected as outliers
};

enum class PacedOutcome : int { kHit = 0, kEarly = 1, kLate = 2 };

class WaitPolicy {
 public:
  static constexpr int64_t kDefaultSpinNs = 20'000;
  static constexpr int64_t kDefaultYieldNs = 10'000;
  static constexpr int64_t kDefaultMinSpinNs = 1'000;
  // While spinning, file descriptors are polled (a system call) at most once per this interval.
  static constexpr int64_t kDefaultFdCheckNs = 20'000;
  // Paced mode. Lead: the least margin before the predicted arrival. A timed park on this VM wakes 5-60 us late
  // even at 1 us slack (learned per policy on top of the lead), so 20 us of lead plus the learned lateness keeps
  // most wake-ups ahead of a steady message while the spin costs ~10 % of a spinning reader's CPU at 1.4 ms.
  static constexpr int64_t kDefaultLeadNs = 20'000;
  // A wake point closer than this is spun to instead of parked for (a park + wake costs ~5-50 us).
  static constexpr int64_t kPacedMinParkNs = 30'000;
  // The spin window's cap: a wait never spins more than this for a prediction (bounds CPU for long, jittery
  // periods: 20 ms +-20 % would otherwise spin 5 ms per message).
  static constexpr int64_t kPacedMaxWindowNs = 1'000'000;
  // The spin window reaches this many deviations either side of the predicted ready (the deviation is a mean
  // absolute one: uniform +-10 % jitter reads as 5 %, so 2 would only just cover it; 3 caught 82 % of 1.4 ms
  // +-10 % messages in the spin window against 70 % with 2, at 13 % of a spinning reader's CPU against 12 %).
  static constexpr int64_t kPacedDevMultiple = 3;
  static constexpr int kPacedWarmup = 4;
  static constexpr int kPacedMaxMisses = 4;
  // The paced spin window calls sched_yield() this often: a writer whose wake-up the scheduler put on this core
  // (on the 2-vCPU VM it does for most messages: a halted vCPU counts as busy) runs at once instead of waiting for
  // the window to end, which delayed the message past it. Measured (bench queue (e), 1.4 ms +-10 %, the VM under
  // other jobs' load, 4 alternating rounds): spin-window hits 248-352 of ~390 waits every 5 us, 228-330 every
  // 20 us, 53-222 never; p50 1.59-2.35x a spinning reader's, 1.95-2.36x, 1.98-3.73x. A yield with nothing else
  // to run returns in ~0.5 us.
  static constexpr int64_t kPacedYieldEveryNs = 5'000;
  // Before any timed park was measured: about what this VM's timed futex waits wake late at 1 us slack.
  static constexpr int64_t kPacedInitialLateNs = 30'000;
  // 1.3 ms timed futex waits on the 2-vCPU VM woke late by p50 83-87 us, p90 105-111 us at the default 50 us
  // slack, and by p50 34-36 us, p90 48-50 us at 1 us: the learned lateness, and so the spin it adds, is halved.
  static constexpr int64_t kPacedTimerSlackNs = 1'000;

  WaitPolicy() = default;
  WaitPolicy(int64_t spin_ns, int64_t yield_ns, bool adaptive, bool paced = false) noexcept
      : spin_ns_(spin_ns), yield_ns_(yield_ns), adaptive_(adaptive), paced_(paced) {}
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

  // ---- paced mode ----
  bool paced() const noexcept { return paced_; }
  void set_paced(bool v) noexcept { paced_ = v; }
  int64_t lead_ns() const noexcept { return lead_ns_; }
  void set_lead_ns(int64_t v) noexcept { lead_ns_ = v; }
  // Sets the anchor: the next ready is predicted at t_ns + the learned interval.
  void anchor(int64_t t_ns) noexcept { pace_.anchor.store(t_ns, std::memory_order_relaxed); }
  int64_t anchor_ns() const noexcept { return pace_.anchor.load(std::memory_order_relaxed); }
  // The learned interval and its deviation (-1: none yet), and whether waits are predicted now.
  int64_t interval_ns() const noexcept { return pace_.srtt.load(std::memory_order_relaxed); }
  int64_t interval_dev_ns() const noexcept { return pace_.rttvar.load(std::memory_order_relaxed); }
  int64_t timer_late_ns() const noexcept { return pace_.late.load(std::memory_order_relaxed); }
  bool predicting() const noexcept;
  // The plan for a wait starting at now_ns (predicted == false: no prediction, wait as the fixed policy).
  PacedPlan plan(int64_t now_ns) const noexcept;
  // A wait found a source ready that became ready at ready_ns: feeds the sample ready - anchor, moves the anchor.
  void observe_ready(int64_t ready_ns) noexcept;
  // A wait (or a read) found a source ready at its first check: when it became ready is not known. Too soon for
  // the periodic ready (what a sample this short would be: a miss) the anchor stays; otherwise it is dropped, as
  // an interval measured from it to the next ready would span two periods (the waiter fell behind by one).
  void observe_ready_unknown(int64_t now_ns = -1) noexcept;  // -1: reads the clock if it needs it
  // A timed park meant to end at the wake point ended late_ns after it.
  void record_timer_lateness(int64_t late_ns) noexcept;
  void count_paced(PacedOutcome o) noexcept;
  void count_predicted() noexcept { pace_.predicted.fetch_add(1, std::memory_order_relaxed); }
  PacedStats paced_stats() const noexcept;

 private:
  // Relaxed atomics each: a policy shared by threads stays safe, only less precise (as the adaptive EMA).
  struct PaceState {
    std::atomic<int64_t> anchor{-1};
    std::atomic<int64_t> srtt{-1};
    std::atomic<int64_t> rttvar{0};
    std::atomic<int64_t> late{kPacedInitialLateNs};
    std::atomic<int> steady{0};       // consecutive agreeing samples since the last reset
    std::atomic<int> miss_run{0};     // consecutive misses
    std::atomic<uint64_t> predicted{0}, hit{0}, early{0}, late_n{0}, samples{0}, misses{0};
    PaceState() = default;
    PaceState(const PaceState& o) noexcept { *this = o; }
    PaceState& operator=(const PaceState& o) noexcept;
  };
  void restart_interval(int64_t sample) noexcept;  // learn afresh from one interval sample
  void forget_interval() noexcept;

  int64_t spin_ns_ = kDefaultSpinNs;
  int64_t yield_ns_ = kDefaultYieldNs;
  bool adaptive_ = false;
  int64_t min_spin_ns_ = kDefaultMinSpinNs;
  int64_t fd_check_ns_ = kDefaultFdCheckNs;
  std::atomic<int64_t> ema_ns_{-1};  // -1: no history yet
  bool paced_ = false;
  int64_t lead_ns_ = kDefaultLeadNs;
  PaceState pace_;
};

}  // namespace hotloop
