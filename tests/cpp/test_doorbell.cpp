// Doorbell: no lost wake-up between a ring and a waiter moving through spin, yield and park.
#include "hotloop/doorbell.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <new>
#include <random>
#include <thread>

#include "hotloop/clock.h"
#include "hotloop/wait_any.h"
#include "test_util.h"

namespace hotloop {
namespace {

using test::CounterSource;

TEST(Doorbell, IsOneCacheLineAndCountsParkers) {
  Doorbell b;
  EXPECT_EQ(sizeof(Doorbell), 64u);
  EXPECT_EQ(b.parked(), 0u);
  b.announce();
  EXPECT_EQ(b.parked(), 1u);
  b.retract();
  EXPECT_EQ(b.parked(), 0u);
  uint32_t s = b.sequence();
  b.ring();
  EXPECT_EQ(b.sequence(), s + 1);
}

TEST(Doorbell, ParkReturnsAtOnceWhenTheWordMoved) {
  Doorbell b;
  uint32_t seen = b.sequence();
  b.ring();
  int64_t t0 = now_ns();
  b.park(seen, now_ns() + 2'000'000'000);
  EXPECT_LT(now_ns() - t0, 500'000'000);
}

TEST(Doorbell, ParkTimesOut) {
  Doorbell b;
  int64_t t0 = now_ns();
  b.park(b.sequence(), now_ns() + 20'000'000);
  int64_t waited = now_ns() - t0;
  EXPECT_GE(waited, 19'000'000);
  EXPECT_LT(waited, 500'000'000);
}

// One wait in four parks at once; the others spin and yield for 0-3 us, so rings land in every phase.
WaitPolicy random_policy(std::mt19937& rng) {
  if (rng() % 4 == 0) return WaitPolicy(0, 0, false);
  return WaitPolicy(int64_t(rng() % 3000), int64_t(rng() % 3000), false);
}

// Ping-pong: each side waits for the other's event before producing its own, so one lost wake-up stalls
// the exchange; the 10 s timeout turns a stall into a failure instead of a hang.
void ping_pong(int64_t rounds, WaitPolicy policy_a, WaitPolicy policy_b, bool randomize) {
  CounterSource a, b;
  std::thread peer([&] {
    std::mt19937 rng(7);
    WaitPolicy p = policy_b;
    Source* s = &a;
    for (int64_t i = 0; i < rounds; ++i) {
      if (randomize) p = random_policy(rng);
      ASSERT_NE(wait_any(&s, 1, 10'000'000'000, p), 0u) << "lost wake-up at round " << i;
      a.seen.fetch_add(1, std::memory_order_relaxed);
      b.publish();
    }
  });
  std::mt19937 rng(11);
  WaitPolicy p = policy_a;
  Source* s = &b;
  for (int64_t i = 0; i < rounds; ++i) {
    a.publish();
    if (randomize) p = random_policy(rng);
    ASSERT_NE(wait_any(&s, 1, 10'000'000'000, p), 0u) << "lost wake-up at round " << i;
    b.seen.fetch_add(1, std::memory_order_relaxed);
  }
  peer.join();
  EXPECT_EQ(a.value.load(), uint64_t(rounds));
  EXPECT_EQ(b.value.load(), uint64_t(rounds));
  EXPECT_EQ(a.bell.parked(), 0u);
  EXPECT_EQ(b.bell.parked(), 0u);
}

TEST(Doorbell, NoLostWakeupWhenAlwaysParking) {
  int64_t rounds = (test::under_tsan() ? 20'000 : 300'000) * test::stress_scale();
  ping_pong(rounds, WaitPolicy(0, 0, false), WaitPolicy(0, 0, false), false);
}

TEST(Doorbell, NoLostWakeupAcrossRandomPhaseBoundaries) {
  // Random budgets (0-3 us) make rings land in every phase: spin, yield, the announce/re-check window, park.
  int64_t rounds = (test::under_tsan() ? 50'000 : 1'000'000) * test::stress_scale();
  ping_pong(rounds, WaitPolicy(), WaitPolicy(), true);
}

TEST(Doorbell, EveryEventSeenUnderAFirehose) {
  // A producer publishes as fast as it can; the waiter must observe the count reach its final value, each
  // wait returning only when something new arrived.
  CounterSource src;
  const uint64_t total = uint64_t(test::under_tsan() ? 100'000 : 2'000'000) * uint64_t(test::stress_scale());
  std::thread producer([&] {
    for (uint64_t i = 0; i < total; ++i) src.publish();
  });
  std::mt19937 rng(3);
  Source* s = &src;
  uint64_t seen = 0, waits = 0;
  while (seen < total) {
    WaitPolicy p = random_policy(rng);
    ASSERT_NE(wait_any(&s, 1, 10'000'000'000, p), 0u) << "stalled at " << seen << " of " << total;
    uint64_t v = src.value.load(std::memory_order_acquire);
    ASSERT_GT(v, seen) << "woke with nothing new";
    seen = v;
    src.seen.store(seen, std::memory_order_relaxed);
    ++waits;
  }
  producer.join();
  EXPECT_EQ(seen, total);
  EXPECT_GT(waits, 0u);
}

TEST(Doorbell, ProcessSharedWakesAnotherProcess) {
  if (test::under_tsan()) GTEST_SKIP() << "fork() under ThreadSanitizer is not supported";
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* src = new (mem) CounterSource(/*shared=*/true);
  const int rounds = 2000;
  pid_t child = fork();
  if (child == 0) {
    // The child waits parked (no spin) for each of the parent's rings and acknowledges through `seen`.
    WaitPolicy park_only(0, 0, false);
    Source* s = src;
    for (int i = 0; i < rounds; ++i) {
      if (wait_any(&s, 1, 5'000'000'000, park_only) == 0) _exit(2);
      src->seen.fetch_add(1);
    }
    _exit(0);
  }
  for (int i = 0; i < rounds; ++i) {
    src->publish();
    int64_t give_up = now_ns() + 5'000'000'000;
    while (src->seen.load() != uint64_t(i + 1)) {
      ASSERT_LT(now_ns(), give_up) << "child missed ring " << i;
      sched_yield();
    }
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  munmap(mem, 4096);
}

}  // namespace
}  // namespace hotloop
