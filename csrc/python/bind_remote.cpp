// Binding of the remote queue's hot path as hotloop._core.ZmqReader / ZmqWriter (csrc/hotloop/zmq_reader.h,
// zmq_writer.h): python/hotloop/queue/remote/ sets the sockets up with pyzmq and hands their raw pointers
// (zmq.Socket.underlying) here; every call below runs its ZeroMQ work and copies with the GIL released, waits stay
// interruptible by Ctrl-C on the main thread. Both resolve libzmq through process_zmq(): the library pyzmq loaded.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "hotloop/errors.h"
#include "hotloop/owned_bytes.h"
#include "hotloop/shm_ring.h"
#include "hotloop/zmq_reader.h"
#include "hotloop/zmq_writer.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;

void* socket_pointer(uintptr_t address, const char* what) {
  if (address == 0) throw nb::value_error((std::string(what) + " is a null socket (closed?)").c_str());
  return reinterpret_cast<void*>(address);
}

// The buffers of a message's parts, held (and released) around a GIL-free send.
template <typename Part>
class Buffers {
 public:
  explicit Buffers(nb::handle parts) {
    PyObject* seq = parts.ptr();
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) throw nb::type_error("parts must be a list or tuple of buffers");
    const Py_ssize_t n = PySequence_Size(seq);
    views_.reserve(size_t(n));
    parts_.reserve(size_t(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      nb::object item = nb::steal(PySequence_GetItem(seq, i));
      if (!item.is_valid()) throw nb::python_error();
      views_.emplace_back();
      if (PyObject_GetBuffer(item.ptr(), &views_.back(), PyBUF_C_CONTIGUOUS) != 0) {
        views_.pop_back();
        throw nb::python_error();
      }
      parts_.push_back(Part{views_.back().buf, size_t(views_.back().len)});
    }
  }
  ~Buffers() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }
  const Part* data() const { return parts_.data(); }
  size_t size() const { return parts_.size(); }

 private:
  std::vector<Py_buffer> views_;
  std::vector<Part> parts_;
};

struct PyZmqReader {
  std::unique_ptr<ZmqReader> reader;  // never reset before the object dies: another thread may be inside a call
};

// Waits for the next message with the GIL released (held, during the interpreter's finalization: a __del__ at
// exit); `sink` (may be null) takes it.
bool released_next(ZmqReader& r, const nb::object& timeout, WaitPolicy& policy, const ZmqReader::Sink* sink,
                   const char* who) {
  const int64_t t = timeout_ns(timeout, who);
  if (interpreter_finalizing()) return r.next(t, policy, nullptr, sink);
  const WaitHooks* hooks = signal_hooks();
  PromptGil prompt(true);
  ReleasedGil released;
  const bool got = r.next(t, policy, hooks, sink);
  if (got) prompt.woke();
  return got;
}

// The next message as an owned, writable buffer (a memoryview, as a shared-memory reader's), or None.
nb::object read(PyZmqReader& self, const nb::object& timeout, WaitPolicy& policy) {
  OwnedBytes out;
  const ZmqReader::Sink copy = [&out](const ZmqReader::Part* parts, size_t n) {
    size_t size = 0;
    for (size_t i = 0; i < n; ++i) size += parts[i].size;
    out.allocate(size);
    size_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      if (parts[i].size) std::memcpy(out.data() + at, parts[i].data, parts[i].size);
      at += parts[i].size;
    }
  };
  if (!released_next(*self.reader, timeout, policy, &copy, "remote reader read")) return nb::none();
  return to_python(std::move(out));
}

// The relay's forward: the next message written into `ring` (as one message of its frames' parts, copied once,
// into the ring), waiting as long as it takes for both. Raises what read() and ShmRing.write raise.
void forward(PyZmqReader& self, nb::handle ring_object, WaitPolicy& policy, WaitPolicy& write_policy) {
  ShmRing& ring = shm_ring_of(ring_object);
  nb::object keep = nb::borrow(ring_object);  // the ring stays alive while the GIL is released
  const WaitHooks* hooks = signal_hooks();
  std::vector<ShmRing::Part> parts;
  const ZmqReader::Sink write = [&](const ZmqReader::Part* p, size_t n) {
    parts.resize(n);
    for (size_t i = 0; i < n; ++i) parts[i] = ShmRing::Part{p[i].data, p[i].size};
    ring.write(parts.data(), n, -1, write_policy, hooks);
  };
  released_next(*self.reader, nb::none(), policy, &write, "remote relay forward");
}

struct PyZmqWriter {
  std::unique_ptr<ZmqWriter> writer;
};

