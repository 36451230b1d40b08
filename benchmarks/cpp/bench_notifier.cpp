// Microbenchmarks of step completion: what done() costs next to the bare atomic load it is (the baseline), and
// what mark() costs per mechanism on the fake driver (logic only: the fake's streams are host threads, so the
// driver part of mark is the fake's enqueue, not a real driver's). GPU timings: hotloop bench notifier.
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdlib>

#include "hotloop/cuda_step_notifier.h"
#include "hotloop/step_counter.h"

extern "C" void fakecu_make_current();

namespace hotloop {
namespace {

void BM_BareAtomicLoad(benchmark::State& state) {  // baseline: the least a done() can cost
  std::atomic<uint64_t> completed{1};
  uint64_t token = 1;
  for (auto _ : state) benchmark::DoNotOptimize(completed.load(std::memory_order_acquire) >= token);
}
BENCHMARK(BM_BareAtomicLoad);

void BM_StepCounterDone(benchmark::State& state) {
  StepCounter c;
  uint64_t t = c.mark();
  c.complete(t);
  for (auto _ : state) benchmark::DoNotOptimize(c.done(t));
}
BENCHMARK(BM_StepCounterDone);

void BM_StepCounterNotDone(benchmark::State& state) {
  StepCounter c;
  uint64_t t = c.mark();
  for (auto _ : state) benchmark::DoNotOptimize(c.done(t));
}
BENCHMARK(BM_StepCounterNotDone);

// mark() on the legacy default stream of the fake driver, in batches that complete before the next.
void BM_FakeDriverMark(benchmark::State& state) {
  fakecu_make_current();
  CudaStepNotifier n(CompletionMechanism(state.range(0)), 1 << 16);
  state.SetLabel(mechanism_name(n.mechanism()));
  uint64_t last = 0;
  int64_t batch = 0;
  for (auto _ : state) {
    last = n.mark(0);
    if (++batch == 4096) {
      state.PauseTiming();
      while (n.in_flight() > 0) {
      }
      batch = 0;
      state.ResumeTiming();
    }
  }
  while (!n.counter().done(last)) {
  }
}
BENCHMARK(BM_FakeDriverMark)->Arg(int(CompletionMechanism::kStreamCallback))->Arg(int(CompletionMechanism::kEventThread));

}  // namespace
}  // namespace hotloop

int main(int argc, char** argv) {
  setenv("HOTLOOP_CUDA_DRIVER", HOTLOOP_FAKE_CUDA_PATH, 0);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
