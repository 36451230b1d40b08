#include "hotloop/zmq_reader.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "hotloop/clock.h"
#include "hotloop/errors.h"

namespace hotloop {
namespace {

int make_epoll() {
  int fd = epoll_create1(EPOLL_CLOEXEC);
  if (fd < 0) throw SourceError(std::string("remote reader: epoll_create1 failed: ") + std::strerror(errno));
  return fd;
}

// Python's repr of a bytes object, as the errors quote a frame: b'M', b'\x00'.
std::string bytes_repr(const unsigned char* p, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string s = "b'";
  for (size_t i = 0; i < n && i < 40; ++i) {
    const unsigned char c = p[i];
    if (c == '\\' || c == '\'') {
      s += '\\';
      s += char(c);
    } else if (c >= 0x20 && c < 0x7f) {
      s += char(c);
    } else {
      s += "\\x";
      s += hex[c >> 4];
      s += hex[c & 15];
    }
  }
  return s + "'";
}

}  // namespace

ZmqReader::ZmqReader(const ZmqApi& api, void* sock, void* monitor, std::string queue_name, std::string address)
    : api_(api), sock_(sock), monitor_(monitor), name_(std::move(queue_name)), address_(std::move(address)),
      epoll_(make_epoll()), source_(epoll_) {
  try {
    if (sock == nullptr || monitor == nullptr) throw std::invalid_argument("ZmqReader: null socket");
    signal_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    cancel_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (signal_ < 0 || cancel_ < 0) throw SourceError(std::string("remote reader: eventfd failed: ") + std::strerror(errno));
    auto watch = [&](int fd) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        throw SourceError(std::string("remote reader: epoll_ctl failed: ") + std::strerror(errno));
      }
    };
    for (void* s : {sock_, monitor_}) {
      int fd = -1;
      size_t len = sizeof(fd);
      if (api_.zmq_getsockopt(s, zmq_abi::kFd, &fd, &len) != 0) zmq_failed("zmq_getsockopt(ZMQ_FD)", api_.zmq_errno());
      watch(fd);
    }
    watch(signal_);
    watch(cancel_);
  } catch (...) {
    for (int fd : {signal_, cancel_, epoll_}) {
      if (fd >= 0) ::close(fd);
    }
    throw;
  }
}

ZmqReader::~ZmqReader() {
  close(true);
}

void ZmqReader::zmq_failed(const char* call, int err) const {
  if (err == zmq_abi::kETerm || err == ENOTSOCK) {
    throw ClosedError("queue " + name_ + ": this reader's socket was closed (" + call + ": " + api_.describe(err) + ")");
  }
  throw std::runtime_error("queue " + name_ + ": " + call + " failed on the connection to " + address_ + ": " +
                           api_.describe(err));
}

void ZmqReader::check_open() const {
  if (closed_ || cancelled_.load(std::memory_order_acquire)) {
    throw ClosedError("queue " + name_ + ": this reader was closed or shut down");
  }
}

void ZmqReader::close_frames(std::vector<ZmqMsg>& frames) noexcept {
  for (ZmqMsg& m : frames) api_.zmq_msg_close(&m);
  frames.clear();
}

void ZmqReader::sync_signal() noexcept {
  if (closed_) return;
  const bool want = has_something();
  if (want && !signalled_) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(signal_, &one, sizeof(one));
  } else if (!want && signalled_) {
    uint64_t v;
    [[maybe_unused]] ssize_t n = ::read(signal_, &v, sizeof(v));  // EAGAIN: nothing to clear
  }
  signalled_ = want;
}

void ZmqReader::take_events() {
  // Reading ZMQ_EVENTS processes ZeroMQ's pending commands, which re-arms the descriptor; anything that arrived
  // meanwhile is announced only by that read (its signal was just consumed), so take it.
  while (true) {
    int events = 0;
    size_t len = sizeof(events);
    if (api_.zmq_getsockopt(monitor_, zmq_abi::kEvents, &events, &len) != 0) {
      zmq_failed("zmq_getsockopt(ZMQ_EVENTS) of the monitor", api_.zmq_errno());
    }
    if (!(events & zmq_abi::kPollIn)) return;
    std::vector<ZmqMsg> frames;
    bool more = true;
    while (more) {
      frames.emplace_back();
      api_.zmq_msg_init(&frames.back());
      if (api_.zmq_msg_recv(&frames.back(), monitor_, zmq_abi::kDontWait) < 0) {
        const int err = api_.zmq_errno();
        close_frames(frames);
        if (err == EAGAIN) return;
        zmq_failed("zmq_msg_recv of the monitor", err);
      }
      more = api_.zmq_msg_more(&frames.back()) != 0;
    }
    // The first frame: the event (uint16) and its value (uint32), in this machine's byte order.
    if (api_.zmq_msg_size(&frames[0]) >= 2) {
      uint16_t event;
      std::memcpy(&event, api_.zmq_msg_data(&frames[0]), sizeof(event));
      if (event == zmq_abi::kEventDisconnected) lost_ = true;
    }
    close_frames(frames);
  }
}

void ZmqReader::take_message(bool probe) {
  // A corrupt message is dropped and reported, but only once the reader looked for the one behind it: the
  // descriptor stays re-armed (or the next message held), so nothing after it waits for another arrival.
  std::string corrupt;
  while (take_one(probe, corrupt)) probe = true;
  if (!corrupt.empty()) {
    throw std::invalid_argument("queue " + name_ + ": corrupt frame kind " + corrupt + " from " + address_ +
                                "; is another program publishing on this port?");
  }
}

