#include "hotloop/zmq_api.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace hotloop {
namespace {

struct LoadResult {
  ZmqApi api;
  std::unique_ptr<std::runtime_error> error;  // set when loading failed
};

// A shared object's file name is a libzmq's: "libzmq.so.5", "libzmq-2f02442c.so.5.2.5" (pyzmq's wheels).
bool is_zmq_library(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string base = path.substr(slash == std::string::npos ? 0 : slash + 1);
  return base.rfind("libzmq", 0) == 0 && base.find(".so") != std::string::npos &&
         (base.size() > 6 && (base[6] == '.' || base[6] == '-'));
}

void load(LoadResult& r) {
  std::string path;
  if (const char* env = std::getenv("HOTLOOP_LIBZMQ"); env != nullptr && *env) {
    path = env;
  } else {
    const std::vector<std::string> found = mapped_zmq_libraries();
    if (found.empty()) {
      r.error = std::make_unique<std::runtime_error>(
          "hotloop's remote queue found no libzmq loaded in this process: import zmq (pyzmq) before using it, "
          "or set HOTLOOP_LIBZMQ to the path of the libzmq that made the sockets");
      return;
    }
    if (found.size() > 1) {
      std::string list;
      for (const std::string& f : found) list += (list.empty() ? "" : ", ") + f;
      r.error = std::make_unique<std::runtime_error>(
          "hotloop's remote queue found several libzmq loaded in this process (" + list +
          "): set HOTLOOP_LIBZMQ to the one pyzmq uses (a socket belongs to the library that made it)");
      return;
    }
    path = found.front();
  }
  try {
    r.api = load_loaded_zmq(path);
  } catch (const std::runtime_error& e) {
    r.error = std::make_unique<std::runtime_error>(e.what());
  }
}

}  // namespace

std::vector<std::string> mapped_zmq_libraries() {
  std::vector<std::string> found;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t at = line.find('/');
    if (at == std::string::npos) continue;
    std::string path = line.substr(at);
    if (path.size() > 10 && path.compare(path.size() - 10, 10, " (deleted)") == 0) continue;
    if (is_zmq_library(path) && std::find(found.begin(), found.end(), path) == found.end()) {
      found.push_back(std::move(path));
    }
  }
  return found;
}

ZmqApi load_loaded_zmq(const std::string& path) {
  ZmqApi a;
  a.path = path;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) {
    const char* err = dlerror();
    throw std::runtime_error("libzmq " + path + " is not loaded in this process (" + (err ? err : "dlopen") +
                             "); hotloop's remote queue uses the libzmq that pyzmq loaded and never loads another "
                             "copy: import zmq first, or point HOTLOOP_LIBZMQ at pyzmq's libzmq");
  }
  std::string missing;
  auto resolve = [&](const char* name, auto& fn) {
    void* p = dlsym(lib, name);
    if (p == nullptr) {
      missing += missing.empty() ? name : std::string(", ") + name;
      return;
    }
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  resolve("zmq_version", a.zmq_version);
  resolve("zmq_errno", a.zmq_errno);
  resolve("zmq_strerror", a.zmq_strerror);
  resolve("zmq_getsockopt", a.zmq_getsockopt);
  resolve("zmq_setsockopt", a.zmq_setsockopt);
  resolve("zmq_send", a.zmq_send);
  resolve("zmq_msg_init", a.zmq_msg_init);
  resolve("zmq_msg_recv", a.zmq_msg_recv);
  resolve("zmq_msg_close", a.zmq_msg_close);
  resolve("zmq_msg_data", a.zmq_msg_data);
  resolve("zmq_msg_size", a.zmq_msg_size);
  resolve("zmq_msg_more", a.zmq_msg_more);
  if (!missing.empty()) {
    throw std::runtime_error("libzmq " + path + " lacks entry points hotloop's remote queue needs (" + missing +
                             "): use libzmq 4.3 or newer (pyzmq >= 25 wheels bring it)");
  }
  int major = 0, minor = 0, patch = 0;
  a.zmq_version(&major, &minor, &patch);
  a.version = major * 10000 + minor * 100 + patch;
  if (a.version < 40300) {
    throw std::runtime_error("libzmq " + path + " is version " + std::to_string(major) + "." + std::to_string(minor) +
                             "." + std::to_string(patch) + "; hotloop's remote queue needs 4.3 or newer");
  }
  return a;
}

std::string ZmqApi::describe(int errnum) const {
  const char* text = zmq_strerror != nullptr ? zmq_strerror(errnum) : nullptr;
  return std::string(text ? text : "unknown error") + " (errno " + std::to_string(errnum) + ")";
}

const ZmqApi& process_zmq() {
  static LoadResult r;
  static std::once_flag once;
  std::call_once(once, [] { load(r); });
  if (r.error) throw *r.error;
  return r.api;
}

}  // namespace hotloop
