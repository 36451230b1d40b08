// Binding of ShmRing as hotloop._core.ShmRing: the byte-level ring under hotloop.MessageQueue (which adds
// serialization, the handshake and remote readers in Python). Every wait runs with the GIL released and stays
// interruptible by Ctrl-C on the main thread; copies of large messages run with the GIL released too.
// close() may come from any thread while another waits in read/write: the waiter ends with ClosedError, and
// the mapping lives until the Python object is collected (a call in progress holds a reference to it).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "hotloop/errors.h"
#include "hotloop/shm_ring.h"

namespace hotloop::py {
namespace {

using namespace nb::literals;
using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::memview>;

constexpr uint8_t kPickleProto = 0x80;  // pickle's PROTO opcode: the first byte of every protocol >= 2 pickle

// The message of `m` as an owned buffer; a view into the ring is copied out and released.
OwnedBytes take_owned(ShmRing& r, ShmRing::Message& m) {
  if (!m.owned.empty()) return std::move(m.owned);
  OwnedBytes b(m.size);
  std::memcpy(b.data(), m.data, m.size);
  r.release();
  return b;
}

DeadReaderPolicy parse_dead_reader(const std::string& s) {
  if (s == "raise") return DeadReaderPolicy::kRaise;
  if (s == "drop") return DeadReaderPolicy::kDrop;
  throw nb::value_error(("dead_reader must be 'raise' or 'drop', not '" + s + "'").c_str());
}

// Buffers of the parts of one message, held (and released) around a GIL-free write.
class PartBuffers {
 public:
  explicit PartBuffers(nb::handle parts) {
    for (nb::handle h : parts) {
      views_.emplace_back();
      if (PyObject_GetBuffer(h.ptr(), &views_.back(), PyBUF_C_CONTIGUOUS) != 0) {
        views_.pop_back();
        throw nb::python_error();
      }
      parts_.push_back(ShmRing::Part{views_.back().buf, size_t(views_.back().len)});
    }
  }
  ~PartBuffers() {
    for (Py_buffer& v : views_) PyBuffer_Release(&v);
  }
  const ShmRing::Part* data() const { return parts_.data(); }
  size_t size() const { return parts_.size(); }

 private:
  std::vector<Py_buffer> views_;
  std::vector<ShmRing::Part> parts_;
};

struct PyShmRing {
  std::unique_ptr<ShmRing> ring;  // never reset before the object dies: another thread may be inside a call
  ShmRing::Message held;  // the message of the last read_view, until release()
  bool viewing = false;
  bool closed = false;
  WaitMetrics metrics;  // this side's waits (read, read_view, the ring waits)

