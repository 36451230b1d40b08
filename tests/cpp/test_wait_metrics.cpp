// Wait metrics: each wait is counted once, in the phase it ended in, in the process aggregate and in the
// scope's metrics; phase times and wake-up latencies land where they belong; concurrent waiters lose nothing.
#include "hotloop/wait_metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "hotloop/clock.h"
#include "hotloop/flag.h"
#include "hotloop/step_counter.h"
#include "hotloop/wait_any.h"
#include "test_util.h"

namespace hotloop {
namespace {

using test::CounterSource;

constexpr int64_t kMs = 1'000'000;
constexpr int64_t kLong = 20'000 * kMs;  // a deadline no test reaches

uint64_t ended(const WaitCounts& c, WaitEnd e) { return c.ended[int(e)]; }

// A counter source that also counts its ready() checks, so a test knows a wait is past its first check.
struct CheckedSource final : Source {
  CounterSource inner;
  mutable std::atomic<uint64_t> checks{0};
  bool ready() const noexcept override {
    checks.fetch_add(1, std::memory_order_relaxed);
    return inner.ready();
  }
  Doorbell* doorbell() noexcept override { return &inner.bell; }
};

// Waits on `src` on another thread with `policy` and publishes `delay_ns` after the wait is under way: parked
// (for a policy that parks at once), or past 20 checks (spinning or yielding). Returns the wait's stats; the
// wait's metrics go to `scope`.
WaitStats wait_for_publish(CheckedSource& src, WaitPolicy policy, WaitMetrics& scope, int64_t delay_ns) {
  WaitStats st;
  std::thread waiter([&] {
    WaitMetricsScope in(&scope);
    Source* s = &src;
    EXPECT_EQ(wait_any(&s, 1, kLong, policy, nullptr, &st), 1u);
  });
  if (policy.spin_ns() == 0 && policy.yield_ns() == 0) {
    while (src.inner.bell.parked() == 0) std::this_thread::yield();
  } else {
    while (src.checks.load() < 20) std::this_thread::yield();
  }
  int64_t until = now_ns() + delay_ns;
  while (now_ns() < until) std::this_thread::yield();
  src.inner.publish();
  waiter.join();
  return st;
}

TEST(WaitMetrics, ImmediateAndTimeoutAreCountedWhereTheyEnd) {
  WaitMetrics scope;
  WaitCounts before = process_wait_metrics();
  {
    WaitMetricsScope in(&scope);
    Flag f;
    Source* s[] = {&f};
    WaitPolicy p(0, 0, false);
    EXPECT_EQ(wait_any(s, 1, 0, p), 0u);           // a zero-timeout check that finds nothing
    EXPECT_EQ(wait_any(s, 1, 2 * kMs, p), 0u);     // parks, then the deadline passes
    f.set();
    EXPECT_EQ(wait_any(s, 1, kLong, p), 1u);       // ready at the first check
  }
  WaitCounts c = scope.snapshot();
  EXPECT_EQ(ended(c, WaitEnd::kTimeout), 2u);
  EXPECT_EQ(ended(c, WaitEnd::kImmediate), 1u);
  EXPECT_EQ(c.waits(), 3u);
  EXPECT_GE(c.parks, 1u);
  // the timed-out wait slept until its deadline: most of the 2 ms (the deadline counts from the wait's start, the
  // park from after its checks: 55 us of them under TSan, where this read 1.945 ms once)
  EXPECT_GE(c.phase_ns[2], uint64_t(3 * kMs / 2));
  EXPECT_EQ(c.latency_count(), 0u);               // nothing rang: no wake-up to time
  WaitCounts after = process_wait_metrics();
  EXPECT_GE(ended(after, WaitEnd::kTimeout) - ended(before, WaitEnd::kTimeout), 2u);
  EXPECT_GE(ended(after, WaitEnd::kImmediate) - ended(before, WaitEnd::kImmediate), 1u);
}

TEST(WaitMetrics, EachPhaseIsCountedWhereTheWaitEnded) {
  struct Case {
    WaitPolicy policy;
    WaitEnd end;
    int timed_phase;
  };
  const Case cases[] = {
      {WaitPolicy(kLong, 0, false), WaitEnd::kSpin, 0},
      {WaitPolicy(0, kLong, false), WaitEnd::kYield, 1},
      {WaitPolicy(0, 0, false), WaitEnd::kPark, 2},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(int(k.end));
    CheckedSource src;
    WaitMetrics scope;
    WaitStats st = wait_for_publish(src, k.policy, scope, 2 * kMs);
    EXPECT_EQ(st.end, k.end);
    WaitCounts c = scope.snapshot();
    for (int e = 0; e < kWaitEnds; ++e) EXPECT_EQ(c.ended[e], e == int(k.end) ? 1u : 0u) << "end " << e;
    // The producer published >= 2 ms into the one phase the policy allows. Yield and park time are read at
    // the end; spin time only up to the spin loop's last clock read (a descheduled spinner may miss most of
    // the 2 ms), so it is only known to be positive.
    if (k.end == WaitEnd::kSpin) {
      EXPECT_GT(c.phase_ns[0], 0u);
    } else {
      EXPECT_GE(c.phase_ns[k.timed_phase], uint64_t(2 * kMs));
    }
    for (int p = 0; p < kTimedPhases; ++p) {
      if (p != k.timed_phase) {
        EXPECT_EQ(c.phase_ns[p], 0u) << "phase " << p;
      }
    }
    EXPECT_EQ(c.spin_iterations, st.spins);
    EXPECT_EQ(c.yields, st.yields);
    EXPECT_EQ(c.parks, st.parks);
    if (k.end == WaitEnd::kSpin) {
      EXPECT_GT(c.spin_iterations, 0u);
    }
    if (k.end == WaitEnd::kYield) {
      EXPECT_GT(c.yields, 0u);
    }
  }
}

TEST(WaitMetrics, AParkWokenByARingRecordsItsLatency) {
  CheckedSource src;
  WaitMetrics scope;
  WaitStats st = wait_for_publish(src, WaitPolicy(0, 0, false), scope, 0);
  ASSERT_EQ(st.end, WaitEnd::kPark);
  // The ring found the waiter parked, so it stamped its time; the waiter measured ring -> running.
  EXPECT_GT(src.inner.bell.rung_ns(), 0);
  EXPECT_GE(st.wake_latency_ns, 0);
  WaitCounts c = scope.snapshot();
  EXPECT_EQ(c.latency_count(), 1u);
  EXPECT_EQ(c.latency_sum_ns, uint64_t(st.wake_latency_ns));
  EXPECT_EQ(c.latency_buckets[LatencyHistogram::bucket_of(st.wake_latency_ns)], 1u);
}

TEST(WaitMetrics, ARingWithNobodyParkedReadsNoClock) {
  CounterSource src;
  for (int i = 0; i < 100; ++i) src.publish();
  EXPECT_EQ(src.bell.rung_ns(), 0);  // the fast path stamps nothing
}

TEST(WaitMetrics, AStepCompletionRecordsCompletionToWaiterLatency) {
  StepCounter counter;
  uint64_t token = counter.mark();
  WaitMetrics scope;
  WaitStats st;
  std::thread waiter([&] {
    WaitMetricsScope in(&scope);
    StepCounter::Until until = counter.until(token);
    Source* s = &until;
    WaitPolicy park(0, 0, false);
    EXPECT_EQ(wait_any(&s, 1, kLong, park, nullptr, &st), 1u);
  });
  while (counter.doorbell()->parked() == 0) std::this_thread::yield();
  counter.complete(token);
  waiter.join();
  EXPECT_GE(st.wake_latency_ns, 0);
  EXPECT_EQ(counter.wake_latency().count(), 1u);
  EXPECT_EQ(counter.wake_latency().sum_ns(), uint64_t(st.wake_latency_ns));
  EXPECT_EQ(scope.snapshot().latency_count(), 1u);

  // The same through settled(), the source that stays the same from step to step.
  uint64_t next = counter.mark();
  WaitStats settled_st;
  std::thread settled_waiter([&] {
    StepCounter::Settled settled(counter);
    Source* s = &settled;
    WaitPolicy park(0, 0, false);
    EXPECT_EQ(wait_any(&s, 1, kLong, park, nullptr, &settled_st), 1u);
  });
  while (counter.doorbell()->parked() == 0) std::this_thread::yield();
  counter.complete(next);
  settled_waiter.join();
  EXPECT_GE(settled_st.wake_latency_ns, 0);
  EXPECT_EQ(counter.wake_latency().count(), 2u);

  // A wait that starts after the completion did not wait for it: no latency.
  StepCounter::Until until = counter.until(token);
  Source* s = &until;
  WaitPolicy p;
  WaitStats again;
  EXPECT_EQ(wait_any(&s, 1, kLong, p, nullptr, &again), 1u);
  EXPECT_EQ(again.end, WaitEnd::kImmediate);
  EXPECT_EQ(again.wake_latency_ns, -1);
  EXPECT_EQ(counter.wake_latency().count(), 2u);
}

TEST(WaitMetrics, ConcurrentWaitersLoseNoCounts) {
  const int threads = 4;
  const int waits = int(2000 * test::stress_scale());
  WaitMetrics shared;  // every thread adds to it (relaxed fetch_add)
  WaitCounts before = process_wait_metrics();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      WaitMetricsScope in(&shared);
      Flag ready, never;
      ready.set();
      Source* hit[] = {&ready};
      Source* miss[] = {&never};
      WaitPolicy p;
      for (int i = 0; i < waits; ++i) {
        wait_any(hit, 1, kLong, p);  // immediate
        wait_any(miss, 1, 0, p);     // timeout
      }
    });
  }
  for (auto& t : pool) t.join();  // the threads are gone: their blocks were folded into the aggregate
  const uint64_t each = uint64_t(threads) * uint64_t(waits);
  WaitCounts c = shared.snapshot();
  EXPECT_EQ(ended(c, WaitEnd::kImmediate), each);
  EXPECT_EQ(ended(c, WaitEnd::kTimeout), each);
  WaitCounts after = process_wait_metrics();
  EXPECT_EQ(ended(after, WaitEnd::kImmediate) - ended(before, WaitEnd::kImmediate), each);
  EXPECT_EQ(ended(after, WaitEnd::kTimeout) - ended(before, WaitEnd::kTimeout), each);
}

