// Bindings of the wait primitives: Source, Flag, FdSource, WaitPolicy, Waiter, wait_any.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <string>

#include "common.h"
#include "hotloop/clock.h"
#include "hotloop/fd_source.h"
#include "hotloop/flag.h"
#include "hotloop/wait_policy.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;

const char* phase_name(WaitPhase p) {
  switch (p) {
    case WaitPhase::kImmediate: return "immediate";
    case WaitPhase::kSpin: return "spin";
    case WaitPhase::kYield: return "yield";
    case WaitPhase::kPark: return "park";
  }
  return "?";
}

int64_t us_to_ns(double us, const char* name) {
  if (!(us >= 0)) throw nb::value_error((std::string(name) + " must be >= 0 microseconds").c_str());
  return int64_t(us * 1e3);
}

// A prepared wait over a fixed list of sources, with its own (possibly adaptive) policy.
class Waiter {
 public:
  Waiter(nb::handle sources, const WaitPolicy* policy, bool prompt_gil) : sources_(sources), prompt_gil_(prompt_gil) {
    if (policy) policy_ = *policy;
  }
  nb::list wait(const nb::object& timeout) {
    WaitStats st;
    int64_t woke = 0;
    uint64_t mask =
        wait_released(sources_.data(), sources_.size(), timeout_ns(timeout, "Waiter.wait"), policy_, &st, &woke,
                      prompt_gil_);
    last_phase_.store(st.phase, std::memory_order_relaxed);
    last_wake_ns_.store(woke, std::memory_order_relaxed);
    safety_wakeups_.fetch_add(st.safety_wakeups, std::memory_order_relaxed);
    metrics_.add(st);
    return sources_.select(mask);
  }
  nb::list ready() const { return sources_.select(ready_mask(sources_.data(), sources_.size())); }
  WaitPolicy& policy() { return policy_; }
  const char* last_phase() const { return phase_name(last_phase_.load(std::memory_order_relaxed)); }
  int64_t last_wake_ns() const { return last_wake_ns_.load(std::memory_order_relaxed); }
  uint64_t safety_wakeups() const { return safety_wakeups_.load(std::memory_order_relaxed); }
  nb::dict stats() const { return counts_dict(metrics_.snapshot()); }

 private:
  SourceList sources_;
  WaitPolicy policy_;
  bool prompt_gil_;
  std::atomic<WaitPhase> last_phase_{WaitPhase::kImmediate};
  std::atomic<int64_t> last_wake_ns_{0};
  std::atomic<uint64_t> safety_wakeups_{0};
  WaitMetrics metrics_;
};

nb::dict backend_dict(const ParkBackendInfo& info) {
  nb::dict d;
  d["backend"] = info.name;
  d["reason"] = info.reason;
  return d;
}

WaitPolicy g_default_policy;

// A duration a policy has not learned yet (negative) as None, else in microseconds.
nb::object us_or_none(int64_t ns) { return ns < 0 ? nb::none() : nb::object(nb::float_(ns / 1e3)); }

}  // namespace

