// ShmRing: delivery (every reader gets every message once, in order, across processes), fragmentation, full
// ring, shutdown, dead peers, bad handles, and no /dev/shm leftovers.
#include <gtest/gtest.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/shm_ring.h"
#include "hotloop/wait_any.h"
#include "test_util.h"

namespace hotloop {
namespace {

constexpr int64_t kLong = 10'000'000'000;

// The hotloop segments named after this process (ctest runs other tests in parallel processes).
std::set<std::string> shm_segments() {
  std::set<std::string> out;
  const std::string mine = "-" + std::to_string(getpid()) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name.rfind("hotloop-", 0) == 0 && name.find(mine) != std::string::npos) out.insert(name);
    }
    closedir(d);
  }
  return out;
}

// Message `seq` of a stream: its size and bytes follow from the sequence number, so readers can verify both.
size_t size_of(uint64_t seq, size_t max_size) {
  std::mt19937_64 rng(seq * 0x9E3779B97F4A7C15ull);
  uint64_t r = rng();
  if (r % 50 == 0) return r % (max_size + 1);  // occasionally up to max_size (fragmented)
  return r % 2048;
}
std::vector<uint8_t> body_of(uint64_t seq, size_t size) {
  std::vector<uint8_t> b(size);
  uint64_t x = seq + 1;
  for (size_t i = 0; i < size; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b[i] = uint8_t(x >> 56);
  }
  return b;
}

void write_bytes(ShmRing& w, const std::vector<uint8_t>& b, int64_t timeout = kLong) {
  WaitPolicy p;
  ShmRing::Part part{b.data(), b.size()};
  w.write(&part, 1, timeout, p);
}

