#include "hotloop/waker_thread.h"

#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <ctime>
#include <system_error>
#include <thread>

#include "hotloop/clock.h"

namespace hotloop::waker_thread {
namespace {

constexpr int kMaxFutexes = 64;
// How long a waiter spins for the helper to finish a job it has already finished in all but its last store
// (a doorbell woke it: it wrote the eventfd, then marks itself idle): a few hundred ns; 20 us bounds it
// before the waiter sleeps on the futex instead (the helper was descheduled).
constexpr int64_t kIdleSpinNs = 20'000;

// The job handed from a waiting thread to its helper. Written by the waiter only while the helper is idle
// (done == job), published by the release increment of `job`.
struct Helper {
  std::atomic<uint32_t> job{0};   // bumped by the waiter: a new job (or quit); the helper sleeps on it when idle
  std::atomic<uint32_t> done{0};  // set to `job` by the helper when it finished that job; the waiter sleeps on it
  std::atomic<uint32_t> stop{0};  // bumped by the waiter to end the helper's futex_waitv (the last entry)
  std::atomic<bool> quit{false};
  std::atomic<uint32_t> started{0};  // set by the helper once it runs: its start-up (allocations included) is over
  std::atomic<int> n{0};
  futex::WaitEntry entries[kMaxFutexes + 1];
  int efd = -1;
  pid_t pid = 0;
  std::thread thread;

  void run() noexcept {
    started.store(1, std::memory_order_release);
    futex::wake(&started, 1, false);
    uint32_t seen = 0;
    for (;;) {
      uint32_t j = job.load(std::memory_order_acquire);
      if (j == seen) {
        futex::wait(&job, seen, false, kForever);
        continue;
      }
      seen = j;
      if (!quit.load(std::memory_order_acquire)) {
        const int count = n.load(std::memory_order_relaxed);
        const uint32_t stop_seen = entries[count - 1].expected;
        futex::wait_many(entries, count, kForever);
        // Returned because a doorbell's word changed (not because the waiter stopped it): wake the waiter.
        if (stop.load(std::memory_order_acquire) == stop_seen) {
          uint64_t one = 1;
          // An eventfd write fails only when the counter would overflow; the waiter drains it every park.
          [[maybe_unused]] ssize_t w = ::write(efd, &one, sizeof one);
        }
      }
      done.store(j, std::memory_order_release);
      futex::wake(&done, 1, false);
      if (quit.load(std::memory_order_acquire)) return;
    }
  }

  // Waits until the helper finished job `j`.
  void wait_idle(uint32_t j) noexcept {
    const int64_t spin_end = now_ns() + kIdleSpinNs;
    uint32_t d;
    for (int i = 0; (d = done.load(std::memory_order_acquire)) != j; ++i) {
      if ((i & 63) == 63 && now_ns() >= spin_end) break;
      cpu_relax();
    }
    while ((d = done.load(std::memory_order_acquire)) != j) futex::wait(&done, d, false, kForever);
  }
};

struct ThreadHelper {
  Helper* h = nullptr;
  ~ThreadHelper() {
    // In a forked child the helper thread does not exist: the object is left as it is (a few hundred bytes).
    if (h == nullptr || h->pid != getpid()) return;
    h->quit.store(true, std::memory_order_release);
    h->job.fetch_add(1, std::memory_order_release);
    futex::wake(&h->job, 1, false);
    h->thread.join();
    ::close(h->efd);
    delete h;
  }
};
thread_local ThreadHelper t_helper;

// This thread's helper, started on first use; nullptr (and *err) when it cannot be started.
Helper* thread_helper(int* err) noexcept {
  if (t_helper.h != nullptr && t_helper.h->pid == getpid()) return t_helper.h;
  t_helper.h = nullptr;  // a forked child's copy of its parent's helper stays unused
  auto* h = new (std::nothrow) Helper();
  if (h == nullptr) return *err = ENOMEM, nullptr;
  h->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (h->efd < 0) {
    *err = errno;
    delete h;
    return nullptr;
  }
  h->pid = getpid();
  // The helper blocks every signal, so process-directed signals (Ctrl-C) go to threads that handle them.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  try {
    h->thread = std::thread([h] { h->run(); });
  } catch (const std::system_error& e) {
    *err = e.code().value() ? e.code().value() : EAGAIN;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (!h->thread.joinable()) {
    ::close(h->efd);
    delete h;
    return nullptr;
  }
  // Return once the helper runs: a thread still starting may hold its allocator's lock (ASan's does), and a
  // fork() then (a worker started right after prepare()) gives the child that lock held for good.
  while (h->started.load(std::memory_order_acquire) == 0) futex::wait(&h->started, 0, false, kForever);
  return t_helper.h = h;
}

}  // namespace

bool available() noexcept { return futex::wait_many_supported(); }

int prepare() noexcept {
  int err = 0;
  return thread_helper(&err) != nullptr ? 0 : err;
}

int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  if (n_futexes < 1 || n_futexes > kMaxFutexes || n_fds < 0) return EINVAL;
  int err = 0;
  Helper* h = thread_helper(&err);
  if (h == nullptr) return err;

  std::copy(futexes, futexes + n_futexes, h->entries);
  const uint32_t stop_seen = h->stop.load(std::memory_order_relaxed);
  h->entries[n_futexes] = futex::WaitEntry{&h->stop, stop_seen, false};
  h->n.store(n_futexes + 1, std::memory_order_relaxed);
  const uint32_t j = h->job.fetch_add(1, std::memory_order_release) + 1;
  futex::wake(&h->job, 1, false);

  fds[n_fds] = pollfd{h->efd, POLLIN, 0};
  timespec ts;
  const timespec* tp = nullptr;
  if (deadline_ns != kForever) {
    int64_t left = std::max<int64_t>(0, deadline_ns - now_ns());
    ts = timespec{time_t(left / 1'000'000'000), long(left % 1'000'000'000)};
    tp = &ts;
  }
  const int rc = ::ppoll(fds, nfds_t(n_fds + 1), tp, nullptr);
  const int poll_err = rc < 0 ? errno : 0;
  const bool helper_fired = rc > 0 && (fds[n_fds].revents & POLLIN) != 0;

  // End the helper's job: a doorbell that woke us already ended it; otherwise stop its futex_waitv.
  if (h->done.load(std::memory_order_acquire) != j) {
    if (!helper_fired) {
      h->stop.fetch_add(1, std::memory_order_release);
      futex::wake(&h->stop, 1, false);
    }
    h->wait_idle(j);
  }
  uint64_t drained;
  [[maybe_unused]] ssize_t r = ::read(h->efd, &drained, sizeof drained);  // EAGAIN when it was not written

  if (rc > 0) return 0;
  if (rc == 0) return ETIMEDOUT;
  return poll_err;
}

}  // namespace hotloop::waker_thread
