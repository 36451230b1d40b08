#include "hotloop/wait_any.h"

#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/fd_source.h"
#include "hotloop/futex.h"
#include "hotloop/nvtx.h"
#include "hotloop/uring_park.h"
#include "hotloop/waker_thread.h"

namespace hotloop {
namespace {

// Sliced mixed waits (kernels without futex_waitv): a ring from another process does not reach the eventfd,
// so such parks end every 100 ms to look again; 100 ms bounds that latency at a few us of CPU per second.
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

  // Whether a descriptor reported data, hang-up or error (POLLNVAL aside) after a sleep.
  bool any_fd_event() const {
    for (int i = 0; i < n_fds; ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) return true;
    }
    return false;
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

// ---- the park backend for waits over doorbells and descriptors together ----

constexpr const char* kBackendNames[] = {"io_uring", "futex_waitv helper", "sliced"};

struct BackendChoice {
  std::mutex mu;
  std::atomic<int> backend{-1};  // a ParkBackend, -1 until chosen
  std::string reason;
};

BackendChoice& backend_choice() {
  static BackendChoice* c = new BackendChoice();  // leaked on purpose: usable during static destruction
  return *c;
}

// Picks the best backend at or after `want`, noting why each better one was passed over. `asked_by` names
// who asked for less than the best ("HOTLOOP_PARK=fallback").
ParkBackendInfo choose(ParkBackend want, std::string reason, const std::string& asked_by) {
  auto note = [&](const std::string& why) { reason += (reason.empty() ? "" : "; ") + why; };
  ParkBackend b = want;
  if (b == ParkBackend::kIoUring && !uring_park::available()) {
    note(std::string("io_uring unavailable: ") + uring_park::unavailable_reason());
    b = ParkBackend::kWakerThread;
  } else if (want != ParkBackend::kIoUring) {
    note("requested by " + asked_by);
  }
  if (b == ParkBackend::kWakerThread && !waker_thread::available()) {
    note("futex_waitv unavailable (needs Linux >= 5.16): a ring from another process is noticed within 100 ms");
    b = ParkBackend::kSliced;
  }
  BackendChoice& c = backend_choice();
  std::lock_guard<std::mutex> lock(c.mu);
  c.reason = reason;
  c.backend.store(int(b), std::memory_order_release);
  return ParkBackendInfo{b, kBackendNames[int(b)], reason};
}

ParkBackend parse_backend(const std::string& request) {
  if (request.empty() || request == "auto" || request == "uring" || request == "io_uring") {
    return ParkBackend::kIoUring;
  }
  if (request == "fallback" || request == "futex_waitv" || request == "helper") return ParkBackend::kWakerThread;
  if (request == "sliced") return ParkBackend::kSliced;
  throw std::invalid_argument("unknown park backend '" + request +
                              "': choose auto, uring, fallback (futex_waitv helper) or sliced");
}

ParkBackend current_backend() {
  int b = backend_choice().backend.load(std::memory_order_acquire);
  if (b >= 0) return ParkBackend(b);
  static std::once_flag once;
  std::call_once(once, [] {
    if (backend_choice().backend.load(std::memory_order_acquire) >= 0) return;  // set_park_backend came first
    const char* env = std::getenv("HOTLOOP_PARK");
    std::string request = env ? env : "auto";
    try {
      choose(parse_backend(request), "", "HOTLOOP_PARK=" + request);
    } catch (const std::invalid_argument&) {
      choose(ParkBackend::kIoUring, "HOTLOOP_PARK='" + request + "' is not auto, uring, fallback or sliced", "");
    }
  });
  return ParkBackend(backend_choice().backend.load(std::memory_order_acquire));
}

// Sleeps on doorbells and descriptors together through `backend`; fills the descriptors' revents. Returns
// whether the sleep ran to `until`; throws SourceError when the backend fails.
bool park_mixed(SourceSet& set, const uint32_t* seen, int64_t until, ParkBackend backend) {
  futex::WaitEntry entries[kMaxSources];
  for (int i = 0; i < set.n_bells; ++i) {
    entries[i] = {set.bells[i]->word(), seen[i], set.bells[i]->process_shared()};
  }
  int rc;
  if (backend == ParkBackend::kIoUring) {
    rc = uring_park::park(entries, set.n_bells, set.fds, set.n_fds, until);
  } else {
    rc = waker_thread::park(entries, set.n_bells, set.fds, set.n_fds, until);
  }
  if (rc != 0 && rc != ETIMEDOUT && rc != EINTR) {
    throw SourceError(std::string("wait_any: the ") + kBackendNames[int(backend)] +
                      " park failed: " + std::strerror(rc) +
                      " (set HOTLOOP_PARK=sliced to work around it, and report it with `hotloop info`)");
  }
  return rc == ETIMEDOUT;
}

// A sleep on doorbells only, announced with sequences seen[]: futex_wait (one), futex_waitv (several).
void park_bells(SourceSet& set, const uint32_t* seen, int64_t until) {
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
}

// A ppoll over the descriptors, plus `efd` (>= 0: the eventfd a sliced mixed park's doorbells write to); clears
// the descriptors' revents unless one had an event. Returns whether it ran to `until`.
bool park_ppoll(SourceSet& set, int efd, int64_t until) {
  int nfds = set.n_fds;
  if (efd >= 0) set.fds[nfds++] = pollfd{efd, POLLIN, 0};
  timespec ts;
  const timespec* tp = nullptr;
  if (until != kForever) {
    ts = relative_timespec(until);
    tp = &ts;
  }
  int rc = ::ppoll(set.fds, nfds_t(nfds), tp, nullptr);
  if (rc <= 0) {
    for (int i = 0; i < set.n_fds; ++i) set.fds[i].revents = 0;
  }
  return rc == 0;
}

// One kernel sleep until `until` (or a ring / readable descriptor / signal). Returns the ready mask after it.
// A sleep over descriptors that ran to `until` without an event increments *timer_wakeups (when given).
uint64_t park_once(SourceSet& set, int64_t until, uint64_t* timer_wakeups) {
  ParkGuard guard{set};
  uint32_t seen[kMaxSources];
  const bool mixed = set.n_fds > 0 && set.n_bells > 0;
  const ParkBackend backend = mixed ? current_backend() : ParkBackend::kSliced;
  if (mixed && backend == ParkBackend::kSliced) {
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

  if (set.n_fds == 0 && set.n_bells > 0) {
    park_bells(set, seen, until);
    return set.check_bells();
  }
  // Descriptors, or no source at all (a wait that is only a timeout): ppoll, over nothing in the latter case, so
  // the sleep still ends at `until` or on a signal (there is no doorbell to sleep on, and futex_waitv refuses an
  // empty list).
  for (int i = 0; i < set.n_fds; ++i) set.fds[i].revents = 0;
  bool timer = mixed && backend != ParkBackend::kSliced ? park_mixed(set, seen, until, backend)
                                                         : park_ppoll(set, guard.efd, until);
  // A descriptor closed during the sleep reads POLLNVAL when the sleep ends, however it ended.
  if (!timer && !set.any_fd_event() && now_ns() >= until) timer = true;
  if (timer && timer_wakeups != nullptr) ++*timer_wakeups;
  return set.check_bells() | set.fd_results();
}

// The wake-up latency of a park that `mask` ended: from the latest ring of a ready doorbell during the park (the
// one that woke it, or a later one), when it rang after park_start.
void note_ring_latency(const SourceSet& set, uint64_t mask, int64_t park_start, int64_t woke, WaitStats& st) {
  int64_t rung = 0;
  for (int i = 0; i < set.n_bells; ++i) {
    if (mask & (uint64_t(1) << set.bell_index[i])) rung = std::max(rung, set.bells[i]->rung_ns());
  }
  if (rung >= park_start) st.wake_latency_ns = woke - rung;
}

// The end of a paced wait that found a source ready at `now`: feeds the interval estimate (the ready time: the
// source's own, the ring's stamp, or now) and counts how a predicted wait ended.
void paced_end(WaitPolicy& policy, const PacedPlan& plan, bool early, const WaitStats& st, int64_t now) {
  policy.observe_ready(st.wake_latency_ns >= 0 ? now - st.wake_latency_ns : now);
  if (!plan.predicted) return;
  policy.count_paced(early                           ? PacedOutcome::kEarly
                     : st.phase == WaitPhase::kSpin ? PacedOutcome::kHit
                                                    : PacedOutcome::kLate);
}

// A paced park's timer should fire when asked, not up to the default 50 us slack later (wait_policy.h).
void precise_timer_slack() noexcept {
  thread_local bool set = false;
  if (set) return;
  set = true;
  ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(WaitPolicy::kPacedTimerSlackNs), 0, 0, 0);
}

// One wait that found nothing ready at once: what its phases (paced pre-park, spin, yield, park) share. Each phase
// returns the ready mask that ended it, or 0 when it ran out and the next phase follows.
struct WaitRun {
  SourceSet& set;
  WaitPolicy& policy;
  const WaitHooks* hooks;
  WaitStats& st;
  const int64_t start;
  const int64_t deadline;
  const int64_t fd_check;  // descriptors are polled at most this often while spinning and yielding
  const PacedPlan plan;
  bool early = false;         // a ring ended the paced pre-park
  int64_t next_fd_check = 0;  // when the spin and yield phases poll the descriptors next

