// Bindings of the wait metrics: WaitMetrics (a collector of waits), the thread's collector, the process
// aggregate, and the dict every metrics reader in Python gets (hotloop.metrics shapes it for users).
#include <nanobind/nanobind.h>

#include "common.h"
#include "hotloop/wait_metrics.h"

namespace hotloop::py {

using namespace nb::literals;

namespace {

constexpr const char* kEndNames[kWaitEnds] = {"immediate", "spin", "yield", "park", "timeout"};
constexpr const char* kPhaseNames[kTimedPhases] = {"spin", "yield", "park"};

}  // namespace

nb::dict latency_dict(const uint64_t* buckets, uint64_t sum_ns) {
  nb::list counts;
  uint64_t n = 0;
  for (int k = 0; k < LatencyHistogram::kBuckets; ++k) {
    counts.append(buckets[k]);
    n += buckets[k];
  }
  nb::dict d;
  d["buckets"] = counts;
  d["count"] = n;
  d["sum_ns"] = sum_ns;
  return d;
}

nb::dict latency_dict(const LatencyHistogram& h) {
  uint64_t buckets[LatencyHistogram::kBuckets];
  for (int k = 0; k < LatencyHistogram::kBuckets; ++k) buckets[k] = h.bucket(k);
  return latency_dict(buckets, h.sum_ns());
}

nb::dict counts_dict(const WaitCounts& c) {
  nb::dict waits, phase_ns;
  for (int i = 0; i < kWaitEnds; ++i) waits[kEndNames[i]] = c.ended[i];
  for (int i = 0; i < kTimedPhases; ++i) phase_ns[kPhaseNames[i]] = c.phase_ns[i];
  nb::dict d;
  d["waits"] = waits;
  d["phase_ns"] = phase_ns;
  d["spin_iterations"] = c.spin_iterations;
  d["yields"] = c.yields;
  d["parks"] = c.parks;
  d["safety_wakeups"] = c.safety_wakeups;
  d["wake_latency"] = latency_dict(c.latency_buckets, c.latency_sum_ns);
  return d;
}

void bind_metrics(nb::module_& m) {
  nb::class_<WaitMetrics>(m, "WaitMetrics",
                          "Collects the waits of the threads that name it with set_thread_wait_metrics (an engine "
                          "loop, a queue reader): waits ended per phase, time per phase, wake-up latency. Safe "
                          "from any thread; adding costs a few relaxed atomic increments per wait.")
      .def(nb::init<>())
      .def("snapshot", [](const WaitMetrics& w) { return counts_dict(w.snapshot()); },
           "The counts so far, as a dict (see hotloop.metrics).");
  m.def("set_thread_wait_metrics",
        [](WaitMetrics* w) { set_thread_wait_metrics(w); }, "metrics"_a.none(),
        "Route the calling thread's later waits into `metrics` as well (None: stop). Keep the object alive "
        "while it is set (hotloop.metrics.collect does).");
  m.def("process_wait_metrics", [] { return counts_dict(process_wait_metrics()); },
        "Every wait of this process (all threads, exited ones too) since it started, as a dict.");
  m.attr("latency_buckets") = LatencyHistogram::kBuckets;
}

}  // namespace hotloop::py