void send(PyZmqWriter& self, nb::handle parts, const nb::object& timeout, bool framed) {
  const int64_t t = timeout_ns(timeout, "remote writer send");
  Buffers<ZmqWriter::Part> buffers(parts);
  if (buffers.size() == 0) throw nb::value_error("a message needs at least one part");
  auto go = [&](const WaitHooks* hooks) {
    if (framed) {
      self.writer->send(buffers.data(), buffers.size(), t, hooks);
    } else {
      self.writer->send_frames(buffers.data(), buffers.size(), t, hooks);
    }
  };
  if (interpreter_finalizing()) return go(nullptr);  // a close() at exit: keep the GIL (see common.h)
  const WaitHooks* hooks = signal_hooks();
  ReleasedGil released;
  go(hooks);
}

}  // namespace

void bind_remote(nb::module_& m) {
  m.def("zmq_library", [] {
    const ZmqApi& api = process_zmq();
    nb::dict d;
    d["path"] = api.path;
    d["version"] = api.version;
    return d;
  }, "The libzmq the remote queue's hot path calls (the one pyzmq loaded): its path and version "
     "(major * 10000 + minor * 100 + patch). Raises RuntimeError if there is none or the choice is ambiguous.");

  nb::class_<PyZmqReader>(m, "ZmqReader",
                          "A remote reader's hot path over a SUB socket and its monitor made by pyzmq "
                          "(csrc/hotloop/zmq_reader.h): sockets are borrowed, never closed here.")
      .def("__init__",
           [](PyZmqReader* self, uintptr_t sock, uintptr_t monitor, const std::string& queue_name,
              const std::string& address) {
             const ZmqApi& api = process_zmq();
             new (self) PyZmqReader{std::make_unique<ZmqReader>(api, socket_pointer(sock, "sock"),
                                                                socket_pointer(monitor, "monitor"), queue_name,
                                                                address)};
           },
           "sock"_a, "monitor"_a, "queue_name"_a, "address"_a)
      .def_prop_ro("fd", [](PyZmqReader& s) { return s.reader->fd(); },
                   "The epoll descriptor a wait on this reader sleeps on (the same for its whole life).")
      .def("read", &read, "timeout"_a = nb::none(), "policy"_a,
           "The next message as an owned writable buffer, or None at the timeout. Raises ClosedError / "
           "DeadPeerError once the writer shut down / was lost and every message was read.")
      .def("wait_readable",
           [](PyZmqReader& s, const nb::object& timeout, WaitPolicy& policy) {
             return released_next(*s.reader, timeout, policy, nullptr, "remote reader wait_readable");
           },
           "timeout"_a = nb::none(), "policy"_a, "Wait until a message is held: True, or False at the timeout.")
      // readable, cancel and close keep the GIL: they never block for long (the lock they take is held only while
      // another thread reads ZeroMQ, never while it waits or needs the GIL), and a close() at exit must not let
      // go of it (see common.h).
      .def("readable", [](PyZmqReader& s) { return s.reader->readable(); },
           "Take what ZeroMQ holds without blocking; whether a message (or the stream's end) is there to take.")
      .def("forward", &forward, "ring"_a, "policy"_a, "write_policy"_a,
           "A node's relay: wait for the next message and write it into the ShmRing `ring`.")
      .def("cancel", [](PyZmqReader& s) { s.reader->cancel(); },
           "Any thread: every wait of this reader, running or later, ends with ClosedError.")
      .def("close", [](PyZmqReader& s, bool release_fds) { return s.reader->close(release_fds); },
           "release_fds"_a,
           "Any thread: cancel, then stop using the sockets (close them after this returns); with release_fds "
           "its descriptors are closed too. False if it was closed already.");

  nb::class_<PyZmqWriter>(m, "ZmqWriter",
                          "A remote writer's hot path over an XPUB socket made by pyzmq "
                          "(csrc/hotloop/zmq_writer.h): framing and send; the socket is borrowed.")
      .def("__init__",
           [](PyZmqWriter* self, uintptr_t sock, const std::string& queue_name, uint32_t check_every,
              double check_interval_s) {
             const ZmqApi& api = process_zmq();
             new (self) PyZmqWriter{std::make_unique<ZmqWriter>(api, socket_pointer(sock, "sock"), queue_name,
                                                                check_every, int64_t(check_interval_s * 1e9))};
           },
           "sock"_a, "queue_name"_a, "check_every"_a, "check_interval_s"_a)
      .def("send", [](PyZmqWriter& s, nb::handle parts, const nb::object& timeout) { send(s, parts, timeout, true); },
           "parts"_a, "timeout"_a = nb::none(),
           "Send one message of `parts` (buffers), framed; raises QueueTimeout if a reader stays a full send "
           "buffer behind for the whole timeout.")
      .def("send_frames",
           [](PyZmqWriter& s, nb::handle frames, const nb::object& timeout) { send(s, frames, timeout, false); },
           "frames"_a, "timeout"_a = nb::none(), "Send `frames` as they are (the shutdown).")
      .def("check_due", [](PyZmqWriter& s) { return s.writer->check_due(); },
           "Count a send; whether the writer is due to look at its peers.")
      .def("peers_checked", [](PyZmqWriter& s) { s.writer->peers_checked(); },
           "The writer looked at its peers: the count and the interval start again.");
}

}  // namespace hotloop::py
