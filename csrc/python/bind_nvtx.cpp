// Binding of NVTX ranges for Python code (the engine's steps): hotloop.nvtx.Range(name) is a reusable context
// manager whose name is registered once with NVTX, in the "hotloop" domain.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "common.h"
#include "hotloop/nvtx.h"

namespace hotloop::py {
namespace {

struct NamedRange {
  explicit NamedRange(std::string n) : name(std::move(n)), handle(nvtx::register_name(name.c_str())) {}
  std::string name;
  const void* handle;
};

}  // namespace

void bind_nvtx(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<NamedRange>(m, "NvtxRange",
                         "An NVTX range with a constant name: create it once (module level), then `with r:` "
                         "around each occurrence. Costs one call when no profiler is attached; nothing when "
                         "hotloop was built without NVTX.")
      .def(nb::init<std::string>(), "name"_a)
      .def_ro("name", &NamedRange::name)
      .def("__enter__", [](NamedRange& r) { nvtx::push_registered(r.handle); return &r; },
           nb::rv_policy::reference)
      .def("__exit__", [](NamedRange& r, nb::args) {
        if (r.handle != nullptr) nvtx::pop();
        return false;
      });
  m.def("nvtx_compiled_in", &nvtx::compiled_in, "Whether hotloop was built with NVTX ranges.");
}

}  // namespace hotloop::py
