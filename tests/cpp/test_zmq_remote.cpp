// The remote queue's hot path (zmq_api.h, zmq_reader.h, zmq_writer.h) over real CurveZMQ connections on TCP
// loopback. The test links Debian's libzmq (libzmq3-dev) and makes the sockets with it, as pyzmq does in
// production; the hot path reaches the same library through process_zmq() (RTLD_NOLOAD of the mapped libzmq).
// Cases: the function table matches zmq.h; messages of one and several parts, the shutdown and a corrupt kind;
// a peer gone mid-message (a proxy cuts the connection inside a large message); a message that came just before
// the disconnect; a refused key (a ZAP handler);
// a full send buffer (QueueTimeout, then every message delivered once, in order); cancel/close from another
// thread (TSan checks the lock).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/zmq_api.h"
#include "hotloop/zmq_reader.h"
#include "hotloop/zmq_writer.h"
#include "test_util.h"

#if defined(__SANITIZE_THREAD__)
// libzmq (Debian's, not built with ThreadSanitizer) hands messages between the caller and its I/O thread through
// lock-free pipes TSan cannot see, so the copies it and libsodium (CurveZMQ's decryption) make inside themselves
// (memcpy, memmove, memcmp: intercepted) look like races with whoever reads the message next. Those interceptor
// calls are ignored; every access of hotloop's own code is still checked against hotloop's own.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libzmq.so.5\ncalled_from_lib:libsodium.so.23\n";
}
#endif

namespace hotloop {
namespace {

static_assert(sizeof(ZmqMsg) == sizeof(zmq_msg_t) && alignof(ZmqMsg) == alignof(zmq_msg_t));
static_assert(zmq_abi::kDontWait == ZMQ_DONTWAIT && zmq_abi::kSndMore == ZMQ_SNDMORE && zmq_abi::kFd == ZMQ_FD &&
              zmq_abi::kEvents == ZMQ_EVENTS && zmq_abi::kSndTimeo == ZMQ_SNDTIMEO &&
              zmq_abi::kPollIn == ZMQ_POLLIN && zmq_abi::kEventDisconnected == ZMQ_EVENT_DISCONNECTED &&
              zmq_abi::kETerm == ETERM);

constexpr int64_t kSecond = 1'000'000'000;

void check(int rc, const char* what) {
  if (rc != 0) FAIL() << what << ": " << zmq_strerror(zmq_errno());
}

struct Keys {
  char pub[41], sec[41];
  Keys() { EXPECT_EQ(zmq_curve_keypair(pub, sec), 0); }
};

// A writer's XPUB (CurveZMQ server) bound to a random loopback port, and readers' SUB sockets with monitors, made
// with libzmq directly, as python/hotloop/queue/remote/ does with pyzmq.
struct Net {
  void* ctx = zmq_ctx_new();
  std::vector<void*> sockets;
  Keys server;
  int monitors = 0;

