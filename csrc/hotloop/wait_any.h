// wait_any: wait until at least one of several sources is ready, or a deadline passes.
//
// Contract. Returns a bit mask of the sources that were ready when the wait ended (bit i = sources[i]); 0 means
// the timeout passed with none ready. Nothing is consumed: the caller takes what is ready. At most 64
// sources. timeout_ns < 0 waits without a deadline, 0 checks once. Thread-safe: any number of threads may
// wait on the same sources (each is woken by every ring). Blocks the calling thread only; call it without
// the Python GIL.
//
// How. Check everything once; then spin (check doorbell sources, `pause`; poll descriptors at a bounded rate),
// then yield, for the policy's budgets; then park: announce on every doorbell, re-check, and sleep in
// futex_wait (one doorbell), futex_waitv (several), or ppoll over the descriptors plus an eventfd that the
// doorbells write to (when descriptors are involved). Wake-ups cannot be lost (see doorbell.h).
//
// Interruption. With hooks, a park lasts at most hooks->slice_ns; after each park that ended without a ready
// source, hooks->on_slice runs and may throw to abort the wait (the Python binding raises KeyboardInterrupt
// there). Descriptors are re-validated after every park (parks last at most 100 ms when descriptors are
// watched): one closed while waited on throws SourceError.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hotloop/source.h"
#include "hotloop/wait_policy.h"

namespace hotloop {

constexpr size_t kMaxSources = 64;

struct WaitHooks {
  int64_t slice_ns = 0;                 // 0: a park lasts until the deadline
  void (*on_slice)(void* ctx) = nullptr;
  void* ctx = nullptr;
};

// Where a wait ended, for benchmarks and tests.
enum class WaitPhase : int { kImmediate = 0, kSpin = 1, kYield = 2, kPark = 3 };

struct WaitStats {
  WaitPhase phase = WaitPhase::kImmediate;
  uint64_t spins = 0;   // spin-loop iterations
  uint64_t yields = 0;  // sched_yield calls
  uint64_t parks = 0;   // kernel sleeps
};

uint64_t wait_any(Source* const* sources, size_t n, int64_t timeout_ns, WaitPolicy& policy,
                  const WaitHooks* hooks = nullptr, WaitStats* stats = nullptr);

// One check of every source, as the spin loop does it (no waiting). Descriptors are polled.
uint64_t ready_mask(Source* const* sources, size_t n);

}  // namespace hotloop
