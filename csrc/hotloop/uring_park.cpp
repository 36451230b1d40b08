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
#include <cstdio>
#include <cstring>
#include <string>

#include "hotloop/clock.h"

namespace hotloop::uring_park {
namespace {

// Constants newer than the build's kernel headers, as upstream defines them:
// include/uapi/linux/io_uring.h: enum io_uring_op counts ..., IORING_OP_SENDMSG_ZC (48, the last one in 6.1
// headers), IORING_OP_READ_MULTISHOT (49, 6.7), IORING_OP_WAITID (50, 6.7), IORING_OP_FUTEX_WAIT (51, 6.7).
constexpr uint8_t kOpFutexWait = 51;
// include/uapi/linux/futex.h: FUTEX2_SIZE_U32 0x02, FUTEX2_PRIVATE = FUTEX_PRIVATE_FLAG (128).
constexpr uint32_t kFutex2SizeU32 = 0x02;
constexpr uint32_t kFutex2Private = 128;
// FUTEX_BITSET_MATCH_ANY: a FUTEX_WAIT's mask must be non-zero; "any" matches every futex_wake.
constexpr uint64_t kMaskAny = 0xffffffffu;
static_assert(IORING_OP_SENDMSG_ZC == 48, "io_uring opcode numbering differs from upstream");
static_assert(sizeof(io_uring_sqe) == 64, "io_uring_sqe must be 64 bytes");

// 64 futexes + 64 descriptors + a cancel fit in the submission queue with room to spare; the completion
// queue is twice that (the kernel's default), so it never overflows.
constexpr unsigned kEntries = 256;
constexpr uint64_t kCancelTag = ~uint64_t(0);
// How long the reap after a cancel waits before cancelling again: a cancelled futex or poll completes at
// once, so this fires only if the kernel misses one (never seen); it bounds the damage if it does.
constexpr int64_t kReapRetryNs = 100'000'000;

long sys_setup(unsigned entries, io_uring_params* p) { return syscall(__NR_io_uring_setup, entries, p); }
long sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags, const void* arg, size_t argsz) {
  return syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, arg, argsz);
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
    // SINGLE_ISSUER + DEFER_TASKRUN (6.1): only this thread submits, and completions run when it waits, not
    // as interrupts of whatever it does meanwhile. SUBMIT_ALL (5.18): one refused operation does not stop the
    // others from being submitted.
    const unsigned tries[] = {IORING_SETUP_SUBMIT_ALL | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
                              IORING_SETUP_SUBMIT_ALL, 0};
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

