// WaitPolicy: fixed budgets as given; the adaptive mode spins for quick events and parks for slow ones; the paced
// mode learns a steady interval, ignores idle gaps and stops predicting when the intervals stop being steady.
#include "hotloop/wait_policy.h"

#include <gtest/gtest.h>

namespace hotloop {
namespace {

TEST(WaitPolicy, FixedBudgetsAreReturnedAsGiven) {
  WaitPolicy p(5'000, 7'000, false);
  EXPECT_EQ(p.budgets().spin_ns, 5'000);
  EXPECT_EQ(p.budgets().yield_ns, 7'000);
  p.record(1'000'000'000);  // ignored when not adaptive
  EXPECT_EQ(p.budgets().spin_ns, 5'000);
}

TEST(WaitPolicy, DefaultsAreWrittenDown) {
  WaitPolicy p;
  EXPECT_EQ(p.spin_ns(), WaitPolicy::kDefaultSpinNs);
  EXPECT_EQ(p.yield_ns(), WaitPolicy::kDefaultYieldNs);
  EXPECT_FALSE(p.adaptive());
}

TEST(WaitPolicy, AdaptiveSpinsAboutTwiceTheRecentWaitWhenEventsComeQuickly) {
  WaitPolicy p(20'000, 10'000, true);
  for (int i = 0; i < 64; ++i) p.record(3'000);
  EXPECT_NEAR(double(p.recent_wait_ns()), 3'000.0, 100.0);
  EXPECT_NEAR(double(p.budgets().spin_ns), 6'000.0, 200.0);
  EXPECT_EQ(p.budgets().yield_ns, 10'000);
}

TEST(WaitPolicy, AdaptiveParksAlmostAtOnceWhenEventsAreFarApart) {
  WaitPolicy p(20'000, 10'000, true);
  for (int i = 0; i < 64; ++i) p.record(5'000'000);  // a message every 5 ms
  EXPECT_EQ(p.budgets().spin_ns, p.min_spin_ns());
  EXPECT_EQ(p.budgets().yield_ns, 0);
}

TEST(WaitPolicy, AdaptiveRecoversQuicklyWhenTrafficResumes) {
  WaitPolicy p(20'000, 10'000, true);
  for (int i = 0; i < 1000; ++i) p.record(10'000'000'000);  // a long idle period, capped per sample
  int waits = 0;
  while (p.budgets().spin_ns < 4'000 && waits < 100) {
    p.record(2'000);
    ++waits;
  }
  EXPECT_LT(waits, 30) << "an idle period must not keep the policy parking for long after traffic resumes";
}

TEST(WaitPolicy, CopiesCarryTheHistory) {
  WaitPolicy p(20'000, 10'000, true);
  p.record(4'000);
  WaitPolicy q = p;
  EXPECT_EQ(q.recent_wait_ns(), 4'000);
  EXPECT_TRUE(q.adaptive());
}

// ---- paced mode: the interval estimate ----

constexpr int64_t kT0 = 1'000'000'000;  // an arbitrary monotonic time to start from
constexpr int64_t kStep = 1'400'000;    // 1.4 ms, a decode step

// Feeds readies every `interval` (+- `jitter`, alternating) from `t`; returns the last ready time.
int64_t feed(WaitPolicy& p, int64_t t, int n, int64_t interval, int64_t jitter = 0) {
  for (int i = 0; i < n; ++i) {
    t += interval + (i % 2 ? jitter : -jitter);
    p.observe_ready(t);
  }
  return t;
}

TEST(PacedPolicy, OffByDefaultAndNeverPredictsWhenOff) {
  WaitPolicy p;
  EXPECT_FALSE(p.paced());
  int64_t t = feed(p, kT0, 20, kStep);
  EXPECT_FALSE(p.plan(t + 1000).predicted);
  WaitPolicy q(20'000, 10'000, false, true);
  EXPECT_TRUE(q.paced());
  EXPECT_EQ(q.lead_ns(), WaitPolicy::kDefaultLeadNs);
}

TEST(PacedPolicy, ConvergesOnASteadyInterval) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);  // the first ready only anchors
  EXPECT_FALSE(p.predicting());
  int64_t t = feed(p, kT0, WaitPolicy::kPacedWarmup, kStep, 50'000);
  EXPECT_TRUE(p.predicting());
  t = feed(p, t, 60, kStep, 50'000);
  EXPECT_NEAR(double(p.interval_ns()), double(kStep), 30'000.0);
  EXPECT_NEAR(double(p.interval_dev_ns()), 50'000.0, 20'000.0);
  EXPECT_EQ(p.anchor_ns(), t);
  PacedPlan plan = p.plan(t + 10'000);
  ASSERT_TRUE(plan.predicted);
  const int64_t due = t + p.interval_ns();
  EXPECT_LT(plan.wake_ns, due - 2 * p.interval_dev_ns());  // wakes a margin ahead of the predicted ready
  EXPECT_GT(plan.wake_ns, due - kStep / 2);
  EXPECT_GT(plan.spin_end_ns, due);                        // spins through it
  // spins at most a quarter of the interval, plus the timer's lateness the park is ended ahead by
  EXPECT_LE(plan.spin_end_ns - plan.wake_ns, kStep / 4 + p.timer_late_ns());
  EXPECT_FALSE(p.plan(plan.spin_end_ns).predicted) << "a wait that starts after the window predicts nothing";
  EXPECT_EQ(p.paced_stats().misses, 0u);
}

TEST(PacedPolicy, AnIdleGapDoesNotPoisonTheEstimate) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);
  int64_t t = feed(p, kT0, 30, kStep);
  const int64_t before = p.interval_ns();
  t += 2'000'000'000;  // two idle seconds, then the steps resume
  p.observe_ready(t);
  EXPECT_EQ(p.interval_ns(), before);
  EXPECT_EQ(p.anchor_ns(), t) << "the interval after the gap is measured from the ready that ended it";
  EXPECT_TRUE(p.predicting());
  EXPECT_EQ(p.paced_stats().misses, 1u);
  t = feed(p, t, 1, kStep);
  EXPECT_EQ(p.interval_ns(), before);
  EXPECT_TRUE(p.plan(t).predicted);
}

TEST(PacedPolicy, StopsPredictingAfterMissesAndResumesOnceSteady) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);
  int64_t t = feed(p, kT0, 30, kStep);
  ASSERT_TRUE(p.predicting());
  for (int i = 0; i < WaitPolicy::kPacedMaxMisses; ++i) {
    t += (i + 3) * 7 * kStep;  // irregular long gaps
    p.observe_ready(t);
  }
  EXPECT_FALSE(p.predicting());
  EXPECT_FALSE(p.plan(t + 1000).predicted);
  t = feed(p, t, 1, 5 * kStep);  // a new, slower pace
  EXPECT_FALSE(p.predicting());
  t = feed(p, t, WaitPolicy::kPacedWarmup, 5 * kStep);
  EXPECT_TRUE(p.predicting());
  EXPECT_NEAR(double(p.interval_ns()), double(5 * kStep), 1'000.0);
}

TEST(PacedPolicy, AnExplicitAnchorPredictsFromItAndAnEarlyReadyKeepsIt) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);
  int64_t t = feed(p, kT0, 30, kStep);
  const int64_t sent = t + 5'000'000;  // e.g. an engine core broadcasts a step after a pause
  p.anchor(sent);
  PacedPlan plan = p.plan(sent);
  ASSERT_TRUE(plan.predicted);
  EXPECT_GT(plan.wake_ns, sent + kStep / 2);
  p.observe_ready(sent + 200'000);  // something else became ready first (an input): not the answer
  EXPECT_EQ(p.anchor_ns(), sent);
  EXPECT_EQ(p.paced_stats().misses, 1u);
  p.observe_ready(sent + kStep + 10'000);  // the answer
  EXPECT_EQ(p.anchor_ns(), sent + kStep + 10'000);
  EXPECT_NEAR(double(p.interval_ns()), double(kStep), 5'000.0);
}

TEST(PacedPolicy, AReadyFoundWithoutAWaitDropsAStaleAnchorAndFeedsNothing) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);
  int64_t t = feed(p, kT0, 30, kStep);
  const uint64_t samples = p.paced_stats().samples;
  p.observe_ready_unknown(t + 200'000);  // too soon to be the periodic ready (an input): the anchor stays
  EXPECT_EQ(p.anchor_ns(), t);
  p.observe_ready_unknown(t + kStep + 300'000);  // the waiter came back late and found the next one waiting
  EXPECT_EQ(p.anchor_ns(), -1) << "an interval from t would span two periods";
  EXPECT_FALSE(p.plan(t + kStep + 400'000).predicted) << "no anchor, no prediction";
  p.observe_ready(t + 2 * kStep);  // the next ready a wait saw: it anchors, it is not a sample
  EXPECT_EQ(p.paced_stats().samples, samples);
  EXPECT_EQ(p.anchor_ns(), t + 2 * kStep);
  EXPECT_NEAR(double(p.interval_ns()), double(kStep), 1'000.0);
  EXPECT_TRUE(p.plan(t + 2 * kStep + 1'000).predicted);
}

TEST(PacedPolicy, TimerLatenessWidensTheMarginAndIsCapped) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);
  int64_t t = feed(p, kT0, 30, kStep);
  const int64_t wake0 = p.plan(t).wake_ns;
  for (int i = 0; i < 64; ++i) p.record_timer_lateness(120'000);
  EXPECT_NEAR(double(p.timer_late_ns()), 120'000.0, 2'000.0);
  EXPECT_LT(p.plan(t).wake_ns, wake0 - 50'000);
  for (int i = 0; i < 64; ++i) p.record_timer_lateness(50'000'000);  // a descheduled thread, not the timer
  EXPECT_LE(p.timer_late_ns(), 200'000);
}

TEST(PacedPolicy, CopiesCarryTheEstimate) {
  WaitPolicy p(20'000, 10'000, false, true);
  p.observe_ready(kT0);
  feed(p, kT0, 10, kStep);
  WaitPolicy q = p;
  EXPECT_TRUE(q.paced());
  EXPECT_EQ(q.interval_ns(), p.interval_ns());
  EXPECT_EQ(q.anchor_ns(), p.anchor_ns());
  EXPECT_EQ(q.paced_stats().samples, p.paced_stats().samples);
}

}  // namespace
}  // namespace hotloop
