// CudaStepNotifier against the fake driver (tests/fake_cuda): every test runs with both mechanisms.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "hotloop/clock.h"
#include "hotloop/cuda_driver.h"
#include "hotloop/cuda_step_notifier.h"
#include "hotloop/input_queue.h"
#include "hotloop/wait_any.h"

using hotloop::cuda_api::CUcontext;
using hotloop::cuda_api::CUstream;

extern "C" {
CUcontext fakecu_context();
void fakecu_make_current();
CUstream fakecu_stream_create();
void fakecu_stream_destroy(CUstream s);
int fakecu_launch_sleep(CUstream s, int64_t duration_ns);
uint64_t fakecu_launch_gated(CUstream s);
void fakecu_open_gate(uint64_t gate);
int fakecu_launch_fault(CUstream s);
void fakecu_reset_error();
int64_t fakecu_events_alive();
}

namespace hotloop {
namespace {

// Before any test touches the driver: load the fake one.
const bool kFakeDriverSelected = [] { return setenv("HOTLOOP_CUDA_DRIVER", HOTLOOP_FAKE_CUDA_PATH, 1) == 0; }();

constexpr int64_t kLong = 5'000'000'000;

uintptr_t handle(CUstream s) { return reinterpret_cast<uintptr_t>(s); }

bool wait_done(StepCounter& c, uint64_t token, int64_t timeout_ns) {
  WaitPolicy park(0, 0, false);
  auto until = c.until(token);
  Source* s = &until;
  return wait_any(&s, 1, timeout_ns, park) == 1u;
}

class CudaStepNotifierTest : public ::testing::TestWithParam<CompletionMechanism> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kFakeDriverSelected);
    fakecu_make_current();
    stream_ = fakecu_stream_create();
  }
  void TearDown() override {
    fakecu_stream_destroy(stream_);
    fakecu_reset_error();
  }
  CUstream stream_ = nullptr;
};

TEST_P(CudaStepNotifierTest, TokensCompleteInOrderOnceTheirKernelsEnd) {
  CudaStepNotifier n(GetParam());
  uint64_t g1 = fakecu_launch_gated(stream_);
  uint64_t t1 = n.mark(handle(stream_));
  uint64_t g2 = fakecu_launch_gated(stream_);
  uint64_t t2 = n.mark(handle(stream_));
  EXPECT_EQ(t2, t1 + 1);
  EXPECT_FALSE(n.counter().done(t1));
  fakecu_open_gate(g2);  // the second kernel cannot run before the first: nothing may complete
  EXPECT_FALSE(wait_done(n.counter(), t1, 30'000'000));
  EXPECT_FALSE(n.counter().done(t2));
  EXPECT_EQ(n.in_flight(), 2u);
  fakecu_open_gate(g1);
  ASSERT_TRUE(wait_done(n.counter(), t2, kLong));
  EXPECT_TRUE(n.counter().done(t1));
  EXPECT_EQ(n.in_flight(), 0u);
}

TEST_P(CudaStepNotifierTest, ALaterStepOnAFastStreamWaitsForAnEarlierOneOnASlowStream) {
  CudaStepNotifier n(GetParam());
  CUstream fast = fakecu_stream_create();
  uint64_t gate = fakecu_launch_gated(stream_);
  uint64_t slow_token = n.mark(handle(stream_));
  fakecu_launch_sleep(fast, 0);
  uint64_t fast_token = n.mark(handle(fast));
  EXPECT_FALSE(wait_done(n.counter(), fast_token, 30'000'000)) << "done(n) must imply done(m) for m < n";
  fakecu_open_gate(gate);
  EXPECT_TRUE(wait_done(n.counter(), fast_token, kLong));
  EXPECT_TRUE(n.counter().done(slow_token));
  fakecu_stream_destroy(fast);
}

TEST_P(CudaStepNotifierTest, WaitWakesWhenTheKernelEndsAndTimesOutWhileItRuns) {
  CudaStepNotifier n(GetParam());
  fakecu_launch_sleep(stream_, 50'000'000);
  uint64_t t = n.mark(handle(stream_));
  int64_t t0 = now_ns();
  EXPECT_FALSE(wait_done(n.counter(), t, 10'000'000));
  ASSERT_TRUE(wait_done(n.counter(), t, kLong));
  int64_t waited = now_ns() - t0;
  EXPECT_GE(waited, 40'000'000) << "woke before the 50 ms kernel ended";
  EXPECT_LT(waited, 2'000'000'000);
}

TEST_P(CudaStepNotifierTest, ManyMarksInFlightReusePooledResources) {
  const size_t cap = 16;
  int64_t events_before = fakecu_events_alive();
  CudaStepNotifier n(GetParam(), cap);
  std::vector<uint64_t> tokens;
  for (int round = 0; round < 200; ++round) {
    uint64_t gate = fakecu_launch_gated(stream_);
    for (size_t i = 0; i < cap; ++i) tokens.push_back(n.mark(handle(stream_)));
    EXPECT_THROW(n.mark(handle(stream_)), std::length_error) << "more than max_in_flight marks pending";
    EXPECT_FALSE(n.counter().done(tokens.back()));
    fakecu_open_gate(gate);
    ASSERT_TRUE(wait_done(n.counter(), tokens.back(), kLong)) << "round " << round;
  }
  for (size_t i = 1; i < tokens.size(); ++i) ASSERT_EQ(tokens[i], tokens[i - 1] + 1) << "the refused mark issued a token";
  for (uint64_t t : tokens) ASSERT_TRUE(n.counter().done(t));
  EXPECT_LE(fakecu_events_alive() - events_before, int64_t(cap)) << "events are pooled, not made per step";
}

TEST_P(CudaStepNotifierTest, WaitAnyOverAnInputQueueAndAStepReturnsWhicheverFiresFirst) {
  CudaStepNotifier n(GetParam());
  InputQueue q;
  uint64_t gate = fakecu_launch_gated(stream_);
  auto until = n.counter().until(n.mark(handle(stream_)));
  Source* s[] = {&q, &until};
  WaitPolicy park(0, 0, false);
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    q.put(&q);
  });
  EXPECT_EQ(wait_any(s, 2, kLong, park), 1u);
  producer.join();
  std::vector<void*> items;
  q.drain(items);
  std::thread gpu([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    fakecu_open_gate(gate);
  });
  EXPECT_EQ(wait_any(s, 2, kLong, park), 2u);
  gpu.join();
}