  ~Net() {
    for (void* s : sockets) zmq_close(s);
    zmq_ctx_term(ctx);
  }
  void* socket(int type) {
    void* s = zmq_socket(ctx, type);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    sockets.push_back(s);
    return s;
  }
  // The writer: returns its endpoint.
  std::string writer(void*& xpub, int hwm = 1000, const char* zap_domain = nullptr) {
    xpub = socket(ZMQ_XPUB);
    int one = 1;
    check(zmq_setsockopt(xpub, ZMQ_CURVE_SERVER, &one, sizeof(one)), "CURVE_SERVER");
    check(zmq_setsockopt(xpub, ZMQ_CURVE_SECRETKEY, server.sec, 40), "CURVE_SECRETKEY");
    if (zap_domain) check(zmq_setsockopt(xpub, ZMQ_ZAP_DOMAIN, zap_domain, strlen(zap_domain)), "ZAP_DOMAIN");
    check(zmq_setsockopt(xpub, ZMQ_XPUB_NODROP, &one, sizeof(one)), "XPUB_NODROP");
    check(zmq_setsockopt(xpub, ZMQ_SNDHWM, &hwm, sizeof(hwm)), "SNDHWM");
    check(zmq_bind(xpub, "tcp://127.0.0.1:*"), "bind");
    char endpoint[256];
    size_t len = sizeof(endpoint);
    check(zmq_getsockopt(xpub, ZMQ_LAST_ENDPOINT, endpoint, &len), "LAST_ENDPOINT");
    return endpoint;
  }
  // A reader's SUB socket (subscribed to everything) and its monitor, connected to `endpoint`.
  void reader(const std::string& endpoint, void*& sub, void*& monitor, const Keys& client, int hwm = 1000,
              const char* server_key = nullptr) {
    sub = socket(ZMQ_SUB);
    check(zmq_setsockopt(sub, ZMQ_CURVE_SERVERKEY, server_key ? server_key : server.pub, 40), "SERVERKEY");
    check(zmq_setsockopt(sub, ZMQ_CURVE_PUBLICKEY, client.pub, 40), "PUBLICKEY");
    check(zmq_setsockopt(sub, ZMQ_CURVE_SECRETKEY, client.sec, 40), "SECRETKEY");
    check(zmq_setsockopt(sub, ZMQ_RCVHWM, &hwm, sizeof(hwm)), "RCVHWM");
    const std::string addr = "inproc://test-monitor-" + std::to_string(monitors++);
    check(zmq_socket_monitor(sub, addr.c_str(), ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED), "monitor");
    monitor = socket(ZMQ_PAIR);
    check(zmq_connect(monitor, addr.c_str()), "monitor connect");
    check(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0), "SUBSCRIBE");
    check(zmq_connect(sub, endpoint.c_str()), "connect");
  }
};

// Waits until the writer has seen `n` subscriptions (a PUB socket sends nothing to a reader it has not seen).
void wait_subscribed(void* xpub, int n = 1) {
  int ms = 10'000;
  zmq_setsockopt(xpub, ZMQ_RCVTIMEO, &ms, sizeof(ms));
  for (int i = 0; i < n; ++i) {
    char buf[256];
    ASSERT_GT(zmq_recv(xpub, buf, sizeof(buf), 0), 0) << "no subscription reached the writer";
  }
}

// One writer and one CURVE reader on loopback, the reader's subscription seen by the writer.
struct Link {
  Net net;
  void *xpub = nullptr, *sub = nullptr, *mon = nullptr;
  Keys client;
  std::string ep;
  explicit Link(int hwm = 1000) {
    ep = net.writer(xpub, hwm);
    net.reader(ep, sub, mon, client, hwm);
    wait_subscribed(xpub);
  }
};

ZmqWriter make_writer(void* xpub) { return ZmqWriter(process_zmq(), xpub, "test-queue", 64, 10'000'000); }

void send(ZmqWriter& w, std::vector<std::string> parts, int64_t timeout_ns = -1) {
  std::vector<ZmqWriter::Part> p;
  for (const std::string& s : parts) p.push_back({s.data(), s.size()});
  w.send(p.data(), p.size(), timeout_ns);
}

void send_frames(ZmqWriter& w, std::vector<std::string> frames) {
  std::vector<ZmqWriter::Part> p;
  for (const std::string& s : frames) p.push_back({s.data(), s.size()});
  w.send_frames(p.data(), p.size(), kSecond);
}

// The next message as one string, or "<timeout>".
std::string read(ZmqReader& r, int64_t timeout_ns = 10 * kSecond) {
  WaitPolicy park(0, 0, false);
  std::string out;
  const ZmqReader::Sink sink = [&](const ZmqReader::Part* parts, size_t n) {
    for (size_t i = 0; i < n; ++i) out.append(static_cast<const char*>(parts[i].data), parts[i].size);
  };
  return r.next(timeout_ns, park, nullptr, &sink) ? out : "<timeout>";
}

TEST(ZmqApi, ResolvesTheLibzmqThisProcessLoaded) {
  const ZmqApi& api = process_zmq();
  EXPECT_EQ(mapped_zmq_libraries().size(), 1u);
  EXPECT_EQ(api.path, mapped_zmq_libraries().front());
  int major, minor, patch;
  zmq_version(&major, &minor, &patch);
  EXPECT_EQ(api.version, major * 10000 + minor * 100 + patch);
  EXPECT_EQ(reinterpret_cast<void*>(api.zmq_send), reinterpret_cast<void*>(&zmq_send));  // the same library
}

TEST(ZmqApi, NeverLoadsALibraryThatIsNotLoadedAlready) {
  try {
    load_loaded_zmq("/nonexistent/libzmq.so.5");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is not loaded in this process"), std::string::npos) << e.what();
  }
}

TEST(ZmqRemote, DeliversMessagesOfOneAndSeveralPartsThenTheShutdown) {
  Link l;
  ZmqReader r(process_zmq(), l.sub, l.mon, "test-queue", l.ep);
  ZmqWriter w = make_writer(l.xpub);
  send(w, {"hello"});
  send(w, {"ab", "", "cd"});
  send(w, {std::string(1 << 20, 'x')});
  send(w, {""});
  send_frames(w, {"S", ""});
  EXPECT_EQ(read(r), "hello");
  EXPECT_EQ(read(r), "abcd");
  EXPECT_EQ(read(r), std::string(1 << 20, 'x'));
  EXPECT_EQ(read(r), "");
  // the end of the stream is something to take: the next read raises
  EXPECT_TRUE(test::wait_until([&] { return r.readable(); }));
  EXPECT_THROW(read(r), ClosedError);
  EXPECT_THROW(read(r), ClosedError);
}

TEST(ZmqRemote, ACorruptFrameKindIsAnErrorThatLosesNothingAfterIt) {
  Link l;
  ZmqReader r(process_zmq(), l.sub, l.mon, "test-queue", l.ep);
  ZmqWriter w = make_writer(l.xpub);
  send_frames(w, {"X", "junk"});
  send(w, {"after"});
  try {
    read(r);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt frame kind b'X'"), std::string::npos) << e.what();
  }
  // The message behind it is not left behind a quiet descriptor: the source becomes ready for it (it may still be
  // on its way when the corrupt one is read; slowly under TSan), with no third message to wake it.
  EXPECT_TRUE(test::wait_until([&] {
    pollfd p{r.fd(), POLLIN, 0};
    return poll(&p, 1, 0) == 1;
  }));
  EXPECT_TRUE(r.readable());
  EXPECT_EQ(read(r, 0), "after");
}

TEST(ZmqRemote, WaitReturnsFalseAtTheTimeoutAndWaitReadableKeepsTheMessage) {
  Link l;
  ZmqReader r(process_zmq(), l.sub, l.mon, "test-queue", l.ep);
  WaitPolicy park(0, 0, false);
  const int64_t t0 = now_ns();
  EXPECT_FALSE(r.next(50'000'000, park, nullptr, nullptr));
  EXPECT_GE(now_ns() - t0, 50'000'000);
  EXPECT_FALSE(r.readable());
  ZmqWriter w = make_writer(l.xpub);
  send(w, {"kept"});
  EXPECT_TRUE(r.next(10 * kSecond, park, nullptr, nullptr));  // no sink: held, not taken
  EXPECT_TRUE(r.readable());
  pollfd p{r.fd(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 1);  // the source stays ready while a message is held
  EXPECT_EQ(read(r, 0), "kept");
  EXPECT_FALSE(r.readable());
}

// A TCP proxy between reader and writer that cuts both connections once `cut_after` bytes went from the writer
// to the reader: the link dies in the middle of whatever message is crossing it then.
class CuttingProxy {
 public:
  CuttingProxy(int writer_port, size_t cut_after) : writer_port_(writer_port), cut_after_(cut_after) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(listen(listener_, 1), 0);
    socklen_t len = sizeof(a);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~CuttingProxy() {
    stop_ = true;
    thread_.join();
    ::close(listener_);
  }
  int port() const { return port_; }
  bool cut() const { return cut_; }

 private:
  void run() {
    pollfd l{listener_, POLLIN, 0};
    while (!stop_ && poll(&l, 1, 10) == 0) {
    }
    if (stop_) return;
    int down = accept(listener_, nullptr, nullptr);
    int up = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(uint16_t(writer_port_));
    EXPECT_EQ(connect(up, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    size_t to_reader = 0;
    char buf[4096];
    while (!stop_) {
      pollfd p[2] = {{up, POLLIN, 0}, {down, POLLIN, 0}};
      if (poll(p, 2, 10) <= 0) continue;
      if (p[0].revents) {
        const size_t room = std::min(sizeof(buf), cut_after_ - to_reader);
        ssize_t n = ::read(up, buf, room);
        if (n <= 0) break;
        EXPECT_EQ(::write(down, buf, size_t(n)), n);
        to_reader += size_t(n);
        if (to_reader >= cut_after_) break;
      }
      if (p[1].revents) {
        ssize_t n = ::read(down, buf, sizeof(buf));
        if (n <= 0) break;
        EXPECT_EQ(::write(up, buf, size_t(n)), n);
      }
    }
    cut_ = true;
    ::close(up);
    ::close(down);
  }

  int writer_port_;
  size_t cut_after_;
  int listener_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  std::thread thread_;
};

TEST(ZmqRemote, APeerGoneMidMessageRaisesDeadPeerAfterEveryWholeMessage) {
  Net net;
  void *xpub, *sub, *mon;
  Keys client;
  const std::string ep = net.writer(xpub);
  const int writer_port = std::stoi(ep.substr(ep.rfind(':') + 1));
  // Handshake and the small messages cross well within 64 KiB; the 1 MiB message is cut inside.
  CuttingProxy proxy(writer_port, 64 * 1024);
  net.reader("tcp://127.0.0.1:" + std::to_string(proxy.port()), sub, mon, client);
  wait_subscribed(xpub);
  ZmqReader r(process_zmq(), sub, mon, "test-queue", "the proxy");
  ZmqWriter w = make_writer(xpub);
  send(w, {"one"});
  send(w, {"two", "parts"});
  send(w, {std::string(1 << 20, 'b')});  // the writer does not see the cut: ZeroMQ's thread writes it
  EXPECT_EQ(read(r), "one");
  EXPECT_EQ(read(r), "twoparts");
  try {
    const std::string got = read(r);
    FAIL() << "read a message of " << got.size() << " bytes after the cut";
  } catch (const DeadPeerError& e) {
    EXPECT_NE(std::string(e.what()).find("lost the connection to its writer at the proxy"), std::string::npos);
  }
  EXPECT_TRUE(proxy.cut());
  EXPECT_THROW(read(r), DeadPeerError);  // and stays so
  send(w, {"after"});                    // the writer carries on (its peer is gone)
}

// The race a reader can lose at the end of a connection: its look at the data socket finds nothing; the writer's
// last message and then the disconnect arrive; its look at the monitor finds the disconnect. A function table
// whose data socket shows nothing until the monitor has been read makes that order happen every time.
struct HideDataUntilMonitorRead {
  static inline const ZmqApi* real = nullptr;
  static inline void *sock = nullptr, *monitor = nullptr;
  static inline std::atomic<bool> hide{false};
  static int getsockopt(void* s, int option, void* optval, size_t* optvallen) {
    if (s == monitor) hide = false;
    if (hide && s == sock && option == ZMQ_EVENTS) {
      *static_cast<int*>(optval) = 0;
      return 0;
    }
    return real->zmq_getsockopt(s, option, optval, optvallen);
  }
  static int msg_recv(ZmqMsg* msg, void* s, int flags) {
    if (hide && s == sock) {
      errno = EAGAIN;
      return -1;
    }
    return real->zmq_msg_recv(msg, s, flags);
  }
  static ZmqApi table(void* sub, void* mon) {
    real = &process_zmq();
    sock = sub;
    monitor = mon;
    ZmqApi api = *real;
    api.zmq_getsockopt = &getsockopt;
    api.zmq_msg_recv = &msg_recv;
    return api;
  }
};

TEST(ZmqRemote, AMessageThatCameJustBeforeTheDisconnectIsReadBeforeDeadPeer) {
  Link l;
  const ZmqApi api = HideDataUntilMonitorRead::table(l.sub, l.mon);
  ZmqReader r(api, l.sub, l.mon, "test-queue", l.ep);
  ZmqWriter w = make_writer(l.xpub);
  send(w, {"last"});
  // The message reaches the reader's ZeroMQ, then the writer goes: the reader's monitor reports the disconnect.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  zmq_close(l.xpub);
  l.net.sockets.erase(std::find(l.net.sockets.begin(), l.net.sockets.end(), l.xpub));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  HideDataUntilMonitorRead::hide = true;
  EXPECT_EQ(read(r), "last");
  EXPECT_THROW(read(r), DeadPeerError);
}

// A ZAP handler (RFC 27) admitting one client key: what context.py's ZapHandler does for a queue's ranks.
class ZapHandler {
 public:
  ZapHandler(void* ctx, std::string admitted) : admitted_(std::move(admitted)) {
    rep_ = zmq_socket(ctx, ZMQ_REP);
    int ms = 10;
    zmq_setsockopt(rep_, ZMQ_RCVTIMEO, &ms, sizeof(ms));
    EXPECT_EQ(zmq_bind(rep_, "inproc://zeromq.zap.01"), 0);
    thread_ = std::thread([this] { run(); });
  }
  ~ZapHandler() {
    stop_ = true;
    thread_.join();
    zmq_close(rep_);
  }
  int refused() const { return refused_; }

 private:
  void run() {
    while (!stop_) {
      std::vector<std::string> frames;
      bool more = true;
      while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, rep_, 0) < 0) {
          zmq_msg_close(&m);
          break;
        }
        frames.emplace_back(static_cast<char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
      }
      if (frames.size() < 7) continue;  // timeout
      // version, request id, domain, address, identity, mechanism, client key
      char z85[41];
      zmq_z85_encode(z85, reinterpret_cast<const uint8_t*>(frames[6].data()), 32);
      const bool ok = admitted_ == z85;
      refused_ += ok ? 0 : 1;
      const std::string reply[] = {"1.0", frames[1], ok ? "200" : "400", ok ? "OK" : "unknown key", "rank-0", ""};
      for (int i = 0; i < 6; ++i) zmq_send(rep_, reply[i].data(), reply[i].size(), i < 5 ? ZMQ_SNDMORE : 0);
    }
  }

  std::string admitted_;
  void* rep_;
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0};
  std::thread thread_;
};

TEST(ZmqRemote, ARefusedKeyReadsNothingWhileAnAdmittedOneReadsEverything) {
  Net net;
  Keys admitted, stranger;
  ZapHandler zap(net.ctx, admitted.pub);
  void *xpub, *sub_ok, *mon_ok, *sub_bad, *mon_bad;
  const std::string ep = net.writer(xpub, 1000, "test");
  net.reader(ep, sub_bad, mon_bad, stranger);
  net.reader(ep, sub_ok, mon_ok, admitted);
  wait_subscribed(xpub);  // the admitted reader's
  ZmqReader ok(process_zmq(), sub_ok, mon_ok, "test-queue", ep);
  ZmqReader bad(process_zmq(), sub_bad, mon_bad, "test-queue", ep);
  ASSERT_TRUE(test::wait_until([&] { return zap.refused() > 0; }));
  ZmqWriter w = make_writer(xpub);
  for (int i = 0; i < 10; ++i) send(w, {std::to_string(i).insert(0, "m")});
  for (int i = 0; i < 10; ++i) EXPECT_EQ(read(ok), std::to_string(i).insert(0, "m"));
  // Refused: no message ever, and the reader learns that it has no connection (ZeroMQ closes it after the
  // failed handshake): DeadPeerError, as for a writer gone.
  EXPECT_THROW(read(bad), DeadPeerError);
}

TEST(ZmqRemote, AWrongServerKeyReadsNothing) {
  Net net;
  Keys client, impostor;
  void *xpub, *sub, *mon;
  const std::string ep = net.writer(xpub);
  net.reader(ep, sub, mon, client, 1000, impostor.pub);
  ZmqReader r(process_zmq(), sub, mon, "test-queue", ep);
  ZmqWriter w = make_writer(xpub);
  send(w, {"secret"});
  EXPECT_THROW(read(r), DeadPeerError);
}

TEST(ZmqRemote, AFullSendBufferTimesOutThenEveryMessageArrivesOnceInOrder) {
  Link l(/*hwm=*/4);
  ZmqReader r(process_zmq(), l.sub, l.mon, "test-queue", l.ep);
  ZmqWriter w = make_writer(l.xpub);
  const std::string body(64 * 1024, 'p');
  int sent = 0;
  bool timed_out = false;
  int64_t waited = 0;
  while (sent < 100'000 && !timed_out) {
    const int64_t t0 = now_ns();
    try {
      send(w, {std::to_string(sent), body}, 50'000'000);
      ++sent;
    } catch (const QueueTimeout& e) {
      waited = now_ns() - t0;
      timed_out = true;
      EXPECT_NE(std::string(e.what()).find("full send buffer behind"), std::string::npos) << e.what();
    }
  }
  ASSERT_TRUE(timed_out) << "the reader never fell a send buffer behind";
  EXPECT_GE(waited, 45'000'000);  // it waited (about) the timeout
  for (int i = 0; i < sent; ++i) ASSERT_EQ(read(r), std::to_string(i) + body) << "message " << i;
  EXPECT_EQ(read(r, 50'000'000), "<timeout>");  // nothing of the timed-out message went
  send(w, {"room again"}, kSecond);
  EXPECT_EQ(read(r), "room again");
}

TEST(ZmqRemote, CancelAndCloseFromAnotherThreadEndAWaitWithClosedError) {
  for (bool closing : {false, true}) {
    Net net;
    void *xpub, *sub, *mon;
    Keys client;
    const std::string ep = net.writer(xpub);
    net.reader(ep, sub, mon, client);
    ZmqReader r(process_zmq(), sub, mon, "test-queue", ep);
    std::atomic<int> outcome{0};  // 1: ClosedError
    std::thread waiter([&] {
      try {
        read(r, 30 * kSecond);
      } catch (const ClosedError&) {
        outcome = 1;
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // usually parked by now; either way it must end
    if (closing) {
      EXPECT_TRUE(r.close(true));
      EXPECT_FALSE(r.close(true));
    } else {
      r.cancel();
    }
    waiter.join();
    EXPECT_EQ(outcome.load(), 1);
    EXPECT_THROW(r.readable(), ClosedError);
  }
}

TEST(ZmqRemote, ConcurrentReadersOfOneReaderTakeEachMessageOnce) {
  Link l;
  ZmqReader r(process_zmq(), l.sub, l.mon, "test-queue", l.ep);
  ZmqWriter w = make_writer(l.xpub);
  const int n = 2000 * int(test::stress_scale());
  std::vector<std::vector<int>> got(2);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      try {
        while (true) got[t].push_back(std::stoi(read(r, 10 * kSecond)));
      } catch (const ClosedError&) {
      }
    });
  }
  for (int i = 0; i < n; ++i) send(w, {std::to_string(i)});
  send_frames(w, {"S", ""});
  for (std::thread& t : threads) t.join();
  std::vector<int> all(got[0]);
  all.insert(all.end(), got[1].begin(), got[1].end());
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), size_t(n));
  for (int i = 0; i < n; ++i) ASSERT_EQ(all[size_t(i)], i);
  for (const auto& g : got) EXPECT_TRUE(std::is_sorted(g.begin(), g.end()));
}

}  // namespace
}  // namespace hotloop
