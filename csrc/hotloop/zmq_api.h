// ZmqApi: the slice of libzmq that the remote queue's hot path calls (zmq_reader.h, zmq_writer.h), as a table of
// function pointers resolved at run time from the libzmq this process has loaded already. hotloop never links
// libzmq, so the wheels gain no dependency (auditwheel sees none) and import without it.
//
// Which libzmq, and why. A socket belongs to the libzmq instance that made it: its pointer means nothing to a
// second copy of the library (another context, other I/O threads, another struct layout). The queue's sockets are
// made by pyzmq (CurveZMQ keys, the ZAP handler, bind/connect: everything off the hot path stays in Python), and
// pyzmq's wheels bring their own libzmq (pyzmq.libs/libzmq-<hash>.so, 4.3.5 for pyzmq 27). So the table is filled
// from that very library: load_process_zmq() finds the one libzmq mapped into the process (/proc/self/maps),
// opens it with RTLD_NOLOAD (it never loads a copy: a library not loaded yet is an error) and resolves its entry
// points with dlsym. A pyzmq built against the system's libzmq is found the same way. $HOTLOOP_LIBZMQ names the
// library instead (a process with two libzmq mapped, which the search refuses as ambiguous); it too must be loaded
// already. The C++ tests link Debian's libzmq (libzmq3-dev) and go through the same table.
//
// Failure to find or resolve the library is remembered: every later call of process_zmq() throws the same
// std::runtime_error, whose message says what failed and what to do. The library is never closed.
// Cost: resolving happens once per process (a read of /proc/self/maps, ~10 dlsym); each call through the table
// is one indirect call.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace hotloop {

// zmq.h's zmq_msg_t: 64 opaque bytes, pointer-aligned (tests/cpp/test_zmq_api.cpp checks it against zmq.h).
struct alignas(sizeof(void*)) ZmqMsg {
  unsigned char bytes[64];
};

namespace zmq_abi {
// zmq.h's values (stable since libzmq 3/4; the test compares them with zmq.h).
constexpr int kDontWait = 1;        // ZMQ_DONTWAIT
constexpr int kSndMore = 2;         // ZMQ_SNDMORE
constexpr int kFd = 14;             // ZMQ_FD
constexpr int kEvents = 15;         // ZMQ_EVENTS
constexpr int kSndTimeo = 28;       // ZMQ_SNDTIMEO
constexpr int kPollIn = 1;          // ZMQ_POLLIN
constexpr int kEventDisconnected = 0x0200;  // ZMQ_EVENT_DISCONNECTED
constexpr int kETerm = 156384712 + 53;      // ETERM (ZMQ_HAUSNUMERO + 53)
}  // namespace zmq_abi

struct ZmqApi {
  void (*zmq_version)(int* major, int* minor, int* patch) = nullptr;
  int (*zmq_errno)() = nullptr;
  const char* (*zmq_strerror)(int errnum) = nullptr;
  int (*zmq_getsockopt)(void* s, int option, void* optval, size_t* optvallen) = nullptr;
  int (*zmq_setsockopt)(void* s, int option, const void* optval, size_t optvallen) = nullptr;
  int (*zmq_send)(void* s, const void* buf, size_t len, int flags) = nullptr;
  int (*zmq_msg_init)(ZmqMsg* msg) = nullptr;
  int (*zmq_msg_recv)(ZmqMsg* msg, void* s, int flags) = nullptr;
  int (*zmq_msg_close)(ZmqMsg* msg) = nullptr;
  void* (*zmq_msg_data)(ZmqMsg* msg) = nullptr;
  size_t (*zmq_msg_size)(const ZmqMsg* msg) = nullptr;
  int (*zmq_msg_more)(const ZmqMsg* msg) = nullptr;

  std::string path;  // the library the entry points came from
  int version = 0;   // major * 10000 + minor * 100 + patch, e.g. 40305

  // zmq_strerror of an errno value, with the value.
  std::string describe(int errnum) const;
};

// The process's libzmq (see above), found and resolved on first use. Throws std::runtime_error (always the same
// message) if it cannot be.
const ZmqApi& process_zmq();

// The table of the library at `path`, which must be loaded in this process already (RTLD_NOLOAD). Throws
// std::runtime_error naming the library and what is missing. For tests and process_zmq().
ZmqApi load_loaded_zmq(const std::string& path);

// Every distinct libzmq shared object mapped into this process (paths from /proc/self/maps), in map order.
std::vector<std::string> mapped_zmq_libraries();

}  // namespace hotloop
