// InputQueue: many producers, one consumer through wait_any; every item once, per-producer FIFO; close.
#include "hotloop/input_queue.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "hotloop/clock.h"
#include "hotloop/wait_any.h"
#include "test_util.h"

namespace hotloop {
namespace {

void* encode(uint64_t producer, uint64_t seq) { return reinterpret_cast<void*>((producer << 40) | (seq + 1)); }

TEST(InputQueue, FifoAndDrain) {
  InputQueue q;
  EXPECT_FALSE(q.ready());
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(q.put(encode(0, i)));
  EXPECT_EQ(q.size(), 10u);
  EXPECT_TRUE(q.ready());
  void* item = nullptr;
  ASSERT_TRUE(q.try_pop(item));
  EXPECT_EQ(item, encode(0, 0));
  std::vector<void*> out;
  EXPECT_EQ(q.drain(out, 4), 4u);
  EXPECT_EQ(out.front(), encode(0, 1));
  EXPECT_EQ(q.drain(out), 5u);
  EXPECT_EQ(out.back(), encode(0, 9));
  EXPECT_EQ(q.size(), 0u);
  EXPECT_FALSE(q.try_pop(item));
}

TEST(InputQueue, CloseRejectsPutsKeepsQueuedItemsAndWakesTheWaiter) {
  InputQueue q;
  ASSERT_TRUE(q.put(encode(0, 0)));
  q.close();
  EXPECT_TRUE(q.closed());
  EXPECT_FALSE(q.put(encode(0, 1)));
  void* item = nullptr;
  ASSERT_TRUE(q.try_pop(item));
  EXPECT_EQ(item, encode(0, 0));
  EXPECT_TRUE(q.ready()) << "a closed queue is ready so that a waiter wakes and learns it";

  InputQueue q2;
  Source* s[] = {&q2};
  WaitPolicy park(0, 0, false);
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    q2.close();
  });
  EXPECT_EQ(wait_any(s, 1, 5'000'000'000, park), 1u);
  closer.join();
}

TEST(InputQueue, ManyProducersEveryItemOnceInProducerOrder) {
  const int producers = 4;
  const uint64_t per_producer = uint64_t(test::under_tsan() ? 20'000 : 250'000) * uint64_t(test::stress_scale());
  InputQueue q;
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      for (uint64_t i = 0; i < per_producer; ++i) ASSERT_TRUE(q.put(encode(uint64_t(p), i)));
    });
  }
  std::vector<uint64_t> next(producers, 0);
  uint64_t received = 0;
  std::vector<void*> batch;
  Source* s[] = {&q};
  WaitPolicy policy(2'000, 2'000, false);  // short budgets so the consumer parks often
  while (received < producers * per_producer) {
    ASSERT_NE(wait_any(s, 1, 10'000'000'000, policy), 0u) << "consumer stalled at " << received;
    batch.clear();
    q.drain(batch, 64);
    for (void* item : batch) {
      uint64_t v = reinterpret_cast<uint64_t>(item);
      uint64_t p = v >> 40, seq = (v & ((uint64_t(1) << 40) - 1)) - 1;
      ASSERT_LT(p, uint64_t(producers));
      ASSERT_EQ(seq, next[p]) << "producer " << p << ": lost, duplicated or reordered item";
      ++next[p];
      ++received;
    }
  }
  for (auto& t : threads) t.join();
  void* extra = nullptr;
  EXPECT_FALSE(q.try_pop(extra)) << "duplicate item after all were received";
  for (int p = 0; p < producers; ++p) EXPECT_EQ(next[p], per_producer);
}

}  // namespace
}  // namespace hotloop
