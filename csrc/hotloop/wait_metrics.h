// WaitMetrics: what waits did (how many ended in each phase, time spent in each phase, wake-up latency), kept
// cheaply enough to stay on in production.
//
// Contract. wait_any records every wait that returns (not one that throws) into
//  - the calling thread's block of the process-wide aggregate (process_wait_metrics() sums the blocks of live
//    threads and those left by exited ones): plain loads and stores of relaxed atomics, each block written by
//    its own thread only, so no locked instruction and no shared cache line on the wait path;
//  - the WaitMetrics named by a WaitMetricsScope on the calling thread, if any (a queue reader, an engine loop;
//    relaxed fetch_add, since one WaitMetrics may collect the waits of several threads);
//  - the caller's WaitStats (per wait), which a Waiter adds to its own WaitMetrics.
// Nothing is read from the clock for the metrics alone: phase times come from the clock reads the wait makes
// anyway (the spin loop reads it every 8 iterations, so a wait that ends while spinning counts its spin time
// up to its last clock read: at most 8 iterations, ~0.4 us, short).
//
// A forked child starts with its parent's counts (the memory is copied); take differences there too.
//
// Phases a wait ends in: immediate (ready at the first check), spin, yield, park, or timeout (the deadline
// passed with nothing ready; a zero-timeout check that finds nothing counts here too).
//
// Wake-up latency: from the moment a source was made ready to the waiter running again, for the wake-ups where
// that moment is known without costing the producer anything: a doorbell stamps the time of a ring that finds
// a waiter parked (the ring makes a system call then anyway), and a step notifier stamps each completion. So
// the histogram holds park wake-ups (ring -> back from the kernel) and step completions (complete -> waiter
// returns, in any phase); a spin wake-up costs one spin iteration and is counted, not timed. Buckets are
// powers of two in nanoseconds: bucket k counts latencies in [2^(k-1), 2^k) ns (bucket 0: 0 ns), the last one
// everything above.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace hotloop {

struct WaitStats;

enum class WaitEnd : int { kImmediate = 0, kSpin = 1, kYield = 2, kPark = 3, kTimeout = 4 };
constexpr int kWaitEnds = 5;
// The phases time is spent in (indexes into phase_ns): spin, yield, park.
constexpr int kTimedPhases = 3;

// A fixed-bucket log2 histogram of nanosecond latencies. Safe from any thread (relaxed atomics).
class LatencyHistogram {
 public:
  static constexpr int kBuckets = 32;  // the last bucket: >= 2^30 ns (~1.07 s)

  static int bucket_of(int64_t ns) noexcept {
    if (ns <= 0) return 0;
    int k = 64 - __builtin_clzll(uint64_t(ns));
    return k < kBuckets ? k : kBuckets - 1;
  }
  // The exclusive upper bound of bucket k in ns (2^k); the last bucket has none.
  static int64_t upper_bound_ns(int k) noexcept { return int64_t(1) << k; }

  void add(int64_t ns) noexcept {
    if (ns < 0) ns = 0;
    buckets_[bucket_of(ns)].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(uint64_t(ns), std::memory_order_relaxed);
  }
  // The same, for a histogram that only the calling thread writes (plain load + store).
  void add_single_writer(int64_t ns) noexcept {
    if (ns < 0) ns = 0;
    auto& b = buckets_[bucket_of(ns)];
    b.store(b.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    sum_ns_.store(sum_ns_.load(std::memory_order_relaxed) + uint64_t(ns), std::memory_order_relaxed);
  }
  uint64_t bucket(int k) const noexcept { return buckets_[k].load(std::memory_order_relaxed); }
  uint64_t sum_ns() const noexcept { return sum_ns_.load(std::memory_order_relaxed); }
  uint64_t count() const noexcept;

 private:
  friend struct WaitCounts;
  std::atomic<uint64_t> buckets_[kBuckets] = {};
  std::atomic<uint64_t> sum_ns_{0};
};

// A plain copy of wait metrics (a snapshot, or the sum of several).
struct WaitCounts {
  uint64_t ended[kWaitEnds] = {};        // waits, by WaitEnd
  uint64_t phase_ns[kTimedPhases] = {};  // time spent spinning, yielding, parked
  uint64_t spin_iterations = 0;
  uint64_t yields = 0;                   // sched_yield calls
  uint64_t parks = 0;                    // kernel sleeps
  uint64_t safety_wakeups = 0;           // parks over descriptors ended by the safety timeout
  uint64_t latency_buckets[LatencyHistogram::kBuckets] = {};
  uint64_t latency_sum_ns = 0;

  uint64_t waits() const noexcept;
  uint64_t latency_count() const noexcept;
  void add(const WaitCounts& other) noexcept;
  void add(const LatencyHistogram& h) noexcept;
};

// Metrics many threads may add to (relaxed fetch_add): a Waiter's, a queue reader's, an engine loop's.
class WaitMetrics {
 public:
  void add(const WaitStats& st) noexcept;
  // The same, for metrics that only the calling thread writes (plain load + store: no locked instruction).
  void add_single_writer(const WaitStats& st) noexcept;
  // A wait that did nothing but end (immediate, or a zero-timeout check that found nothing): one counter.
  void add_end(WaitEnd e) noexcept { ended_[int(e)].fetch_add(1, std::memory_order_relaxed); }
  void add_end_single_writer(WaitEnd e) noexcept {
    ended_[int(e)].store(ended_[int(e)].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  WaitCounts snapshot() const noexcept;
  // Kernel sleeps so far (one relaxed load: cheap enough to read around every wait).
  uint64_t parks() const noexcept { return parks_.load(std::memory_order_relaxed); }

 private:
  template <bool kShared>
  void add_impl(const WaitStats& st) noexcept;

  std::atomic<uint64_t> ended_[kWaitEnds] = {};
  std::atomic<uint64_t> phase_ns_[kTimedPhases] = {};
  std::atomic<uint64_t> spin_iterations_{0};
  std::atomic<uint64_t> yields_{0};
  std::atomic<uint64_t> parks_{0};
  std::atomic<uint64_t> safety_wakeups_{0};
  LatencyHistogram latency_;
};

// Routes the calling thread's later waits into `m` as well (nullptr: none); returns the previous one.
WaitMetrics* set_thread_wait_metrics(WaitMetrics* m) noexcept;

// The same as a scope: while it lives, the calling thread's waits also go to `m`. Scopes nest: the innermost
// wins; the previous one is restored at the end.
class WaitMetricsScope {
 public:
  explicit WaitMetricsScope(WaitMetrics* m) noexcept;
  ~WaitMetricsScope();
  WaitMetricsScope(const WaitMetricsScope&) = delete;
  WaitMetricsScope& operator=(const WaitMetricsScope&) = delete;

 private:
  WaitMetrics* previous_;
};

// The sum over every thread of this process, live and exited, since the process started (counters only grow:
// take differences).
WaitCounts process_wait_metrics();

// Called by wait_any at the end of each wait that returns; record_wait_end for a wait that only ended (the
// immediate path, kept to one counter).
void record_wait(const WaitStats& st) noexcept;
void record_wait_end(WaitEnd e) noexcept;

}  // namespace hotloop