TEST(WaitMetrics, ScopesNestAndRestore) {
  WaitMetrics outer, inner;
  Flag f;
  f.set();
  Source* s[] = {&f};
  WaitPolicy p;
  {
    WaitMetricsScope a(&outer);
    wait_any(s, 1, 0, p);
    {
      WaitMetricsScope b(&inner);
      wait_any(s, 1, 0, p);
    }
    wait_any(s, 1, 0, p);
  }
  wait_any(s, 1, 0, p);
  EXPECT_EQ(outer.snapshot().waits(), 2u);
  EXPECT_EQ(inner.snapshot().waits(), 1u);
}

TEST(LatencyHistogram, BucketsArePowersOfTwo) {
  EXPECT_EQ(LatencyHistogram::bucket_of(0), 0);
  EXPECT_EQ(LatencyHistogram::bucket_of(1), 1);
  EXPECT_EQ(LatencyHistogram::bucket_of(2), 2);
  EXPECT_EQ(LatencyHistogram::bucket_of(3), 2);
  EXPECT_EQ(LatencyHistogram::bucket_of(1023), 10);
  EXPECT_EQ(LatencyHistogram::bucket_of(1024), 11);
  EXPECT_LT(1023, LatencyHistogram::upper_bound_ns(10));
  EXPECT_EQ(LatencyHistogram::bucket_of(int64_t(1) << 62), LatencyHistogram::kBuckets - 1);
  LatencyHistogram h;
  h.add(-5);  // clamped to 0
  h.add(1500);
  EXPECT_EQ(h.count(), 2u);
  EXPECT_EQ(h.sum_ns(), 1500u);
  EXPECT_EQ(h.bucket(0), 1u);
  EXPECT_EQ(h.bucket(11), 1u);
}

}  // namespace
}  // namespace hotloop
