// The slice of the CUDA driver API that hotloop calls, declared here so that hotloop builds without the CUDA
// toolkit and never links libcuda: the driver is opened at run time (cuda_driver.h). Types, values and
// signatures are those of cuda.h (CUDA 12 and 13); tests/cpp/test_cuda_api.cpp checks them against the
// toolkit's cuda.h when it is installed. The fake driver used by the tests implements the same signatures.
#pragma once

#include <cstdint>

// The driver's opaque handle types, with cuda.h's own (global) names.
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;

namespace hotloop::cuda_api {

using CUresult = int;  // cuda.h: enum cudaError_enum, int-sized
using CUcontext = ::CUctx_st*;
using CUstream = ::CUstream_st*;
using CUevent = ::CUevent_st*;
using CUstreamCallback = void (*)(CUstream stream, CUresult status, void* user_data);

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;
constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_ILLEGAL_ADDRESS = 700;
constexpr CUresult CUDA_ERROR_LAUNCH_FAILED = 719;

constexpr unsigned CU_EVENT_BLOCKING_SYNC = 0x1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;

constexpr uint64_t CU_GET_PROC_ADDRESS_DEFAULT = 0;
// The API version hotloop asks cuGetProcAddress for: CUDA 12.0 semantics of every entry point below.
constexpr int kRequestedApiVersion = 12000;

// Entry point signatures, by the names cuGetProcAddress resolves.
using PFN_cuGetProcAddress_v2 = CUresult (*)(const char* symbol, void** pfn, int cuda_version, uint64_t flags,
                                             int* symbol_status);
using PFN_cuInit = CUresult (*)(unsigned flags);
using PFN_cuDriverGetVersion = CUresult (*)(int* version);
using PFN_cuGetErrorName = CUresult (*)(CUresult error, const char** name);
using PFN_cuGetErrorString = CUresult (*)(CUresult error, const char** text);
using PFN_cuCtxGetCurrent = CUresult (*)(CUcontext* ctx);
using PFN_cuCtxSetCurrent = CUresult (*)(CUcontext ctx);
using PFN_cuStreamGetCtx = CUresult (*)(CUstream stream, CUcontext* ctx);
using PFN_cuStreamAddCallback = CUresult (*)(CUstream stream, CUstreamCallback callback, void* user_data,
                                             unsigned flags);
using PFN_cuEventCreate = CUresult (*)(CUevent* event, unsigned flags);
using PFN_cuEventDestroy = CUresult (*)(CUevent event);
using PFN_cuEventRecord = CUresult (*)(CUevent event, CUstream stream);
using PFN_cuEventQuery = CUresult (*)(CUevent event);
using PFN_cuEventSynchronize = CUresult (*)(CUevent event);

}  // namespace hotloop::cuda_api
