// hotloop._core: the nanobind module. Thin: each binding converts arguments, releases the GIL around anything
// that can block, and maps core exceptions to Python ones. The Python package (python/hotloop) re-exports it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "hotloop/errors.h"
#include "hotloop/futex.h"
#include "hotloop/nvtx.h"
#include "hotloop/wait_policy.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "hotloop's C++ core: doorbells, GIL-free multi-source waits, queues.";
  m.attr("__version__") = HOTLOOP_VERSION;

  nb::exception<hotloop::ClosedError>(m, "ClosedError", PyExc_RuntimeError);
  nb::exception<hotloop::SourceError>(m, "SourceError", PyExc_OSError);

  // Objects alive at exit (held by daemon threads parked in a wait, or by tracebacks) are not bugs here.
  nb::set_leak_warnings(false);
  hotloop::py::init_main_thread();
  hotloop::py::bind_metrics(m);
  hotloop::py::bind_wait(m);
  hotloop::py::bind_input_queue(m);
  hotloop::py::bind_step(m);
  hotloop::py::bind_cuda(m);
  hotloop::py::bind_nvtx(m);
  hotloop::py::bind_shm_ring(m);
  hotloop::py::bind_remote(m);
  hotloop::py::bind_bench(m);
  // The importing thread (usually the one that runs the loop) gets its park ring now: its first wait over
  // doorbells and descriptors together then pays no setup, and the ring's descriptor exists from import on.
  try {
    hotloop::prepare_park();
  } catch (const hotloop::SourceError&) {
    // Reported by the first such wait, which tries again.
  }

  m.def("build_info", [] {
    nb::dict d;
    d["version"] = HOTLOOP_VERSION;
    d["build_type"] = HOTLOOP_BUILD_TYPE;
    d["compiler"] = __VERSION__;
    d["nvtx"] = hotloop::nvtx::compiled_in();
    d["futex_waitv"] = hotloop::futex::wait_many_supported();
    d["default_spin_us"] = hotloop::WaitPolicy::kDefaultSpinNs / 1e3;
    d["default_yield_us"] = hotloop::WaitPolicy::kDefaultYieldNs / 1e3;
    return d;
  }, "Facts about this build, for bug reports (see `hotloop info`).");
}
