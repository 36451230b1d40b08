// An NVTX injection library for tests: loaded by NVTX3 through NVTX_INJECTION64_PATH, it records the domain
// ranges and markers a process produces and writes them, one per line, to $HOTLOOP_NVTX_RECORD at exit:
//   push <domain>:<name> | pop <domain> | mark <domain>:<name>
#include <nvtx3/nvToolsExt.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

std::mutex g_mu;
std::vector<std::string>* g_lines = new std::vector<std::string>();

void record(std::string line) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_lines->push_back(std::move(line));
}

const char* domain_name(nvtxDomainHandle_t d) {
  return d ? reinterpret_cast<const std::string*>(d)->c_str() : "(default)";
}

std::string message(const nvtxEventAttributes_t* a) {
  if (a == nullptr) return "(none)";
  if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED && a->message.registered) {
    return *reinterpret_cast<const std::string*>(a->message.registered);
  }
  if (a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii) return a->message.ascii;
  return "(unnamed)";
}

nvtxDomainHandle_t create_domain(const char* name) {
  return reinterpret_cast<nvtxDomainHandle_t>(new std::string(name));
}
nvtxStringHandle_t register_string(nvtxDomainHandle_t, const char* s) {
  return reinterpret_cast<nvtxStringHandle_t>(new std::string(s));
}
int push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
  record(std::string("push ") + domain_name(d) + ":" + message(a));
  return 0;
}
int pop(nvtxDomainHandle_t d) {
  record(std::string("pop ") + domain_name(d));
  return 0;
}
void mark(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
  record(std::string("mark ") + domain_name(d) + ":" + message(a));
}

void write_out() {
  const char* path = std::getenv("HOTLOOP_NVTX_RECORD");
  if (path == nullptr) return;
  std::lock_guard<std::mutex> lock(g_mu);
  if (FILE* f = std::fopen(path, "w")) {
    for (const std::string& line : *g_lines) std::fprintf(f, "%s\n", line.c_str());
    std::fclose(f);
  }
}

template <class F>
void set(NvtxFunctionTable table, unsigned size, unsigned id, F fn) {
  if (id < size && table[id] != nullptr) *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
  auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get(NVTX_ETID_CALLBACKS));
  if (callbacks == nullptr) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned size = 0;
  if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) || table == nullptr) return 0;
  set(table, size, NVTX_CBID_CORE2_DomainCreateA, &create_domain);
  set(table, size, NVTX_CBID_CORE2_DomainRegisterStringA, &register_string);
  set(table, size, NVTX_CBID_CORE2_DomainRangePushEx, &push);
  set(table, size, NVTX_CBID_CORE2_DomainRangePop, &pop);
  set(table, size, NVTX_CBID_CORE2_DomainMarkEx, &mark);
  std::atexit(write_out);
  return 1;
}
