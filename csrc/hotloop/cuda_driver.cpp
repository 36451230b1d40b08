#include "hotloop/cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>

namespace hotloop {
namespace {

using namespace cuda_api;

struct LoadResult {
  CudaDriver driver;
  std::unique_ptr<CudaUnavailable> error;  // set when loading failed
};

const char* library_path() {
  const char* env = std::getenv("HOTLOOP_CUDA_DRIVER");
  return env && *env ? env : "libcuda.so.1";
}

// Resolves the driver entry points hotloop calls into `d` (and cuInit into `cu_init`) through get_proc. Returns
// the names it could not resolve, comma-separated ("" when all were).
std::string resolve_entry_points(PFN_cuGetProcAddress_v2 get_proc, CudaDriver& d, PFN_cuInit& cu_init) {
  std::string missing;
  auto resolve = [&](const char* name, auto& fn) {
    void* p = nullptr;
    int status = 0;
    CUresult rc = get_proc(name, &p, kRequestedApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    if (rc != CUDA_SUCCESS || p == nullptr || status != 0) {
      missing += missing.empty() ? name : std::string(", ") + name;
      return;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  resolve("cuInit", cu_init);
  resolve("cuDriverGetVersion", d.cuDriverGetVersion);
  resolve("cuGetErrorName", d.cuGetErrorName);
  resolve("cuGetErrorString", d.cuGetErrorString);
  resolve("cuCtxGetCurrent", d.cuCtxGetCurrent);
  resolve("cuCtxSetCurrent", d.cuCtxSetCurrent);
  resolve("cuStreamGetCtx", d.cuStreamGetCtx);
  resolve("cuStreamAddCallback", d.cuStreamAddCallback);
  resolve("cuEventCreate", d.cuEventCreate);
  resolve("cuEventDestroy", d.cuEventDestroy);
  resolve("cuEventRecord", d.cuEventRecord);
  resolve("cuEventQuery", d.cuEventQuery);
  resolve("cuEventSynchronize", d.cuEventSynchronize);
  return missing;
}

void load(LoadResult& r) {
  CudaDriver& d = r.driver;
  d.path = library_path();
  void* lib = dlopen(d.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    r.error = std::make_unique<CudaUnavailable>(
        "the CUDA driver could not be loaded (" + std::string(err ? err : d.path) +
            "): no NVIDIA driver on this machine? Install one, or set HOTLOOP_CUDA_DRIVER to the path of "
            "libcuda.so.1; on a CPU-only machine use HostStepNotifier",
        CUDA_ERROR_NOT_INITIALIZED);
    return;
  }
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v2>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    r.error = std::make_unique<CudaUnavailable>(
        d.path + " has no cuGetProcAddress_v2: hotloop needs an NVIDIA driver for CUDA 12.0 or newer",
        CUDA_ERROR_NOT_FOUND);
    return;
  }
  PFN_cuInit cu_init = nullptr;
  const std::string missing = resolve_entry_points(get_proc, d, cu_init);
  if (!missing.empty()) {
    r.error = std::make_unique<CudaUnavailable>(
        d.path + " lacks driver entry points hotloop needs (" + missing + "): update the NVIDIA driver",
        CUDA_ERROR_NOT_FOUND);
    return;
  }
  CUresult rc = cu_init(0);
  if (rc != CUDA_SUCCESS) {
    r.error = std::make_unique<CudaUnavailable>(
        "cuInit failed: " + d.describe(rc) + " (driver " + d.path +
            "): no usable GPU; on a CPU-only machine use HostStepNotifier",
        rc);
    return;
  }
  d.check(d.cuDriverGetVersion(&d.version), "cuDriverGetVersion");
}

const LoadResult& loaded() {
  static LoadResult r;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      load(r);
    } catch (const CudaError& e) {
      r.error = std::make_unique<CudaUnavailable>(e.what(), e.code());
    }
  });
  return r;
}

}  // namespace

std::string CudaDriver::describe(CUresult code) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName == nullptr || cuGetErrorName(code, &name) != CUDA_SUCCESS || name == nullptr) {
    return "CUresult " + std::to_string(code) + " (unknown to the driver)";
  }
  if (cuGetErrorString == nullptr || cuGetErrorString(code, &text) != CUDA_SUCCESS || text == nullptr) {
    return name;
  }
  return std::string(name) + " (" + text + ")";
}

void CudaDriver::check(CUresult code, const char* call) const {
  if (code != CUDA_SUCCESS) throw CudaError(std::string(call) + " failed: " + describe(code), code);
}

const CudaDriver& cuda_driver() {
  const LoadResult& r = loaded();
  if (r.error) throw *r.error;
  return r.driver;
}

bool cuda_available(std::string* why) noexcept {
  const LoadResult& r = loaded();
  if (r.error && why) *why = r.error->what();
  return !r.error;
}

}  // namespace hotloop
