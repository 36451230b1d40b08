// hotloop._core.bench: load generators for the Python benchmarks that must not need the GIL to fire
// (a Python thread would itself wait for the GIL, and measure that instead of the waiter).
#include <nanobind/nanobind.h>

#include <atomic>
#include <random>
#include <thread>

#include "common.h"
#include "hotloop/clock.h"
#include "hotloop/flag.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;

// Sets a Flag every `period` seconds (+- jitter) from a C++ thread and records when, until stop(). A tick that
// finds the flag still set (the waiter has not taken the last one) is skipped, so last_set_ns always names
// the set that the waiter will see.
class Ticker {
 public:
  Ticker(Flag& flag, double period_s, double jitter_s) : flag_(flag) {
    int64_t period = int64_t(period_s * 1e9), jitter = int64_t(jitter_s * 1e9);
    if (period <= 0) throw nb::value_error("Ticker: period must be > 0");
    thread_ = std::thread([this, period, jitter] {
      std::mt19937_64 rng(1);
      int64_t next = now_ns() + period;
      while (!stop_.load(std::memory_order_relaxed)) {
        int64_t at = next + (jitter > 0 ? int64_t(rng() % uint64_t(2 * jitter)) - jitter : 0);
        timespec ts{time_t(at / 1'000'000'000), long(at % 1'000'000'000)};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
        if (stop_.load(std::memory_order_relaxed)) break;
        if (!flag_.is_set()) {
          last_set_ns_.store(now_ns(), std::memory_order_relaxed);
          flag_.set();
          fired_.fetch_add(1, std::memory_order_relaxed);
        }
        next += period;
      }
    });
  }
  ~Ticker() { stop(); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) {
      ReleasedGil released;
      thread_.join();
    }
  }
  int64_t last_set_ns() const { return last_set_ns_.load(std::memory_order_relaxed); }
  uint64_t fired() const { return fired_.load(std::memory_order_relaxed); }

 private:
  Flag& flag_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> last_set_ns_{0};
  std::atomic<uint64_t> fired_{0};
  std::thread thread_;
};

}  // namespace

void bind_bench(nb::module_& m) {
  nb::module_ b = m.def_submodule("bench", "Load generators for hotloop's benchmarks.");
  b.def("now_ns", &now_ns, "CLOCK_MONOTONIC in ns (the clock time.monotonic_ns() reads).");
  nb::class_<Ticker>(b, "Ticker", "Sets a Flag periodically from a C++ thread (no GIL); stop() joins it.")
      .def(nb::init<Flag&, double, double>(), "flag"_a, "period"_a, "jitter"_a = 0.0, nb::keep_alive<1, 2>())
      .def("stop", &Ticker::stop)
      .def_prop_ro("last_set_ns", &Ticker::last_set_ns)
      .def_prop_ro("fired", &Ticker::fired)
      .def("__enter__", [](Ticker& t) -> Ticker& { return t; }, nb::rv_policy::reference)
      .def("__exit__", [](Ticker& t, nb::args) { t.stop(); });
}

}  // namespace hotloop::py
