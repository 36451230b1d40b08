#include "hotloop/wait_any.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/fd_source.h"
#include "hotloop/futex.h"
#include "hotloop/nvtx.h"

namespace hotloop {
namespace {

constexpr int64_t kFdRecheckNs = 100'000'000;

// The sources of one wait, split by kind.
struct SourceSet {
  Source* const* src = nullptr;
  int n_bells = 0;
  int n_fds = 0;
  Doorbell* bells[kMaxSources];
  uint8_t bell_index[kMaxSources];
  uint8_t fd_index[kMaxSources];
  pollfd fds[kMaxSources + 1];  // + the eventfd of a park

  SourceSet(Source* const* s, size_t n) : src(s) {
    for (size_t i = 0; i < n; ++i) {
      if (s[i] == nullptr) throw std::invalid_argument("wait_any: source " + std::to_string(i) + " is null");
      int fd = s[i]->fd();
      if (fd >= 0) {
        fd_index[n_fds] = uint8_t(i);
        fds[n_fds++] = pollfd{fd, POLLIN, 0};
      } else {
        Doorbell* b = s[i]->doorbell();
        if (b == nullptr) {
          throw std::invalid_argument("wait_any: source " + std::to_string(i) +
                                      " has neither a doorbell nor a file descriptor");
        }
        bell_index[n_bells] = uint8_t(i);
        bells[n_bells++] = b;
      }
    }
  }

  uint64_t check_bells() const noexcept {
    uint64_t mask = 0;
    for (int i = 0; i < n_bells; ++i) {
      if (src[bell_index[i]]->ready()) mask |= uint64_t(1) << bell_index[i];
    }
    return mask;
  }

  // Reads the revents of fds[0..n_fds) after a poll.
  uint64_t fd_results() const {
    uint64_t mask = 0;
    for (int i = 0; i < n_fds; ++i) {
      short r = fds[i].revents;
      if (r & POLLNVAL) {
        throw SourceError("file descriptor " + std::to_string(fds[i].fd) +
                          " was closed while waited on; stop waiting on a socket before closing it");
      }
      if (r & (POLLIN | POLLHUP | POLLERR)) mask |= uint64_t(1) << fd_index[i];
    }
    return mask;
  }

  uint64_t check_fds() {
    if (n_fds == 0) return 0;
    int rc;
    do rc = ::poll(fds, nfds_t(n_fds), 0);
    while (rc < 0 && errno == EINTR);
    return rc > 0 ? fd_results() : 0;
  }

  uint64_t check_all() { return check_bells() | check_fds(); }

