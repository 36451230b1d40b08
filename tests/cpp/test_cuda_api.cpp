// cuda_api.h restates part of cuda.h so that hotloop builds without the toolkit; where the toolkit's cuda.h is
// installed, this file checks the restatement against it: values, and every signature up to int <-> enum and
// uint64_t <-> unsigned long long (same size and calling convention).
#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>

#include "hotloop/cuda_api.h"

#if __has_include(<cuda.h>)
#include <cuda.h>
#define HOTLOOP_HAVE_CUDA_H 1

namespace {

template <class T, class = void>
struct Norm {
  using type = T;
};
template <class T>
struct Norm<T, std::enable_if_t<std::is_enum_v<T>>> {  // C enums are passed as int-sized integers
  static_assert(sizeof(T) == sizeof(int));
  using type = int;
};
template <>
struct Norm<unsigned long long> {
  using type = uint64_t;
};
template <class T>
struct Norm<T*, std::enable_if_t<!std::is_function_v<T>>> {
  using type = typename Norm<T>::type*;
};
template <class R, class... A>
struct Norm<R (*)(A...)> {
  using type = typename Norm<R>::type (*)(typename Norm<A>::type...);
};
template <class T>
using norm_t = typename Norm<T>::type;

#define SAME_SIGNATURE(name) \
  static_assert(std::is_same_v<norm_t<hotloop::cuda_api::PFN_##name>, norm_t<decltype(&::name)>>, #name)

SAME_SIGNATURE(cuInit);
SAME_SIGNATURE(cuDriverGetVersion);
SAME_SIGNATURE(cuGetErrorName);
SAME_SIGNATURE(cuGetErrorString);
SAME_SIGNATURE(cuCtxGetCurrent);
SAME_SIGNATURE(cuCtxSetCurrent);
SAME_SIGNATURE(cuStreamGetCtx);
SAME_SIGNATURE(cuEventCreate);
SAME_SIGNATURE(cuEventRecord);
SAME_SIGNATURE(cuEventQuery);
SAME_SIGNATURE(cuEventSynchronize);
SAME_SIGNATURE(cuStreamAddCallback);
// Versioned names: cuda.h maps cuEventDestroy and cuGetProcAddress to their _v2 forms.
static_assert(std::is_same_v<norm_t<hotloop::cuda_api::PFN_cuEventDestroy>, norm_t<decltype(&::cuEventDestroy_v2)>>);
static_assert(
    std::is_same_v<norm_t<hotloop::cuda_api::PFN_cuGetProcAddress_v2>, norm_t<decltype(&::cuGetProcAddress_v2)>>);

}  // namespace
#endif

TEST(CudaApi, ValuesMatchTheToolkitHeader) {
#ifndef HOTLOOP_HAVE_CUDA_H
  GTEST_SKIP() << "cuda.h is not installed: the restated driver API is not compared with it";
#else
  namespace api = hotloop::cuda_api;
  EXPECT_EQ(api::CUDA_SUCCESS, ::CUDA_SUCCESS);
  EXPECT_EQ(api::CUDA_ERROR_INVALID_VALUE, ::CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api::CUDA_ERROR_NOT_INITIALIZED, ::CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(api::CUDA_ERROR_NO_DEVICE, ::CUDA_ERROR_NO_DEVICE);
  EXPECT_EQ(api::CUDA_ERROR_INVALID_CONTEXT, ::CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(api::CUDA_ERROR_INVALID_HANDLE, ::CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api::CUDA_ERROR_NOT_FOUND, ::CUDA_ERROR_NOT_FOUND);
  EXPECT_EQ(api::CUDA_ERROR_NOT_READY, ::CUDA_ERROR_NOT_READY);
  EXPECT_EQ(api::CUDA_ERROR_ILLEGAL_ADDRESS, ::CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_EQ(api::CUDA_ERROR_LAUNCH_FAILED, ::CUDA_ERROR_LAUNCH_FAILED);
  EXPECT_EQ(api::CU_EVENT_BLOCKING_SYNC, unsigned(::CU_EVENT_BLOCKING_SYNC));
  EXPECT_EQ(api::CU_EVENT_DISABLE_TIMING, unsigned(::CU_EVENT_DISABLE_TIMING));
  EXPECT_EQ(api::CU_GET_PROC_ADDRESS_DEFAULT, uint64_t(::CU_GET_PROC_ADDRESS_DEFAULT));
  EXPECT_EQ(sizeof(::CUresult), sizeof(api::CUresult));
#endif
}
