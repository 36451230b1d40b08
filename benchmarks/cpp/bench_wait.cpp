// Microbenchmarks of the flag-spin wait, each next to the bare baseline it is judged against, in one run.
//
// Method. Ping-pong between two threads pinned to different CPUs (when there are two): the time per
// iteration is one round trip, i.e. two one-way wake-ups. Pairs: hotloop spinning wait vs a bare cache-line
// ping-pong (two atomics, pause loop); hotloop parked wait vs a bare futex ping-pong (raw FUTEX_WAIT/WAKE).
// The spin-iteration cost is measured inside wait_any itself: a wait on three never-ready sources with a
// spin-only policy, elapsed time divided by the iterations it reports. At the end the binary prints the
// ratios (hotloop / baseline) from the medians of --benchmark_repetitions runs. The message queue's ring is
// judged the same way: a 64-byte message each way through two ShmRings vs the bare cache-line ping-pong.
// BM_Wait_Immediate / BM_Wait_EndsInSpin time a whole short wait on one thread (its fixed costs, the wait
// metrics' bookkeeping included), which a loaded machine disturbs far less than a ping-pong between cores.
#include <benchmark/benchmark.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "hotloop/clock.h"
#include "hotloop/flag.h"
#include "hotloop/futex.h"
#include "hotloop/input_queue.h"
#include "hotloop/shm_ring.h"
#include "hotloop/wait_any.h"

namespace hotloop {
namespace {

void pin_to_cpu(int index) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0 || CPU_COUNT(&allowed) < 2) return;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (seen++ == index) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
      return;
    }
  }
}

void unpin() {
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &all);
  pthread_setaffinity_np(pthread_self(), sizeof(all), &all);
}

// A source that is ready while its counter differs from the last value its waiter took.
struct Counter final : Source {
  Doorbell bell;
  alignas(kCacheLine) std::atomic<uint64_t> value{0};
  alignas(kCacheLine) uint64_t taken = 0;  // touched by the waiter only: its own line
  bool ready() const noexcept override { return value.load(std::memory_order_acquire) != taken; }
  Doorbell* doorbell() noexcept override { return &bell; }
  uint64_t published = 0;  // touched by the producer only
  void publish() {
    value.store(++published, std::memory_order_release);
    bell.ring();
  }
};

// ---- spin iteration and ring costs --------------------------------------------------------------------------

void BM_SpinIteration_3Sources(benchmark::State& state) {
  Flag flag;
  InputQueue queue;
  Counter counter;
  Source* s[] = {&flag, &queue, &counter};
  WaitPolicy spin_only(2'000'000, 0, false);  // 2 ms of pure spinning per wait, never ready
  double iterations = 0, ns = 0;
  for (auto _ : state) {
    WaitStats st;
    int64_t t0 = now_ns();
    benchmark::DoNotOptimize(wait_any(s, 3, 2'000'000, spin_only, nullptr, &st));
    ns += double(now_ns() - t0);
    iterations += double(st.spins);
  }
  state.counters["ns_per_iteration"] = ns / iterations;
}
BENCHMARK(BM_SpinIteration_3Sources)->Iterations(200)->UseRealTime();

// A source that turns ready on its `after`-th check (counted from the last reset): a wait on it ends in the
// spin phase after a fixed number of iterations, on one thread, so the cost of a whole short wait (its setup,
// spin iterations and bookkeeping, metrics included) is measured without a second core.
struct ReadyAfter final : Source {
  Doorbell bell;
  mutable uint64_t checks = 0;
  uint64_t after = 1;
  bool ready() const noexcept override { return ++checks >= after; }
  Doorbell* doorbell() noexcept override { return &bell; }
};

