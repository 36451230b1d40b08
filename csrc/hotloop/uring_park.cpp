#include "hotloop/uring_park.h"

#include <linux/io_uring.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "hotloop/clock.h"
#include "hotloop/fd_watch.h"

namespace hotloop::uring_park {
namespace {

static_assert(sizeof(io_uring_sqe) == 64, "io_uring_sqe must be 64 bytes");

// One poll is ever in flight (on the thread's fd_watch); the queues' smallest sizes are plenty.
constexpr unsigned kEntries = 4;
constexpr uint64_t kWatchTag = 1;

long sys_setup(unsigned entries, io_uring_params* p) { return syscall(__NR_io_uring_setup, entries, p); }
long sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
  return syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, nullptr, 0);
}
long sys_register(int fd, unsigned op, void* arg, unsigned n) {
  return syscall(__NR_io_uring_register, fd, op, arg, n);
}

uint32_t load_acquire(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

class Ring {
 public:
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (owned_by_this_process()) close();
  }

  bool is_open() const { return fd_ >= 0; }
  bool owned_by_this_process() const { return pid_ == getpid(); }
  unsigned features() const { return features_; }
  int fd() const { return fd_; }

  // Returns 0 or an errno.
  int open() {
    // Completions must be run by task work queued with TWA_SIGNAL (io_uring's default), which wakes this
    // thread from futex_waitv: so no IORING_SETUP_DEFER_TASKRUN (completions would wait until this thread
    // enters io_uring), COOP_TASKRUN or TASKRUN_FLAG (no wake-up of a sleeping thread). SUBMIT_ALL (5.18):
    // one refused operation does not stop the others; where it is unknown, a partial submission is undone.
    const unsigned tries[] = {IORING_SETUP_SUBMIT_ALL, 0};
    io_uring_params p;
    long fd = -1;
    int err = 0;
    for (unsigned flags : tries) {
      std::memset(&p, 0, sizeof p);
      p.flags = flags;
      fd = sys_setup(kEntries, &p);
      if (fd >= 0) break;
      err = errno;
      if (err != EINVAL) return err;
    }
    if (fd < 0) return err;
    fd_ = int(fd);
    watch_armed_ = false;  // a new ring holds no poll (a forked child's copy of the flag is its parent's)
    pid_ = getpid();
    features_ = p.features;
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_map_ = mmap(nullptr, sq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    if (sq_map_ == MAP_FAILED) return fail_open();
    cq_map_ = single ? sq_map_
                     : mmap(nullptr, cq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                            IORING_OFF_CQ_RING);
    if (cq_map_ == MAP_FAILED) return fail_open();
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    void* sqes = mmap(nullptr, sqes_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) return fail_open();
    sqes_ = static_cast<io_uring_sqe*>(sqes);
    auto* sq = static_cast<uint8_t*>(sq_map_);
    auto* cq = static_cast<uint8_t*>(cq_map_);
    sq_head_ = reinterpret_cast<uint32_t*>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<uint32_t*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<uint32_t*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<uint32_t*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<uint32_t*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<uint32_t*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<uint32_t*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    return 0;
  }

  void close() {
    if (sqes_ != nullptr) munmap(sqes_, sqes_len_);
    if (cq_map_ != nullptr && cq_map_ != MAP_FAILED && cq_map_ != sq_map_) munmap(cq_map_, cq_len_);
    if (sq_map_ != nullptr && sq_map_ != MAP_FAILED) munmap(sq_map_, sq_len_);
    if (fd_ >= 0) ::close(fd_);
    sqes_ = nullptr;
    sq_map_ = cq_map_ = nullptr;
    fd_ = -1;
  }

  // Forgets a ring inherited through fork without touching it: the child may have closed the descriptor and
  // reused its number already, so closing it could close someone else's file. The copy is left as it is.
  void abandon() {
    sqes_ = nullptr;
    sq_map_ = cq_map_ = nullptr;
    fd_ = -1;
    watch_armed_ = false;
  }

  int park(const futex::WaitEntry* fx, int n_fx, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept;

 private:
  int fail_open() {
    int err = errno;
    close();
    return err;
  }

  // A zeroed SQE at position `tail` (the kernel reads SQEs only inside io_uring_enter).
  io_uring_sqe* sqe_at(uint32_t tail) {
    uint32_t idx = tail & sq_mask_;
    sq_array_[idx] = idx;
    io_uring_sqe* s = &sqes_[idx];
    std::memset(s, 0, sizeof *s);
    return s;
  }

  // Submits `n` prepared SQEs from `tail` without waiting. Returns how many the kernel took; *err is the
  // errno of the call. A completion posted meanwhile (the watch already readable) is in the completion queue
  // when it returns: its task work runs before the call returns to user space.
  unsigned submit(uint32_t tail, unsigned n, int* err) {
    const uint32_t head = load_acquire(sq_head_);
    store_release(sq_tail_, tail + n);
    long rc;
    do rc = sys_enter(fd_, n, 0, 0);
    while (rc < 0 && errno == EINTR && load_acquire(sq_head_) == head);
    *err = rc < 0 ? errno : 0;
    unsigned taken = load_acquire(sq_head_) - head;
    // An SQE the kernel refused to take (an error before submission) must not linger into the next call.
    if (taken < n) store_release(sq_tail_, head + taken);
    return taken;
  }

  // Consumes the completion queue; a completion of the watch's poll means it is no longer armed.
  void reap() {
    uint32_t head = *cq_head_;
    const uint32_t ctail = load_acquire(cq_tail_);
    for (; head != ctail; ++head) {
      if (cqes_[head & cq_mask_].user_data == kWatchTag) watch_armed_ = false;
    }
    store_release(cq_head_, head);
  }

  // Arms a one-shot poll on the thread's watch (unless one is armed). Returns 0 or an errno.
  int arm_watch(int watch_fd) {
    if (watch_armed_) return 0;
    const uint32_t tail = *sq_tail_;  // this thread is the only writer of the tail
    io_uring_sqe* s = sqe_at(tail);
    s->opcode = IORING_OP_POLL_ADD;
    s->fd = watch_fd;
    s->poll32_events = POLLIN;
    s->user_data = kWatchTag;
    int err = 0;
    if (submit(tail, 1, &err) != 1) return err ? err : EAGAIN;
    watch_armed_ = true;
    return 0;
  }

  int fd_ = -1;
  pid_t pid_ = 0;
  unsigned features_ = 0;
  void* sq_map_ = nullptr;
  void* cq_map_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  uint32_t *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr;
  uint32_t sq_mask_ = 0;
  uint32_t *cq_head_ = nullptr, *cq_tail_ = nullptr;
  uint32_t cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  bool watch_armed_ = false;
};

int Ring::park(const futex::WaitEntry* fx, int n_fx, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  if (n_fds <= 0) return EINVAL;
  fd_watch::Watch& watch = fd_watch::this_thread();
  reap();
  const uint32_t before = load_acquire(cq_tail_);
  bool ready = false;
  if (int err = watch.arm(fds, n_fds, &ready)) return err;
  if (ready) return 0;
  if (int err = arm_watch(watch.fd())) return err;
  // The completion queue's tail moves when the watch's poll completes. If that happens while this thread
  // sleeps in futex_waitv, the poll's task work (queued with TWA_SIGNAL) wakes the thread to run it; the
  // interrupted futex_waitv restarts, finds the tail moved and returns. A completion before the sleep (a
  // descriptor that became readable while being armed, or before) shows in the tail read here.
  const uint32_t ctail = load_acquire(cq_tail_);
  if (ctail != before) {
    watch.collect(fds, n_fds);
    return 0;
  }
  return watch.sleep(fx, n_fx, reinterpret_cast<const std::atomic<uint32_t>*>(cq_tail_), ctail, fds, n_fds,
                     deadline_ns);
}

struct ThreadRing {
  Ring ring;
};
thread_local ThreadRing t_ring;

// The probe: can this process set up a ring, does the kernel know the opcodes, and does a real park behave?
struct Probe {
  bool ok = false;
  std::string why;

  Probe() {
    if (FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "r")) {
      int v = 0;
      if (std::fscanf(f, "%d", &v) == 1 && v == 2) why = "io_uring is disabled (kernel.io_uring_disabled = 2)";
      std::fclose(f);
      if (!why.empty()) return;
    }
    Ring r;
    if (int err = r.open()) {
      why = std::string("io_uring_setup failed: ") + std::strerror(err) +
            (err == ENOSYS ? " (kernel without io_uring)"
             : err == EPERM ? " (refused: kernel.io_uring_disabled or a seccomp filter)"
                            : "");
      return;
    }
    if (!futex::wait_many_supported()) {
      why = "futex_waitv unavailable (needs Linux >= 5.16)";
      return;
    }
    constexpr unsigned kOps = 256;
    alignas(io_uring_probe) uint8_t buf[sizeof(io_uring_probe) + kOps * sizeof(io_uring_probe_op)] = {};
    auto* probe = reinterpret_cast<io_uring_probe*>(buf);
    if (sys_register(r.fd(), IORING_REGISTER_PROBE, probe, kOps) < 0) {
      why = std::string("IORING_REGISTER_PROBE failed: ") + std::strerror(errno);
      return;
    }
    auto supported = [&](unsigned op) {
      return op <= probe->last_op && (probe->ops[op].flags & IO_URING_OP_SUPPORTED) != 0;
    };
    if (!supported(IORING_OP_POLL_ADD)) {
      why = "the kernel's io_uring lacks POLL_ADD";
      return;
    }
    why = self_test(r);
    ok = why.empty();
  }

  // Four parks whose outcome is known: a readable eventfd next to a futex that stays asleep; a futex word
  // that already changed (private, then process-shared) next to an idle eventfd; and an idle eventfd written by another thread while the park sleeps in futex_waitv, which must
  // end the sleep (the task-work wake-up this park relies on). A wrong field shows up as EINVAL here.
  static std::string self_test(Ring& r) {
    int ready = eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);
    int idle = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    std::string why;
    std::atomic<uint32_t> word{1};
    for (int step = 0; step < 4 && why.empty(); ++step) {
      futex::WaitEntry e{&word, step == 1 || step == 2 ? 0u : 1u, step == 2};
      pollfd p{step == 0 ? ready : idle, POLLIN, 0};
      std::thread writer;
      if (step == 3) {
        writer = std::thread([idle] {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          uint64_t one = 1;
          if (::write(idle, &one, sizeof one) != sizeof one) std::abort();
        });
      }
      int rc = r.park(&e, 1, &p, 1, now_ns() + 2'000'000'000);
      if (writer.joinable()) writer.join();
      bool good = rc == 0 && (step == 0 || step == 3 ? (p.revents & POLLIN) != 0 : p.revents == 0);
      if (!good) {
        why = "io_uring self-test " + std::to_string(step) + " failed: " +
              (rc ? std::string(std::strerror(rc)) : "revents " + std::to_string(p.revents));
      }
    }
    ::close(ready);
    ::close(idle);
    return why;
  }
};

const Probe& probe() {
  static const Probe p;
  return p;
}

}  // namespace

bool available() noexcept { return probe().ok; }

const char* unavailable_reason() noexcept { return probe().why.c_str(); }

int prepare() noexcept {
  Ring& r = t_ring.ring;
  if (r.is_open() && !r.owned_by_this_process()) r.abandon();  // a forked child must not share its parent's ring
  if (int err = fd_watch::this_thread().prepare()) return err;
  return r.is_open() ? 0 : r.open();
}

int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  if (int err = prepare()) return err;
  return t_ring.ring.park(futexes, n_futexes, fds, n_fds, deadline_ns);
}

}  // namespace hotloop::uring_park
