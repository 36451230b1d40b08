// Binding of host step completion: HostStepNotifier (a StepCounter that a worker thread completes) and the
// per-token wait source every notifier hands out.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "hotloop/step_counter.h"
#include "step_methods.h"

namespace hotloop::py {

using namespace nb::literals;

bool wait_step(StepCounter& c, uint64_t token, const nb::object& timeout, WaitPolicy& policy, const char* what) {
  if (c.done(token)) return true;
  StepCounter::Until until = c.until(token);
  Source* s = &until;
  wait_released(&s, 1, timeout_ns(timeout, what), policy);
  return c.done(token);
}

void bind_step(nb::module_& m) {
  nb::exception<StepError>(m, "StepError", PyExc_RuntimeError);

  nb::class_<StepCounter::Until, Source>(m, "StepUntil", "A wait_any source: ready once its step is done.")
      .def_prop_ro("token", &StepCounter::Until::token);
  nb::class_<StepCounter::Settled, Source>(m, "StepSettled",
                                           "A wait_any source: ready while every marked step is done.");

  nb::class_<StepCounter> cls(
      m, "HostStepNotifier",
      "Step completion for CPU engines: mark() issues increasing step tokens (opaque ints naming this notifier); "
      "the thread that runs the steps calls complete(token) (or fail(token, why)) in order; done(token) is one "
      "atomic load; wait(token) waits with the GIL released; until(token) is a wait_any source. done(n) implies "
      "done(m) for m < n.");
  cls.def(nb::init<>())
      .def("mark", &StepCounter::mark, "Issue the next step token.")
      .def(
          "complete",
          [](StepCounter& c, uint64_t token) {
            c.check_issued(token);
            c.complete(token);
          },
          "token"_a, "Mark step `token` (and every earlier one) done.")
      .def(
          "fail",
          [](StepCounter& c, uint64_t token, const std::string& why) {
            c.check_issued(token);
            c.fail(token, why);
          },
          "token"_a, "why"_a,
           "Mark step `token` failed: waiters wake and done() raises StepError for it and later steps.");
  add_step_methods(cls, [](StepCounter& c) -> StepCounter& { return c; }, "HostStepNotifier.wait");
}

}  // namespace hotloop::py