  void check_fds_still_open() const {
    for (int i = 0; i < n_fds; ++i) {
      // FdSource remembers its file; other descriptor sources only get the closed check from poll.
      if (auto* f = dynamic_cast<const FdSource*>(src[fd_index[i]])) f->check_still_open();
    }
  }
};

// Undoes a park's announcements (and eventfd registration) however the park ends.
struct ParkGuard {
  SourceSet& set;
  int efd = -1;
  int announced = 0;
  ~ParkGuard() {
    for (int i = 0; i < announced; ++i) {
      set.bells[i]->retract();
      if (efd >= 0) set.bells[i]->unwatch(efd);
    }
    if (efd >= 0) ::close(efd);
  }
};

timespec relative_timespec(int64_t deadline_ns) {
  int64_t left = std::max<int64_t>(0, deadline_ns - now_ns());
  return timespec{time_t(left / 1'000'000'000), long(left % 1'000'000'000)};
}

// One kernel sleep until `until` (or a ring / readable descriptor / signal). Returns the ready mask after it.
uint64_t park_once(SourceSet& set, int64_t until) {
  ParkGuard guard{set};
  uint32_t seen[kMaxSources];
  if (set.n_fds > 0 && set.n_bells > 0) {
    guard.efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (guard.efd < 0) throw SourceError(std::string("wait_any: eventfd failed: ") + std::strerror(errno));
  }
  for (int i = 0; i < set.n_bells; ++i) {
    if (guard.efd >= 0) set.bells[i]->watch(guard.efd);
    set.bells[i]->announce();
    guard.announced = i + 1;
    seen[i] = set.bells[i]->sequence();
  }
  // Re-check after announcing: a ring that came before the announcement is seen here.
  if (uint64_t mask = set.check_all()) return mask;

  if (set.n_fds == 0) {
    if (set.n_bells == 1) {
      set.bells[0]->park(seen[0], until);
    } else if (futex::wait_many_supported()) {
      futex::WaitEntry entries[kMaxSources];
      for (int i = 0; i < set.n_bells; ++i) {
        entries[i] = {set.bells[i]->word(), seen[i], set.bells[i]->process_shared()};
      }
      futex::wait_many(entries, set.n_bells, until);
    } else {
      // Kernels before 5.16 cannot sleep on several futexes: sleep on the first in 1 ms slices.
      set.bells[0]->park(seen[0], std::min(until, now_ns() + 1'000'000));
    }
    return set.check_bells();
  }

  int nfds = set.n_fds;
  if (guard.efd >= 0) set.fds[nfds++] = pollfd{guard.efd, POLLIN, 0};
  timespec ts;
  const timespec* tp = nullptr;
  if (until != kForever) {
    ts = relative_timespec(until);
    tp = &ts;
  }
  int rc = ::ppoll(set.fds, nfds_t(nfds), tp, nullptr);
  uint64_t mask = set.check_bells();
  if (rc > 0) mask |= set.fd_results();
  return mask;
}

}  // namespace

uint64_t ready_mask(Source* const* sources, size_t n) {
  if (n > kMaxSources) throw std::invalid_argument("wait_any: at most 64 sources");
  SourceSet set(sources, n);
  return set.check_all();
}

uint64_t wait_any(Source* const* sources, size_t n, int64_t timeout_ns, WaitPolicy& policy,
                  const WaitHooks* hooks, WaitStats* stats) {
  if (n > kMaxSources) {
    throw std::invalid_argument("wait_any: at most 64 sources, got " + std::to_string(n));
  }
  if (n == 0 && timeout_ns < 0) {
    throw std::invalid_argument("wait_any: no sources and no timeout would wait forever");
  }
  WaitStats local;
  WaitStats& st = stats ? *stats : local;
  st = WaitStats{};
  SourceSet set(sources, n);

  if (uint64_t mask = set.check_all()) return mask;
  if (timeout_ns == 0) return 0;

  const int64_t start = now_ns();
  const int64_t deadline = timeout_ns < 0 || timeout_ns > kForever - start ? kForever : start + timeout_ns;
  const WaitBudgets budgets = policy.budgets();
  const int64_t fd_check = policy.fd_check_ns();
  auto finish = [&](uint64_t mask) {
    if (policy.adaptive()) policy.record(now_ns() - start);
    return mask;
  };

  nvtx::Scope wait_range(nvtx::Range::kWait);
  nvtx::Scope spin_range(nvtx::Range::kSpin);

  // Spin: check the doorbell sources every iteration, the clock every 8, descriptors at a bounded rate.
  st.phase = WaitPhase::kSpin;
  const int64_t spin_end = std::min(deadline, start + budgets.spin_ns);
  int64_t next_fd_check = start + fd_check;
  for (uint64_t i = 1; budgets.spin_ns > 0; ++i) {
    if (uint64_t mask = set.check_bells()) return st.spins = i, finish(mask);
    cpu_relax();
    if ((i & 7) == 0) {
      int64_t t = now_ns();
      if (set.n_fds > 0 && t >= next_fd_check) {
        if (uint64_t mask = set.check_fds()) return st.spins = i, finish(mask);
        next_fd_check = t + fd_check;
      }
      if (t >= spin_end) {
        st.spins = i;
        break;
      }
    }
  }

  // Yield: let other threads on this core run between checks.
  st.phase = WaitPhase::kYield;
  const int64_t yield_end = std::min(deadline, spin_end + budgets.yield_ns);
  for (int64_t t = now_ns(); t < yield_end; t = now_ns()) {
    if (uint64_t mask = set.check_bells()) return finish(mask);
    if (set.n_fds > 0 && t >= next_fd_check) {
      if (uint64_t mask = set.check_fds()) return finish(mask);
      next_fd_check = t + fd_check;
    }
    sched_yield();
    ++st.yields;
  }

  // Park: sleep in the kernel until a ring, a readable descriptor, the deadline or the end of a slice.
  spin_range.end();
  nvtx::Scope park_range(nvtx::Range::kPark);
  st.phase = WaitPhase::kPark;
  // A descriptor closed while the kernel watches it does not wake ppoll, so waits on descriptors re-validate
  // them at least every 100 ms (a few us of CPU per second: not a poll of the data, which wakes at once).
  int64_t slice = hooks ? hooks->slice_ns : 0;
  if (set.n_fds > 0) slice = slice > 0 ? std::min(slice, kFdRecheckNs) : kFdRecheckNs;
  for (;;) {
    int64_t t = now_ns();
    if (t >= deadline) {
      policy.record(timeout_ns);
      return set.check_all();
    }
    int64_t until = slice > 0 ? std::min(deadline, t + slice) : deadline;
    ++st.parks;
    if (uint64_t mask = park_once(set, until)) return finish(mask);
    set.check_fds_still_open();
    if (hooks && hooks->on_slice) hooks->on_slice(hooks->ctx);
  }
}

}  // namespace hotloop
