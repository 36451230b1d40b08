#include "common.h"

#include <Python.h>
#include <dlfcn.h>
#include <pythread.h>
#include <unistd.h>

#include <cmath>
#include <mutex>
#include <string>

#include "hotloop/clock.h"
#include "hotloop/fd_source.h"

namespace hotloop::py {
namespace {

unsigned long g_main_thread = 0;
PyObject* g_empty = nullptr;  // queue.Empty, kept for the life of the process

// A parked main thread is normally woken at once by a signal (EINTR: the kernel prefers the main thread for
// process-directed signals; on the futex_waitv helper backend, during a thread's first park too, while the helper
// starts: waker_thread.cpp). The slice is the fallback for a signal the park cannot see: one caught by another
// thread, or one that came between the wait's last signal check and the start of its sleep (its handler has run, so
// the sleep does not end; the io_uring backend's one-time 2 ms self-test is such a window). Each slice end takes
// the GIL and costs ~60-90 us of CPU on small VMs. 500 ms, the queue's liveness slice: a parked queue reader does
// both checks in one wake-up (shm_ring.cpp, liveness_sliced), so no longer slice would wake it less often; and a
// longer one would stretch the Ctrl-C that another thread caught and the SourceError of a descriptor closed under a
// wait (re-validated at each slice end; kFdSafetyNs, 1 s, without hooks) beyond the half second the tests and docs
// promise. Two wake-ups a second per parked main thread (vLLM's engine core and each worker have one): 0.059 /
// 0.085 % of a core at TP=1 / TP=2, against 0.069 / 0.098 % at 250 ms.
constexpr int64_t kSignalSliceNs = 500'000'000;

// Prompt GIL hand-over: CPython gives a thread that asks for the GIL the lock only after the holder's switch
// interval (5 ms by default) has passed. A woken waiter that must react quickly shortens the interval while it
// takes the GIL back, then restores it. Shared by all such waiters: the first in saves, the last out restores.
// On 3.10 and 3.11 CPython's _PyEval_{Get,Set}SwitchInterval work without the GIL, so the interval is shortened
// only once the wait has succeeded, for the hand-over itself. From 3.12 on they need the calling thread's state
// (calling them without the GIL aborted the process), and 3.13 no longer exports them: there the interval is
// shortened through sys.setswitchinterval with the GIL still held, before the wait lets go of it, and restored
// once the GIL is back. While such a waiter is parked, the process's other threads then switch among
// themselves every 50 us instead of 5 ms when two of them want the GIL at once (one thread running Python alone
// is not interrupted: nobody asks it for the GIL).
constexpr unsigned long kPromptSwitchIntervalUs = 50;
int g_prompt_users = 0;
#if PY_VERSION_HEX >= 0x030C0000
PyObject* g_get_interval = nullptr;  // sys.getswitchinterval / sys.setswitchinterval, kept for the process
PyObject* g_set_interval = nullptr;
double g_saved_interval_s = 0;

void set_interval_s(double seconds) {  // GIL held
  PyObject* arg = PyFloat_FromDouble(seconds);
  PyObject* r = arg ? call_one(g_set_interval, arg) : nullptr;
  if (r == nullptr) PyErr_Clear();
  Py_XDECREF(r);
  Py_XDECREF(arg);
}
#else
std::mutex g_prompt_mu;
unsigned long g_saved_interval_us = 0;

void prompt_gil_enter() {
  std::lock_guard<std::mutex> lock(g_prompt_mu);
  if (g_prompt_users++ == 0) {
    g_saved_interval_us = _PyEval_GetSwitchInterval();
    if (g_saved_interval_us > kPromptSwitchIntervalUs) _PyEval_SetSwitchInterval(kPromptSwitchIntervalUs);
  }
}

void prompt_gil_exit() {
  std::lock_guard<std::mutex> lock(g_prompt_mu);
  if (--g_prompt_users == 0 && g_saved_interval_us > kPromptSwitchIntervalUs) {
    _PyEval_SetSwitchInterval(g_saved_interval_us);
  }
}
#endif

}  // namespace

PromptGil::PromptGil(bool on) : on_(on) {
#if PY_VERSION_HEX >= 0x030C0000
  if (!on_ || g_get_interval == nullptr) return;
  if (g_prompt_users++ == 0) {  // the GIL orders these
    PyObject* r = PyObject_CallNoArgs(g_get_interval);
    g_saved_interval_s = r ? PyFloat_AsDouble(r) : 0.0;
    Py_XDECREF(r);
    if (PyErr_Occurred()) PyErr_Clear();
    if (g_saved_interval_s > kPromptSwitchIntervalUs * 1e-6) set_interval_s(kPromptSwitchIntervalUs * 1e-6);
  }
  shortened_ = true;
#endif
}

void PromptGil::woke() {
#if PY_VERSION_HEX < 0x030C0000
  if (on_ && !shortened_) {
    prompt_gil_enter();
    shortened_ = true;
  }
#endif
}

PromptGil::~PromptGil() {
  if (!shortened_) return;
#if PY_VERSION_HEX >= 0x030C0000
  if (--g_prompt_users == 0 && g_saved_interval_s > kPromptSwitchIntervalUs * 1e-6) {
    PyObject* raised = PyErr_GetRaisedException();  // an exception may be on its way out of the wait: keep it
    set_interval_s(g_saved_interval_s);
    PyErr_SetRaisedException(raised);
  }
#else
  prompt_gil_exit();
#endif
}

namespace {

void check_signals(void*) {
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw nb::python_error();
}

}  // namespace

void init_main_thread() {
#if PY_VERSION_HEX >= 0x030C0000
  nb::object sys = nb::module_::import_("sys");
  g_get_interval = nb::object(sys.attr("getswitchinterval")).release().ptr();
  g_set_interval = nb::object(sys.attr("setswitchinterval")).release().ptr();
#endif
  nb::object threading = nb::module_::import_("threading");
  g_main_thread = nb::cast<unsigned long>(threading.attr("main_thread")().attr("ident"));
  nb::object empty = nb::module_::import_("queue").attr("Empty");
  g_empty = empty.release().ptr();
}

[[noreturn]] void raise_empty(const char* message) {
  PyErr_SetString(g_empty, message);
  throw nb::python_error();
}

int64_t timeout_ns(const nb::object& timeout, const char* what) {
  if (timeout.is_none()) return -1;
  double seconds;
  if (!nb::try_cast<double>(timeout, seconds)) {
    throw nb::type_error((std::string(what) + ": timeout must be a number of seconds or None").c_str());
  }
  if (std::isnan(seconds) || seconds < 0) {
    throw nb::value_error((std::string(what) + ": timeout must be >= 0 seconds or None (no deadline), got " +
                           std::to_string(seconds)).c_str());
  }
  if (seconds > 1e9) return -1;  // ~31 years: treat as no deadline
  return int64_t(seconds * 1e9);
}

SourceList::SourceList(nb::handle iterable) {
  if (PyUnicode_Check(iterable.ptr()) || PyBytes_Check(iterable.ptr()) || !nb::hasattr(iterable, "__iter__")) {
    throw nb::type_error("sources must be a list or tuple of sources (InputQueue, Flag, FdSource, a file "
                         "descriptor, or an object with fileno())");
  }
  for (nb::handle h : iterable) {
    nb::object obj = nb::borrow(h);
    Source* src = nullptr;
    if (nb::try_cast<Source*>(obj, src) && src != nullptr) {
    } else if (PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr())) {
      owned_.push_back(std::make_unique<FdSource>(nb::cast<int>(obj)));
      src = owned_.back().get();
    } else if (nb::hasattr(obj, "hotloop_source")) {  // e.g. a MessageQueue reader
      nb::object inner = obj.attr("hotloop_source");
      src = nb::cast<Source*>(inner);
      keep_.push_back(std::move(inner));  // select() reports the queue itself
    } else if (nb::hasattr(obj, "fileno")) {
      owned_.push_back(std::make_unique<FdSource>(nb::cast<int>(obj.attr("fileno")())));
      src = owned_.back().get();
    } else {
      throw nb::type_error(("cannot wait on an object of type " +
                            std::string(nb::type_name(obj.type()).c_str()) +
                            ": pass an InputQueue, Flag, FdSource, MessageQueue reader, step notifier source, a file "
                            "descriptor, or an object with fileno()")
                               .c_str());
    }
    if (ptrs_.size() == kMaxSources) throw nb::value_error("wait_any: at most 64 sources");
    objects_.push_back(std::move(obj));
    ptrs_.push_back(src);
  }
}

