// Source: anything wait_any can wait on.
//
// A source is either
//  - doorbell-backed: ready() is a cheap, side-effect-free check (an atomic load or two) and the source's
//    producer rings doorbell() after every change that can make ready() true; or
//  - descriptor-backed: fd() >= 0 names a file descriptor that is "ready" when poll(2) reports it readable
//    (or hung up / in error, so a reader sees EOF or the error); ready() and doorbell() are then unused.
// ready() never consumes data: wait_any only reports, the caller takes.
#pragma once

#include "hotloop/doorbell.h"

namespace hotloop {

class Source {
 public:
  virtual ~Source() = default;
  virtual bool ready() const noexcept = 0;
  virtual Doorbell* doorbell() noexcept { return nullptr; }
  virtual int fd() const noexcept { return -1; }
};

}  // namespace hotloop
