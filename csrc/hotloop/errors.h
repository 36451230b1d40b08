// The exceptions the core throws. Each message says what happened and what to do about it.
//  - ClosedError: the queue (or other source) was closed; no more items will come.
//  - SourceError: a source can no longer be waited on (e.g. its file descriptor was closed).
//  - DeadPeerError: a peer process of a shared-memory queue (its writer, or a reader) died.
//  - BadHandleError: a queue handle does not describe a usable segment (wrong name, layout, geometry, rank).
//  - QueueTimeout: a wait for ring space or a message timed out.
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

class DeadPeerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class BadHandleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class QueueTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace hotloop
