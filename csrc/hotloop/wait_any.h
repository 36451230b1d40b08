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
// futex_wait (one doorbell), futex_waitv (several), ppoll (descriptors only), or, when doorbells and
// descriptors are mixed, in the park backend chosen at run time (park_backend()):
//  - "io_uring" (Linux >= 5.16): futex_waitv on the doorbells plus the tail of the thread's io_uring, whose
//    one poll on the thread's epoll watch of the descriptors completes when one is ready (uring_park.h);
//  - "futex_waitv helper" (Linux >= 5.16, io_uring refused): futex_waitv on the doorbells plus a word that a
//    per-thread helper polling that watch bumps (waker_thread.h);
//  - "sliced" (older kernels): ppoll over the descriptors plus an eventfd that doorbells write to. The eventfd
//    registry is process-local, so a ring from another process is noticed only at the end of a 100 ms slice.
// The first two wake within microseconds of either kind of event, whichever process rings. Wake-ups cannot
// be lost (see doorbell.h). HOTLOOP_PARK=auto (default) | uring | fallback (the helper) | sliced selects the
// backend; one that is unavailable falls back to the next, with the reason in park_backend().
//
// Interruption. With hooks, a park lasts at most hooks->slice_ns; after each park that ended without a ready
// source, hooks->on_slice runs and may throw to abort the wait (the Python binding raises KeyboardInterrupt
// there). A signal ends a park at once (EINTR; on the helper backend, one during the thread's first park ends
// it once the helper has started), so on_slice runs then too.
//
// Closed descriptors. One that is not open when a park starts throws SourceError at once. One closed while the
// kernel watches it wakes nothing, so descriptors are
// re-validated after every park that ended without an event, and parks over descriptors last at most
// kFdSafetyNs (1 s; "sliced" mixed waits: 100 ms): such a close throws SourceError within about a second
// (within hooks->slice_ns with hooks). A park ended by that safety timeout is counted in
// WaitStats::safety_wakeups; events never wait for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hotloop/source.h"
#include "hotloop/wait_metrics.h"
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

// What one wait did. Every wait that returns is also recorded in the process's wait metrics (wait_metrics.h).
struct WaitStats {
  WaitPhase phase = WaitPhase::kImmediate;  // the phase the wait was in when it returned
  WaitEnd end = WaitEnd::kImmediate;        // the same, with a wait that found nothing ready as kTimeout
  uint64_t spins = 0;   // spin-loop iterations
  uint64_t yields = 0;  // sched_yield calls
  uint64_t parks = 0;   // kernel sleeps
  uint64_t safety_wakeups = 0;  // parks over descriptors ended by the safety timeout, not by an event
  uint64_t phase_ns[kTimedPhases] = {};  // time spinning, yielding, parked (see wait_metrics.h for the accuracy)
  int64_t wake_latency_ns = -1;  // ready -> running again, where known (wait_metrics.h); -1 otherwise
};

// The longest park over descriptors: a descriptor closed while waited on is noticed after at most this long.
// An idle wait pays one wake-up per second for it (~10-90 us of CPU: < 0.01 % of a core).
constexpr int64_t kFdSafetyNs = 1'000'000'000;

// How a wait over doorbells and descriptors together sleeps (see "How" above).
enum class ParkBackend : int { kIoUring = 0, kWakerThread = 1, kSliced = 2 };

struct ParkBackendInfo {
  ParkBackend backend;
  const char* name;    // "io_uring", "futex_waitv helper", "sliced"
  std::string reason;  // why it is not io_uring ("" when it is)
};

// The backend in use: chosen at the first mixed park from $HOTLOOP_PARK (auto, uring, fallback, sliced).
ParkBackendInfo park_backend();
// Chooses the backend for every later park in this process ("auto", "uring", "fallback" (also
// "futex_waitv"), "sliced"); an unavailable one falls back to the next best, with the reason. For tests and
// benchmarks; throws std::invalid_argument for an unknown name.
ParkBackendInfo set_park_backend(const std::string& request);
// Sets up the calling thread's resources for the current backend now (its io_uring ring, or its helper thread
// and eventfd), which its first mixed park would otherwise do (~50-100 us, once). They stay until the thread
// exits. Throws SourceError if they cannot be set up.
void prepare_park();

uint64_t wait_any(Source* const* sources, size_t n, int64_t timeout_ns, WaitPolicy& policy,
                  const WaitHooks* hooks = nullptr, WaitStats* stats = nullptr);

// One check of every source, as the spin loop does it (no waiting). Descriptors are polled.
uint64_t ready_mask(Source* const* sources, size_t n);

}  // namespace hotloop