void wait_ready_after(benchmark::State& state, uint64_t after) {
  ReadyAfter src;
  src.after = after;
  Source* s = &src;
  WaitPolicy p;
  for (auto _ : state) {
    src.checks = 0;
    benchmark::DoNotOptimize(wait_any(&s, 1, 10'000'000'000, p));
  }
}

// Ready at the first check: the wait returns at once.
void BM_Wait_Immediate(benchmark::State& state) { wait_ready_after(state, 1); }
BENCHMARK(BM_Wait_Immediate);

// Ready at the fourth check: the wait starts its clock and spins three iterations.
void BM_Wait_EndsInSpin(benchmark::State& state) { wait_ready_after(state, 4); }
BENCHMARK(BM_Wait_EndsInSpin);

void BM_ReadyCheck_3Sources(benchmark::State& state) {
  Flag flag;
  InputQueue queue;
  Counter counter;
  Source* s[] = {&flag, &queue, &counter};
  for (auto _ : state) benchmark::DoNotOptimize(ready_mask(s, 3));
}
BENCHMARK(BM_ReadyCheck_3Sources);

void BM_Ring_NobodyParked(benchmark::State& state) {
  Doorbell bell;
  for (auto _ : state) bell.ring();
}
BENCHMARK(BM_Ring_NobodyParked);

void BM_InputQueuePutDrain(benchmark::State& state) {
  InputQueue q;
  std::vector<void*> out;
  out.reserve(64);
  for (auto _ : state) {
    for (int i = 0; i < 64; ++i) q.put(&out);
    out.clear();
    q.drain(out);
  }
  state.SetItemsProcessed(state.iterations() * 64);
}
BENCHMARK(BM_InputQueuePutDrain);

// ---- ping-pong: hotloop vs bare baselines ----------------------------------------------------------------------

template <class SideA, class SideB>
void run_ping_pong(benchmark::State& state, SideA& side_a, SideB& side_b, std::atomic<bool>& stop) {
  std::thread peer([&] {
    pin_to_cpu(1);
    while (side_b()) {
    }
  });
  pin_to_cpu(0);
  for (auto _ : state) side_a();
  stop.store(true);
  side_a();  // release the peer if it waits
  peer.join();
  unpin();
}

// Bare cache-line ping-pong: the floor for "a thread notices a store on another core".
void BM_PingPong_BareCacheLine(benchmark::State& state) {
  alignas(kCacheLine) std::atomic<uint64_t> ping{0};
  alignas(kCacheLine) std::atomic<uint64_t> pong{0};
  std::atomic<bool> stop{false};
  uint64_t a = 0, b = 0;
  auto side_a = [&]() -> bool {
    ping.store(++a, std::memory_order_release);
    while (pong.load(std::memory_order_acquire) != a && !stop.load(std::memory_order_relaxed)) cpu_relax();
    return true;
  };
  auto side_b = [&]() -> bool {
    while (ping.load(std::memory_order_acquire) == b) cpu_relax();
    if (stop.load()) return false;
    b = ping.load(std::memory_order_acquire);
    pong.store(b, std::memory_order_release);
    return true;
  };
  run_ping_pong(state, side_a, side_b, stop);
}
BENCHMARK(BM_PingPong_BareCacheLine)->UseRealTime();

void hotloop_ping_pong(benchmark::State& state, WaitPolicy policy) {
  Counter ping, pong;
  std::atomic<bool> stop{false};
  WaitPolicy pa = policy, pb = policy;
  auto side_a = [&]() -> bool {
    ping.publish();
    if (stop.load()) return true;
    Source* s = &pong;
    wait_any(&s, 1, 10'000'000'000, pa);
    pong.taken = pong.value.load(std::memory_order_acquire);
    return true;
  };
  auto side_b = [&]() -> bool {
    Source* s = &ping;
    wait_any(&s, 1, 10'000'000'000, pb);
    if (stop.load()) return false;
    ping.taken = ping.value.load(std::memory_order_acquire);
    pong.publish();
    return true;
  };
  run_ping_pong(state, side_a, side_b, stop);
}

void BM_PingPong_HotloopSpin(benchmark::State& state) { hotloop_ping_pong(state, WaitPolicy(1'000'000'000, 0, false)); }
BENCHMARK(BM_PingPong_HotloopSpin)->UseRealTime();

// A 64-byte message each way through two shared-memory rings (the message queue's core), spinning readers:
// judged against the bare cache-line ping-pong. Each side's own objects (its writer, its reader, its policy, its
// message) sit on cache lines of their own, as they do in two processes: sharing a line between the sides
// would add transfers that no real queue pays.
template <class T>
struct alignas(kCacheLine) OwnLines {
  T v;
};

void BM_PingPong_ShmRingSpin(benchmark::State& state) {
  RingGeometry g;
  g.capacity = 1 << 16;
  OwnLines<ShmRing> ab_w{ShmRing::create(g)}, ba_w{ShmRing::create(g)};
  OwnLines<ShmRing> ab_r{ShmRing::attach(ab_w.v.name(), 0, g.capacity, 1)};
  OwnLines<ShmRing> ba_r{ShmRing::attach(ba_w.v.name(), 0, g.capacity, 1)};
  std::atomic<bool> stop{false};
  OwnLines<WaitPolicy> pa{WaitPolicy(1'000'000'000, 0, false)}, pb{WaitPolicy(1'000'000'000, 0, false)};
  char msg[64] = {};
  ShmRing::Part part{msg, sizeof msg};
  OwnLines<ShmRing::Message> ma, mb;
  auto side_a = [&]() -> bool {
    ab_w.v.write(&part, 1, -1, pa.v);
    if (stop.load()) return true;
    ba_r.v.read(ma.v, 10'000'000'000, pa.v);
    return true;
  };
  auto side_b = [&]() -> bool {
    ab_r.v.read(mb.v, 10'000'000'000, pb.v);
    if (stop.load()) return false;
    ba_w.v.write(&part, 1, -1, pb.v);
    return true;
  };
  run_ping_pong(state, side_a, side_b, stop);
}
BENCHMARK(BM_PingPong_ShmRingSpin)->UseRealTime();

// Bare futex ping-pong: the floor for "a sleeping thread is woken by another".
void BM_PingPong_BareFutex(benchmark::State& state) {
  alignas(kCacheLine) std::atomic<uint32_t> ping{0};
  alignas(kCacheLine) std::atomic<uint32_t> pong{0};
  std::atomic<bool> stop{false};
  uint32_t a = 0, b = 0;
  auto side_a = [&]() -> bool {
    ping.store(++a, std::memory_order_seq_cst);
    futex::wake(&ping, INT_MAX, false);
    uint32_t v;
    while ((v = pong.load()) != a && !stop.load()) futex::wait(&pong, v, false, kForever);
    return true;
  };
  auto side_b = [&]() -> bool {
    uint32_t v;
    while ((v = ping.load()) == b) futex::wait(&ping, v, false, kForever);
    if (stop.load()) return false;
    b = v;
    pong.store(b, std::memory_order_seq_cst);
    futex::wake(&pong, INT_MAX, false);
    return true;
  };
  run_ping_pong(state, side_a, side_b, stop);
}
BENCHMARK(BM_PingPong_BareFutex)->UseRealTime();

void BM_PingPong_HotloopPark(benchmark::State& state) { hotloop_ping_pong(state, WaitPolicy(0, 0, false)); }
BENCHMARK(BM_PingPong_HotloopPark)->UseRealTime();

// ---- ratio summary ---------------------------------------------------------------------------------------------

// Keeps each benchmark's median (or single) real time per iteration, to print the ratios at the end.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      std::string name = r.run_name.function_name;
      bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      if (!aggregate && medians_.count(name) && has_median_.count(name)) continue;
      double ns = r.GetAdjustedRealTime();
      if (r.counters.count("ns_per_iteration")) ns = r.counters.at("ns_per_iteration");
      medians_[name] = ns;
      if (aggregate) has_median_[name] = true;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    auto get = [&](const char* n) { return medians_.count(n) ? medians_[n] : 0.0; };
    std::printf("\nSummary (medians; ping-pong figures are round trips, one-way = half)\n");
    std::printf("  spin iteration over 3 sources: %.1f ns (goal <= 50 ns)\n", get("BM_SpinIteration_3Sources"));
    auto ratio = [&](const char* what, const char* a, const char* b, double goal) {
      double x = get(a), y = get(b);
      if (x > 0 && y > 0) {
        std::printf("  %-34s hotloop %.0f ns vs bare %.0f ns: %.2fx (goal <= %.1fx)\n", what, x, y, x / y, goal);
      }
    };
    ratio("wake-up while spinning:", "BM_PingPong_HotloopSpin", "BM_PingPong_BareCacheLine", 2.0);
    ratio("wake-up from park:", "BM_PingPong_HotloopPark", "BM_PingPong_BareFutex", 1.5);
    ratio("64 B message through ShmRing:", "BM_PingPong_ShmRingSpin", "BM_PingPong_BareCacheLine", 2.0);
  }

 private:
  std::map<std::string, double> medians_;
  std::map<std::string, bool> has_median_;
};

}  // namespace
}  // namespace hotloop

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  hotloop::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