bool ZmqReader::take_one(bool probe, std::string& corrupt) {
  if (!held_.empty() || shut_down_) return false;
  if (probe) {
    // ~1 us (a poll() in ZeroMQ); worth it where a message is unlikely: a receive that finds none costs the same
    // and re-arms the descriptor as well, so after a wake-up the receive goes first.
    int events = 0;
    size_t len = sizeof(events);
    if (api_.zmq_getsockopt(sock_, zmq_abi::kEvents, &events, &len) != 0) {
      zmq_failed("zmq_getsockopt(ZMQ_EVENTS)", api_.zmq_errno());
    }
    if (!(events & zmq_abi::kPollIn)) return false;
  }
  std::vector<ZmqMsg> frames;
  frames.reserve(2);
  bool more = true;
  while (more) {
    frames.emplace_back();
    api_.zmq_msg_init(&frames.back());
    // Nonblocking: the first frame may not be there; the rest of a multipart message always is (ZeroMQ delivers
    // a message whole).
    if (api_.zmq_msg_recv(&frames.back(), sock_, zmq_abi::kDontWait) < 0) {
      const int err = api_.zmq_errno();
      const bool first = frames.size() == 1;
      close_frames(frames);
      if (err == EAGAIN && first) return false;
      zmq_failed("zmq_msg_recv", err);
    }
    more = api_.zmq_msg_more(&frames.back()) != 0;
  }
  if (frames.size() == 1) {
    held_ = std::move(frames);
    payload_from_ = 0;
    return false;
  }
  ZmqMsg& kind = frames[0];
  const size_t kind_size = api_.zmq_msg_size(&kind);
  const auto* k = static_cast<const unsigned char*>(api_.zmq_msg_data(&kind));
  if (kind_size == 1 && k[0] == 'S') {
    shut_down_ = true;
    close_frames(frames);
    return false;
  }
  if (kind_size == 1 && k[0] == 'M') {
    held_ = std::move(frames);
    payload_from_ = 1;
    return false;
  }
  if (corrupt.empty()) corrupt = bytes_repr(k, kind_size);
  close_frames(frames);
  return true;  // dropped: look for the next
}

void ZmqReader::drain_locked() {
  try {
    check_open();
    take_events();
    take_message(true);
  } catch (...) {
    sync_signal();
    throw;
  }
  sync_signal();
}

bool ZmqReader::readable() {
  std::lock_guard<std::mutex> lock(mu_);
  drain_locked();
  return has_something();
}

bool ZmqReader::next(int64_t timeout_ns, WaitPolicy& policy, const WaitHooks* hooks, const Sink* sink) {
  const int64_t deadline = deadline_after(timeout_ns);
  bool first = true;
  bool woken = timeout_ns == 0;
  bool waited = false;  // woken by the wait: a message is almost surely there (see take_message)
  Source* sources[1] = {&source_};
  while (true) {
    std::vector<ZmqMsg> taken;
    bool shut = false, lost = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      check_open();
      // Between calls the descriptor is readable whenever something may have arrived, so a call that will wait
      // goes straight to the wait (whose own first look is one poll() of the descriptor).
      if (first && !held_.empty()) woken = true;
      first = false;
      try {
        if (woken) {
          take_message(!waited);
          if (held_.empty()) {
            take_events();
            // The writer's last messages and the disconnect may have arrived between the two looks: ZeroMQ's
            // thread hands a connection's messages over before it reports the connection gone, so after a
            // disconnect one more look finds whatever came before it (otherwise the reader would raise
            // DeadPeerError with messages still unread).
            if (lost_) take_message(true);
          }
        }
        if (!held_.empty()) {
          if (sink != nullptr) {
            taken.swap(held_);
            take_message(true);  // the one behind it: the source stays signalled while ZeroMQ holds more
          }
          sync_signal();
        } else {
          sync_signal();
          shut = shut_down_;
          lost = lost_;
        }
      } catch (...) {
        close_frames(taken);
        sync_signal();
        throw;
      }
      if (taken.empty() && !held_.empty() && sink == nullptr) return true;
    }
    if (!taken.empty()) {
      const size_t from = taken.size() == 1 ? 0 : 1;
      Part parts[8];
      std::vector<Part> many;
      Part* p = parts;
      const size_t n = taken.size() - from;
      if (n > 8) {
        many.resize(n);
        p = many.data();
      }
      for (size_t i = 0; i < n; ++i) {
        p[i] = Part{api_.zmq_msg_data(&taken[from + i]), api_.zmq_msg_size(&taken[from + i])};
      }
      try {
        (*sink)(p, n);
      } catch (...) {
        close_frames(taken);
        throw;
      }
      close_frames(taken);
      return true;
    }
    if (shut) throw ClosedError("queue " + name_ + ": shut down by its writer and every message read");
    if (lost) {
      throw DeadPeerError("queue " + name_ + ": lost the connection to its writer at " + address_ +
                          " (its process died or the network failed); every message received was read");
    }
    int64_t left = -1;
    if (deadline != kForever) {
      left = deadline - now_ns();
      if (left <= 0) return false;
    }
    try {
      wait_any(sources, 1, left, policy, hooks);
    } catch (const SourceError&) {
      if (!cancelled_.load(std::memory_order_acquire)) throw;  // closed by close() in another thread: ClosedError next
    }
    woken = waited = true;
  }
}

void ZmqReader::cancel() noexcept {
  cancelled_.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);  // never held across a wait: only while ZeroMQ is read
  if (!closed_) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(cancel_, &one, sizeof(one));  // wakes a thread waiting on the sockets
  }
}

bool ZmqReader::close(bool release_fds) noexcept {
  cancel();
  std::lock_guard<std::mutex> lock(mu_);
  const bool was_open = !closed_;
  closed_ = true;
  close_frames(held_);
  if (release_fds) {
    for (int* fd : {&epoll_, &signal_, &cancel_}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }
  return was_open;
}

}  // namespace hotloop
