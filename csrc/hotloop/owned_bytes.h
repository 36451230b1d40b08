// OwnedBytes: a byte buffer for message payloads handed to their reader. Unlike std::vector it does not zero
// what it allocates (the payload is copied over it at once), and large buffers (>= 2 MiB) are mapped with
// transparent huge pages requested and faulted in at once; the last few freed large buffers (up to 1 GiB) are
// kept for the next message of the same size, so a stream of large tensors reuses warm memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hotloop {

class OwnedBytes {
 public:
  OwnedBytes() = default;
  explicit OwnedBytes(size_t n) { allocate(n); }
  OwnedBytes(OwnedBytes&& o) noexcept : p_(o.p_), n_(o.n_), mapped_(o.mapped_) { o.p_ = nullptr, o.n_ = 0; }
  OwnedBytes& operator=(OwnedBytes&& o) noexcept;
  OwnedBytes(const OwnedBytes&) = delete;
  OwnedBytes& operator=(const OwnedBytes&) = delete;
  ~OwnedBytes() { reset(); }

  // Replaces the buffer with `n` uninitialised bytes. Throws std::bad_alloc.
  void allocate(size_t n);
  void reset() noexcept;
  uint8_t* data() const noexcept { return p_; }
  size_t size() const noexcept { return n_; }
  bool empty() const noexcept { return p_ == nullptr; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
  bool mapped_ = false;
};

}  // namespace hotloop
