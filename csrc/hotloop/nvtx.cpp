#include "hotloop/nvtx.h"

#if HOTLOOP_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>

#include <mutex>
#include <string>
#include <unordered_map>
#endif

namespace hotloop::nvtx {
namespace {

constexpr const char* kNames[] = {
    "hotloop.wait",      "hotloop.wait.spin",     "hotloop.wait.park",     "hotloop.step.mark",
    "hotloop.step.done", "hotloop.queue.enqueue", "hotloop.queue.dequeue",
};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == size_t(Range::kCount));

}  // namespace

const char* name(Range r) noexcept { return kNames[size_t(r)]; }

bool compiled_in() noexcept { return HOTLOOP_HAVE_NVTX != 0; }

#if HOTLOOP_HAVE_NVTX
namespace {

nvtxEventAttributes_t attributes_for(nvtxDomainHandle_t domain, const char* text) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
  a.message.registered = nvtxDomainRegisterStringA(domain, text);
  return a;
}

struct Domain {
  nvtxDomainHandle_t handle = nvtxDomainCreateA("hotloop");
  nvtxEventAttributes_t ranges[size_t(Range::kCount)];
  std::mutex names_mu;
  std::unordered_map<std::string, nvtxEventAttributes_t*> names;  // never erased: handles stay valid

  Domain() {
    for (size_t i = 0; i < size_t(Range::kCount); ++i) ranges[i] = attributes_for(handle, kNames[i]);
  }
};

Domain& domain() {
  static Domain* d = new Domain();  // never destroyed: ranges may be pushed during exit
  return *d;
}

}  // namespace

void push(Range r) noexcept {
  Domain& d = domain();
  nvtxDomainRangePushEx(d.handle, &d.ranges[size_t(r)]);
}

void pop() noexcept { nvtxDomainRangePop(domain().handle); }

void mark(Range r) noexcept {
  Domain& d = domain();
  nvtxDomainMarkEx(d.handle, &d.ranges[size_t(r)]);
}

const void* register_name(const char* text) noexcept {
  Domain& d = domain();
  std::lock_guard<std::mutex> lock(d.names_mu);
  auto it = d.names.find(text);
  if (it != d.names.end()) return it->second;
  auto* a = new nvtxEventAttributes_t(attributes_for(d.handle, text));
  d.names.emplace(text, a);
  return a;
}

void push_registered(const void* handle) noexcept {
  if (handle != nullptr) {
    nvtxDomainRangePushEx(domain().handle, static_cast<const nvtxEventAttributes_t*>(handle));
  }
}
#endif

}  // namespace hotloop::nvtx
