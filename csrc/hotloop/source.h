// Source: anything wait_any can wait on.
//
// A source is either
//  - doorbell-backed: ready() is a cheap, side-effect-free check (an atomic load or two) and the source's
//    producer rings doorbell() after every change that can make ready() true; or
//  - descriptor-backed: fd() >= 0 names a file descriptor that is "ready" when poll(2) reports it readable
//    (or hung up / in error, so a reader sees EOF or the error); ready() and doorbell() are then unused.
// ready() never consumes data: wait_any only reports, the caller takes.
// A source may also keep the time it last became ready (ready_since_ns(); a step notifier stamps each
// completion): it says so at construction (Source(true)), and wait_any then measures the wake-up latency from
// that time and hands it back (count_wake_latency). Other sources cost a wait one member read for it.
#pragma once

#include <cstdint>

#include "hotloop/doorbell.h"

namespace hotloop {

class Source {
 public:
  explicit Source(bool keeps_ready_time = false) noexcept : keeps_ready_time_(keeps_ready_time) {}
  virtual ~Source() = default;
  virtual bool ready() const noexcept = 0;
  virtual Doorbell* doorbell() noexcept { return nullptr; }
  virtual int fd() const noexcept { return -1; }
  // CLOCK_MONOTONIC time at which the source last became ready, or -1 if it does not keep it.
  virtual int64_t ready_since_ns() const noexcept { return -1; }
  // Receives the latency (ready_since_ns() -> waiter running) of a wait this source ended.
  virtual void count_wake_latency(int64_t /*ns*/) noexcept {}
  bool keeps_ready_time() const noexcept { return keeps_ready_time_; }

 private:
  bool keeps_ready_time_;
};

}  // namespace hotloop