  // Submits `n` prepared SQEs from `tail` and waits for `min_complete` completions or `timeout_ns` (< 0:
  // none). Returns how many SQEs the kernel took; *err is the errno of the call (0, ETIME, EINTR, ...).
  unsigned enter(uint32_t tail, unsigned n, unsigned min_complete, int64_t timeout_ns, int* err) {
    const uint32_t head = load_acquire(sq_head_);
    store_release(sq_tail_, tail + n);
    __kernel_timespec ts{};
    io_uring_getevents_arg arg{};
    arg.sigmask = 0;
    arg.sigmask_sz = _NSIG / 8;
    if (timeout_ns >= 0) {
      ts.tv_sec = timeout_ns / 1'000'000'000;
      ts.tv_nsec = timeout_ns % 1'000'000'000;
      arg.ts = reinterpret_cast<uint64_t>(&ts);
    }
    long rc = sys_enter(fd_, n, min_complete, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg, sizeof arg);
    *err = rc < 0 ? errno : 0;
    unsigned taken = load_acquire(sq_head_) - head;
    // An SQE the kernel refused to take (an error before submission) must not linger into the next call.
    if (taken < n) store_release(sq_tail_, head + taken);
    return taken;
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
};

int Ring::park(const futex::WaitEntry* fx, int n_fx, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  const unsigned n = unsigned(n_fx + n_fds);
  if (n_fx < 0 || n_fds < 0 || n == 0 || n > 128) return EINVAL;
  uint32_t tail = *sq_tail_;  // this thread is the only writer of the tail
  for (int i = 0; i < n_fx; ++i) {
    io_uring_sqe* s = sqe_at(tail++);
    s->opcode = kOpFutexWait;
    s->fd = int32_t(kFutex2SizeU32 | (fx[i].shared ? 0 : kFutex2Private));  // futex2 flags travel in sqe->fd
    s->addr = reinterpret_cast<uint64_t>(fx[i].word);
    s->addr2 = fx[i].expected;  // the value to sleep on
    s->addr3 = kMaskAny;
    s->user_data = uint64_t(i) + 1;
  }
  for (int j = 0; j < n_fds; ++j) {
    fds[j].revents = 0;
    io_uring_sqe* s = sqe_at(tail++);
    s->opcode = IORING_OP_POLL_ADD;
    s->fd = fds[j].fd;
    s->poll32_events = POLLIN;  // one-shot; POLLHUP and POLLERR are always reported
    s->user_data = uint64_t(n_fx + j) + 1;
  }
  tail -= n;

  int64_t timeout = -1;
  if (deadline_ns != kForever) timeout = std::max<int64_t>(0, deadline_ns - now_ns());
  int err = 0;
  unsigned outstanding = enter(tail, n, 1, timeout, &err);
  if (outstanding == 0) return err ? err : EAGAIN;
  tail += outstanding;
  // A partial submission (the kernel ran out of something) would leave sources unwatched: undo and report it.
  const int partial = outstanding < n ? (err ? err : EAGAIN) : 0;

  bool event = false;
  int failure = 0;
  unsigned cancels_owed = 0;
  auto drain = [&] {
    uint32_t head = *cq_head_;
    const uint32_t ctail = load_acquire(cq_tail_);
    for (; head != ctail; ++head) {
      const io_uring_cqe& c = cqes_[head & cq_mask_];
      if (c.user_data == kCancelTag) {
        --cancels_owed;
        continue;
      }
      --outstanding;
      const int k = int(c.user_data) - 1;
      const int res = c.res;
      if (res == -ECANCELED) continue;
      if (k < n_fx) {
        // 0: woken; -EAGAIN: the word already differed from the expected value. Either is an event.
        if (res == 0 || res == -EAGAIN) event = true;
        else if (res != -EINTR) failure = -res;
      } else if (res >= 0) {
        fds[k - n_fx].revents = short(res);
        event = true;
      } else if (res == -EBADF) {
        fds[k - n_fx].revents = POLLNVAL;  // not an open descriptor: wait_any reports it as closed
        event = true;
      } else {
        failure = -res;
      }
    }
    store_release(cq_head_, head);
  };
  drain();

  // Cancel what is still armed and reap until every operation submitted above has completed.
  while (outstanding > 0 || cancels_owed > 0) {
    int reap_err = 0;
    if (outstanding > 0 && cancels_owed == 0) {
      io_uring_sqe* s = sqe_at(tail);
      s->opcode = IORING_OP_ASYNC_CANCEL;
      s->fd = -1;
      s->cancel_flags = IORING_ASYNC_CANCEL_ALL | IORING_ASYNC_CANCEL_ANY;
      s->user_data = kCancelTag;
      unsigned taken = enter(tail, 1, outstanding + 1, kReapRetryNs, &reap_err);
      tail += taken;
      cancels_owed += taken;
    } else {
      enter(tail, 0, outstanding + cancels_owed, kReapRetryNs, &reap_err);
    }
    drain();
    if (reap_err != 0 && reap_err != EINTR && reap_err != ETIME && reap_err != EAGAIN && reap_err != EBUSY) {
      // The ring itself is unusable: nothing more will complete. Report it rather than spin.
      return reap_err;
    }
  }

  if (partial != 0) return partial;
  if (failure != 0) return failure;
  if (event) return 0;
  if (err != 0 && err != ETIME && err != EINTR) return err;
  return now_ns() >= deadline_ns ? ETIMEDOUT : EINTR;
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
    if ((r.features() & IORING_FEAT_EXT_ARG) == 0) {
      why = "io_uring without IORING_FEAT_EXT_ARG (needs Linux >= 5.11)";
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
    if (!supported(kOpFutexWait)) {
      why = "the kernel's io_uring lacks IORING_OP_FUTEX_WAIT (needs Linux >= 6.7)";
      return;
    }
    if (!supported(IORING_OP_POLL_ADD) || !supported(IORING_OP_ASYNC_CANCEL)) {
      why = "the kernel's io_uring lacks POLL_ADD or ASYNC_CANCEL";
      return;
    }
    why = self_test(r);
    ok = why.empty();
  }

  // Three parks whose outcome is known: a readable eventfd next to a futex that stays asleep (the futex wait
  // must be cancelled), a futex word that already changed (private, then process-shared flags) next to an idle
  // eventfd (the poll must be cancelled). A wrong opcode, flag or field shows up as EINVAL here.
  static std::string self_test(Ring& r) {
    int ready = eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);
    int idle = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    std::string why;
    std::atomic<uint32_t> word{1};
    for (int step = 0; step < 3 && why.empty(); ++step) {
      futex::WaitEntry e{&word, step == 0 ? 1u : 0u, step == 2};
      pollfd p{step == 0 ? ready : idle, POLLIN, 0};
      int rc = r.park(&e, 1, &p, 1, now_ns() + 1'000'000'000);
      bool good = rc == 0 && (step == 0 ? (p.revents & POLLIN) != 0 : p.revents == 0);
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
  return r.is_open() ? 0 : r.open();
}

int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  if (int err = prepare()) return err;
  return t_ring.ring.park(futexes, n_futexes, fds, n_fds, deadline_ns);
}

}  // namespace hotloop::uring_park
