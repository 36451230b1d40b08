#include "hotloop/cuda_step_notifier.h"

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "hotloop/cuda_driver.h"
#include "hotloop/nvtx.h"

namespace hotloop {

using namespace cuda_api;

const char* mechanism_name(CompletionMechanism m) noexcept {
  return m == CompletionMechanism::kStreamCallback ? "stream_callback" : "event_thread";
}

CompletionMechanism parse_mechanism(const std::string& name) {
  if (name == "stream_callback") return CompletionMechanism::kStreamCallback;
  if (name == "event_thread") return CompletionMechanism::kEventThread;
  throw std::invalid_argument("unknown completion mechanism '" + name +
                              "': choose 'stream_callback' or 'event_thread'");
}

// Shared by the notifier and its in-flight completions; freed by whichever releases it last.
struct CudaStepNotifier::State {
  State(const CudaDriver& d, CUcontext c, CompletionMechanism m, size_t n)
      : drv(d), ctx(c), mechanism(m), cap(n), slots(n), finished(n, 0), pending(n) {}

  void retain() noexcept { refs.fetch_add(1, std::memory_order_relaxed); }
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
  size_t index(uint64_t token) const noexcept { return (token - counter.base()) % cap; }

  // A step ended (status: its CUDA result). Completes every step up to the first one not ended yet; on an
  // error, fails the oldest pending step first.
  void finish(uint64_t token, CUresult status) {
    std::lock_guard<std::mutex> lock(finish_mu);
    uint64_t done = counter.completed();
    if (status != CUDA_SUCCESS && !failed) {
      failed = true;
      counter.fail(done + 1, "CUDA error in the step's stream: " + drv.describe(status));
      done = counter.completed();
    }
    finished[index(token)] = token;
    uint64_t next = done;
    while (finished[index(next + 1)] == next + 1) {
      finished[index(next + 1)] = 0;
      ++next;
    }
    if (next > done) {
      nvtx::mark(nvtx::Range::kStepDone);
      counter.complete(next);
    }
  }

  const CudaDriver& drv;
  const CUcontext ctx;
  const CompletionMechanism mechanism;
  const size_t cap;
  StepCounter counter;
  std::atomic<int64_t> refs{1};

  // kStreamCallback: the user data of each pending callback, by token index.
  struct Slot {
    State* state = nullptr;
    uint64_t token = 0;
    std::atomic<bool> busy{false};
  };
  std::vector<Slot> slots;
  std::mutex finish_mu;
  std::vector<uint64_t> finished;  // token that ended, by index; 0 = none
  bool failed = false;

  // kEventThread: recorded events waiting for the helper (a ring of cap entries) and the event pool.
  struct Pending {
    uint64_t token;
    CUevent event;
  };
  std::mutex event_mu;
  std::condition_variable event_cv;
  std::vector<Pending> pending;
  size_t head = 0, count = 0;
  bool stopping = false;
  std::vector<CUevent> free_events;

