// wait_any over flags, descriptors and counters: readiness masks, timeouts, wake-ups from park, errors.
#include "hotloop/wait_any.h"

#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/fd_source.h"
#include "hotloop/flag.h"
#include "test_util.h"

namespace hotloop {
namespace {

constexpr int64_t kMs = 1'000'000;
const WaitPolicy kParkAtOnce(0, 0, false);

struct Pipe {
  int r = -1, w = -1;
  Pipe() {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe");
    r = fds[0];
    w = fds[1];
  }
  ~Pipe() {
    if (r >= 0) ::close(r);
    if (w >= 0) ::close(w);
  }
  void write_byte() { ASSERT_EQ(::write(w, "x", 1), 1); }
};

TEST(WaitAny, ReportsWhichSourcesAreReady) {
  Flag a, b, c;
  Source* s[] = {&a, &b, &c};
  WaitPolicy p;
  b.set();
  c.set();
  EXPECT_EQ(wait_any(s, 3, 0, p), 0b110u);
  EXPECT_EQ(ready_mask(s, 3), 0b110u);
  b.clear();
  c.clear();
  EXPECT_EQ(wait_any(s, 3, 0, p), 0u);
}

TEST(WaitAny, NeverConsumes) {
  Flag f;
  f.set();
  Source* s[] = {&f};
  WaitPolicy p;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(wait_any(s, 1, 0, p), 1u);
  EXPECT_TRUE(f.is_set());
}

TEST(WaitAny, TimeoutIsHonouredInEveryPhase) {
  Flag f;
  Source* s[] = {&f};
  for (WaitPolicy p : {WaitPolicy(0, 0, false), WaitPolicy(100 * kMs, 0, false), WaitPolicy(0, 100 * kMs, false),
                       WaitPolicy()}) {
    WaitStats st;
    int64_t t0 = now_ns();
    EXPECT_EQ(wait_any(s, 1, 30 * kMs, p, nullptr, &st), 0u);
    int64_t waited = now_ns() - t0;
    EXPECT_GE(waited, 30 * kMs);
    EXPECT_LT(waited, 30 * kMs + 50 * kMs) << "returned late after the deadline";
  }
}

TEST(WaitAny, FlagSetFromAnotherThreadWakesAParkedWait) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p = kParkAtOnce;
  WaitStats st;
  std::thread setter([&] {
    EXPECT_TRUE(test::wait_parked(*f.doorbell())) << "the wait never parked";
    f.set();
  });
  int64_t t0 = now_ns();
  EXPECT_EQ(wait_any(s, 1, 5'000 * kMs, p, nullptr, &st), 1u);
  EXPECT_LT(now_ns() - t0, 2'000 * kMs);
  EXPECT_EQ(st.phase, WaitPhase::kPark);
  setter.join();
  EXPECT_EQ(f.doorbell()->parked(), 0u);
}

TEST(WaitAny, SeveralDoorbellsWakeThroughOneSleep) {
  Flag a, b, c;
  Source* s[] = {&a, &b, &c};
  for (Flag* which : {&a, &b, &c}) {
    a.clear(), b.clear(), c.clear();
    WaitPolicy p = kParkAtOnce;
    WaitStats st;
    std::thread setter([&] {
      EXPECT_TRUE(test::wait_parked(*which->doorbell())) << "the wait never parked";
      which->set();
    });
    uint64_t mask = wait_any(s, 3, 5'000 * kMs, p, nullptr, &st);
    setter.join();
    EXPECT_EQ(mask, which == &a ? 1u : which == &b ? 2u : 4u);
    EXPECT_EQ(st.phase, WaitPhase::kPark);
  }
}

TEST(WaitAny, ReadableDescriptorWakesAParkedWait) {
  Pipe pipe;
  FdSource fd(pipe.r);
  Flag f;
  Source* s[] = {&f, &fd};
  WaitPolicy p = kParkAtOnce;
  WaitStats st;
  std::thread writer([&] {
    EXPECT_TRUE(test::wait_parked(*f.doorbell())) << "the wait never parked";
    pipe.write_byte();
  });
  int64_t t0 = now_ns();
  EXPECT_EQ(wait_any(s, 2, 5'000 * kMs, p, nullptr, &st), 2u);
  EXPECT_LT(now_ns() - t0, 2'000 * kMs);
  EXPECT_EQ(st.phase, WaitPhase::kPark);
  writer.join();
}

TEST(WaitAny, FlagWakesAWaitThatAlsoWatchesDescriptors) {
  Pipe pipe;
  FdSource fd(pipe.r);
  Flag f;
  Source* s[] = {&fd, &f};
  WaitPolicy p = kParkAtOnce;
  std::atomic<int64_t> set_at{0};
  std::thread setter([&] {
    EXPECT_TRUE(test::wait_parked(*f.doorbell())) << "the wait never parked";
    set_at = now_ns();
    f.set();
  });
  EXPECT_EQ(wait_any(s, 2, 5'000 * kMs, p), 2u);
  int64_t woke = now_ns();
  setter.join();
  EXPECT_LT(woke - set_at.load(), 50 * kMs) << "the flag must wake the park at once, not a periodic re-check";
  EXPECT_EQ(f.doorbell()->parked(), 0u);
}

TEST(WaitAny, DescriptorIsNoticedWhileSpinning) {
  Pipe pipe;
  FdSource fd(pipe.r);
  Source* s[] = {&fd};
  WaitPolicy spin_long(2'000 * kMs, 0, false);
  WaitStats st;
  std::thread writer([&] {
    // Deliberate: a spinning wait shows no state to wait for; 20 ms into its 2 s spin budget the write lands
    // while it spins (a write before wait_any starts would read as an immediate return, not a spin).
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pipe.write_byte();
  });
  EXPECT_EQ(wait_any(s, 1, 5'000 * kMs, spin_long, nullptr, &st), 1u);
  EXPECT_EQ(st.phase, WaitPhase::kSpin);
  writer.join();
}

TEST(WaitAny, HungUpDescriptorCountsAsReady) {
  Pipe pipe;
  FdSource fd(pipe.r);
  ::close(pipe.w);
  pipe.w = -1;
  Source* s[] = {&fd};
  WaitPolicy p;
  EXPECT_EQ(wait_any(s, 1, 1'000 * kMs, p), 1u);
}

TEST(WaitAny, DescriptorClosedWhileWaitedOnRaises) {
  // The close wakes nothing (the kernel holds the watched file open): the park's safety timeout notices it.
  Pipe pipe;
  FdSource fd(pipe.r);
  Source* s[] = {&fd};
  WaitPolicy p = kParkAtOnce;
  const pid_t waiter = test::this_tid();
  std::thread closer([&] {
    // a wait on descriptors alone sleeps in ppoll, where no doorbell counts it
    EXPECT_TRUE(test::wait_until([&] { return test::blocked_in(waiter, SYS_ppoll); })) << "the wait never parked";
    ::close(pipe.r);
    pipe.r = -1;
  });
  WaitStats st;
  int64_t t0 = now_ns();
  EXPECT_THROW(wait_any(s, 1, -1, p, nullptr, &st), SourceError);
  EXPECT_LT(now_ns() - t0, kFdSafetyNs + 500 * kMs);
  EXPECT_EQ(st.safety_wakeups, 1u);
  closer.join();
}

TEST(WaitAny, DescriptorClosedWhileWaitedOnRaisesWithinAHookSlice) {
  Pipe pipe;
  FdSource fd(pipe.r);
  Source* s[] = {&fd};
  WaitPolicy p = kParkAtOnce;
  WaitHooks hooks;
  hooks.slice_ns = 50 * kMs;
  hooks.on_slice = [](void*) {};
  const pid_t waiter = test::this_tid();
  std::thread closer([&] {
    // a wait on descriptors alone sleeps in ppoll, where no doorbell counts it
    EXPECT_TRUE(test::wait_until([&] { return test::blocked_in(waiter, SYS_ppoll); })) << "the wait never parked";
    ::close(pipe.r);
    pipe.r = -1;
  });
  WaitStats st;
  int64_t t0 = now_ns();
  EXPECT_THROW(wait_any(s, 1, -1, p, &hooks, &st), SourceError);
  EXPECT_LT(now_ns() - t0, 500 * kMs);
  EXPECT_EQ(st.safety_wakeups, 0u);
  closer.join();
}

TEST(WaitAny, IdleDescriptorWaitWakesOnlyForTheSafetyTimeout) {
  Pipe pipe;
  FdSource fd(pipe.r);
  Source* s[] = {&fd};
  WaitPolicy p = kParkAtOnce;
  WaitStats st;
  EXPECT_EQ(wait_any(s, 1, kFdSafetyNs + 200 * kMs, p, nullptr, &st), 0u);
  EXPECT_EQ(st.parks, 2u) << "one park per safety period, no 100 ms re-checks";
  EXPECT_EQ(st.safety_wakeups, 1u);
}

TEST(WaitAny, BadArgumentsAreRejected) {
  WaitPolicy p;
  EXPECT_THROW(wait_any(nullptr, 0, -1, p), std::invalid_argument);
  Source* null_source[] = {nullptr};
  EXPECT_THROW(wait_any(null_source, 1, 0, p), std::invalid_argument);
  Flag flags[65];
  Source* many[65];
  for (int i = 0; i < 65; ++i) many[i] = &flags[i];
  EXPECT_THROW(wait_any(many, 65, 0, p), std::invalid_argument);
  EXPECT_THROW(FdSource(-1), std::invalid_argument);
  EXPECT_THROW(FdSource(1'000'000), SourceError);
}

TEST(WaitAny, NoSourcesSleepsUntilTheTimeout) {
  WaitPolicy p;
  int64_t t0 = now_ns();
  EXPECT_EQ(wait_any(nullptr, 0, 20 * kMs, p), 0u);
  EXPECT_GE(now_ns() - t0, 20 * kMs);
  // in one sleep: not a loop of parks that return at once (futex_waitv refuses an empty list), nor a park on a
  // doorbell that is not there (where futex_waitv is missing: kernels before 5.16, qemu-user)
  WaitPolicy at_once = kParkAtOnce;
  WaitStats st;
  t0 = now_ns();
  EXPECT_EQ(wait_any(nullptr, 0, 20 * kMs, at_once, nullptr, &st), 0u);
  EXPECT_GE(now_ns() - t0, 20 * kMs);
  EXPECT_EQ(st.parks, 1u);
}

TEST(WaitAny, HookCanAbortAParkedWaitAndLeavesNothingAnnounced) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p = kParkAtOnce;
  int calls = 0;
  WaitHooks hooks;
  hooks.slice_ns = 5 * kMs;
  hooks.ctx = &calls;
  hooks.on_slice = [](void* ctx) {
    if (++*static_cast<int*>(ctx) == 3) throw std::runtime_error("interrupted");
  };
  int64_t t0 = now_ns();
  EXPECT_THROW(wait_any(s, 1, -1, p, &hooks), std::runtime_error);
  EXPECT_EQ(calls, 3);
  EXPECT_LT(now_ns() - t0, 1'000 * kMs);
  EXPECT_EQ(f.doorbell()->parked(), 0u);
}

TEST(WaitAny, AdaptivePolicyLearnsToPark) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p(50'000, 0, true);
  // Events 5 ms apart: after a few waits the policy stops spinning its 50 us budget.
  for (int i = 0; i < 20; ++i) {
    std::thread setter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // deliberate: the 5 ms spacing is what it learns
      f.set();
    });
    EXPECT_EQ(wait_any(s, 1, 5'000 * kMs, p), 1u);
    f.clear();
    setter.join();
  }
  EXPECT_EQ(p.budgets().spin_ns, p.min_spin_ns());
}

// ---- paced waits (wait_policy.h, "Paced mode") ----

// A policy that has learned `interval` and is anchored now: its next wait is predicted at now + interval.
WaitPolicy trained_paced(int64_t interval) {
  WaitPolicy p(20'000, 10'000, false, true);
  int64_t t = now_ns() - 40 * interval;
  for (int i = 0; i < 40; ++i) p.observe_ready(t += interval);
  p.anchor(now_ns());
  return p;
}

TEST(PacedWait, APeriodicDoorbellIsCaughtInTheSpinWindowAfterWarmUp) {
  // Another thread rings every 2 ms on an absolute schedule; the waiter consumes each ring.
  test::CounterSource src;
  Source* s[] = {&src};
  WaitPolicy p(20'000, 10'000, false, true);
  constexpr int kRings = 300;
  // The estimate follows the last few dozen intervals (EMA 1/8; a restart after misses converges in ~10): the
  // timing checks hold the policy to a 2 ms period only when the ringer kept it over the last kSteadyTail rings.
  constexpr int kSteadyTail = 40;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> tail_late_ns{0};  // the ringer's worst lateness over the last kSteadyTail rings
  std::thread ringer([&] {
    ::prctl(PR_SET_TIMERSLACK, 1'000UL, 0, 0, 0);  // ring on time (the default slack adds up to 50 us)
    int64_t next = now_ns() + 2 * kMs;
    for (int i = 0; i < kRings && !stop; ++i, next += 2 * kMs) {
      timespec ts{time_t(next / 1'000'000'000), long(next % 1'000'000'000)};
      clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
      if (i >= kRings - kSteadyTail) tail_late_ns = std::max<int64_t>(tail_late_ns, now_ns() - next);
      src.publish();
    }
  });
  int got = 0;
  int tail_coalesced = 0;  // waits over the last kSteadyTail rings that found more than one new ring
  while (got < kRings) {
    if (wait_any(s, 1, 2'000 * kMs, p) == 0) break;  // a lost wake-up would end here
    uint64_t v = src.value.load(std::memory_order_acquire);
    const int fresh = int(v - src.seen.load(std::memory_order_relaxed));
    if (fresh > 1 && got >= kRings - kSteadyTail) ++tail_coalesced;
    got += fresh;
    src.seen.store(v, std::memory_order_relaxed);
  }
  stop = true;
  ringer.join();
  EXPECT_EQ(got, kRings) << "every ring ended a wait";
  PacedStats st = p.paced_stats();
  if (tail_late_ns > kMs / 2) {  // a loaded machine held the ringer back: its rings were not a 2 ms period
    std::printf("the ringer ran up to %.0f us late over its last %d rings: the timing checks do not apply\n",
                tail_late_ns / 1e3, kSteadyTail);
    return;
  }
  // The waiter is held back the same way: a wait that finds two rings waiting means its thread was off the CPU
  // for a whole period (a ring during a park wakes it at once, and a lost ring fails the count above), so the
  // intervals it observed were 4 ms as often as 2 ms and the learned period says nothing about the policy.
  if (tail_coalesced > 0) {
    std::printf("the waiter found two rings at once %d times over the last %d rings (off the CPU for a period): "
                "the timing checks do not apply\n", tail_coalesced, kSteadyTail);
    return;
  }
  EXPECT_NEAR(double(p.interval_ns()), 2.0 * kMs, 0.5 * kMs);
  if (test::under_tsan()) return;  // too slow under TSan for the timing part to mean anything
  std::printf("paced over a 2 ms ring: predicted %llu hit %llu early %llu late %llu; interval %.1f us, deviation "
              "%.1f us, timer lateness %.1f us\n",
              (unsigned long long)st.predicted, (unsigned long long)st.hit, (unsigned long long)st.early,
              (unsigned long long)st.late, p.interval_ns() / 1e3, p.interval_dev_ns() / 1e3, p.timer_late_ns() / 1e3);
  // Loose bounds: a loaded CI machine delays the ringer and the waiter alike (on a quiet 2-vCPU VM 60-75 % of the
  // predicted waits are hits, under a parallel ctest run 40-75 %, most of the rest early: the waiter's timer
  // wake-up waited for a core).
  EXPECT_GT(st.predicted, uint64_t(kRings / 3)) << "most waits after the warm-up are predicted";
  EXPECT_GT(st.hit, st.predicted / 4) << "hit " << st.hit << " early " << st.early << " late " << st.late;
  EXPECT_GT(st.hit, st.late) << "hit " << st.hit << " early " << st.early << " late " << st.late;
}

TEST(PacedWait, AWaitThatFindsTheSourceReadyAfterThePredictionDropsTheAnchor) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p = trained_paced(2 * kMs);
  const int64_t anchor = p.anchor_ns();
  f.set();
  EXPECT_EQ(wait_any(s, 1, 0, p), 1u);  // ready at the first check, right after the anchor: an input
  EXPECT_EQ(p.anchor_ns(), anchor);
  std::this_thread::sleep_for(std::chrono::microseconds(2'500));  // the waiter falls behind the period
  EXPECT_EQ(wait_any(s, 1, 0, p), 1u);
  EXPECT_EQ(p.anchor_ns(), -1) << "the ready it found came at an unknown time in the last period";
}

TEST(PacedWait, ARingDuringTheTimedParkWakesItAtOnce) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p = trained_paced(400 * kMs);  // the next ready is predicted ~400 ms from now
  ASSERT_TRUE(p.plan(now_ns()).predicted);
  std::thread setter([&] {
    while (f.doorbell()->parked() == 0) std::this_thread::yield();  // the wait is in its timed park
    f.set();
  });
  WaitStats st;
  const int64_t t0 = now_ns();
  EXPECT_EQ(wait_any(s, 1, 5'000 * kMs, p, nullptr, &st), 1u);
  EXPECT_LT(now_ns() - t0, 300 * kMs) << "the ring must not wait for the predicted time";
  setter.join();
  EXPECT_EQ(st.phase, WaitPhase::kPark);
  EXPECT_EQ(p.paced_stats().early, 1u);
  EXPECT_EQ(p.paced_stats().predicted, 1u);
}

TEST(PacedWait, TheCallersTimeoutWins) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p = trained_paced(400 * kMs);
  int64_t t0 = now_ns();
  EXPECT_EQ(wait_any(s, 1, 20 * kMs, p), 0u);
  int64_t waited = now_ns() - t0;
  EXPECT_GE(waited, 20 * kMs);
  EXPECT_LT(waited, 250 * kMs) << "a timeout before the predicted wake point ends the timed park";
  EXPECT_EQ(wait_any(s, 1, 0, p), 0u);
  PacedStats st = p.paced_stats();
  EXPECT_EQ(st.hit + st.early + st.late, 0u) << "a wait that timed out is none of hit, early, late";
}

TEST(PacedWait, AReadyAfterTheWindowIsLateAndStillWakesTheWait) {
  Flag f;
  Source* s[] = {&f};
  WaitPolicy p = trained_paced(40 * kMs);
  const PacedPlan plan = p.plan(now_ns());
  ASSERT_TRUE(plan.predicted);
  std::thread setter([&] {
    while (now_ns() < plan.spin_end_ns + 20 * kMs || f.doorbell()->parked() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    f.set();
  });
  WaitStats st;
  EXPECT_EQ(wait_any(s, 1, 5'000 * kMs, p, nullptr, &st), 1u);
  setter.join();
  EXPECT_EQ(st.phase, WaitPhase::kPark);
  EXPECT_EQ(p.paced_stats().late, 1u);
}

}  // namespace
}  // namespace hotloop
