// Exercises every NVTX range of the core once, for test_nvtx.cpp: a wait that spins then parks, and a CUDA
// step marked and completed on the fake driver (HOTLOOP_CUDA_DRIVER must point at it).
#include <cstdint>
#include <cstdio>

#include "hotloop/cuda_step_notifier.h"
#include "hotloop/flag.h"
#include "hotloop/wait_any.h"

extern "C" void fakecu_make_current();
extern "C" int fakecu_launch_sleep(void* stream, int64_t duration_ns);

int main() {
  using namespace hotloop;
  Flag never;
  Source* s = &never;
  WaitPolicy policy(1'000, 0, false);
  if (wait_any(&s, 1, 2'000'000, policy) != 0) return 1;  // times out after spin and park
  fakecu_make_current();
  CudaStepNotifier n;
  fakecu_launch_sleep(nullptr, 20'000'000);  // a 20 ms kernel: the wait below really waits
  StepCounter::Until until = n.counter().until(n.mark(0));
  Source* step = &until;
  if (wait_any(&step, 1, 5'000'000'000, policy) != 1) return 2;
  std::puts("probe done");
  return 0;
}
