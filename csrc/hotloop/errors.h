// The exceptions the core throws. Each message says what happened and what to do about it.
//  - ClosedError: the queue (or other source) was closed; no more items will come.
//  - SourceError: a source can no longer be waited on (e.g. its file descriptor was closed).
// Invalid arguments throw std::invalid_argument.
#pragma once

#include <stdexcept>

namespace hotloop {

class ClosedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class SourceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace hotloop
