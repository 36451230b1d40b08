#include "hotloop/wait_metrics.h"

#include <pthread.h>

#include <mutex>
#include <new>
#include <vector>

#include "hotloop/wait_any.h"

namespace hotloop {
namespace {

// The process aggregate: one WaitMetrics per thread that waited, written by that thread only.
struct Registry {
  std::mutex mu;
  std::vector<WaitMetrics*> live;
  WaitCounts retired;  // the blocks of exited threads, summed
};

Registry& registry() {
  // Leaked on purpose: threads may exit during static destruction. Held across fork(), so a child never
  // inherits it locked by a thread that does not exist there.
  static Registry* r = [] {
    auto* reg = new Registry();
    pthread_atfork([] { registry().mu.lock(); }, [] { registry().mu.unlock(); }, [] { registry().mu.unlock(); });
    return reg;
  }();
  return *r;
}

// The wait path reads only these trivially initialised pointers; the owner below (a thread_local with a
// destructor) is touched once per thread, when its block is made, and folds the block into `retired` at exit.
thread_local WaitMetrics* t_block = nullptr;
thread_local WaitMetrics* t_scope = nullptr;

struct BlockOwner {
  WaitMetrics* block = nullptr;
  ~BlockOwner() {
    if (block == nullptr) return;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.retired.add(block->snapshot());
    for (auto& b : r.live) {
      if (b == block) {
        b = r.live.back();
        r.live.pop_back();
        break;
      }
    }
    t_block = nullptr;
    delete block;
  }
};
thread_local BlockOwner t_owner;

WaitMetrics* make_block() noexcept {
  auto* b = new (std::nothrow) WaitMetrics();
  if (b == nullptr) return nullptr;
  try {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.live.push_back(b);
  } catch (...) {  // out of memory: this thread's waits go uncounted rather than fail
    delete b;
    return nullptr;
  }
  t_owner.block = b;
  t_block = b;
  return b;
}

// Adds v (most fields of most waits are 0: an immediate wait touches one counter).
template <bool kShared>
inline void bump(std::atomic<uint64_t>& a, uint64_t v) noexcept {
  if (v == 0) return;
  if constexpr (kShared) {
    a.fetch_add(v, std::memory_order_relaxed);
  } else {
    a.store(a.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
  }
}

}  // namespace

uint64_t LatencyHistogram::count() const noexcept {
  uint64_t n = 0;
  for (const auto& b : buckets_) n += b.load(std::memory_order_relaxed);
  return n;
}

uint64_t WaitCounts::waits() const noexcept {
  uint64_t n = 0;
  for (uint64_t e : ended) n += e;
  return n;
}

uint64_t WaitCounts::latency_count() const noexcept {
  uint64_t n = 0;
  for (uint64_t b : latency_buckets) n += b;
  return n;
}

void WaitCounts::add(const WaitCounts& o) noexcept {
  for (int i = 0; i < kWaitEnds; ++i) ended[i] += o.ended[i];
  for (int i = 0; i < kTimedPhases; ++i) phase_ns[i] += o.phase_ns[i];
  spin_iterations += o.spin_iterations;
  yields += o.yields;
  parks += o.parks;
  safety_wakeups += o.safety_wakeups;
  for (int i = 0; i < LatencyHistogram::kBuckets; ++i) latency_buckets[i] += o.latency_buckets[i];
  latency_sum_ns += o.latency_sum_ns;
}

void WaitCounts::add(const LatencyHistogram& h) noexcept {
  for (int i = 0; i < LatencyHistogram::kBuckets; ++i) latency_buckets[i] += h.bucket(i);
  latency_sum_ns += h.sum_ns();
}

template <bool kShared>
void WaitMetrics::add_impl(const WaitStats& st) noexcept {
  bump<kShared>(ended_[int(st.end)], 1);
  for (int i = 0; i < kTimedPhases; ++i) bump<kShared>(phase_ns_[i], st.phase_ns[i]);
  bump<kShared>(spin_iterations_, st.spins);
  bump<kShared>(yields_, st.yields);
  bump<kShared>(parks_, st.parks);
  bump<kShared>(safety_wakeups_, st.safety_wakeups);
  if (st.wake_latency_ns < 0) return;
  if constexpr (kShared) {
    latency_.add(st.wake_latency_ns);
  } else {
    latency_.add_single_writer(st.wake_latency_ns);
  }
}

void WaitMetrics::add(const WaitStats& st) noexcept { add_impl<true>(st); }
void WaitMetrics::add_single_writer(const WaitStats& st) noexcept { add_impl<false>(st); }

WaitCounts WaitMetrics::snapshot() const noexcept {
  WaitCounts c;
  auto get = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  for (int i = 0; i < kWaitEnds; ++i) c.ended[i] = get(ended_[i]);
  for (int i = 0; i < kTimedPhases; ++i) c.phase_ns[i] = get(phase_ns_[i]);
  c.spin_iterations = get(spin_iterations_);
  c.yields = get(yields_);
  c.parks = get(parks_);
  c.safety_wakeups = get(safety_wakeups_);
  c.add(latency_);
  return c;
}

WaitMetrics* set_thread_wait_metrics(WaitMetrics* m) noexcept {
  WaitMetrics* previous = t_scope;
  t_scope = m;
  return previous;
}

WaitMetricsScope::WaitMetricsScope(WaitMetrics* m) noexcept : previous_(set_thread_wait_metrics(m)) {}

WaitMetricsScope::~WaitMetricsScope() { set_thread_wait_metrics(previous_); }

WaitCounts process_wait_metrics() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  WaitCounts total = r.retired;
  for (const WaitMetrics* b : r.live) total.add(b->snapshot());
  return total;
}

void record_wait(const WaitStats& st) noexcept {
  WaitMetrics* b = t_block;
  if (b != nullptr || (b = make_block()) != nullptr) b->add_single_writer(st);
  if (WaitMetrics* m = t_scope) m->add(st);
}

void record_wait_end(WaitEnd e) noexcept {
  WaitMetrics* b = t_block;
  if (b != nullptr || (b = make_block()) != nullptr) b->add_end_single_writer(e);
  if (WaitMetrics* m = t_scope) m->add_end(e);
}

}  // namespace hotloop
