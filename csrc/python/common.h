// What the binding files share: converting Python timeouts and source lists, and running a core wait with
// the GIL released while staying interruptible by Ctrl-C.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "hotloop/owned_bytes.h"
#include "hotloop/shm_ring.h"
#include "hotloop/source.h"
#include "hotloop/wait_any.h"

namespace hotloop::py {

namespace nb = nanobind;

// The calls the hot paths make, in both builds of the module: the version-specific one (3.10, 3.11: macros and
// PyObject_CallOneArg) and the cp312-abi3 one (the limited API: their function forms, and vectorcall, which the
// limited API has from 3.12).
inline PyObject* call_one(PyObject* callable, PyObject* arg) {
#if defined(Py_LIMITED_API)
  PyObject* args[2] = {nullptr, arg};
  return PyObject_Vectorcall(callable, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
#else
  return PyObject_CallOneArg(callable, arg);
#endif
}
inline Py_ssize_t list_size(PyObject* list) {
#if defined(Py_LIMITED_API)
  return PyList_Size(list);
#else
  return PyList_GET_SIZE(list);
#endif
}
inline PyObject* list_item(PyObject* list, Py_ssize_t i) {  // borrowed
#if defined(Py_LIMITED_API)
  return PyList_GetItem(list, i);
#else
  return PyList_GET_ITEM(list, i);
#endif
}

// seconds (None = no deadline) -> nanoseconds (-1 = no deadline). Raises ValueError for negative or NaN.
int64_t timeout_ns(const nb::object& timeout, const char* what);

// The sources of a wait: Source instances, objects with a `hotloop_source` attribute (MessageQueue readers), or
// file descriptors given as ints or objects with fileno().
// Holds a reference to every object so none disappears while the GIL is released.
class SourceList {
 public:
  explicit SourceList(nb::handle iterable);
  Source* const* data() const { return ptrs_.data(); }
  size_t size() const { return ptrs_.size(); }
  // The objects whose bits are set, in order, as a new list.
  nb::list select(uint64_t mask) const;

 private:
  std::vector<nb::object> objects_;
  std::vector<Source*> ptrs_;
  std::vector<std::unique_ptr<Source>> owned_;  // FdSources made for ints / fileno() objects
  std::vector<nb::object> keep_;                 // sources behind objects' `hotloop_source`
};

// Releases the GIL for a scope, like nb::gil_scoped_release, except that a thread coming back while the
// interpreter is finalizing (a daemon thread whose wait ends at exit) parks forever instead of taking the GIL:
// CPython < 3.14 would end it with pthread_exit, whose unwinding through C++ destructors aborts the process.
class ReleasedGil {
 public:
  ReleasedGil();
  ~ReleasedGil();
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* state_;
};

// Whether the interpreter is finalizing (callable without the GIL). A call made then (a __del__ at exit) keeps
// the GIL: a ReleasedGil would park it forever on its way back.
bool interpreter_finalizing();

// Runs wait_any with the GIL released. On the main thread the park is sliced (500 ms) so that a pending
// signal (Ctrl-C) is handled: the Python exception it raises propagates out of this call.
// If woke_ns is given, it receives the CLOCK_MONOTONIC time at which the core wait returned, before the GIL
// was taken back (the difference to "back in Python" is the GIL hand-over). prompt_gil: when a source is
// ready, take the GIL back after ~50 us instead of the holder's full switch interval (see common.cpp).
uint64_t wait_released(Source* const* sources, size_t n, int64_t timeout_ns, WaitPolicy& policy,
                       WaitStats* stats = nullptr, int64_t* woke_ns = nullptr, bool prompt_gil = false);

// The hooks a core wait needs to stay interruptible by Ctrl-C on the main thread (nullptr elsewhere). The
// hook takes the GIL to run Python's signal handlers: call the wait with the GIL released.
const WaitHooks* signal_hooks();

// Prompt GIL hand-over for one wait (see common.cpp). Construct it with the GIL held, before the GIL is let
// go; call woke() (GIL released) once the wait succeeded; it is destroyed with the GIL held again. Declare it
// before the ReleasedGil of the wait, so that it outlives it.
class PromptGil {
 public:
  explicit PromptGil(bool on);
  PromptGil(const PromptGil&) = delete;
  PromptGil& operator=(const PromptGil&) = delete;
  void woke();
  ~PromptGil();

 private:
  bool on_;
  bool shortened_ = false;
};

// Remembered at import: the thread that runs Python's signal handlers.
void init_main_thread();

// Raises queue.Empty (so hotloop.InputQueue can stand in for queue.Queue).
[[noreturn]] void raise_empty(const char* message);

// Wait metrics as the dicts Python sees (bind_metrics.cpp).
nb::dict counts_dict(const WaitCounts& c);
nb::dict latency_dict(const LatencyHistogram& h);

void bind_metrics(nb::module_& m);
void bind_wait(nb::module_& m);
void bind_input_queue(nb::module_& m);
void bind_bench(nb::module_& m);
void bind_step(nb::module_& m);
void bind_cuda(nb::module_& m);
void bind_nvtx(nb::module_& m);
void bind_shm_ring(nb::module_& m);
void bind_remote(nb::module_& m);

// A writable memoryview owning `b` (no copy): a message handed to its reader (bind_shm_ring.cpp).
nb::object to_python(OwnedBytes&& b);
// The ring of a hotloop._core.ShmRing object; TypeError for anything else, ClosedError once it is closed
// (bind_shm_ring.cpp).
ShmRing& shm_ring_of(nb::handle ring);

}  // namespace hotloop::py