  ShmRing& get() {
    if (closed) throw ClosedError("queue " + ring->name() + ": this ShmRing was closed");
    return *ring;
  }
};

// Writes one message of `n` parts: at once when there is room, otherwise waiting with the GIL released.
void write_parts(PyShmRing& self, ShmRing& r, const ShmRing::Part* parts, size_t n, int64_t t, WaitPolicy& policy) {
  if (r.try_write(parts, n)) return;  // room now: no need to let go of the GIL
  const WaitHooks* hooks = signal_hooks();
  ReleasedGil released;
  WaitMetricsScope counted(&self.metrics);
  r.write(parts, n, t, policy, hooks);
}

void write(PyShmRing& self, nb::handle parts, const nb::object& timeout, WaitPolicy& policy) {
  ShmRing& r = self.get();
  int64_t t = timeout_ns(timeout, "ShmRing.write");
  PartBuffers buffers(parts);
  write_parts(self, r, buffers.data(), buffers.size(), t, policy);
}

// Takes the next message into `m` (false on timeout): one already there without letting go of the GIL (zero
// timeout: never waits), otherwise waiting with the GIL released. `then()` runs once a message is taken,
// before the GIL is taken back when it was let go (read's copy of a large message runs without it too).
template <typename Then>
bool next_message(PyShmRing& self, ShmRing& r, ShmRing::Message& m, const char* who, const nb::object& timeout,
                  WaitPolicy& policy, Then&& then) {
  if (self.viewing) throw std::logic_error("release() the message of read_view() before reading the next one");
  int64_t t = timeout_ns(timeout, who);
  if (r.readable() && r.read(m, 0, policy, nullptr)) {
    then();
    return true;
  }
  const WaitHooks* hooks = signal_hooks();
  bool got;
  PromptGil prompt(true);
  {
    ReleasedGil released;
    WaitMetricsScope counted(&self.metrics);
    got = r.read(m, t, policy, hooks);
    if (got) {
      then();
      prompt.woke();
    }
  }
  return got;
}

// Waits for the next message; returns it as an owned buffer (None on timeout).
nb::object read(PyShmRing& self, const nb::object& timeout, WaitPolicy& policy) {
  ShmRing& r = self.get();
  ShmRing::Message m;
  OwnedBytes owned;
  if (!next_message(self, r, m, "ShmRing.read", timeout, policy, [&] { owned = take_owned(r, m); })) {
    return nb::none();
  }
  return to_python(std::move(owned));
}

// Waits for the next message; returns a read-only memoryview of it, in ring memory when it fits one record.
// Valid until release() (or the next read).
nb::object read_view(PyShmRing& self, const nb::object& timeout, WaitPolicy& policy) {
  ShmRing& r = self.get();
  if (self.viewing) throw std::logic_error("release() the message of read_view() before reading the next one");
  int64_t t = timeout_ns(timeout, "ShmRing.read_view");
  const WaitHooks* hooks = signal_hooks();
  bool got;
  {
    ReleasedGil released;
    WaitMetricsScope counted(&self.metrics);
    got = r.read(self.held, t, policy, hooks);
  }
  if (!got) return nb::none();
  self.viewing = true;
  return nb::steal(PyMemoryView_FromMemory(reinterpret_cast<char*>(const_cast<uint8_t*>(self.held.data)),
                                           Py_ssize_t(self.held.size), PyBUF_READ));
}

// A thread's pickler of hotloop.queue.serialization (its _Encoder.native), as write_object uses it.
struct PickleSink {
  nb::object dump;        // Pickler.dump, bound: writes the stream into `chunks`
  nb::object clear_memo;  // Pickler.clear_memo, bound
  nb::list chunks;        // the pickle stream, as the pickler handed it to its file
  nb::list buffers;       // out-of-band buffers met while pickling
  nb::list keep_alive;    // objects the out-of-band buffers point into
  bool torch_registered = false;  // the pickler reduces torch tensors hotloop's way (set by serialization)
};

// Every thread's pickler (hotloop.queue.serialization.THREAD_PICKLERS): the calling thread's PickleSink is kept in its
// thread-state dict, so it goes with the thread, and looked up in C++ (a Python call to find it cost more than
// a 64 B message's write). `make` (serialization's encoder().native, which registers torch's reducer when torch
// is imported) makes it on the thread's first message, and again once torch is imported.
struct ThreadPicklers {
  nb::object make;
  nb::object key = nb::steal(PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type)));
  nb::object torch = nb::steal(PyUnicode_InternFromString("torch"));

  nb::object sink() {
    PyObject* dict = PyThreadState_GetDict();  // borrowed; made on first use
    if (dict == nullptr) throw std::runtime_error("hotloop: this thread has no Python thread state dict");
    PyObject* found = PyDict_GetItemWithError(dict, key.ptr());  // borrowed
    if (found != nullptr) {
      if (nb::inst_ptr<PickleSink>(found)->torch_registered ||
          PyDict_GetItemWithError(PyImport_GetModuleDict(), torch.ptr()) == nullptr) {
        if (PyErr_Occurred()) throw nb::python_error();
        return nb::borrow(found);
      }
    } else if (PyErr_Occurred()) {
      throw nb::python_error();
    }
    nb::object made = make();
    if (!nb::isinstance<PickleSink>(made)) throw std::logic_error("ThreadPicklers.make must return a PickleSink");
    if (PyDict_SetItem(dict, key.ptr(), made.ptr()) != 0) throw nb::python_error();
    return made;
  }
};

