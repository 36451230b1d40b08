// ZmqReader: the hot path of a remote queue's reader (python/hotloop/queue/remote/subscriber.py): the wait, the
// receive, the readiness look and the copy out, in one call that needs no Python (the binding runs it with the
// GIL released).
//
// Roles. Python makes and owns the sockets (pyzmq: CurveZMQ keys, subscriptions, connect, the connection monitor)
// and hands their raw pointers (zmq.Socket.underlying) to this object, which borrows them: it never closes them,
// and after close() it never touches them again, so the owner closes them once close() has returned. It owns
// three descriptors: an epoll set of the data socket's and the monitor's ZMQ_FD, an eventfd that stays signalled
// while there is something to take (a message held here, or the stream ended), and an eventfd that cancel() writes.
// fd() (the epoll set) is the reader's one wait_any source for its whole life.
//
// Readiness. ZeroMQ's descriptors are edge-like (a message can be waiting with the descriptor quiet), so every
// operation leaves this reader either holding the next message (signal eventfd readable) or with ZeroMQ drained
// and its descriptor re-armed. next() woken by its wait receives at once (no ZMQ_EVENTS read first: a receive
// that finds nothing re-arms just as well), and once a message is taken it looks once (ZMQ_EVENTS) for the one
// behind it before returning. What travels (python/hotloop/queue/remote/wire.py): a one-frame message is the
// message; otherwise [kind, *parts] with kind "M" (the parts of one message) or "S" (the writer's shutdown).
// Any other kind is a corrupt stream: std::invalid_argument naming the queue and the address, the frames dropped.
// A DISCONNECTED event on the monitor is the writer lost: DeadPeerError once every message received before it is
// read; the shutdown frame gives ClosedError the same way.
//
// Threads. One mutex serialises every use of the sockets (a ZeroMQ socket is single-threaded), held only while
// ZeroMQ is read, never across the wait nor while a taken message is handed to its sink (which may block: a
// relay's ring write). cancel() and close() may come from any thread: a wait in progress wakes (the cancel
// eventfd is in the epoll set) and ends with ClosedError, as does every later call.
// Costs: a message costs one zmq_msg_recv per frame, one ZMQ_EVENTS read (a poll() inside ZeroMQ) and the sink's
// copy; an idle reader is parked in the kernel (epoll through wait_any).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "hotloop/fd_source.h"
#include "hotloop/wait_any.h"
#include "hotloop/wait_policy.h"
#include "hotloop/zmq_api.h"

namespace hotloop {

class ZmqReader {
 public:
  struct Part {
    const void* data;
    size_t size;
  };
  // Receives a taken message's parts (without the kind frame); runs without the lock.
  using Sink = std::function<void(const Part* parts, size_t n)>;

  // `sock`: a SUB socket (connected or not); `monitor`: the PAIR end of its monitor (DISCONNECTED events at least).
  // `queue_name` and `address` word the errors. Throws SourceError if the descriptors cannot be made.
  ZmqReader(const ZmqApi& api, void* sock, void* monitor, std::string queue_name, std::string address);
  ~ZmqReader();
  ZmqReader(const ZmqReader&) = delete;
  ZmqReader& operator=(const ZmqReader&) = delete;

  // The epoll descriptor to wait on (wait_any's source); the same for the reader's whole life.
  int fd() const noexcept { return epoll_; }

  // Waits until a message is held: with a sink, hands it to the sink (and looks for the next), else leaves it held.
  // True then; false at the timeout (timeout_ns < 0: none; 0: look once). Throws ClosedError (closed, cancelled,
  // or shut down by the writer with every message read), DeadPeerError (the writer lost, every message read),
  // std::invalid_argument (a corrupt frame kind), std::runtime_error (a ZeroMQ error), or what the hooks throw.
  bool next(int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks, const Sink* sink);
  // Takes what ZeroMQ holds without blocking and says whether there is something to take (a message, or the end
  // of the stream: the next call raises). Throws ClosedError once closed or cancelled.
  bool readable();
  // Any thread: every wait of this reader, running or later, ends with ClosedError.
  void cancel() noexcept;
  // Any thread: cancel(), then (once no other thread is inside ZeroMQ through this object) stop using the sockets
  // for good. With `release_fds`, its descriptors are closed too (a forked copy keeps them: they are its parent's).
  // Returns false if it was closed already.
  bool close(bool release_fds) noexcept;

 private:
  void check_open() const;
  void drain_locked();
  void take_events();
  void take_message(bool probe);
  bool take_one(bool probe, std::string& corrupt);  // true: a corrupt message was dropped (kind in `corrupt`)
  bool has_something() const noexcept { return !held_.empty() || shut_down_ || lost_; }
  void sync_signal() noexcept;
  void close_frames(std::vector<ZmqMsg>& frames) noexcept;
  [[noreturn]] void zmq_failed(const char* call, int err) const;

  const ZmqApi& api_;
  void* sock_;
  void* monitor_;
  const std::string name_;
  const std::string address_;
  int epoll_ = -1;
  int signal_ = -1;  // readable while has_something()
  int cancel_ = -1;  // written by cancel()
  FdSource source_;  // epoll_, for next()'s own wait

  std::mutex mu_;
  std::vector<ZmqMsg> held_;  // the next message's frames, received and not yet taken
  size_t payload_from_ = 0;   // 0: a message of one frame; 1: [kind "M", *parts]
  bool shut_down_ = false;
  bool lost_ = false;
  bool signalled_ = false;
  bool closed_ = false;
  std::atomic<bool> cancelled_{false};
};

}  // namespace hotloop
