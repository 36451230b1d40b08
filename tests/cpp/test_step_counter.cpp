// StepCounter (host completion): tokens complete in order, waits wake, failures and bad tokens surface.
#include "hotloop/step_counter.h"

#include <gtest/gtest.h>

#include <thread>

#include "hotloop/clock.h"
#include "hotloop/input_queue.h"
#include "hotloop/wait_any.h"

namespace hotloop {
namespace {

TEST(StepCounter, TokensCompleteInOrder) {
  StepCounter c;
  uint64_t a = c.mark(), b = c.mark();
  EXPECT_EQ(a, c.base() + 1);
  EXPECT_EQ(b, c.base() + 2);
  EXPECT_FALSE(c.done(a));
  EXPECT_FALSE(c.done(b));
  c.complete(a);
  EXPECT_TRUE(c.done(a));
  EXPECT_FALSE(c.done(b));
  c.complete(b);
  c.complete(a);  // a late duplicate does not move the counter back
  EXPECT_TRUE(c.done(a));
  EXPECT_TRUE(c.done(b));
}

TEST(StepCounter, BadTokensAreRejected) {
  StepCounter c;
  EXPECT_THROW(c.done(0), std::invalid_argument);
  EXPECT_THROW(c.done(c.base()), std::invalid_argument);      // step 0 is never issued
  EXPECT_THROW(c.done(c.base() + 1), std::invalid_argument);  // not issued yet
  uint64_t t = c.mark();
  EXPECT_NO_THROW(c.done(t));
  EXPECT_THROW(c.until(t + 1), std::invalid_argument);
  // A token of another counter is refused even where its step number exists here, and even once done there.
  StepCounter other;
  uint64_t foreign = other.mark();
  other.complete(foreign);
  EXPECT_NE(other.base(), c.base());
  EXPECT_THROW(c.done(foreign), std::invalid_argument);
  EXPECT_THROW(c.until(foreign), std::invalid_argument);
}

TEST(StepCounter, FailureWakesWaitersAndSurfacesOnDone) {
  StepCounter c;
  uint64_t a = c.mark(), b = c.mark(), d = c.mark();
  c.complete(a);
  auto until = c.until(d);
  Source* s[] = {&until};
  WaitPolicy park(0, 0, false);
  std::thread worker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    c.fail(b, "worker raised ValueError");
    c.complete(d);
  });
  EXPECT_EQ(wait_any(s, 1, 5'000'000'000, park), 1u);
  worker.join();
  EXPECT_TRUE(c.done(a)) << "steps before the failure stay done";
  EXPECT_THROW(c.done(b), StepError);
  try {
    c.done(d);
    FAIL() << "a step after the failed one must not look done";
  } catch (const StepError& e) {
    EXPECT_NE(std::string(e.what()).find("step 2 failed: worker raised ValueError"), std::string::npos);
  }
}

TEST(StepCounter, WaitAnyReturnsWhicheverFiresFirst) {
  StepCounter c;
  InputQueue q;
  uint64_t t = c.mark();
  auto until = c.until(t);
  Source* s[] = {&q, &until};
  WaitPolicy park(0, 0, false);
  std::thread worker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    c.complete(t);
  });
  EXPECT_EQ(wait_any(s, 2, 5'000'000'000, park), 2u);
  worker.join();
  q.put(&q);
  EXPECT_EQ(wait_any(s, 2, 0, park), 3u);
}

TEST(StepCounter, ManyStepsCompletedByAWorkerThreadAreAllSeen) {
  StepCounter c;
  const uint64_t steps = 100'000;
  std::atomic<uint64_t> launched{0};
  std::thread worker([&] {
    for (uint64_t n = 1; n <= steps; ++n) {
      while (launched.load(std::memory_order_acquire) < n) cpu_relax();
      c.complete(c.base() + n);
    }
  });
  WaitPolicy p(2'000, 0, false);
  for (uint64_t n = 1; n <= steps; ++n) {
    uint64_t t = c.mark();
    ASSERT_EQ(t, c.base() + n);
    launched.store(n, std::memory_order_release);
    auto until = c.until(t);
    Source* s = &until;
    ASSERT_EQ(wait_any(&s, 1, 5'000'000'000, p), 1u) << "lost completion of step " << n;
    ASSERT_TRUE(c.done(t));
  }
  worker.join();
}

// One Settled source held across many steps (as a prepared Waiter holds it): ready exactly when the step in
// flight is done, parked waits woken by each completion, none lost.
TEST(StepCounter, SettledIsOneSourceForEveryStep) {
  StepCounter c;
  StepCounter::Settled settled(c);
  EXPECT_TRUE(settled.ready()) << "nothing issued: settled";
  const uint64_t steps = 2'000;
  std::atomic<uint64_t> launched{0};
  std::thread worker([&] {
    for (uint64_t n = 1; n <= steps; ++n) {
      while (launched.load(std::memory_order_acquire) < n) cpu_relax();
      if (n % 2) std::this_thread::sleep_for(std::chrono::microseconds(200));  // let odd steps park
      c.complete(c.base() + n);
    }
  });
  Source* s = &settled;
  WaitPolicy park(0, 0, false);
  for (uint64_t n = 1; n <= steps; ++n) {
    uint64_t t = c.mark();
    launched.store(n, std::memory_order_release);
    ASSERT_EQ(wait_any(&s, 1, 5'000'000'000, park), 1u) << "lost completion of step " << n;
    ASSERT_TRUE(c.done(t));
  }
  worker.join();
  uint64_t t = c.mark();
  EXPECT_FALSE(settled.ready()) << "a marked step in flight";
  c.fail(t, "injected");
  EXPECT_TRUE(settled.ready()) << "a failed step is settled too: its waiter wakes and done() raises";
}

}  // namespace
}  // namespace hotloop
