// Binding of the CUDA side: driver availability, CudaStepNotifier (as StepNotifier) and the CUDA exceptions.
// Streams are given as raw handles (int) or as objects with a `cuda_stream` attribute (torch.cuda.Stream);
// the core does not depend on torch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "hotloop/cuda_driver.h"
#include "hotloop/cuda_step_notifier.h"
#include "step_methods.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;

uintptr_t stream_handle(const nb::handle& stream) {
  nb::handle h = stream;
  nb::object attr;
  if (nb::hasattr(stream, "cuda_stream")) {
    attr = stream.attr("cuda_stream");
    h = attr;
  }
  if (!nb::isinstance<nb::int_>(h)) {
    throw nb::type_error("stream must be a CUDA stream handle (int) or have a `cuda_stream` attribute "
                         "(torch.cuda.Stream)");
  }
  int64_t v = nb::cast<int64_t>(h);
  if (v < 0) throw nb::value_error("a CUDA stream handle is not negative");
  return uintptr_t(v);
}

}  // namespace

void bind_cuda(nb::module_& m) {
  auto cuda_error = nb::exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  nb::exception<CudaUnavailable>(m, "CudaUnavailableError", cuda_error);

  m.def(
      "cuda_unavailable_reason",
      [] {
        std::string why;
        return cuda_available(&why) ? nb::none() : nb::object(nb::str(why.c_str()));
      },
      "None if the CUDA driver loads and initialises, else why not (loads it on first call).");
  m.def(
      "cuda_driver_info",
      [] {
        const CudaDriver& d = cuda_driver();
        nb::dict info;
        info["path"] = d.path;
        info["version"] = d.version;
        return info;
      },
      "The loaded driver: its library path and version (e.g. 13000). Raises CudaUnavailableError.");

  nb::class_<CudaStepNotifier> cls(
      m, "StepNotifier",
      "Step completion for work on CUDA streams. Create it on a thread whose current CUDA context is the "
      "engine's; mark(stream) after a step's work (and its device-to-host copies) is enqueued returns the "
      "step's token. done(token) is one atomic load, wait(token) waits with the GIL released, until(token) is "
      "a wait_any source. Tokens complete in mark order (done(n) implies done(m) for m < n). mechanism: "
      "'stream_callback' (default) or 'event_thread'.");
  cls.def(
         "__init__",
         [](CudaStepNotifier* self, const std::string& mechanism, size_t max_in_flight) {
           new (self) CudaStepNotifier(parse_mechanism(mechanism), max_in_flight);
         },
         "mechanism"_a = "stream_callback", "max_in_flight"_a = 1024)
      .def(
          "mark", [](CudaStepNotifier& n, nb::handle stream) { return n.mark(stream_handle(stream)); },
          "stream"_a,
          "Issue the next step token; it completes once everything enqueued on `stream` so far has finished. "
          "Raises CudaError with the driver's message when the driver refuses the handle; pass a live stream "
          "(torch.cuda.Stream.cuda_stream, or 0 for the legacy default): a real driver does not check that a "
          "number is a stream before using it.")
      .def_prop_ro("mechanism", [](const CudaStepNotifier& n) { return mechanism_name(n.mechanism()); })
      .def_prop_ro("max_in_flight", &CudaStepNotifier::max_in_flight)
      .def_prop_ro("in_flight", &CudaStepNotifier::in_flight, "Marks not completed yet.");
  add_step_methods(cls, [](CudaStepNotifier& n) -> StepCounter& { return n.counter(); }, "StepNotifier.wait");
}

}  // namespace hotloop::py
