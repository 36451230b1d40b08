// WaitPolicy: fixed budgets as given; the adaptive mode spins for quick events and parks for slow ones.
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

}  // namespace
}  // namespace hotloop
