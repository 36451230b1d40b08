// Binding of InputQueue for Python objects: the queue holds one reference per queued object.
#include <nanobind/nanobind.h>

#include <vector>

#include "common.h"
#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/input_queue.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;

class PyInputQueue final : public InputQueue {
 public:
  ~PyInputQueue() override {
    // Runs with the GIL held (nanobind deallocates under it): drop the references still queued.
    std::vector<void*> left;
    drain(left);
    for (void* item : left) Py_DECREF(static_cast<PyObject*>(item));
  }

  void put_obj(nb::handle obj) {
    Py_INCREF(obj.ptr());
    if (!put(obj.ptr())) {
      Py_DECREF(obj.ptr());
      throw ClosedError("InputQueue.put: the queue is closed; nothing was added (create a new queue, or stop "
                        "producing once close() is called)");
    }
  }

  nb::object get_nowait() {
    void* item;
    if (try_pop(item)) return nb::steal(static_cast<PyObject*>(item));
    if (closed()) throw ClosedError("InputQueue.get: the queue is closed and empty");
    raise_empty("InputQueue.get_nowait: the queue is empty");
  }

  nb::object get(const nb::object& timeout) {
    int64_t t = timeout_ns(timeout, "InputQueue.get");
    const int64_t deadline = deadline_after(t);
    Source* self = this;
    for (;;) {
      void* item;
      if (try_pop(item)) return nb::steal(static_cast<PyObject*>(item));
      if (closed()) throw ClosedError("InputQueue.get: the queue is closed and empty");
      int64_t left = deadline == kForever ? -1 : deadline - now_ns();
      if (deadline != kForever && left <= 0) raise_empty("InputQueue.get: timed out with the queue empty");
      wait_released(&self, 1, left, policy_, nullptr, nullptr, /*prompt_gil=*/true);
    }
  }

  nb::list drain_list(const nb::object& max_items) {
    size_t max = 0;
    if (!max_items.is_none()) {
      long v = nb::cast<long>(max_items);
      if (v < 0) throw nb::value_error("InputQueue.drain: max_items must be >= 0 or None");
      if (v == 0) return nb::list();
      max = size_t(v);
    }
    std::vector<void*> items;
    drain(items, max);
    nb::list out;
    for (void* item : items) out.append(nb::steal(static_cast<PyObject*>(item)));
    return out;
  }

 private:
  WaitPolicy policy_;
};

}  // namespace

void bind_input_queue(nb::module_& m) {
  nb::class_<PyInputQueue, Source>(
      m, "InputQueue",
      "An in-process multi-producer queue of Python objects that wait_any can wait on. put() from any thread; "
      "FIFO per producer; nothing lost or duplicated. close() rejects later puts but keeps queued items; a get "
      "on a closed, empty queue raises ClosedError. Timeouts raise queue.Empty, as queue.Queue does.")
      .def(nb::init<>())
      .def("put", &PyInputQueue::put_obj, "item"_a.none(), "Append an item (never blocks) and wake the consumer.")
      .def("put_nowait", &PyInputQueue::put_obj, "item"_a.none(), "Same as put (the queue is unbounded).")
      .def("get", &PyInputQueue::get, "timeout"_a = nb::none(),
           "Remove and return the oldest item, waiting (GIL released) up to `timeout` seconds.")
      .def("get_nowait", &PyInputQueue::get_nowait, "Remove and return the oldest item; queue.Empty if none.")
      .def("drain", &PyInputQueue::drain_list, "max_items"_a = nb::none(),
           "Remove and return up to max_items items (None: all), oldest first; [] if empty. Never blocks.")
      .def("close", &InputQueue::close, "Reject later puts and wake waiters; queued items can still be taken.")
      .def_prop_ro("closed", &InputQueue::closed)
      .def("qsize", &InputQueue::size)
      .def("empty", [](const PyInputQueue& q) { return q.size() == 0; })
      .def("__len__", &InputQueue::size)
      .def("__repr__", [](const PyInputQueue& q) {
        return nb::str("InputQueue(len={}{})").format(q.size(), q.closed() ? ", closed" : "");
      });
}

}  // namespace hotloop::py