  // The end of a park that starts at t: the deadline `end`, or sooner the end of the hook's slice.
  int64_t slice_end(int64_t t, int64_t end) const noexcept {
    const int64_t hook_slice = hooks ? hooks->slice_ns : 0;
    return hook_slice > 0 ? std::min(end, t + hook_slice) : end;
  }

  // After a park that ended with nothing ready: re-validate the descriptors, then run the slice hook (which may
  // throw to abort the wait).
  void after_empty_park(bool run_hook) {
    set.check_fds_still_open();
    if (run_hook && hooks && hooks->on_slice) hooks->on_slice(hooks->ctx);
  }

  uint64_t finish(uint64_t mask, int64_t now);
  uint64_t paced_prepark(int64_t wake_ns, int64_t* woke);
  uint64_t paced_start(WaitBudgets& budgets, int64_t* spin_start);
  uint64_t spin(int64_t spin_start, int64_t spin_ns, int64_t spin_end);
  uint64_t yield(int64_t yield_end, int64_t* yield_stop);
  uint64_t park(int64_t park_start, int64_t timeout_ns);
};

// Ends a wait that found `mask` ready; `now` is the time if already read (-1: not read since the last check).
uint64_t WaitRun::finish(uint64_t mask, int64_t now) {
  for (uint64_t m = mask; m != 0; m &= m - 1) {
    Source* s = set.src[__builtin_ctzll(m)];
    if (!s->keeps_ready_time()) continue;
    int64_t since = s->ready_since_ns();
    if (since < start) continue;  // keeps no time (-1), or was ready before this wait began
    if (now < 0) now = now_ns();
    st.wake_latency_ns = now - since;
    s->count_wake_latency(st.wake_latency_ns);
  }
  if (policy.adaptive()) policy.record((now < 0 ? now_ns() : now) - start);
  if (policy.paced()) paced_end(policy, plan, early, st, now < 0 ? now_ns() : now);
  record_wait(st);
  return mask;
}

// The paced pre-park (wait_policy.h, "Paced mode"): a timed sleep until the predicted wake point, which a ring
// or readable descriptor ends early; the caller's deadline wins. The park phase's loop without its safety bound
// (the pre-park is short). Returns the ready mask when a source ended it ("early"), else 0; *woke: when it woke.
uint64_t WaitRun::paced_prepark(int64_t wake_ns, int64_t* woke) {
  precise_timer_slack();
  const int64_t end = std::min(wake_ns, deadline);
  const int64_t t0 = now_ns();
  int64_t t = t0;
  while (t < end) {
    ++st.parks;
    uint64_t mask = park_once(set, slice_end(t, end), nullptr);
    t = now_ns();
    if (mask != 0) {
      st.phase_ns[2] += uint64_t(t - t0);
      note_ring_latency(set, mask, t0, t, st);
      *woke = t;
      return mask;
    }
    after_empty_park(t < end);
  }
  if (wake_ns <= deadline) policy.record_timer_lateness(t - wake_ns);
  st.phase_ns[2] += uint64_t(t - t0);
  *woke = t;
  return 0;
}

// The start of a predicted wait: the timed pre-park when the wake point is far enough ahead, then the spin window
// (budgets.spin_ns from *spin_start). Returns the ready mask when a source ended the pre-park ("early"), else 0.
uint64_t WaitRun::paced_start(WaitBudgets& budgets, int64_t* spin_start) {
  policy.count_predicted();
  if (plan.wake_ns - *spin_start > WaitPolicy::kPacedMinParkNs) {
    st.phase = WaitPhase::kPark;
    st.end = WaitEnd::kPark;
    if (uint64_t mask = paced_prepark(plan.wake_ns, spin_start)) return mask;
  }
  budgets.spin_ns = std::max<int64_t>(plan.spin_end_ns - *spin_start, 0);
  return 0;
}

// Spin: check the doorbell sources every iteration, the clock every 8, descriptors at a bounded rate, until
// spin_end (no iteration when spin_ns is 0).
uint64_t WaitRun::spin(int64_t spin_start, int64_t spin_ns, int64_t spin_end) {
  st.phase = WaitPhase::kSpin;
  st.end = WaitEnd::kSpin;
  next_fd_check = spin_start + fd_check;
  int64_t t = spin_start;  // the last clock read
  int64_t next_yield = plan.predicted ? spin_start + WaitPolicy::kPacedYieldEveryNs : kForever;
  uint64_t mask = 0;
  for (uint64_t i = 1; spin_ns > 0; ++i) {
    if ((mask = set.check_bells()) != 0) {
      st.spins = i;
      break;
    }
    cpu_relax();
    if ((i & 7) == 0) {
      t = now_ns();
      if (set.n_fds > 0 && t >= next_fd_check) {
        if ((mask = set.check_fds()) != 0) {
          st.spins = i;
          break;
        }
        next_fd_check = t + fd_check;
      }
      if (t >= spin_end) {
        st.spins = i;
        break;
      }
      if (t >= next_yield) {  // paced: let a writer woken onto this core run (wait_policy.h)
        sched_yield();
        next_yield = t + WaitPolicy::kPacedYieldEveryNs;
      }
    }
  }
  st.phase_ns[0] = uint64_t(t - spin_start);
  return mask;
}

// Yield: let other threads on this core run between checks, until yield_end. *yield_stop: the last clock read.
uint64_t WaitRun::yield(int64_t yield_end, int64_t* yield_stop) {
  st.phase = WaitPhase::kYield;
  st.end = WaitEnd::kYield;
  int64_t t = now_ns();
  const int64_t yield_start = t;
  uint64_t mask = 0;
  for (; t < yield_end; t = now_ns()) {
    mask = set.check_bells();
    if (mask == 0 && set.n_fds > 0 && t >= next_fd_check) {
      mask = set.check_fds();
      next_fd_check = t + fd_check;
    }
    if (mask != 0) break;
    sched_yield();
    ++st.yields;
  }
  st.phase_ns[1] = uint64_t(t - yield_start);
  *yield_stop = t;
  return mask;
}

// Park: sleep in the kernel until a ring, a readable descriptor, the deadline or the end of a slice. Ends the wait:
// returns its result (0: the deadline passed with nothing ready).
uint64_t WaitRun::park(int64_t park_start, int64_t timeout_ns) {
  st.phase = WaitPhase::kPark;
  st.end = WaitEnd::kPark;
  // A descriptor closed while the kernel watches it wakes nothing: parks over descriptors end at least every
  // kFdSafetyNs to re-validate them (kFdRecheckNs for sliced mixed waits, which also notice rings from other
  // processes that way). Those timer wake-ups are counted; events never wait for them.
  int64_t safety = 0;
  if (set.n_fds > 0) {
    safety = set.n_bells > 0 && current_backend() == ParkBackend::kSliced ? kFdRecheckNs : kFdSafetyNs;
  }
  for (;;) {
    const int64_t t = now_ns();
    if (t >= deadline) {
      policy.record(timeout_ns);
      st.phase_ns[2] += uint64_t(t - park_start);
      uint64_t mask = set.check_all();
      if (mask == 0) st.end = WaitEnd::kTimeout;
      record_wait(st);
      return mask;
    }
    int64_t until = slice_end(t, deadline);
    const bool safety_bound = safety > 0 && t + safety < until;
    if (safety_bound) until = t + safety;
    ++st.parks;
    if (uint64_t mask = park_once(set, until, safety_bound ? &st.safety_wakeups : nullptr)) {
      const int64_t woke = now_ns();
      st.phase_ns[2] += uint64_t(woke - park_start);
      note_ring_latency(set, mask, t, woke, st);
      return finish(mask, woke);
    }
    after_empty_park(true);
  }
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

  if (uint64_t mask = set.check_all()) {
    if (policy.paced()) policy.observe_ready_unknown();
    return record_wait_end(WaitEnd::kImmediate), mask;
  }
  if (timeout_ns == 0) {
    st.end = WaitEnd::kTimeout;
    return record_wait_end(WaitEnd::kTimeout), 0;
  }

  const int64_t start = now_ns();
  const int64_t deadline = timeout_ns < 0 || timeout_ns > kForever - start ? kForever : start + timeout_ns;
  WaitRun w{set, policy, hooks, st, start, deadline, policy.fd_check_ns(),
            policy.paced() ? policy.plan(start) : PacedPlan{}};
  WaitBudgets budgets = policy.budgets();

  nvtx::Scope wait_range(nvtx::Range::kWait);
  nvtx::Scope spin_range(nvtx::Range::kSpin);

  // Paced: park on a timer until shortly before the predicted ready, then spin through it (wait_policy.h).
  int64_t spin_start = start;
  if (w.plan.predicted) {
    if (uint64_t mask = w.paced_start(budgets, &spin_start)) {
      w.early = true;
      return w.finish(mask, spin_start);
    }
  }
  const int64_t spin_end = std::min(deadline, spin_start + budgets.spin_ns);
  if (uint64_t mask = w.spin(spin_start, budgets.spin_ns, spin_end)) return w.finish(mask, -1);
  int64_t park_start;
  if (uint64_t mask = w.yield(std::min(deadline, spin_end + budgets.yield_ns), &park_start)) {
    return w.finish(mask, -1);
  }
  spin_range.end();
  nvtx::Scope park_range(nvtx::Range::kPark);
  return w.park(park_start, timeout_ns);
}

ParkBackendInfo park_backend() {
  ParkBackend b = current_backend();
  BackendChoice& c = backend_choice();
  std::lock_guard<std::mutex> lock(c.mu);
  return ParkBackendInfo{b, kBackendNames[int(b)], c.reason};
}

void prepare_park() {
  ParkBackend b = current_backend();
  int err = b == ParkBackend::kIoUring        ? uring_park::prepare()
            : b == ParkBackend::kWakerThread ? waker_thread::prepare()
                                             : 0;
  if (err != 0) {
    throw SourceError(std::string("wait_any: cannot set up the ") + kBackendNames[int(b)] + " park: " +
                      std::strerror(err));
  }
}

ParkBackendInfo set_park_backend(const std::string& request) {
  return choose(parse_backend(request), "", "set_park_backend('" + request + "')");
}

}  // namespace hotloop
