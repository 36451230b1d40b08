#include "hotloop/zmq_writer.h"

#include <cerrno>
#include <cstdio>
#include <stdexcept>

#include "hotloop/clock.h"
#include "hotloop/errors.h"

namespace hotloop {

namespace {
constexpr unsigned char kKindMessage = 'M';
constexpr int64_t kMaxSliceNs = 1'000'000'000;  // a blocking send's slice without hooks (the timeout still holds)

std::string seconds(int64_t ns) {
  if (ns < 0) return "None";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", double(ns) / 1e9);
  return buf;
}
}  // namespace

ZmqWriter::ZmqWriter(const ZmqApi& api, void* sock, std::string queue_name, uint32_t check_every,
                     int64_t check_interval_ns)
    : api_(api), sock_(sock), name_(std::move(queue_name)), check_every_(check_every ? check_every : 1),
      check_interval_ns_(check_interval_ns) {
  if (sock == nullptr) throw std::invalid_argument("ZmqWriter: null socket");
}

void ZmqWriter::zmq_failed(const char* call, int err) const {
  if (err == zmq_abi::kETerm || err == ENOTSOCK) {
    throw ClosedError("queue " + name_ + ": the remote writer's socket was closed (" + call + ": " +
                      api_.describe(err) + ")");
  }
  throw std::runtime_error("queue " + name_ + ": " + call + " failed: " + api_.describe(err));
}

void ZmqWriter::set_send_timeout(int ms) {
  if (ms == send_timeout_ms_) return;
  if (api_.zmq_setsockopt(sock_, zmq_abi::kSndTimeo, &ms, sizeof(ms)) != 0) {
    zmq_failed("zmq_setsockopt(ZMQ_SNDTIMEO)", api_.zmq_errno());
  }
  send_timeout_ms_ = ms;
}

void ZmqWriter::send_frame(const void* data, size_t size, int flags, int64_t deadline, const WaitHooks* hooks,
                           bool first) {
  if (api_.zmq_send(sock_, data, size, flags | zmq_abi::kDontWait) >= 0) return;
  int err = api_.zmq_errno();
  while (true) {
    if (err != EAGAIN && err != EINTR) zmq_failed("zmq_send", err);
    // A reader is a full send buffer behind (or a signal came): wait in ZeroMQ's blocking send, a slice at a time.
    const int64_t now = now_ns();
    if (first && deadline != kForever && now >= deadline) {
      throw QueueTimeout("queue " + name_ + ": a remote reader is a full send buffer behind and did not catch up "
                         "within " + seconds(timeout_for_error_ns_) + " s; it is too slow or stuck");
    }
    if (hooks != nullptr && hooks->on_slice != nullptr && err == EINTR) hooks->on_slice(hooks->ctx);
    int64_t slice = hooks != nullptr && hooks->slice_ns > 0 ? hooks->slice_ns : kMaxSliceNs;
    if (first && deadline != kForever && deadline - now < slice) slice = deadline - now;
    set_send_timeout(int((slice + 999'999) / 1'000'000));
    if (api_.zmq_send(sock_, data, size, flags) >= 0) return;
    err = api_.zmq_errno();
    if (err == EAGAIN && hooks != nullptr && hooks->on_slice != nullptr) hooks->on_slice(hooks->ctx);
  }
}

void ZmqWriter::send_frames(const Part* frames, size_t n, int64_t timeout_ns, const WaitHooks* hooks) {
  if (n == 0) throw std::invalid_argument("queue " + name_ + ": a message needs at least one frame");
  timeout_for_error_ns_ = timeout_ns;
  const int64_t deadline = deadline_after(timeout_ns);
  for (size_t i = 0; i < n; ++i) {
    send_frame(frames[i].data, frames[i].size, i + 1 < n ? zmq_abi::kSndMore : 0, deadline, hooks, i == 0);
  }
}

void ZmqWriter::send(const Part* parts, size_t n, int64_t timeout_ns, const WaitHooks* hooks) {
  if (n == 0) throw std::invalid_argument("queue " + name_ + ": a message needs at least one part");
  if (n == 1) {
    send_frames(parts, 1, timeout_ns, hooks);
    return;
  }
  timeout_for_error_ns_ = timeout_ns;
  const int64_t deadline = deadline_after(timeout_ns);
  send_frame(&kKindMessage, 1, zmq_abi::kSndMore, deadline, hooks, true);
  for (size_t i = 0; i < n; ++i) {
    send_frame(parts[i].data, parts[i].size, i + 1 < n ? zmq_abi::kSndMore : 0, deadline, hooks, false);
  }
}

bool ZmqWriter::check_due() noexcept {
  return ++sends_unchecked_ >= check_every_ || now_ns() >= next_check_ns_;
}

void ZmqWriter::peers_checked() noexcept {
  sends_unchecked_ = 0;
  next_check_ns_ = now_ns() + check_interval_ns_;
}

}  // namespace hotloop