nb::list SourceList::select(uint64_t mask) const {
  nb::list out;
  for (size_t i = 0; i < objects_.size(); ++i) {
    if (mask & (uint64_t(1) << i)) out.append(objects_[i]);
  }
  return out;
}

ReleasedGil::ReleasedGil() : state_(PyEval_SaveThread()) {}

// Whether the interpreter is finalizing (callable without the GIL). The stable-ABI module (cp312-abi3: the
// limited API has neither function) looks up what every CPython exports, Py_IsFinalizing (3.13+) or
// _Py_IsFinalizing (3.12), once; where neither is found (an interpreter loaded with RTLD_LOCAL) it answers false,
// as a build for 3.10 would have without the check.
bool interpreter_finalizing() {
#if defined(Py_LIMITED_API)
  using Fn = int (*)();
  static const Fn fn = [] {
    void* f = dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
    if (f == nullptr) f = dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
    return reinterpret_cast<Fn>(f);
  }();
  return fn != nullptr && fn() != 0;
#elif PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

ReleasedGil::~ReleasedGil() {
  const bool finalizing = interpreter_finalizing();
  if (finalizing) {
    for (;;) pause();  // the process is exiting; this thread must not touch the interpreter again
  }
  PyEval_RestoreThread(state_);
}

const WaitHooks* signal_hooks() {
  static const WaitHooks hooks{kSignalSliceNs, check_signals, nullptr};
  return PyThread_get_thread_ident() == g_main_thread ? &hooks : nullptr;
}

uint64_t wait_released(Source* const* sources, size_t n, int64_t timeout_ns, WaitPolicy& policy,
                       WaitStats* stats, int64_t* woke_ns, bool prompt_gil) {
  const WaitHooks* hp = signal_hooks();
  uint64_t mask;
  PromptGil prompt(prompt_gil);
  {
    ReleasedGil released;
    mask = wait_any(sources, n, timeout_ns, policy, hp, stats);
    if (woke_ns) *woke_ns = now_ns();
    if (mask != 0) prompt.woke();
  }  // the GIL is taken back here
  return mask;
}

}  // namespace hotloop::py