// How read_object turns a message into an object (hotloop.queue.serialization.OBJECT_LOADERS).
struct ObjectLoaders {
  nb::object bare_loads;     // pickle.loads: a bare pickle (first byte PROTO)
  nb::object general_loads;  // serialization.loads: any message, from an owned buffer; raises on a corrupt one
  nb::object nothing;        // returned on timeout (None is a message like any other)
};

void clear_list(nb::handle list) { PyList_SetSlice(list.ptr(), 0, list_size(list.ptr()), nullptr); }

// Clears a list (what the pickler wrote) however the write below ends.
struct ListClear {
  nb::handle list;
  ~ListClear() { clear_list(list); }
};

// Pickles `obj` with the calling thread's pickler. A bare pickle (no out-of-band buffer: requests, scheduler
// outputs, RPC tuples) is written at once and true returned; otherwise the pickler's chunks and buffers are left
// for serialization.assemble(serialization.encoder()) and false returned. A pickling error leaves the encoder
// empty and propagates.
bool write_object(PyShmRing& self, nb::handle obj, const nb::object& timeout, WaitPolicy& policy,
                  ThreadPicklers& picklers) {
  ShmRing& r = self.get();
  int64_t t = timeout_ns(timeout, "ShmRing.write_object");
  nb::object held = picklers.sink();
  PickleSink& sink = *nb::inst_ptr<PickleSink>(held);
  PyObject* chunks = sink.chunks.ptr();
  PyObject* done = call_one(sink.dump.ptr(), obj.ptr());
  if (done == nullptr) {
    nb::python_error e;  // takes the pending exception
    sink.clear_memo();
    for (nb::handle l : {sink.chunks, sink.buffers, sink.keep_alive}) clear_list(l);
    throw e;
  }
  Py_DECREF(done);
  sink.clear_memo();  // the memo would keep obj's parts alive
  if (list_size(chunks) != 1 || list_size(sink.buffers.ptr()) != 0) return false;
  ListClear clear{sink.chunks};
  Py_buffer view;
  if (PyObject_GetBuffer(list_item(chunks, 0), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
  struct ViewRelease {
    Py_buffer* v;
    ~ViewRelease() { PyBuffer_Release(v); }
  } release_view{&view};
  const ShmRing::Part part{view.buf, size_t(view.len)};
  write_parts(self, r, &part, 1, t, policy);
  return true;
}

// Waits for the next message and returns it as an object (loaders.nothing on timeout). A bare pickle that
// fits one record is unpickled in ring memory, then the record released: no copy, no buffer object.
nb::object read_object(PyShmRing& self, const nb::object& timeout, WaitPolicy& policy, ObjectLoaders& loaders) {
  ShmRing& r = self.get();
  ShmRing::Message m;
  if (!next_message(self, r, m, "ShmRing.read_object", timeout, policy, [] {})) return loaders.nothing;
  if (m.owned.empty() && m.size > 0 && m.data[0] == kPickleProto) {
    struct RecordRelease {
      ShmRing& r;
      ~RecordRelease() { r.release(); }
    } release_record{r};
    nb::object view = nb::steal(PyMemoryView_FromMemory(reinterpret_cast<char*>(const_cast<uint8_t*>(m.data)),
                                                        Py_ssize_t(m.size), PyBUF_READ));
    PyObject* obj = call_one(loaders.bare_loads.ptr(), view.ptr());
    if (Py_REFCNT(view.ptr()) > 1) {  // kept by someone: nothing may read ring memory once it is released
      PyObject* rel = PyObject_CallMethod(view.ptr(), "release", nullptr);
      if (rel == nullptr) PyErr_Clear();  // exported still: the view outlives the call, but empty
      Py_XDECREF(rel);
    }
    if (obj != nullptr) return nb::steal(obj);
    PyErr_Clear();  // corrupt: the general loader below raises the error serialization gives it
    OwnedBytes copy(m.size);
    std::memcpy(copy.data(), m.data, m.size);
    return loaders.general_loads(to_python(std::move(copy)));
  }
  return loaders.general_loads(to_python(take_owned(r, m)));
}

// MessageQueue.enqueue and .dequeue of a queue whose only side is shared memory: bound to its ring and wait
// policy, one C++ call per message (a Python method around write_object / read_object cost ~60 ns a call, a
// fifth of a 64 B object's one-way trip).
struct ObjectWriter {
  nb::object ring;             // ShmRing
  nb::object policy;           // WaitPolicy
  nb::object picklers;         // ThreadPicklers
  nb::object write_assembled;  // (ring, timeout, policy): writes what write_object left (a message with buffers)

  void operator()(nb::handle obj, const nb::object& timeout) {
    if (!write_object(*nb::inst_ptr<PyShmRing>(ring), obj, timeout, *nb::inst_ptr<WaitPolicy>(policy),
                      *nb::inst_ptr<ThreadPicklers>(picklers))) {
      write_assembled(ring, timeout, policy);
    }
  }
};

struct ObjectReader {
  nb::object ring;     // ShmRing
  nb::object policy;   // WaitPolicy
  nb::object loaders;    // ObjectLoaders
  nb::object timed_out;  // timeout -> the exception to raise (the queue's QueueTimeout, worded in Python once)

  nb::object operator()(const nb::object& timeout) {
    ObjectLoaders& l = *nb::inst_ptr<ObjectLoaders>(loaders);
    nb::object obj = read_object(*nb::inst_ptr<PyShmRing>(ring), timeout, *nb::inst_ptr<WaitPolicy>(policy), l);
    if (obj.is(l.nothing)) {
      nb::object exc = timed_out(timeout);
      if (!PyExceptionInstance_Check(exc.ptr())) {
        throw nb::type_error("ObjectReader: timed_out(timeout) must return an exception");
      }
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw nb::python_error();
    }
    return obj;
  }
};

// ObjectWriter's and ObjectReader's __init__ (ring, policy, helper, last): the call casts its members unchecked,
// so their types are checked here, once.
template <typename Call, typename Helper>
auto checked_init(const char* helper_error) {
  return [helper_error](Call* self, nb::object ring, nb::object policy, nb::object helper, nb::object last) {
    if (!nb::isinstance<PyShmRing>(ring)) throw nb::type_error("ring must be a ShmRing");
    if (!nb::isinstance<WaitPolicy>(policy)) throw nb::type_error("policy must be a WaitPolicy");
    if (!nb::isinstance<Helper>(helper)) throw nb::type_error(helper_error);
    new (self) Call{ring, policy, helper, last};
  };
}

// A ring wait (wait_all_attached, wait) with the GIL released.
template <bool (ShmRing::*Wait)(int64_t, WaitPolicy&, const WaitHooks*)>
bool released_wait(PyShmRing& self, const nb::object& timeout, WaitPolicy& policy) {
  ShmRing& r = self.get();
  int64_t t = timeout_ns(timeout, "ShmRing wait");
  const WaitHooks* hooks = signal_hooks();
  ReleasedGil released;
  WaitMetricsScope counted(&self.metrics);
  return (r.*Wait)(t, policy, hooks);
}

void release(PyShmRing& self) {
  if (self.closed) return;
  self.ring->release();
  self.held = ShmRing::Message{};
  self.viewing = false;
}

}  // namespace

nb::object to_python(OwnedBytes&& b) {
  auto* owned = new OwnedBytes(std::move(b));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<OwnedBytes*>(p); });
  return nb::cast(Bytes(owned->data(), {owned->size()}, owner));
}