void bind_wait(nb::module_& m) {
  nb::class_<Source>(m, "Source",
                     "Base of everything wait_any can wait on. `ready()` is a cheap check that consumes nothing.")
      .def("ready", &Source::ready, "Whether the source is ready now (never blocks, consumes nothing).")
      .def_prop_ro(
          "parked",
          [](Source& s) -> uint32_t {
            Doorbell* bell = s.doorbell();
            return bell != nullptr ? bell->parked() : 0;
          },
          "How many threads are parked now on this source's doorbell (of every process, for a shared-memory "
          "queue; 0 for a descriptor source): tests and diagnostics wait for it instead of sleeping.");

  nb::class_<Flag, Source>(m, "Flag",
                           "A settable flag that wait_any can wait on (cancel, shutdown). Safe from any thread.")
      .def(nb::init<>())
      .def("set", &Flag::set, "Set the flag and wake every waiter.")
      .def("clear", &Flag::clear, "Clear the flag.")
      .def("is_set", &Flag::is_set, "Whether the flag is set.")
      .def("__bool__", &Flag::is_set)
      .def("__repr__", [](const Flag& f) { return std::string("Flag(") + (f.is_set() ? "set" : "clear") + ")"; });

  nb::class_<FdSource, Source>(m, "FdSource",
                               "A file descriptor as a source: ready when readable (or hung up). Does not own or "
                               "close the descriptor; raises SourceError if it is closed while waited on.")
      .def("__init__",
           [](FdSource* self, nb::handle fd_or_file) {
             int fd;
             if (!nb::try_cast<int>(fd_or_file, fd)) {
               if (!nb::hasattr(fd_or_file, "fileno")) {
                 throw nb::type_error("FdSource needs an int file descriptor or an object with fileno()");
               }
               fd = nb::cast<int>(fd_or_file.attr("fileno")());
             }
             new (self) FdSource(fd);
           },
           "fd"_a)
      .def_prop_ro("fd", &FdSource::fd)
      .def("__repr__", [](const FdSource& s) { return "FdSource(" + std::to_string(s.fd()) + ")"; });

  nb::class_<WaitPolicy>(m, "WaitPolicy",
                         "How a wait spins, then yields, then parks. Budgets in microseconds. adaptive=True sizes "
                         "the spin from recent wait durations (spin when events come quickly, park when they do "
                         "not); give each waiting loop its own adaptive policy. paced=True learns the interval "
                         "between readies (from the anchor: the previous ready, or anchor()) and, once steady, "
                         "sleeps on a timer until shortly before the next one is due (lead_us, or three times the "
                         "interval's deviation, plus the timer's lateness), then spins through it; a message that "
                         "comes earlier still wakes it. Sets the waiting thread's timer slack to 1 us.")
      .def("__init__",
           [](WaitPolicy* self, double spin_us, double yield_us, bool adaptive, double min_spin_us,
              double fd_check_us, bool paced, double lead_us) {
             new (self) WaitPolicy(us_to_ns(spin_us, "spin_us"), us_to_ns(yield_us, "yield_us"), adaptive, paced);
             self->set_min_spin_ns(us_to_ns(min_spin_us, "min_spin_us"));
             self->set_fd_check_ns(us_to_ns(fd_check_us, "fd_check_us"));
             self->set_lead_ns(us_to_ns(lead_us, "lead_us"));
           },
           "spin_us"_a = WaitPolicy::kDefaultSpinNs / 1e3, "yield_us"_a = WaitPolicy::kDefaultYieldNs / 1e3,
           "adaptive"_a = false, "min_spin_us"_a = WaitPolicy::kDefaultMinSpinNs / 1e3,
           "fd_check_us"_a = WaitPolicy::kDefaultFdCheckNs / 1e3, "paced"_a = false,
           "lead_us"_a = WaitPolicy::kDefaultLeadNs / 1e3)
      .def_prop_rw("spin_us", [](const WaitPolicy& p) { return p.spin_ns() / 1e3; },
                   [](WaitPolicy& p, double v) { p.set_spin_ns(us_to_ns(v, "spin_us")); })
      .def_prop_rw("yield_us", [](const WaitPolicy& p) { return p.yield_ns() / 1e3; },
                   [](WaitPolicy& p, double v) { p.set_yield_ns(us_to_ns(v, "yield_us")); })
      .def_prop_rw("adaptive", &WaitPolicy::adaptive, &WaitPolicy::set_adaptive)
      .def_prop_ro("min_spin_us", [](const WaitPolicy& p) { return p.min_spin_ns() / 1e3; })
      .def_prop_ro("fd_check_us", [](const WaitPolicy& p) { return p.fd_check_ns() / 1e3; })
      .def_prop_ro("recent_wait_us", [](const WaitPolicy& p) { return us_or_none(p.recent_wait_ns()); },
                   "Moving average of recent wait durations (adaptive mode), or None before the first wait.")
      .def_prop_rw("paced", &WaitPolicy::paced, &WaitPolicy::set_paced)
      .def_prop_rw("lead_us", [](const WaitPolicy& p) { return p.lead_ns() / 1e3; },
                   [](WaitPolicy& p, double v) { p.set_lead_ns(us_to_ns(v, "lead_us")); })
      .def("anchor",
           [](WaitPolicy& p, const nb::object& t_ns) {
             p.anchor(t_ns.is_none() ? now_ns() : nb::cast<int64_t>(t_ns));
           },
           "t_ns"_a = nb::none(),
           "Paced mode: predict the next ready at t_ns (time.monotonic_ns(); default: now) + the learned "
           "interval, e.g. anchor when a request is sent, to predict its answer.")
      .def_prop_ro("anchor_ns", [](const WaitPolicy& p) -> nb::object {
                     int64_t v = p.anchor_ns();
                     if (v < 0) return nb::none();
                     return nb::cast(v);
                   },
                   "Paced mode: the current anchor (time.monotonic_ns()), or None.")
      .def_prop_ro("interval_us", [](const WaitPolicy& p) { return us_or_none(p.interval_ns()); },
                   "Paced mode: the learned interval between readies, or None.")
      .def_prop_ro("predicting", &WaitPolicy::predicting,
                   "Paced mode: whether the next wait is predicted (the intervals are steady).")
      .def("paced_stats",
           [](const WaitPolicy& p) {
             PacedStats s = p.paced_stats();
             nb::dict d;
             d["predicted"] = s.predicted;
             d["hit"] = s.hit;
             d["early"] = s.early;
             d["late"] = s.late;
             d["samples"] = s.samples;
             d["misses"] = s.misses;
             d["interval_us"] = p.interval_ns() < 0 ? -1.0 : p.interval_ns() / 1e3;
             d["deviation_us"] = p.interval_dev_ns() / 1e3;
             d["timer_late_us"] = p.timer_late_ns() / 1e3;
             return d;
           },
           "Paced mode: waits predicted, and how they ended: hit (ready during the spin window), early (a ring "
           "woke the timed park), late (the window passed); interval samples fed and rejected (misses); the "
           "learned interval, deviation and timer lateness (us).")
      .def("budgets_us",
           [](const WaitPolicy& p) {
             WaitBudgets b = p.budgets();
             return nb::make_tuple(b.spin_ns / 1e3, b.yield_ns / 1e3);
           },
           "The (spin, yield) budgets the next wait will use.")
      .def("__repr__", [](const WaitPolicy& p) {
        return "WaitPolicy(spin_us=" + std::to_string(p.spin_ns() / 1e3) +
               ", yield_us=" + std::to_string(p.yield_ns() / 1e3) + ", adaptive=" + (p.adaptive() ? "True" : "False") +
               (p.paced() ? ", paced=True" : "") + ")";
      });

  nb::class_<Waiter>(m, "Waiter",
                     "A prepared wait over a fixed list of sources (cheaper than wait_any in a loop), with its own "
                     "policy (a copy of the one given, or the default). prompt_gil (default True): when woken while another "
                     "thread runs Python code, take the GIL back after ~50 us instead of that thread's full switch "
                     "interval (sys.getswitchinterval(), 5 ms by default). On CPython 3.12+ the interval is shortened "
                     "before the wait lets go of the GIL and restored once it is back (docs/architecture.md).")
      .def(nb::init<nb::handle, const WaitPolicy*, bool>(), "sources"_a, "policy"_a = nb::none(),
           "prompt_gil"_a = true)
      .def("wait", &Waiter::wait, "timeout"_a = nb::none(),
           "Wait (GIL released) until a source is ready or `timeout` seconds pass; return the ready sources "
           "(empty on timeout).")
      .def("ready", &Waiter::ready, "The sources ready now, without waiting.")
      .def_prop_ro("policy", &Waiter::policy, nb::rv_policy::reference_internal)
      .def_prop_ro("last_phase", &Waiter::last_phase,
                   "Where the last wait ended: 'immediate', 'spin', 'yield' or 'park'.")
      .def_prop_ro("last_wake_ns", &Waiter::last_wake_ns,
                   "time.monotonic_ns() at which the last wait's C++ part returned, before the GIL was retaken.")
      .def_prop_ro("safety_wakeups", &Waiter::safety_wakeups,
                   "How many parks over descriptors, over all of this Waiter's waits, ended by the 1 s safety "
                   "timeout (the check for a descriptor closed while waited on) rather than by an event.")
      .def_prop_ro("stats", &Waiter::stats,
                   "This Waiter's waits so far: ended per phase, time per phase, wake-up latency (a dict; "
                   "hotloop.metrics describes it).");

  m.def("park_backend", [] { return backend_dict(park_backend()); },
        "How a wait over doorbells and descriptors together sleeps: {'backend': 'io_uring' | 'futex_waitv helper' "
        "| 'sliced', 'reason': why it is not io_uring ('' when it is)}. Chosen from $HOTLOOP_PARK (auto, uring, "
        "fallback, sliced) at first use.");
  m.def("set_park_backend", [](const std::string& name) { return backend_dict(set_park_backend(name)); },
        "name"_a,
        "Choose the park backend for every later wait in this process ('auto', 'uring', 'fallback', 'sliced'); "
        "an unavailable one falls back to the next. Returns park_backend(). For tests and benchmarks.");
  m.def("prepare_park", &prepare_park,
        "Set up the calling thread's park resources for the current backend now (its io_uring ring, or its "
        "helper thread and eventfd) instead of at its first wait over doorbells and descriptors together. "
        "They stay until the thread exits; the importing thread's are set up at import.");

  m.def("wait_any",
        [](nb::handle sources, const nb::object& timeout, WaitPolicy* policy, bool prompt_gil) {
          SourceList list(sources);
          uint64_t mask = wait_released(list.data(), list.size(), timeout_ns(timeout, "wait_any"),
                                        policy ? *policy : g_default_policy, nullptr, nullptr, prompt_gil);
          return list.select(mask);
        },
        "sources"_a, "timeout"_a = nb::none(), "policy"_a = nb::none(), "prompt_gil"_a = true,
        "Wait until at least one source is ready or `timeout` seconds pass (None: no deadline), with the GIL "
        "released; return the ready sources in the order given (empty on timeout). Consumes nothing. Sources: "
        "InputQueue, Flag, FdSource, ints (file descriptors) or objects with fileno(). Ctrl-C interrupts a "
        "wait on the main thread. prompt_gil: see Waiter.");
}

}  // namespace hotloop::py
