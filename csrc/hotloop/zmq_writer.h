// ZmqWriter: the hot path of a remote queue's writer (python/hotloop/queue/remote/publisher.py): a message's
// framing and its send to the XPUB socket, in one call that needs no Python (the binding runs it with the GIL
// released), and the count that says when the writer's Python side should look at its peers again.
//
// Roles. Python makes and owns the socket (pyzmq: CurveZMQ server keys, ZAP domain, XPUB_NODROP, bind) and reads
// its subscriptions and monitor (poll_peers, off the hot path); this object borrows the raw socket pointer
// (zmq.Socket.underlying), sends on it and never closes it. One thread writes: the same thread that runs
// poll_peers, so the socket is never used by two threads at once. Not thread-safe otherwise.
//
// Framing (python/hotloop/queue/remote/wire.py): a message of one part is one frame, the part itself; anything
// else is [kind "M", *parts]; send_frames() sends frames as they are (the shutdown, [kind "S", ""]).
//
// Blocking. A send first tries without waiting (ZMQ_DONTWAIT: no socket option to set, the common case). Only
// when a reader is a full send buffer (SNDHWM messages, XPUB_NODROP) behind does it wait in ZeroMQ's blocking
// send (ZMQ_SNDTIMEO), in slices of the hooks' slice_ns (the binding's Ctrl-C check runs between them), up to the
// timeout: QueueTimeout then, with nothing of the message sent. ZeroMQ counts the send buffer in messages, so once
// the first frame of a message went the rest go too (ZeroMQ's own thread writes them to the connection).
// Cost: one zmq_send per frame (ZeroMQ copies the part into its message: the one copy), and a clock read per
// message for the peer-look schedule (check_due: ~20 ns, the vDSO).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hotloop/wait_any.h"
#include "hotloop/zmq_api.h"

namespace hotloop {

class ZmqWriter {
 public:
  struct Part {
    const void* data;
    size_t size;
  };

  // `check_every` sends and `check_interval_ns` of time between the peer looks check_due() asks for.
  ZmqWriter(const ZmqApi& api, void* sock, std::string queue_name, uint32_t check_every, int64_t check_interval_ns);

  // Sends one message of `n` parts (n >= 1), framed. timeout_ns < 0: waits as long as a reader is behind.
  // Throws QueueTimeout (a reader a full send buffer behind for the whole timeout), ClosedError (the socket or
  // context was closed), std::runtime_error (another ZeroMQ error), or what the hooks throw.
  void send(const Part* parts, size_t n, int64_t timeout_ns, const WaitHooks* hooks = nullptr);
  // Sends `n` frames as they are (no framing); as send() otherwise.
  void send_frames(const Part* frames, size_t n, int64_t timeout_ns, const WaitHooks* hooks = nullptr);

  // Counts a send and says whether the writer is due to look at its peers: every `check_every` sends and every
  // `check_interval_ns`. peers_checked() restarts both.
  bool check_due() noexcept;
  void peers_checked() noexcept;

 private:
  void send_frame(const void* data, size_t size, int flags, int64_t deadline, const WaitHooks* hooks, bool first);
  void set_send_timeout(int ms);
  [[noreturn]] void zmq_failed(const char* call, int err) const;

  const ZmqApi& api_;
  void* sock_;
  const std::string name_;
  const uint32_t check_every_;
  const int64_t check_interval_ns_;
  uint32_t sends_unchecked_ = 0;
  int64_t next_check_ns_ = 0;
  int send_timeout_ms_ = -2;  // the ZMQ_SNDTIMEO last set (-2: not set by this object)
  int64_t timeout_for_error_ns_ = 0;
};

}  // namespace hotloop