ShmRing& shm_ring_of(nb::handle ring) {
  if (!nb::isinstance<PyShmRing>(ring)) throw nb::type_error("ring must be a hotloop._core.ShmRing");
  return nb::inst_ptr<PyShmRing>(ring)->get();
}

void bind_shm_ring(nb::module_& m) {
  nb::exception<DeadPeerError>(m, "DeadPeerError", PyExc_RuntimeError);
  nb::exception<BadHandleError>(m, "BadHandleError", PyExc_ValueError);
  nb::exception<QueueTimeout>(m, "QueueTimeout", PyExc_TimeoutError);

  nb::class_<PickleSink>(m, "PickleSink", "A thread's pickler, as ShmRing.write_object uses it.")
      .def(nb::init<nb::object, nb::object, nb::list, nb::list, nb::list>(), "dump"_a, "clear_memo"_a, "chunks"_a,
           "buffers"_a, "keep_alive"_a)
      .def_rw("torch_registered", &PickleSink::torch_registered);
  nb::class_<ThreadPicklers>(m, "ThreadPicklers",
                             "Every thread's PickleSink, as ShmRing.write_object finds the calling thread's.")
      .def(nb::init<nb::object>(), "make"_a);
  nb::class_<ObjectLoaders>(m, "ObjectLoaders", "How ShmRing.read_object turns a message into an object.")
      .def(nb::init<nb::object, nb::object, nb::object>(), "bare_loads"_a, "general_loads"_a, "nothing"_a);

  nb::class_<ObjectWriter>(m, "ObjectWriter",
                           "enqueue(obj, timeout=None) of a MessageQueue whose only side is shared memory: pickle "
                           "obj and write it in one call (a message with out-of-band buffers through "
                           "write_assembled).")
      .def("__init__", checked_init<ObjectWriter, ThreadPicklers>("picklers must be a ThreadPicklers"), "ring"_a,
           "policy"_a, "picklers"_a, "write_assembled"_a)
      .def("__call__", &ObjectWriter::operator(), "obj"_a.none(), "timeout"_a = nb::none());
  nb::class_<ObjectReader>(m, "ObjectReader",
                           "dequeue(timeout=None) of a MessageQueue reading shared memory: the next object; "
                           "raises what timed_out(timeout) returns (the queue's QueueTimeout) when none came "
                           "within timeout.")
      .def("__init__", checked_init<ObjectReader, ObjectLoaders>("loaders must be an ObjectLoaders"), "ring"_a,
           "policy"_a, "loaders"_a, "timed_out"_a)
      .def("__call__", &ObjectReader::operator(), "timeout"_a = nb::none());
  nb::class_<PyShmRing>(m, "ShmRing",
                        "One-writer, many-reader broadcast ring of byte messages in POSIX shared memory (see "
                        "csrc/hotloop/shm_ring.h). hotloop.MessageQueue is the object-level API on top.")
      .def_static(
          "create",
          [](uint64_t capacity, uint32_t n_readers, uint64_t max_message, const std::string& dead_reader,
             const std::string& name) {
            RingGeometry g{capacity, n_readers, max_message, parse_dead_reader(dead_reader)};
            auto* r = new PyShmRing();
            r->ring = std::make_unique<ShmRing>(ShmRing::create(g, name));
            return r;
          },
          "capacity"_a, "n_readers"_a, "max_message"_a = 0, "dead_reader"_a = "raise", "name"_a = "",
          nb::rv_policy::take_ownership, "Create the segment (this process is the writer).")
      .def_static(
          "attach",
          [](const std::string& name, uint32_t rank, uint64_t capacity, uint32_t n_readers) {
            auto* r = new PyShmRing();
            r->ring = std::make_unique<ShmRing>(ShmRing::attach(name, rank, capacity, n_readers));
            return r;
          },
          "name"_a, "rank"_a, "capacity"_a, "n_readers"_a, nb::rv_policy::take_ownership,
          "Attach as reader `rank`. Raises BadHandleError for a wrong name, geometry or rank.")
      .def("write", &write, "parts"_a, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
           "Write one message: the concatenation of `parts` (buffer-protocol objects), copied once.")
      .def("read", &read, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
           "The next message as an owned buffer, or None on timeout.")
      .def("write_object", &write_object, "obj"_a.none(), "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
           "picklers"_a, "Pickle obj with the calling thread's pickler and write it when it is one bare pickle "
           "(True); otherwise leave the pickled parts in that pickler's sink (False).")
      .def("read_object", &read_object, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(), "loaders"_a,
           "The next message as an object (a bare pickle is unpickled in ring memory); loaders.nothing on "
           "timeout.")
      .def("read_view", &read_view, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
           "The next message as a read-only memoryview (zero-copy when it fits one record), valid until "
           "release(); None on timeout.")
      .def("wait_all_attached", &released_wait<&ShmRing::wait_all_attached>, "timeout"_a = nb::none(),
           "policy"_a = WaitPolicy(), "Writer: wait until every reader attached.")
      .def("wait_readable", &released_wait<&ShmRing::wait>, "timeout"_a = nb::none(), "policy"_a = WaitPolicy(),
          "Reader: wait until a message is readable (False on timeout); raises ClosedError / DeadPeerError.")
      .def("release", &release, "Release the message of the last read_view().")
      .def("readable", [](PyShmRing& s) { return s.get().readable(); },
           "Whether a message is waiting (one atomic load).")
      .def("shutdown", [](PyShmRing& s) { s.get().shutdown(); },
           "Writer: no more messages; parked readers wake and get ClosedError once drained.")
      .def("abandon", [](PyShmRing& s) { s.get().abandon(); },
           "Writer: it lost its own source; parked readers wake and get DeadPeerError once drained.")
      .def("close_unattached", [](PyShmRing& s) { return s.get().close_unattached(); },
           "Writer: reader slots not attached yet stop holding it back and can no longer attach; returns how "
           "many.")
      .def("unlink", [](PyShmRing& s) { s.get().unlink(); }, "Remove the segment's name (mapped peers go on).")
      .def("close", [](PyShmRing& s) {
        if (s.closed) return;
        s.closed = true;
        s.held = ShmRing::Message{};
        s.viewing = false;
        s.ring->close();
      }, "Leave the queue (a writer shuts it down and unlinks it); waits in other threads end with ClosedError. "
         "Idempotent; the memory is unmapped when the object is collected.")
      .def("cancel_waits", [](PyShmRing& s) { s.ring->cancel_waits(); },
           "Any thread: every wait of this ring, running or later, ends with ClosedError.")
      .def_prop_ro("closed", [](PyShmRing& s) { return s.closed; })
      .def_prop_ro("wait_stats", [](const PyShmRing& s) { return counts_dict(s.metrics.snapshot()); },
                   "This side's waits in read / read_view / write / the ring waits (a dict; hotloop.metrics "
                   "describes it). A message already there when read is called takes no wait.")
      .def_prop_ro("parks", [](const PyShmRing& s) { return s.metrics.parks(); },
                   "How many times this side's waits parked in the kernel so far (wait_stats' \"parks\"; one load).")
      .def_prop_ro("source", [](PyShmRing& s) -> Source& { return s.get().source(); },
                   nb::rv_policy::reference_internal, "Reader: the wait_any source (ready when readable).")
      .def_prop_ro("name", [](PyShmRing& s) { return s.get().name(); })
      .def_prop_ro("rank", [](PyShmRing& s) { return s.get().rank(); })
      .def_prop_ro("capacity", [](PyShmRing& s) { return s.get().capacity(); })
      .def_prop_ro("n_readers", [](PyShmRing& s) { return s.get().n_readers(); })
      .def_prop_ro("attached_readers", [](PyShmRing& s) { return s.get().attached_readers(); })
      .def_prop_ro("shut_down", [](PyShmRing& s) { return s.get().shut_down(); })
      .def_prop_ro("messages_written", [](PyShmRing& s) { return s.get().messages_written(); })
      .def_prop_ro("messages_read", [](PyShmRing& s) { return s.get().messages_read(); });
  m.def("reap_stale_segments", &ShmRing::reap_stale_segments,
        "Remove /dev/shm segments of hotloop queues whose creating process died; returns how many.");
}

}  // namespace hotloop::py