// Child process body: returns the exit code (0 = every message verified).
int read_stream(const std::string& name, uint32_t rank, uint64_t cap, uint32_t n, uint64_t count, size_t max_size,
                int slow_every) {
  try {
    ShmRing r = ShmRing::attach(name, rank, cap, n);
    WaitPolicy p;
    ShmRing::Message m;
    for (uint64_t seq = 0; seq < count; ++seq) {
      if (!r.read(m, kLong, p)) return 10;
      if (m.seq != seq) return 11;
      std::vector<uint8_t> want = body_of(seq, size_of(seq, max_size));
      if (m.size != want.size() || (m.size && std::memcmp(m.data, want.data(), m.size) != 0)) return 12;
      if (slow_every && seq % slow_every == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    r.release();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reader %u: %s\n", rank, e.what());
    return 20;
  }
}

int wait_child(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class ShmRingTest : public ::testing::Test {
 protected:
  void SetUp() override { before_ = shm_segments(); }
  void TearDown() override { EXPECT_EQ(shm_segments(), before_) << "a test left a segment in /dev/shm"; }
  std::set<std::string> before_;
};

TEST_F(ShmRingTest, ThreeReaderProcessesGetEveryMessageOnceInOrder) {
  const uint64_t cap = 1 << 16, count = (test::under_tsan() ? 3'000 : 20'000) * uint64_t(test::stress_scale());
  const size_t max_size = 4 * cap;  // up to four rings: fragmented while readers consume
  for (int slow : {0, 1}) {
    RingGeometry g;
    g.capacity = cap;
    g.n_readers = 3;
    ShmRing w = ShmRing::create(g);
    std::vector<pid_t> kids;
    for (uint32_t rank = 0; rank < 3; ++rank) {
      pid_t pid = fork();
      if (pid == 0) _exit(read_stream(w.name(), rank, cap, 3, count, max_size, slow && rank == 2 ? 97 : 0));
      kids.push_back(pid);
    }
    int64_t deadline = now_ns() + kLong;
    while (!w.all_attached() && now_ns() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_TRUE(w.all_attached());
    // the last reader unlinks right after its attach count lands, so the writer may see the count first
    EXPECT_TRUE(test::wait_until([&] { return shm_segments() == before_; }))
        << "the name is unlinked once every reader attached";
    for (uint64_t seq = 0; seq < count; ++seq) write_bytes(w, body_of(seq, size_of(seq, max_size)));
    for (pid_t k : kids) EXPECT_EQ(wait_child(k), 0) << "slow=" << slow;
  }
}

TEST_F(ShmRingTest, ZeroByteAndBoundarySizedMessagesRoundTrip) {
  RingGeometry g;
  g.capacity = 4096;
  ShmRing w = ShmRing::create(g);
  ShmRing r = ShmRing::attach(w.name(), 0, g.capacity, 1);
  WaitPolicy p;
  std::vector<size_t> sizes = {0, 1, 7, 8, 9, 1008, 1009, 1010, 1024, 4095, 4096, 20000};
  std::thread writer([&] {
    for (size_t i = 0; i < sizes.size(); ++i) write_bytes(w, body_of(i, sizes[i]));
  });
  ShmRing::Message m;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(r.read(m, kLong, p));
    ASSERT_EQ(m.size, sizes[i]);
    EXPECT_EQ(std::vector<uint8_t>(m.data, m.data + m.size), body_of(i, sizes[i]));
    EXPECT_EQ(m.owned.empty(), sizes[i] <= 1008) << "small messages are zero-copy views, large ones assembled";
  }
  writer.join();
}

TEST_F(ShmRingTest, AFullRingTimesOutNamingTheSlowReader) {
  RingGeometry g;
  g.capacity = 4096;
  g.n_readers = 2;
  ShmRing w = ShmRing::create(g);
  ShmRing r0 = ShmRing::attach(w.name(), 0, g.capacity, 2);
  ShmRing r1 = ShmRing::attach(w.name(), 1, g.capacity, 2);
  std::vector<uint8_t> msg(500);
  WaitPolicy p;
  ShmRing::Message m;
  int written = 0;
  try {
    for (;; ++written) {
      write_bytes(w, msg, 50'000'000);
      ASSERT_TRUE(r0.read(m, 0, p));  // rank 0 keeps up; rank 1 never reads
    }
  } catch (const QueueTimeout& e) {
    EXPECT_NE(std::string(e.what()).find("reader rank 1 (pid " + std::to_string(getpid()) + ")"), std::string::npos)
        << e.what();
  }
  EXPECT_GE(written, 6);
  EXPECT_LE(written, 8);
  // The ring is intact: the slow reader gets everything that was written, and the writer goes on.
  for (int i = 0; i < written; ++i) ASSERT_TRUE(r1.read(m, 0, p));
  r1.release();
  write_bytes(w, msg, 0);
}

TEST_F(ShmRingTest, ShutdownWakesAParkedReaderAfterTheLastMessage) {
  RingGeometry g;
  g.capacity = 4096;
  ShmRing w = ShmRing::create(g);
  ShmRing r = ShmRing::attach(w.name(), 0, g.capacity, 1);
  write_bytes(w, {1, 2, 3});
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    w.shutdown();
  });
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  ASSERT_TRUE(r.read(m, kLong, park));
  EXPECT_EQ(m.size, 3u);
  int64_t t0 = now_ns();
  EXPECT_THROW(r.read(m, kLong, park), ClosedError);
  EXPECT_LT(now_ns() - t0, 1'000'000'000);
  closer.join();
  EXPECT_THROW(write_bytes(w, {1}), ClosedError);
}

TEST_F(ShmRingTest, ADeadReaderIsDetectedWhenTheRingFillsAndCanBeDropped) {
  for (auto policy : {DeadReaderPolicy::kRaise, DeadReaderPolicy::kDrop}) {
    RingGeometry g;
    g.capacity = 4096;
    g.n_readers = 2;
    g.dead_reader = policy;
    ShmRing w = ShmRing::create(g);
    ShmRing live = ShmRing::attach(w.name(), 0, g.capacity, 2);
    pid_t pid = fork();
    if (pid == 0) {
      ShmRing r = ShmRing::attach(w.name(), 1, g.capacity, 2);
      pause();  // killed below, mid-stream, without closing
      _exit(0);
    }
    while (!w.all_attached()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    kill(pid, SIGKILL);  // a zombie until reaped: must count as dead
    siginfo_t info{};
    waitid(P_PID, pid, &info, WEXITED | WNOWAIT);  // dead (not reaped): the state the writer must recognise
    std::vector<uint8_t> msg(900);
    WaitPolicy p;
    ShmRing::Message m;
    int64_t t0 = now_ns();
    try {
      for (int i = 0; i < 100; ++i) {
        write_bytes(w, msg, 5'000'000'000);
        ASSERT_TRUE(live.read(m, 0, p));
      }
      EXPECT_EQ(policy, DeadReaderPolicy::kDrop) << "with kRaise the writer must raise";
    } catch (const DeadPeerError& e) {
      EXPECT_EQ(policy, DeadReaderPolicy::kRaise) << e.what();
      EXPECT_NE(std::string(e.what()).find("reader rank 1 (pid " + std::to_string(pid) + ")"), std::string::npos);
    }
    // found when the ring first fills (a few writes in), not after a liveness slice
    EXPECT_LT(now_ns() - t0, 250'000'000) << "detected as soon as the ring is full";
    wait_child(pid);
  }
}

// A writer in a child process: creates the ring `name` (4 KiB, one reader), says so, and on each byte from the
// parent runs the next step with it; exits without shutting down after the last (or when the parent stops).
class WriterChild {
 public:
  WriterChild(const std::string& name, std::vector<std::function<void(ShmRing&)>> steps) {
    EXPECT_EQ(pipe(ready_), 0);
    EXPECT_EQ(pipe(go_), 0);
    pid_ = fork();
    if (pid_ == 0) {
      RingGeometry g;
      g.capacity = 4096;
      ShmRing w = ShmRing::create(g, name);
      char c = 1;
      if (write(ready_[1], &c, 1) != 1) _exit(3);
      for (auto& step : steps) {
        if (read(go_[0], &c, 1) != 1) _exit(3);
        step(w);
      }
      _exit(0);  // dies without shutdown (no destructors)
    }
    char c = 0;
    EXPECT_EQ(read(ready_[0], &c, 1), 1);
  }
  ~WriterChild() {
    close(go_[1]);  // a child still waiting for its next step ends (a test that failed before giving it)
    wait_child(pid_);
    for (int fd : {ready_[0], ready_[1], go_[0]}) close(fd);
  }
  void next() {
    char c = 1;
    EXPECT_EQ(write(go_[1], &c, 1), 1);
  }

 private:
  int ready_[2], go_[2];
  pid_t pid_;
};

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST_F(ShmRingTest, ADeadWriterIsDetectedByAParkedReaderAfterItsLastMessage) {
  const std::string name = "/hotloop-test-" + std::to_string(getpid()) + "-deadwriter";
  WriterChild writer(name, {[](ShmRing& w) { write_bytes(w, {42}); }});
  ShmRing r = ShmRing::attach(name, 0, 4096, 1);
  writer.next();
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  ASSERT_TRUE(r.read(m, kLong, park));
  EXPECT_EQ(m.data[0], 42);
  int64_t t0 = now_ns();
  EXPECT_THROW(r.read(m, kLong, park), DeadPeerError);
  EXPECT_LT(now_ns() - t0, 1'500'000'000);
}

TEST_F(ShmRingTest, BadHandlesAndArgumentsGiveClearErrors) {
  RingGeometry g;
  g.capacity = 4096;
  g.n_readers = 2;
  g.max_message = 1000;
  ShmRing w = ShmRing::create(g);
  auto expect_bad = [](auto fn, const char* words) {
    try {
      fn();
      ADD_FAILURE() << "expected BadHandleError mentioning '" << words << "'";
    } catch (const BadHandleError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_bad([&] { ShmRing::attach("/hotloop-no-such-queue", 0, 4096, 2); }, "no shared-memory segment");
  expect_bad([&] { ShmRing::attach(w.name(), 0, 8192, 2); }, "not the");
  expect_bad([&] { ShmRing::attach(w.name(), 5, 4096, 2); }, "out of range");
  ShmRing r0 = ShmRing::attach(w.name(), 0, 4096, 2);
  expect_bad([&] { ShmRing::attach(w.name(), 0, 4096, 2); }, "already attached");
  // a segment of the right size that is not a ring
  std::string junk = "/hotloop-test-junk-" + std::to_string(getpid());
  int fd = shm_open(junk.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  size_t size = 0;
  {
    RingGeometry g2;
    g2.capacity = 4096;
    ShmRing probe = ShmRing::create(g2);
    struct stat st {};
    int pfd = shm_open(probe.name().c_str(), O_RDONLY, 0);
    fstat(pfd, &st);
    close(pfd);
    size = size_t(st.st_size);
  }
  ASSERT_EQ(ftruncate(fd, off_t(size)), 0);
  close(fd);
  expect_bad([&] { ShmRing::attach(junk, 0, 4096, 1); }, "not a hotloop message queue");
  shm_unlink(junk.c_str());
  // an oversized message is refused and the ring stays usable
  std::vector<uint8_t> big(1001);
  EXPECT_THROW(write_bytes(w, big), std::length_error);
  EXPECT_THROW(ShmRing::create(RingGeometry{1000, 1, 0, DeadReaderPolicy::kRaise}), std::invalid_argument);
  ShmRing r1 = ShmRing::attach(w.name(), 1, 4096, 2);
  write_bytes(w, {7});
  WaitPolicy p;
  ShmRing::Message m;
  ASSERT_TRUE(r0.read(m, 0, p));
  EXPECT_EQ(m.seq, 0u) << "the refused message left no trace in the ring";
  EXPECT_EQ(m.data[0], 7);
}

TEST_F(ShmRingTest, SegmentsOfDeadCreatorsAreReapedOnlyInThisPidNamespace) {
  const std::string ns = std::to_string(ShmRing::pid_namespace());
  const std::string stale = "/hotloop-" + ns + "-999999999-12345-0-deadbeef";  // this namespace, no such pid
  const std::string foreign = "/hotloop-1-999999999-12345-0-deadbeef";         // a pid of another namespace
  const std::string old_style = "/hotloop-999999999-12345-0-deadbeef";          // no namespace: unknown origin
  for (const std::string& n : {stale, foreign, old_style}) {
    int fd = shm_open(n.c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    close(fd);
  }
  RingGeometry g;
  g.capacity = 4096;
  ShmRing live = ShmRing::create(g);  // its creator (this process) is alive: kept
  // Another reaper on this machine (a test running beside this one, a Python MessageQueue being created) may
  // remove the stale segment first: what is checked is what is left, not who removed it.
  ShmRing::reap_stale_segments();
  EXPECT_NE(access(("/dev/shm" + stale).c_str(), F_OK), 0) << "the dead creator's segment is gone";
  EXPECT_EQ(access(("/dev/shm" + live.name()).c_str(), F_OK), 0) << "the live creator's segment stays";
  EXPECT_EQ(access(("/dev/shm" + foreign).c_str(), F_OK), 0) << "another namespace's pid proves nothing";
  EXPECT_EQ(access(("/dev/shm" + old_style).c_str(), F_OK), 0) << "a name without a namespace proves nothing";
  shm_unlink(foreign.c_str());
  shm_unlink(old_style.c_str());
}

TEST_F(ShmRingTest, AWriterThatDiesWhileAReaderIsParkedIsSeenAtOnceNotAtTheSliceEnd) {
  // The reader parks, then the writer process dies 150 ms into the wait: past the reader's first park (50 ms),
  // so its pidfd is watched and the death is seen at once. Without it, at the liveness slice's end (500 ms).
  if (park_backend().backend == ParkBackend::kSliced) {
    GTEST_SKIP() << "the sliced park backend (no io_uring, no futex_waitv: qemu-user, kernels before 5.16) does "
                    "not watch the writer's pidfd: a writer's death is seen at the liveness slice's end";
  }
  const std::string name = "/hotloop-test-" + std::to_string(getpid()) + "-writerexit";
  WriterChild writer(name, {[](ShmRing&) { sleep_ms(150); }});
  ShmRing r = ShmRing::attach(name, 0, 4096, 1);
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  writer.next();
  const int64_t t0 = now_ns();
  try {
    r.read(m, kLong, park);
    FAIL() << "read a message from a writer that wrote none";
  } catch (const DeadPeerError& e) {
    EXPECT_NE(std::string(e.what()).find("died"), std::string::npos) << e.what();
  }
  const int64_t took = now_ns() - t0;
  EXPECT_GE(took, 100'000'000) << "raised before the writer died";
  EXPECT_LT(took, 400'000'000) << "seen at the liveness slice's end, not when the writer died";
}

TEST_F(ShmRingTest, NoDescriptorOutlivesALongWait) {
  // A wait past its first park holds the writer's pidfd; it is closed as the wait returns (a message, a timeout).
  const std::string name = "/hotloop-test-" + std::to_string(getpid()) + "-pidfdclosed";
  WriterChild writer(name, {[](ShmRing& w) {
                                      sleep_ms(150);
                                      write_bytes(w, {7});
                                    }, [](ShmRing&) {}});
  auto open_fds = [] {
    int n = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (readdir(d) != nullptr) ++n;
      closedir(d);
    }
    return n;
  };
  ShmRing r = ShmRing::attach(name, 0, 4096, 1);
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  EXPECT_FALSE(r.read(m, 120'000'000, park));  // a timeout; also sets up this thread's park resources
  const int before = open_fds();
  writer.next();
  ASSERT_TRUE(r.read(m, kLong, park));
  EXPECT_EQ(m.data[0], 7);
  EXPECT_EQ(open_fds(), before);
  EXPECT_FALSE(r.read(m, 120'000'000, park));
  EXPECT_EQ(open_fds(), before);
  writer.next();
}

TEST_F(ShmRingTest, AnAbandonedRingDeliversWhatItHasThenRaisesDeadPeer) {
  RingGeometry g;
  g.capacity = 4096;
  ShmRing w = ShmRing::create(g);
  ShmRing r = ShmRing::attach(w.name(), 0, 4096, 1);
  write_bytes(w, {7});
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  std::thread abandoner([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    w.abandon();
  });
  ASSERT_TRUE(r.read(m, kLong, park));
  EXPECT_EQ(m.data[0], 7);
  int64_t t0 = now_ns();
  EXPECT_THROW(r.read(m, kLong, park), DeadPeerError) << "a parked reader wakes: the writer lost its source";
  EXPECT_LT(now_ns() - t0, 1'000'000'000);
  abandoner.join();
}

TEST_F(ShmRingTest, ClosedUnattachedSlotsNoLongerHoldTheWriterBackNorAttach) {
  RingGeometry g;
  g.capacity = 4096;
  g.n_readers = 3;
  ShmRing w = ShmRing::create(g);
  ShmRing r = ShmRing::attach(w.name(), 1, 4096, 3);
  EXPECT_EQ(w.close_unattached(), 2u);
  EXPECT_EQ(w.close_unattached(), 0u) << "idempotent";
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  for (int i = 0; i < 200; ++i) {  // many rings' worth: only rank 1 holds the writer back
    write_bytes(w, std::vector<uint8_t>(100, uint8_t(i)));
    ASSERT_TRUE(r.read(m, kLong, park));
    ASSERT_EQ(m.data[0], uint8_t(i));
  }
  EXPECT_THROW(ShmRing::attach(w.name(), 0, 4096, 3), BadHandleError) << "a closed slot cannot attach";
}

TEST_F(ShmRingTest, NodeRingsAreReapedByTheirHeadersWriter) {
  const std::string ns = std::to_string(ShmRing::pid_namespace());
  const std::string dead_name = "/hotloop-node-" + ns + "-deadwriter" + std::to_string(getpid());
  const std::string live_name = "/hotloop-node-" + ns + "-livewriter" + std::to_string(getpid());
  pid_t pid = fork();
  if (pid == 0) {
    RingGeometry g;
    g.capacity = 4096;
    ShmRing w = ShmRing::create(g, dead_name);
    _exit(0);  // dies without unlinking (no destructors)
  }
  ASSERT_EQ(wait_child(pid), 0) << "the child created its ring, then died";
  RingGeometry g;
  g.capacity = 4096;
  ShmRing live = ShmRing::create(g, live_name);
  ASSERT_EQ(access(("/dev/shm" + live_name).c_str(), F_OK), 0) << "a node ring is created under the name given";
  // The child's ring may already be gone: another reaper on this machine (a test running beside this one, a Python
  // MessageQueue being created) reaps it as soon as its writer is dead. What is checked is what is left.
  ShmRing::reap_stale_segments();
  EXPECT_NE(access(("/dev/shm" + dead_name).c_str(), F_OK), 0) << "its header's writer is dead";
  EXPECT_EQ(access(("/dev/shm" + live_name).c_str(), F_OK), 0) << "its header's writer (this process) lives";
}

TEST_F(ShmRingTest, RingsWhoseRecordsCouldOverflowTheirSizeFieldAreRefused) {
  RingGeometry g;
  g.capacity = ShmRing::kMaxCapacity * 2;
  EXPECT_THROW(ShmRing::create(g), std::invalid_argument);
  EXPECT_THROW(ShmRing::attach("/hotloop-none", 0, ShmRing::kMaxCapacity * 2, 1), BadHandleError);
}

// Maps a ring's segment the way a faulty peer could, to scribble on it.
struct Vandal {
  uint8_t* base = nullptr;
  size_t size = 0;
  Vandal(const std::string& name, size_t sz) : size(sz) {
    int fd = shm_open(name.c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0);
    base = static_cast<uint8_t*>(mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~Vandal() { munmap(base, size); }
};

TEST_F(ShmRingTest, GeometryOverwrittenInSharedMemoryIsIgnored) {
  // The header's geometry (version, readers, capacity, limits, writer identity) is scribbled over after both
  // sides took their own copies: every message still arrives intact (a side trusting the header would index
  // far outside the mapping).
  RingGeometry g;
  g.capacity = 4096;
  ShmRing w = ShmRing::create(g);
  Vandal v(w.name(), 1 << 16);
  ShmRing r = ShmRing::attach(w.name(), 0, 4096, 1);
  std::memset(v.base + 8, 0xff, 40);  // everything between the magic and the state word
  WaitPolicy p;
  ShmRing::Message m;
  for (uint64_t seq = 0; seq < 200; ++seq) {
    std::vector<uint8_t> want = body_of(seq, size_of(seq, 3000));
    write_bytes(w, want);
    ASSERT_TRUE(r.read(m, kLong, p));
    ASSERT_EQ(m.seq, seq);
    ASSERT_EQ(std::vector<uint8_t>(m.data, m.data + m.size), want);
  }
}

TEST_F(ShmRingTest, ASegmentOfAnotherLayoutIsRefusedNamingBothVersions) {
  // A peer from a hotloop whose segment layout differs (layout 2 had a shared write position; 3 has a header
  // word per record) must not attach: the two would read each other's records wrongly. The segment keeps its
  // size across the change, so the peer reaches the version check and its error names both versions.
  RingGeometry g;
  g.capacity = 4096;
  ShmRing w = ShmRing::create(g);
  Vandal v(w.name(), 1 << 12);
  uint32_t old_version = 2;
  std::memcpy(v.base + 8, &old_version, sizeof old_version);  // the version word, after the magic
  try {
    ShmRing::attach(w.name(), 0, 4096, 1);
    ADD_FAILURE() << "a layout-2 segment was attached";
  } catch (const BadHandleError& e) {
    EXPECT_NE(std::string(e.what()).find("layout version is 2, this hotloop reads version 3"), std::string::npos)
        << e.what();
  }
}

TEST_F(ShmRingTest, RandomCorruptionUnderALiveReaderGivesErrorsNeverCrashes) {
  // A fuzz of the reader and writer against a segment that a faulty peer scribbles on: rounds of writes,
  // random bytes at random offsets (header, doorbells, positions, reader slots, records), and reads. Each side
  // may raise (a corrupt record, a timeout, a shutdown) but never reads or writes outside its mapping (ASan
  // and UBSan builds run this) and never waits past its timeout.
  const int seeds = 120 * int(test::stress_scale());
  int errors = 0;
  for (int seed = 0; seed < seeds; ++seed) {
    std::mt19937_64 rng(seed);
    RingGeometry g;
    g.capacity = 4096;
    g.n_readers = 2;
    ShmRing w = ShmRing::create(g);
    const size_t map = 4096 + (1 << 12);  // the header and slots take less than a page here
    Vandal v(w.name(), map);
    ShmRing r0 = ShmRing::attach(w.name(), 0, 4096, 2);
    ShmRing r1 = ShmRing::attach(w.name(), 1, 4096, 2);
    WaitPolicy p;
    ShmRing::Message m;
    try {
      for (int step = 0; step < 40; ++step) {
        std::vector<uint8_t> body(rng() % 2500, uint8_t(step));
        try {
          write_bytes(w, body, 0);
        } catch (const QueueTimeout&) {
        }
        for (int k = int(rng() % 4); k > 0; --k) {
          size_t off = rng() % 3 == 0 ? rng() % 512 : rng() % (map - 8);  // the header more often
          v.base[off] = uint8_t(rng());
        }
        while (r0.read(m, 0, p)) r0.release();
        while (r1.read(m, 0, p)) r1.release();
      }
    } catch (const std::exception&) {
      ++errors;  // a clear error (corrupt record, shutdown, dead peer): the round ends here
    }
  }
  EXPECT_GT(errors, 0) << "the corruption never reached anything the ring checks: the fuzz is not working";
}

TEST_F(ShmRingTest, PingPongAcrossProcessesLosesNoWakeUp) {
  // parent -(ping)-> child -(pong)-> parent, both waiting with a park-at-once policy: a lost wake-up hangs a
  // round (caught by the 5 s timeout). The child writes pong through the writer mapping it inherits.
  const int rounds = 20'000 * int(test::stress_scale());
  RingGeometry g;
  g.capacity = 4096;
  ShmRing ping = ShmRing::create(g);
  ShmRing pong = ShmRing::create(g);
  pid_t pid = fork();
  if (pid == 0) {
    ShmRing in = ShmRing::attach(ping.name(), 0, 4096, 1);
    WaitPolicy park(0, 0, false);
    ShmRing::Message m;
    for (int i = 0; i < rounds; ++i) {
      if (!in.read(m, 5'000'000'000, park)) _exit(1);
      uint32_t v;
      std::memcpy(&v, m.data, sizeof v);
      if (v != uint32_t(i)) _exit(2);
      ShmRing::Part part{&v, sizeof v};
      pong.write(&part, 1, 5'000'000'000, park);
    }
    _exit(0);
  }
  ShmRing back = ShmRing::attach(pong.name(), 0, 4096, 1);
  WaitPolicy park(0, 0, false);
  ShmRing::Message m;
  for (int i = 0; i < rounds; ++i) {
    uint32_t v = uint32_t(i);
    ShmRing::Part part{&v, sizeof v};
    ping.write(&part, 1, 5'000'000'000, park);
    ASSERT_TRUE(back.read(m, 5'000'000'000, park)) << "lost wake-up at round " << i;
    std::memcpy(&v, m.data, sizeof v);
    ASSERT_EQ(v, uint32_t(i));
  }
  EXPECT_EQ(wait_child(pid), 0);
}

}  // namespace
}  // namespace hotloop
