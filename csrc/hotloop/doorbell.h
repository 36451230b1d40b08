// Doorbell: "something changed, look again", as one cache line that can live in process or shared memory.
//
// Roles. Producers publish their data (with release stores or under their own lock), then ring().
// A waiter that found nothing to do parks without missing a ring:
//   announce();                        // 1. count myself as parked (seq_cst)
//   uint32_t seen = sequence();        // 2. the value to sleep on
//   if (my sources are ready) { retract(); return; }   // 3. re-check after announcing
//   park(seen, deadline);              // 4. sleeps only while the word still equals `seen`
//   retract();
// A ring that lands before step 2 is visible to the re-check in step 3; one after step 2 changes the word,
// so the futex call returns at once or is woken (ring() sees parked() > 0). Hence no lost wake-up.
//
// Cost. ring() is one atomic increment plus one load when nobody is parked: no system call. With parked
// waiters it adds one futex wake, and one eventfd write per waiter that watches the doorbell through an
// eventfd (a waiter that also watches file descriptors sleeps in ppoll, not on the futex).
//
// Metrics. A ring that finds a waiter parked stamps its time (rung_ns(); it makes a system call then anyway),
// so the woken waiter can measure ring -> running again; a ring on the fast path reads no clock.
//
// Ordering (reviewed for weakly ordered CPUs, aarch64; C++ seq_cst maps there to LDAR / STLR / LDADDAL, which
// ARMv8 keeps in order among themselves, so no explicit fence is needed):
//   - ring(): the sequence increment is a seq_cst read-modify-write. It releases what the producer stored before
//     it (plain or relaxed stores are fine), so a waiter whose sequence() reads the new value sees the data; and
//     with the seq_cst load of parked_ after it, it is one side of a Dekker pair whose other side is the waiter's
//     announce() (seq_cst RMW) then sequence() (seq_cst load): either the ring sees parked_ > 0 and wakes, or
//     the waiter's sequence() reads the new value and its futex call returns at once.
//   - ring_if_parked(): no increment, so the pair is the producer's seq_cst store of its data then the seq_cst
//     load of parked_, against announce() then a seq_cst load of that data in the waiter's ready(). A ready()
//     that reads with acquire only (LDAPR on ARMv8.3+ may be satisfied before the announce is visible) can lose
//     the wake-up: ShmRing's two sources read with seq_cst for this reason (shm_ring.h, "Ordering").
//   - watchers_: watch() increments it (seq_cst) before announce(); a ring that sees the announce reads it
//     (seq_cst) after parked_, so it sees the watcher and writes its eventfd.
//   - park()/wake: the kernel checks the word under its hash-bucket lock after queueing the waiter, and
//     futex_wake issues a full barrier before it looks for waiters (futex.h): nothing more is needed here.
//   - rung_ns_ is relaxed: a metric, carried to the woken waiter by the futex wake; a stale value mismeasures
//     one wake-up, nothing else. retract() is release: a late retract costs a producer one needless wake.
//
// Placement. Trivially constructible and exactly one cache line, so it can sit inside a shared-memory
// segment (construct with process_shared = true; the futex is then process-shared). Eventfd watchers are a
// process-local registry: only rings from the same process reach them.
#pragma once

#include <atomic>
#include <cstdint>

#include "hotloop/clock.h"

namespace hotloop {

class alignas(kCacheLine) Doorbell {
 public:
  explicit Doorbell(bool process_shared = false) noexcept : shared_(process_shared ? 1u : 0u) {}
  Doorbell(const Doorbell&) = delete;
  Doorbell& operator=(const Doorbell&) = delete;

  // Producer side: call after publishing the data the waiter will look at.
  void ring() noexcept {
    seq_.fetch_add(1, std::memory_order_seq_cst);
    if (parked_.load(std::memory_order_seq_cst) != 0) wake_parked();
  }

  // Producer side, cheaper: rings only when a waiter has announced itself. Correct only if the producer
  // published with a seq_cst store (then the waiter's announce and the producer's store are ordered, and one
  // of them sees the other); saves the shared increment while nobody waits.
  void ring_if_parked() noexcept {
    if (parked_.load(std::memory_order_seq_cst) != 0) {
      seq_.fetch_add(1, std::memory_order_seq_cst);
      wake_parked();
    }
  }

  // Waiter side (see the protocol above).
  uint32_t sequence() const noexcept { return seq_.load(std::memory_order_seq_cst); }
  void announce() noexcept { parked_.fetch_add(1, std::memory_order_seq_cst); }
  void retract() noexcept { parked_.fetch_sub(1, std::memory_order_release); }
  // Sleeps while the sequence equals `seen`, until a ring, the deadline, or a signal. Returns futex::wait's code.
  int park(uint32_t seen, int64_t deadline_ns) noexcept;

  // An eventfd to write to on every ring while registered (for waiters that sleep in ppoll). Register before
  // announce(), unregister after retract().
  void watch(int eventfd) noexcept;
  void unwatch(int eventfd) noexcept;

  uint32_t parked() const noexcept { return parked_.load(std::memory_order_relaxed); }
  // CLOCK_MONOTONIC time of the last ring that found a waiter parked (0: none yet).
  int64_t rung_ns() const noexcept { return rung_ns_.load(std::memory_order_relaxed); }
  bool process_shared() const noexcept { return shared_ != 0; }
  const std::atomic<uint32_t>* word() const noexcept { return &seq_; }

 private:
  void wake_parked() noexcept;

  std::atomic<uint32_t> seq_{0};
  std::atomic<uint32_t> parked_{0};
  std::atomic<uint32_t> watchers_{0};
  uint32_t shared_;
  std::atomic<int64_t> rung_ns_{0};
};

static_assert(sizeof(Doorbell) == kCacheLine, "a Doorbell is exactly one cache line");

}  // namespace hotloop
