// CudaStepNotifier: "step N is done" for work enqueued on CUDA streams, as a StepCounter (done = one atomic
// load, wait_any source through until()).
//
// Contract. Constructed on a thread whose current CUDA context is the engine's (torch's primary context once
// torch has initialised CUDA); streams must belong to that context. mark(stream), called after a step's work
// and its device-to-host copies are enqueued, returns the step's token; the token completes once everything
// enqueued on `stream` before the mark has finished. Tokens complete in mark order: done(n) implies done(m)
// for m < n, also across streams (a later step on a fast stream waits for an earlier one on a slow stream).
// mark() is called from one thread at a time. At most max_in_flight marks may be pending; one more throws.
// A CUDA error in the context fails the oldest pending step with the driver's message (StepError from done /
// wait), and every later one.
//
// Mechanisms (how completion reaches the counter):
//  - kStreamCallback: cuStreamAddCallback per mark; the driver's callback thread completes the token and rings
//    the doorbell. Chosen over cuLaunchHostFunc because a host function is not called at all once the context
//    has an error (a waiter would wait forever), while a stream callback runs exactly once and gets the error.
//  - kEventThread: cuEventRecord of a pooled blocking-sync event per mark; one helper thread per notifier
//    sleeps in cuEventSynchronize on each in turn, then completes the token.
// Neither allocates per step: callback slots and events are pooled (events grow to the most ever in flight).
//
// Destruction never waits for the GPU: completions still in flight finish into state they co-own, which is
// freed by the last of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hotloop/step_counter.h"

namespace hotloop {

enum class CompletionMechanism { kStreamCallback, kEventThread };

// "stream_callback" / "event_thread", and back (std::invalid_argument listing the choices).
const char* mechanism_name(CompletionMechanism m) noexcept;
CompletionMechanism parse_mechanism(const std::string& name);

class CudaStepNotifier {
 public:
  // Throws CudaUnavailable without a driver, CudaError if there is no current context.
  explicit CudaStepNotifier(CompletionMechanism mechanism = CompletionMechanism::kStreamCallback,
                            size_t max_in_flight = 1024);
  ~CudaStepNotifier();
  CudaStepNotifier(const CudaStepNotifier&) = delete;
  CudaStepNotifier& operator=(const CudaStepNotifier&) = delete;

  // Throws CudaError (driver's message: e.g. not a stream), std::invalid_argument (stream of another context),
  // std::length_error (max_in_flight marks already pending). No token is issued when it throws.
  uint64_t mark(uintptr_t stream);

  StepCounter& counter() noexcept;
  CompletionMechanism mechanism() const noexcept;
  size_t max_in_flight() const noexcept;
  // Marks not completed yet.
  size_t in_flight() const noexcept;

 private:
  struct State;
  State* state_;
};

}  // namespace hotloop
