// Binding of host step completion: HostStepNotifier (a StepCounter that a worker thread completes) and the
// per-token wait source it hands out.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "hotloop/clock.h"
#include "hotloop/step_counter.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;

bool wait_step(StepCounter& c, uint64_t token, const nb::object& timeout, WaitPolicy& policy) {
  if (c.done(token)) return true;
  StepCounter::Until until = c.until(token);
  Source* s = &until;
  wait_released(&s, 1, timeout_ns(timeout, "HostStepNotifier.wait"), policy);
  return c.done(token);
}

}  // namespace

void bind_step(nb::module_& m) {
  nb::exception<StepError>(m, "StepError", PyExc_RuntimeError);

  nb::class_<StepCounter::Until, Source>(m, "StepUntil", "A wait_any source: ready once its step is done.")
      .def_prop_ro("token", &StepCounter::Until::token);

  nb::class_<StepCounter>(
      m, "HostStepNotifier",
      "Step completion for CPU engines: mark() issues increasing step tokens (opaque ints naming this notifier); the thread that runs the steps "
      "calls complete(token) (or fail(token, why)) in order; done(token) is one atomic load; wait(token) waits "
      "with the GIL released; until(token) is a wait_any source. done(n) implies done(m) for m < n.")
      .def(nb::init<>())
      .def("mark", &StepCounter::mark, "Issue the next step token.")
      .def("complete", &StepCounter::complete, "token"_a, "Mark step `token` (and every earlier one) done.")
      .def("fail", &StepCounter::fail, "token"_a, "why"_a,
           "Mark step `token` failed: waiters wake and done() raises StepError for it and later steps.")
      .def("done", &StepCounter::done, "token"_a,
           "Whether step `token` is done. Raises ValueError for a token this notifier did not issue, StepError if "
           "that step (or an earlier one) failed.")
      .def("wait", &wait_step, "token"_a, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
           "Wait (GIL released) until step `token` is done; return whether it is (False on timeout).")
      .def("until", &StepCounter::until, "token"_a, nb::keep_alive<0, 1>(),
           "A wait_any source that is ready once step `token` is done.")
      .def_prop_ro("issued", [](const StepCounter& c) { return c.issued() - c.base(); },
                   "How many steps were marked.")
      .def_prop_ro("completed", [](const StepCounter& c) { return c.completed() - c.base(); },
                   "How many steps are done (completed or failed), counted from the first.");
}

}  // namespace hotloop::py
