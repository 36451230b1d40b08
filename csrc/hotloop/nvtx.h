// NVTX ranges, so that an Nsight Systems timeline shows where the hot loop waits (spin or park), marks steps
// and moves messages. All live in the "hotloop" NVTX domain under constant names registered once per process.
//
// Cost: NVTX3 is header-only; without a tool attached (no NVTX_INJECTION64_PATH, not run under nsys) a push
// or pop is one call through a null-checked function pointer. Built without the NVTX3 headers
// (HOTLOOP_HAVE_NVTX=0), every call here is an empty inline function.
#pragma once

#include <cstdint>

namespace hotloop::nvtx {

enum class Range : uint8_t {
  kWait,      // "hotloop.wait": a wait_any that did not return at once
  kSpin,      // "hotloop.wait.spin": its spin and yield phases
  kPark,      // "hotloop.wait.park": its park phase (asleep in the kernel)
  kMark,      // "hotloop.step.mark": StepNotifier::mark enqueueing a completion
  kStepDone,  // "hotloop.step.done": an instant marker when a step's completion lands
  kEnqueue,   // "hotloop.queue.enqueue"
  kDequeue,   // "hotloop.queue.dequeue"
  kCount
};

const char* name(Range r) noexcept;
// Whether hotloop was built with NVTX ranges.
bool compiled_in() noexcept;

#if HOTLOOP_HAVE_NVTX
void push(Range r) noexcept;
void pop() noexcept;
void mark(Range r) noexcept;  // an instant event
// Ranges with a caller-chosen name (the Python engine's steps): register the name once, then push by handle.
const void* register_name(const char* name) noexcept;
void push_registered(const void* handle) noexcept;
#else
inline void push(Range) noexcept {}
inline void pop() noexcept {}
inline void mark(Range) noexcept {}
inline const void* register_name(const char*) noexcept { return nullptr; }
inline void push_registered(const void*) noexcept {}
#endif

// A range for the lifetime of a scope, or until end().
class Scope {
 public:
  explicit Scope(Range r) noexcept { push(r); }
  ~Scope() { end(); }
  void end() noexcept {
    if (open_) pop();
    open_ = false;
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  bool open_ = true;
};

}  // namespace hotloop::nvtx
