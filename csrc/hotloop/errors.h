// The exceptions the core throws. Each message says what happened and what to do about it.
//  - ClosedError: the queue (or other source) was closed; no more items will come.
//  - SourceError: a source can no longer be waited on (e.g. its file descriptor was closed).
//  - DeadPeerError: a peer process of a shared-memory queue (its writer, or a reader) died.
//  - BadHandleError: a queue handle does not describe a usable segment (wrong name, layout, geometry, rank).
//  - QueueTimeout: a wait for ring space or a message timed out.
//  - StepError: a step completed through a step notifier failed (the message says which and why).
//  - CudaError: a CUDA driver call failed (code() is the CUresult); CudaUnavailable: no usable driver.
// Invalid arguments throw std::invalid_argument.
#pragma once

#include <stdexcept>
#include <string>

#include "hotloop/cuda_api.h"

namespace hotloop {

class ClosedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class SourceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class DeadPeerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class BadHandleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class QueueTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StepError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A driver call failed. code() is the CUresult; what() names the call and gives the driver's error name and
// description, e.g. "cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE (invalid resource handle)".
class CudaError : public std::runtime_error {
 public:
  CudaError(const std::string& what, cuda_api::CUresult code) : std::runtime_error(what), code_(code) {}
  cuda_api::CUresult code() const noexcept { return code_; }

 private:
  cuda_api::CUresult code_;
};

// No usable driver: not installed, no device, or a library without the entry points hotloop needs.
class CudaUnavailable : public CudaError {
 public:
  using CudaError::CudaError;
};

}  // namespace hotloop
