// The methods every step notifier shares in Python (done / wait / until / settled / issued / completed), bound for any
// class that can hand out its StepCounter.
#pragma once

#include <nanobind/nanobind.h>

#include "common.h"
#include "hotloop/step_counter.h"

namespace hotloop::py {

// Waits (GIL released) until step `token` is done or the timeout passes; returns done(token).
bool wait_step(StepCounter& c, uint64_t token, const nb::object& timeout, WaitPolicy& policy, const char* what);

template <class T, class CounterOf>
void add_step_methods(nb::class_<T>& cls, CounterOf counter_of, const char* name) {
  using namespace nb::literals;
  cls.def(
         "done", [counter_of](T& self, uint64_t token) { return counter_of(self).done(token); }, "token"_a,
         "Whether step `token` is done: one atomic load. Raises ValueError for a token this notifier did not "
         "issue, StepError if that step (or an earlier one) failed.")
      .def(
          "wait",
          [counter_of, name](T& self, uint64_t token, const nb::object& timeout, WaitPolicy& policy) {
            return wait_step(counter_of(self), token, timeout, policy, name);
          },
          "token"_a, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
          "Wait (GIL released) until step `token` is done; return whether it is (False on timeout).")
      .def(
          "until", [counter_of](T& self, uint64_t token) { return counter_of(self).until(token); }, "token"_a,
          nb::keep_alive<0, 1>(), "A wait_any source that is ready once step `token` is done.")
      .def(
          "settled", [counter_of](T& self) { return StepCounter::Settled(counter_of(self)); },
          nb::keep_alive<0, 1>(),
          "A wait_any source that is ready while every marked step is done: the same source for every step (with "
          "one step in flight it is until(that step)), so a prepared Waiter can hold it.")
      .def_prop_ro(
          "issued", [counter_of](T& self) { return counter_of(self).issued() - counter_of(self).base(); },
          "How many steps were marked.")
      .def_prop_ro(
          "completed", [counter_of](T& self) { return counter_of(self).completed() - counter_of(self).base(); },
          "How many steps are done (completed or failed), counted from the first.")
      .def_prop_ro(
          "stats",
          [counter_of](T& self) {
            StepCounter& c = counter_of(self);
            nb::dict d;
            d["marks"] = c.issued() - c.base();
            d["completions"] = c.completed() - c.base();
            d["wake_latency"] = latency_dict(c.wake_latency());
            return d;
          },
          "Steps marked and completed, and completion -> waiter running latency for waits that a completion "
          "ended (a dict; hotloop.metrics describes it).");
}

}  // namespace hotloop::py
