// A fake CUDA driver for tests of CUDA code paths on machines without a GPU: a shared library exporting
// cuGetProcAddress_v2 and the entry points of csrc/hotloop/cuda_api.h, loaded by hotloop through
// HOTLOOP_CUDA_DRIVER. Python: hotloop.testing.FakeCudaDriver.
//
// Emulation: one context; each stream is a host thread executing its operations in order (emulated kernels,
// event records, stream callbacks). Handles 0, 1 (legacy) and 2 (per-thread) name one default stream. A
// kernel either sleeps for a duration, waits for its gate to be opened by the test, or faults: a fault makes
// the context's error sticky (CUDA_ERROR_ILLEGAL_ADDRESS), after which kernels are skipped, event records and
// synchronisations return the error and callbacks receive it, as with the real driver.
//
// Test controls (extern "C", prefix fakecu_) create streams, launch kernels, open gates and count live
// events. Environment: HOTLOOP_FAKE_CUDA_INIT=<CUresult> makes cuInit fail with that code;
// HOTLOOP_FAKE_CUDA_HIDE=<name> makes cuGetProcAddress_v2 report that entry point as missing.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "hotloop/cuda_api.h"

using namespace hotloop::cuda_api;

#define FAKECU_EXPORT extern "C" __attribute__((visibility("default")))

struct CUctx_st {
  int id = 1;
};

struct CUevent_st {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;
  uint64_t completed = 0;
  bool destroyed = false;  // destroyed while a record was pending: freed when that record completes
};

namespace {

struct Op {
  enum Kind { kSleep, kGate, kFault, kRecord, kCallback } kind;
  int64_t duration_ns = 0;
  uint64_t gate = 0;
  CUevent event = nullptr;
  uint64_t generation = 0;
  CUstreamCallback fn = nullptr;
  void* data = nullptr;
};

CUctx_st g_context;
std::atomic<bool> g_initialised{false};
std::atomic<CUresult> g_sticky{CUDA_SUCCESS};
std::atomic<int64_t> g_events_alive{0};
thread_local CUcontext t_current = nullptr;

std::mutex g_gates_mu;
std::condition_variable g_gates_cv;
std::set<uint64_t> g_open_gates;
uint64_t g_next_gate = 0;

}  // namespace

struct CUstream_st {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> ops;
  bool stopping = false;
  size_t running = 0;  // ops taken but not finished
  std::thread thread;

  CUstream_st() : thread([this] { run(); }) {}
  ~CUstream_st() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stopping = true;
    }
    cv.notify_all();
    thread.join();
  }

  void push(Op op) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ops.push_back(op);
    }
    cv.notify_all();
  }

  void run() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !ops.empty(); });
        if (ops.empty()) return;  // stopping, and everything enqueued has run
        op = ops.front();
        ops.pop_front();
      }
      execute(op);
    }
  }

  void execute(const Op& op) {
    CUresult sticky = g_sticky.load();
    switch (op.kind) {
      case Op::kSleep:
        if (sticky == CUDA_SUCCESS) std::this_thread::sleep_for(std::chrono::nanoseconds(op.duration_ns));
        break;
      case Op::kGate: {
        std::unique_lock<std::mutex> lock(g_gates_mu);
        g_gates_cv.wait(lock, [&] { return g_open_gates.count(op.gate) != 0; });
        break;
      }
      case Op::kFault:
        if (sticky == CUDA_SUCCESS) g_sticky.store(CUDA_ERROR_ILLEGAL_ADDRESS);
        break;
      case Op::kRecord: {
        bool free_it;
        {
          std::lock_guard<std::mutex> lock(op.event->mu);
          if (op.event->completed < op.generation) op.event->completed = op.generation;
          op.event->cv.notify_all();
          free_it = op.event->destroyed && op.event->completed >= op.event->recorded;
        }
        if (free_it) delete op.event;
        break;
      }
      case Op::kCallback:
        op.fn(this, g_sticky.load(), op.data);
        break;
    }
  }
};