TEST_P(CudaStepNotifierTest, DestroyingANotifierWithMarksInFlightIsSafe) {
  int64_t events_before = fakecu_events_alive();
  uint64_t gate = fakecu_launch_gated(stream_);
  {
    CudaStepNotifier n(GetParam());
    for (int i = 0; i < 8; ++i) n.mark(handle(stream_));
  }  // destroyed while every mark is pending: the destructor must not wait for the GPU
  fakecu_open_gate(gate);
  fakecu_launch_sleep(stream_, 0);
  fakecu_stream_destroy(stream_);  // runs the pending completions into the orphaned state
  stream_ = fakecu_stream_create();
  int64_t deadline = now_ns() + kLong;
  while (fakecu_events_alive() != events_before && now_ns() < deadline) std::this_thread::yield();
  EXPECT_EQ(fakecu_events_alive(), events_before) << "the helper destroys its pooled events once drained";
}

TEST_P(CudaStepNotifierTest, AStreamHandleThatIsNotAStreamIsRefusedWithTheDriversMessage) {
  CudaStepNotifier n(GetParam());
  try {
    n.mark(0xdead0);
    FAIL() << "expected CudaError";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), cuda_api::CUDA_ERROR_INVALID_HANDLE);
    EXPECT_NE(std::string(e.what()).find("CUDA_ERROR_INVALID_HANDLE (invalid resource handle)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(n.counter().issued(), n.counter().base()) << "no token issued for a refused mark";
  uint64_t t = n.mark(0);  // the legacy default stream is a stream
  EXPECT_TRUE(wait_done(n.counter(), t, kLong));
}

TEST_P(CudaStepNotifierTest, ACudaErrorInAStepFailsItAndEveryLaterStep) {
  CudaStepNotifier n(GetParam());
  fakecu_launch_sleep(stream_, 0);
  uint64_t ok = n.mark(handle(stream_));
  ASSERT_TRUE(wait_done(n.counter(), ok, kLong));
  uint64_t gate = fakecu_launch_gated(stream_);
  fakecu_launch_fault(stream_);
  uint64_t bad = n.mark(handle(stream_));
  fakecu_open_gate(gate);
  ASSERT_TRUE(wait_done(n.counter(), bad, kLong)) << "a failed step must wake its waiters, not hang them";
  EXPECT_TRUE(n.counter().done(ok));
  try {
    n.counter().done(bad);
    FAIL() << "a failed step must not look done";
  } catch (const StepError& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA_ERROR_ILLEGAL_ADDRESS"), std::string::npos) << e.what();
  }
  // Later marks either are refused by the driver (event record) or complete as failed (stream callback).
  try {
    uint64_t later = n.mark(handle(stream_));
    ASSERT_TRUE(wait_done(n.counter(), later, kLong));
    EXPECT_THROW(n.counter().done(later), StepError);
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), cuda_api::CUDA_ERROR_ILLEGAL_ADDRESS);
  }
}

INSTANTIATE_TEST_SUITE_P(Mechanisms, CudaStepNotifierTest,
                         ::testing::Values(CompletionMechanism::kStreamCallback, CompletionMechanism::kEventThread),
                         [](const auto& info) { return std::string(mechanism_name(info.param)); });

TEST(CudaStepNotifier, NeedsACurrentContext) {
  ASSERT_TRUE(kFakeDriverSelected);
  std::thread([] {  // a fresh thread has no current context
    try {
      CudaStepNotifier n;
      ADD_FAILURE() << "expected CudaError";
    } catch (const CudaError& e) {
      EXPECT_NE(std::string(e.what()).find("no current CUDA context"), std::string::npos) << e.what();
    }
  }).join();
}

TEST(CudaStepNotifier, MechanismNamesRoundTripAndUnknownOnesAreRefused) {
  for (auto m : {CompletionMechanism::kStreamCallback, CompletionMechanism::kEventThread}) {
    EXPECT_EQ(parse_mechanism(mechanism_name(m)), m);
  }
  EXPECT_THROW(parse_mechanism("host_func"), std::invalid_argument);
}

TEST(CudaDriver, TheFakeDriverLoadsAndDescribesErrors) {
  ASSERT_TRUE(kFakeDriverSelected);
  std::string why;
  ASSERT_TRUE(cuda_available(&why)) << why;
  const CudaDriver& d = cuda_driver();
  EXPECT_EQ(d.path, HOTLOOP_FAKE_CUDA_PATH);
  EXPECT_EQ(d.version, 13000);
  EXPECT_EQ(d.describe(cuda_api::CUDA_ERROR_NOT_READY), "CUDA_ERROR_NOT_READY (device not ready)");
  EXPECT_NE(d.describe(12345).find("unknown"), std::string::npos);
}

}  // namespace
}  // namespace hotloop
