// CudaDriver: the CUDA driver, opened at run time. hotloop never links libcuda, so the wheel builds and imports
// on machines without an NVIDIA driver; the first call of cuda_driver() dlopens it, resolves the entry points
// of cuda_api.h through cuGetProcAddress (versioned: the CUDA 12.0 semantics of each), and calls cuInit(0).
//
// Library: $HOTLOOP_CUDA_DRIVER if set (the tests point it at a fake driver), else libcuda.so.1.
// Failure to load or initialise is remembered: every later call throws the same CudaUnavailable, whose message
// says what failed (dlopen's or the driver's own words) and what to do. The library is never closed (stream
// callbacks may still be running at exit).
#pragma once

#include <stdexcept>
#include <string>

#include "hotloop/cuda_api.h"
#include "hotloop/errors.h"

namespace hotloop {

struct CudaDriver {
  cuda_api::PFN_cuDriverGetVersion cuDriverGetVersion = nullptr;
  cuda_api::PFN_cuGetErrorName cuGetErrorName = nullptr;
  cuda_api::PFN_cuGetErrorString cuGetErrorString = nullptr;
  cuda_api::PFN_cuCtxGetCurrent cuCtxGetCurrent = nullptr;
  cuda_api::PFN_cuCtxSetCurrent cuCtxSetCurrent = nullptr;
  cuda_api::PFN_cuStreamGetCtx cuStreamGetCtx = nullptr;
  cuda_api::PFN_cuStreamAddCallback cuStreamAddCallback = nullptr;
  cuda_api::PFN_cuEventCreate cuEventCreate = nullptr;
  cuda_api::PFN_cuEventDestroy cuEventDestroy = nullptr;
  cuda_api::PFN_cuEventRecord cuEventRecord = nullptr;
  cuda_api::PFN_cuEventQuery cuEventQuery = nullptr;
  cuda_api::PFN_cuEventSynchronize cuEventSynchronize = nullptr;

  std::string path;    // the library that was opened
  int version = 0;     // cuDriverGetVersion, e.g. 13000

  // "CUDA_ERROR_X (description)" for a result code, from the driver itself.
  std::string describe(cuda_api::CUresult code) const;
  // Throws CudaError("<call> failed: <describe(code)>") unless code is CUDA_SUCCESS.
  void check(cuda_api::CUresult code, const char* call) const;
};

// The process's driver, loaded on first use. Throws CudaUnavailable (always the same one) if it cannot be.
const CudaDriver& cuda_driver();

// Whether cuda_driver() succeeds; if not and `why` is given, the reason. Never throws.
bool cuda_available(std::string* why = nullptr) noexcept;

}  // namespace hotloop