  void helper_main();
  CUevent take_event();
  static void on_callback(CUstream stream, CUresult status, void* user_data);
};

CUevent CudaStepNotifier::State::take_event() {
  {
    std::lock_guard<std::mutex> lock(event_mu);
    if (!free_events.empty()) {
      CUevent e = free_events.back();
      free_events.pop_back();
      return e;
    }
  }
  CUevent e = nullptr;
  drv.check(drv.cuEventCreate(&e, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  return e;
}

void CudaStepNotifier::State::helper_main() {
  drv.cuCtxSetCurrent(ctx);
  for (;;) {
    Pending p;
    {
      std::unique_lock<std::mutex> lock(event_mu);
      event_cv.wait(lock, [&] { return stopping || count > 0; });
      if (count == 0) break;  // stopping, nothing left in flight
      p = pending[head];
    }
    CUresult rc = drv.cuEventSynchronize(p.event);
    {  // back to the pool before the step completes, so the engine's next mark finds it there
      std::lock_guard<std::mutex> lock(event_mu);
      head = (head + 1) % cap;
      --count;
      free_events.push_back(p.event);
    }
    finish(p.token, rc);
  }
  for (CUevent e : free_events) drv.cuEventDestroy(e);
  free_events.clear();
  release();
}

void CudaStepNotifier::State::on_callback(CUstream, CUresult status, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  State* state = slot->state;
  uint64_t token = slot->token;
  slot->busy.store(false, std::memory_order_release);
  state->finish(token, status);
  state->release();
}

CudaStepNotifier::CudaStepNotifier(CompletionMechanism mechanism, size_t max_in_flight) {
  const CudaDriver& drv = cuda_driver();
  if (max_in_flight == 0) throw std::invalid_argument("max_in_flight must be at least 1");
  CUcontext ctx = nullptr;
  drv.check(drv.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    throw CudaError(
        "no current CUDA context on this thread: create the notifier after the engine initialised CUDA on it "
        "(with torch: after torch.cuda.init() or the first CUDA tensor)",
        CUDA_ERROR_INVALID_CONTEXT);
  }
  state_ = new State(drv, ctx, mechanism, max_in_flight);
  if (mechanism == CompletionMechanism::kEventThread) {
    state_->retain();  // the helper's reference
    try {
      std::thread([s = state_] { s->helper_main(); }).detach();
    } catch (...) {
      delete state_;
      throw;
    }
  }
}

CudaStepNotifier::~CudaStepNotifier() {
  if (state_->mechanism == CompletionMechanism::kEventThread) {
    {
      std::lock_guard<std::mutex> lock(state_->event_mu);
      state_->stopping = true;
    }
    state_->event_cv.notify_all();
  }
  state_->release();
}

uint64_t CudaStepNotifier::mark(uintptr_t stream_handle) {
  nvtx::Scope range(nvtx::Range::kMark);
  State& s = *state_;
  const CudaDriver& drv = s.drv;
  auto stream = reinterpret_cast<CUstream>(stream_handle);
  CUcontext stream_ctx = nullptr;
  CUresult rc = drv.cuStreamGetCtx(stream, &stream_ctx);
  if (rc != CUDA_SUCCESS) {
    throw CudaError("stream handle " + std::to_string(stream_handle) + " is not a usable CUDA stream: " +
                        drv.describe(rc),
                    rc);
  }
  if (stream_ctx != s.ctx) {
    throw std::invalid_argument("stream " + std::to_string(stream_handle) +
                                " belongs to another CUDA context than this notifier's: create one notifier "
                                "per context, on a thread where that context is current");
  }
  if (in_flight() >= s.cap) {
    throw std::length_error(std::to_string(s.cap) +
                            " steps are already in flight on this notifier: wait for the oldest before marking "
                            "another, or create the notifier with a larger max_in_flight");
  }
  uint64_t token = s.counter.issued() + 1;  // issued by counter.mark() once the completion is enqueued
  if (s.mechanism == CompletionMechanism::kStreamCallback) {
    State::Slot& slot = s.slots[s.index(token)];
    if (slot.busy.load(std::memory_order_acquire)) {
      throw std::length_error("the completion slot of step " + std::to_string(token - s.counter.base()) +
                              " is still held by an earlier step's callback: too many steps in flight");
    }
    slot.state = &s;
    slot.token = token;
    slot.busy.store(true, std::memory_order_relaxed);
    s.retain();
    rc = drv.cuStreamAddCallback(stream, &State::on_callback, &slot, 0);
    if (rc != CUDA_SUCCESS) {
      slot.busy.store(false, std::memory_order_relaxed);
      s.release();
      drv.check(rc, "cuStreamAddCallback");
    }
  } else {
    CUevent event = s.take_event();
    rc = drv.cuEventRecord(event, stream);
    {
      std::lock_guard<std::mutex> lock(s.event_mu);
      if (rc != CUDA_SUCCESS) {
        s.free_events.push_back(event);
      } else {
        s.pending[(s.head + s.count) % s.cap] = State::Pending{token, event};
        ++s.count;
      }
    }
    drv.check(rc, "cuEventRecord");
    s.event_cv.notify_one();
  }
  return s.counter.mark();
}

StepCounter& CudaStepNotifier::counter() noexcept { return state_->counter; }
CompletionMechanism CudaStepNotifier::mechanism() const noexcept { return state_->mechanism; }
size_t CudaStepNotifier::max_in_flight() const noexcept { return state_->cap; }
size_t CudaStepNotifier::in_flight() const noexcept {
  // A completion can land between enqueueing a mark and issuing its token: completed may lead issued briefly.
  uint64_t issued = state_->counter.issued(), completed = state_->counter.completed();
  return issued > completed ? size_t(issued - completed) : 0;
}

}  // namespace hotloop