namespace {

std::mutex g_streams_mu;
std::set<CUstream> g_streams;
CUstream g_default_stream = nullptr;

// The stream a handle names, or nullptr if it names none.
CUstream lookup(CUstream handle) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  if (reinterpret_cast<uintptr_t>(handle) <= 2) {
    if (g_default_stream == nullptr) g_default_stream = new CUstream_st();
    return g_default_stream;
  }
  return g_streams.count(handle) ? handle : nullptr;
}

CUresult cu_init(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (const char* forced = std::getenv("HOTLOOP_FAKE_CUDA_INIT")) {
    CUresult rc = std::atoi(forced);
    if (rc != CUDA_SUCCESS) return rc;
  }
  g_initialised = true;
  return CUDA_SUCCESS;
}

CUresult cu_driver_get_version(int* v) {
  if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *v = 13000;
  return CUDA_SUCCESS;
}

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;
};
const ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
};

const ErrorText* find_error(CUresult code) {
  for (const ErrorText& e : kErrors) {
    if (e.code == code) return &e;
  }
  return nullptr;
}

CUresult cu_get_error_name(CUresult code, const char** out) {
  const ErrorText* e = find_error(code);
  if (e == nullptr || out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *out = e->name;
  return CUDA_SUCCESS;
}

CUresult cu_get_error_string(CUresult code, const char** out) {
  const ErrorText* e = find_error(code);
  if (e == nullptr || out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *out = e->text;
  return CUDA_SUCCESS;
}

CUresult cu_ctx_get_current(CUcontext* ctx) {
  if (!g_initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *ctx = t_current;
  return CUDA_SUCCESS;
}

CUresult cu_ctx_set_current(CUcontext ctx) {
  if (!g_initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx != nullptr && ctx != &g_context) return CUDA_ERROR_INVALID_CONTEXT;
  t_current = ctx;
  return CUDA_SUCCESS;
}

CUresult cu_stream_get_ctx(CUstream stream, CUcontext* ctx) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (reinterpret_cast<uintptr_t>(stream) <= 2 && t_current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (lookup(stream) == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *ctx = &g_context;
  return CUDA_SUCCESS;
}

CUresult cu_stream_add_callback(CUstream stream, CUstreamCallback fn, void* data, unsigned flags) {
  CUstream s = lookup(stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (fn == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Op op{Op::kCallback};
  op.fn = fn;
  op.data = data;
  s->push(op);
  return CUDA_SUCCESS;
}

CUresult cu_event_create(CUevent* event, unsigned flags) {
  if (event == nullptr || (flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (t_current == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *event = new CUevent_st();
  ++g_events_alive;
  return CUDA_SUCCESS;
}

CUresult cu_event_destroy(CUevent event) {
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  // Like the real driver, an event whose record is still pending is freed once that record completes.
  --g_events_alive;
  bool free_now;
  {
    std::lock_guard<std::mutex> lock(event->mu);
    free_now = event->completed >= event->recorded;
    event->destroyed = true;
  }
  if (free_now) delete event;
  return CUDA_SUCCESS;
}

CUresult cu_event_record(CUevent event, CUstream stream) {
  if (g_sticky.load() != CUDA_SUCCESS) return g_sticky.load();
  CUstream s = lookup(stream);
  if (s == nullptr || event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  Op op{Op::kRecord};
  op.event = event;
  {
    std::lock_guard<std::mutex> lock(event->mu);
    op.generation = ++event->recorded;
  }
  s->push(op);
  return CUDA_SUCCESS;
}

CUresult cu_event_query(CUevent event) {
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (g_sticky.load() != CUDA_SUCCESS) return g_sticky.load();
  std::lock_guard<std::mutex> lock(event->mu);
  return event->completed >= event->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cu_event_synchronize(CUevent event) {
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  {
    std::unique_lock<std::mutex> lock(event->mu);
    uint64_t target = event->recorded;
    event->cv.wait(lock, [&] { return event->completed >= target; });
  }
  return g_sticky.load();
}

}  // namespace

FAKECU_EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, uint64_t flags,
                                           int* symbol_status) {
  static const std::map<std::string, void*> table = {
      {"cuInit", reinterpret_cast<void*>(&cu_init)},
      {"cuDriverGetVersion", reinterpret_cast<void*>(&cu_driver_get_version)},
      {"cuGetErrorName", reinterpret_cast<void*>(&cu_get_error_name)},
      {"cuGetErrorString", reinterpret_cast<void*>(&cu_get_error_string)},
      {"cuCtxGetCurrent", reinterpret_cast<void*>(&cu_ctx_get_current)},
      {"cuCtxSetCurrent", reinterpret_cast<void*>(&cu_ctx_set_current)},
      {"cuStreamGetCtx", reinterpret_cast<void*>(&cu_stream_get_ctx)},
      {"cuStreamAddCallback", reinterpret_cast<void*>(&cu_stream_add_callback)},
      {"cuEventCreate", reinterpret_cast<void*>(&cu_event_create)},
      {"cuEventDestroy", reinterpret_cast<void*>(&cu_event_destroy)},
      {"cuEventRecord", reinterpret_cast<void*>(&cu_event_record)},
      {"cuEventQuery", reinterpret_cast<void*>(&cu_event_query)},
      {"cuEventSynchronize", reinterpret_cast<void*>(&cu_event_synchronize)},
  };
  if (symbol == nullptr || pfn == nullptr || cuda_version < 12000 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  const char* hidden = std::getenv("HOTLOOP_FAKE_CUDA_HIDE");
  auto it = table.find(symbol);
  if (it == table.end() || (hidden && std::strcmp(hidden, symbol) == 0)) {
    *pfn = nullptr;
    if (symbol_status) *symbol_status = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    return CUDA_ERROR_NOT_FOUND;
  }
  *pfn = it->second;
  if (symbol_status) *symbol_status = 0;
  return CUDA_SUCCESS;
}

// ---- test controls ----

FAKECU_EXPORT CUcontext fakecu_context() { return &g_context; }

// Makes the fake context current on the calling thread (what torch does when it initialises CUDA).
FAKECU_EXPORT void fakecu_make_current() { t_current = &g_context; }

FAKECU_EXPORT CUstream fakecu_stream_create() {
  CUstream s = new CUstream_st();
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_streams.insert(s);
  return s;
}

// Runs what is enqueued on the stream, then destroys it.
FAKECU_EXPORT void fakecu_stream_destroy(CUstream s) {
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    if (g_streams.erase(s) == 0) return;
  }
  delete s;
}

FAKECU_EXPORT int fakecu_launch_sleep(CUstream stream, int64_t duration_ns) {
  CUstream s = lookup(stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  Op op{Op::kSleep};
  op.duration_ns = duration_ns;
  s->push(op);
  return CUDA_SUCCESS;
}

// Enqueues a kernel that runs until fakecu_open_gate(returned id); 0 if the stream is not one.
FAKECU_EXPORT uint64_t fakecu_launch_gated(CUstream stream) {
  CUstream s = lookup(stream);
  if (s == nullptr) return 0;
  Op op{Op::kGate};
  {
    std::lock_guard<std::mutex> lock(g_gates_mu);
    op.gate = ++g_next_gate;
  }
  s->push(op);
  return op.gate;
}

FAKECU_EXPORT void fakecu_open_gate(uint64_t gate) {
  {
    std::lock_guard<std::mutex> lock(g_gates_mu);
    g_open_gates.insert(gate);
  }
  g_gates_cv.notify_all();
}

FAKECU_EXPORT int fakecu_launch_fault(CUstream stream) {
  CUstream s = lookup(stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  s->push(Op{Op::kFault});
  return CUDA_SUCCESS;
}

// Clears the sticky error (the real driver needs a context reset for that).
FAKECU_EXPORT void fakecu_reset_error() { g_sticky.store(CUDA_SUCCESS); }

FAKECU_EXPORT int64_t fakecu_events_alive() { return g_events_alive.load(); }
