// StepCounter: "step N is done" as a counter that wait_any can wait on. The shared part of every step
// notifier: a mechanism (a host thread for CPU engines, a CUDA stream callback for GPU engines) calls
// complete(n) in step order; engine code asks done(n) (one atomic load), waits for it, or puts until(n) into a
// wait_any together with its other sources.
//
// Tokens. mark() issues the next token and is called by the thread that launches steps (one at a time). A
// token is (this counter's id << 40) | step number (1, 2, ...): tokens from one counter increase, and a token
// from another counter is recognised and refused instead of being read as a step number of this one.
// Roles. complete(n) and fail(n, why) are called by the completion mechanism, in token order, from any thread.
// done/until/settled/error are safe from any thread. Ordering: done(n) implies done(m) for every m < n.
// Failure: fail(n, why) completes n (waiters wake) and records the first error; done(n) then throws StepError
// with that message for every token >= the failed one, so a failed step is never mistaken for a finished one.
// Metrics: complete() stamps its time (one clock read per step, on the completion's own cache line), so a wait
// on until(n) or settled() that a completion ends records completion -> waiter running in wake_latency() (in
// any phase).
// Ordering: complete() stores its time (relaxed), then raises completed_ with a release CAS, then rings (a
// seq_cst increment): done()/ready() load completed_ with acquire, so they see that time (or a later one) and
// whatever the completing thread wrote before. fail() records the error under error_mu_ and stores failed_at_
// (release) before its completion's release CAS; done() loads completed_ (acquire) then failed_at_, so a failed
// step is never seen done without its failure. issued_ is relaxed: mark() is called by the thread that launches
// steps, and a waiter on another thread learns of a token through whatever handed it over (which orders it).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include "hotloop/clock.h"
#include "hotloop/errors.h"
#include "hotloop/source.h"
#include "hotloop/wait_metrics.h"

namespace hotloop {

class StepCounter {
 public:
  // A wait_any source that is ready once step `token` is done (or failed).
  class Until final : public Source {
   public:
    Until(StepCounter& counter, uint64_t token) : Source(true), counter_(counter), token_(token) {}
    bool ready() const noexcept override { return counter_.completed() >= token_; }
    Doorbell* doorbell() noexcept override { return &counter_.bell_; }
    int64_t ready_since_ns() const noexcept override { return counter_.completed_at(token_); }
    void count_wake_latency(int64_t ns) noexcept override { counter_.wake_latency_.add(ns); }
    uint64_t token() const noexcept { return token_; }

   private:
    StepCounter& counter_;
    uint64_t token_;
  };

  // A wait_any source that is ready while every step issued so far is done (or failed). Unlike Until it does
  // not name a step, so it stays the same object from step to step (a prepared Waiter can hold it); with one
  // step in flight at a time it is ready exactly when that step is done.
  class Settled final : public Source {
   public:
    explicit Settled(StepCounter& counter) : Source(true), counter_(counter) {}
    bool ready() const noexcept override { return counter_.completed() >= counter_.issued(); }
    Doorbell* doorbell() noexcept override { return &counter_.bell_; }
    int64_t ready_since_ns() const noexcept override { return counter_.completed_at(counter_.issued()); }
    void count_wake_latency(int64_t ns) noexcept override { counter_.wake_latency_.add(ns); }

   private:
    StepCounter& counter_;
  };

  static constexpr int kStepBits = 40;

  StepCounter() noexcept;

  uint64_t mark() noexcept { return issued_.fetch_add(1, std::memory_order_relaxed) + 1; }
  // complete/fail take tokens from mark(), in token order.
  void complete(uint64_t token) noexcept;
  void fail(uint64_t token, const std::string& why);

  // Throws std::invalid_argument for a token this counter did not issue (0, another counter's, one in the
  // future); StepError if that step (or an earlier one) failed.
  bool done(uint64_t token) const;
  Until until(uint64_t token) { check_issued(token); return Until(*this, token); }

  // The last token issued / completed (equal to `base()` when none).
  uint64_t issued() const noexcept { return issued_.load(std::memory_order_relaxed); }
  uint64_t completed() const noexcept { return completed_.load(std::memory_order_acquire); }
  // Tokens of this counter are base() + 1, base() + 2, ...
  uint64_t base() const noexcept { return base_; }
  Doorbell* doorbell() noexcept { return &bell_; }
  // Completion -> waiter running, for waits on until(token) that a completion ended.
  const LatencyHistogram& wake_latency() const noexcept { return wake_latency_; }
  // Throws std::invalid_argument (with what to do) unless `token` was issued by this counter.
  void check_issued(uint64_t token) const;

 private:
  // When the latest completion ran, if it covers `token` (-1 otherwise): the sources' ready_since_ns().
  int64_t completed_at(uint64_t token) const noexcept {
    return completed() >= token ? completed_ns_.load(std::memory_order_relaxed) : -1;
  }

  uint64_t base_;
  Doorbell bell_;
  alignas(kCacheLine) std::atomic<uint64_t> completed_;
  std::atomic<int64_t> completed_ns_{0};  // when complete() last ran (same line as completed_: read with it)
  std::atomic<uint64_t> failed_at_{0};  // 0: no failure
  alignas(kCacheLine) std::atomic<uint64_t> issued_;
  mutable std::mutex error_mu_;
  std::string error_;
  LatencyHistogram wake_latency_;
};

}  // namespace hotloop
