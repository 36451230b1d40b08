#include "hotloop/waker_thread.h"

#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <system_error>
#include <thread>

#include "hotloop/clock.h"
#include "hotloop/fd_watch.h"

namespace hotloop::waker_thread {
namespace {

// A waiting thread's helper: while armed, it sleeps in poll() on the thread's fd_watch; when that becomes
// readable it bumps `word` (the waiter's futex_waitv holds it) and wakes it, and is idle until armed again.
struct Helper {
  std::atomic<uint32_t> word{0};     // bumped when the watch became readable; the waiter sleeps on it
  std::atomic<uint32_t> armed{0};    // bumped by the waiter to arm the helper (or make it quit)
  std::atomic<uint32_t> fired{0};    // set to `armed` by the helper when that arming has fired
  std::atomic<uint32_t> started{0};  // set by the helper once it runs: its start-up (allocations included) is over
  std::atomic<bool> quit{false};
  int watch_fd = -1;  // the waiting thread's fd_watch; set before the first arming
  int quit_fd = -1;   // an eventfd written to end the helper's poll when the thread exits
  pid_t pid = 0;
  std::thread thread;

  void run() noexcept {
    started.store(1, std::memory_order_release);
    futex::wake(&started, 1, false);
    uint32_t seen = 0;
    for (;;) {
      const uint32_t a = armed.load(std::memory_order_acquire);
      if (a == seen) {
        futex::wait(&armed, seen, false, kForever);
        continue;
      }
      seen = a;
      if (quit.load(std::memory_order_acquire)) return;
      pollfd p[2] = {{watch_fd, POLLIN, 0}, {quit_fd, POLLIN, 0}};
      int rc;
      do rc = ::poll(p, 2, -1);
      while (rc < 0 && errno == EINTR);
      if (quit.load(std::memory_order_acquire)) return;
      fired.store(a, std::memory_order_release);
      word.fetch_add(1, std::memory_order_release);
      futex::wake(&word, 1, false);
    }
  }
};

struct ThreadHelper {
  Helper* h = nullptr;
  ~ThreadHelper() {
    // In a forked child the helper thread does not exist: the object is left as it is (a few hundred bytes).
    if (h == nullptr || h->pid != getpid()) return;
    h->quit.store(true, std::memory_order_release);
    h->armed.fetch_add(1, std::memory_order_release);
    futex::wake(&h->armed, 1, false);
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(h->quit_fd, &one, sizeof one);
    h->thread.join();
    ::close(h->quit_fd);
    delete h;
  }
};
thread_local ThreadHelper t_helper;

// Starts this thread's helper and returns once it runs. Sets *interrupted: a signal may have reached the calling
// thread meanwhile, its handler then run (at the mask's restore, or during the wait for the helper), and the park
// must not sleep as if it had not; the caller checks (one spurious wake-up a thread, on its first park). nullptr
// (and *err) when the helper cannot be started.
Helper* start_helper(int* err, bool* interrupted) noexcept {
  auto* h = new (std::nothrow) Helper();
  if (h == nullptr) return *err = ENOMEM, nullptr;
  h->quit_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (h->quit_fd < 0) {
    *err = errno;
    delete h;
    return nullptr;
  }
  h->pid = getpid();
  // The helper blocks every signal, so process-directed signals (Ctrl-C) go to threads that handle them. It
  // inherits the mask it is created under; a signal that comes for this thread meanwhile waits for the restore.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  try {
    h->thread = std::thread([h] { h->run(); });
  } catch (const std::system_error& e) {
    *err = e.code().value() ? e.code().value() : EAGAIN;
  }
  // A signal pending now is handled at the restore; one that comes between a look at the pending set and the
  // restore would be too, unseen (a Ctrl-C then waited out a 500 ms slice, 3 times in 25): so always report one.
  *interrupted = true;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (!h->thread.joinable()) {
    ::close(h->quit_fd);
    delete h;
    return nullptr;
  }
  // Return once the helper runs: a thread still starting may hold its allocator's lock (ASan's does), and a
  // fork() then (a worker started right after prepare()) gives the child that lock held for good. A signal that
  // ends this sleep is noted, not lost: the caller's park returns EINTR instead of sleeping through it.
  while (h->started.load(std::memory_order_acquire) == 0) {
    if (futex::wait(&h->started, 0, false, kForever) == EINTR) *interrupted = true;
  }
  return h;
}

// This thread's helper, started on first use (see start_helper); nullptr (and *err) when it cannot be started.
Helper* thread_helper(int* err, bool* interrupted) noexcept {
  if (t_helper.h != nullptr && t_helper.h->pid == getpid()) return t_helper.h;
  t_helper.h = nullptr;  // a forked child's copy of its parent's helper stays unused
  return t_helper.h = start_helper(err, interrupted);
}

}  // namespace

bool available() noexcept { return futex::wait_many_supported(); }

int prepare() noexcept {
  int err = 0;
  bool interrupted = false;  // not a wait: the signal's handler has run, and its caller sees its effect as usual
  if (thread_helper(&err, &interrupted) == nullptr) return err;
  return fd_watch::this_thread().prepare();
}

int park(const futex::WaitEntry* futexes, int n_futexes, pollfd* fds, int n_fds, int64_t deadline_ns) noexcept {
  if (n_fds <= 0) return EINVAL;
  int err = 0;
  bool interrupted = false;
  Helper* h = thread_helper(&err, &interrupted);
  if (h == nullptr) return err;
  if (interrupted) return EINTR;  // a signal came while the helper started: as if it had ended the sleep
  fd_watch::Watch& watch = fd_watch::this_thread();

  // Read before arming: a firing of the helper from here on changes the word, so futex_waitv cannot sleep
  // through it; one from an earlier arming shows as a change too (a spurious return, re-checked by the caller).
  const uint32_t seen = h->word.load(std::memory_order_acquire);
  bool ready = false;
  if (int e = watch.arm(fds, n_fds, &ready)) return e;
  if (ready) return 0;
  // Arm the helper unless it is still armed from an earlier park (a doorbell ended that one).
  const uint32_t a = h->armed.load(std::memory_order_relaxed);
  if (h->fired.load(std::memory_order_acquire) == a) {
    h->watch_fd = watch.fd();  // read by the helper after the release below
    h->armed.store(a + 1, std::memory_order_release);
    futex::wake(&h->armed, 1, false);
  }
  return watch.sleep(futexes, n_futexes, &h->word, seen, fds, n_fds, deadline_ns);
}

}  // namespace hotloop::waker_thread
