#include "hotloop/owned_bytes.h"

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <new>

namespace hotloop {
namespace {

constexpr size_t kMapThreshold = size_t(2) << 20;

// Recently freed large buffers, kept mapped (and so already faulted in) for the next message of the same
// size: fresh memory costs a page fault per page, which on a VM is slower than the copy itself.
struct Pool {
  static constexpr int kSlots = 4;
  static constexpr size_t kMaxBytes = size_t(1) << 30;
  std::mutex mu;
  void* ptr[kSlots] = {};
  size_t size[kSlots] = {};

  void* take(size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < kSlots; ++i) {
      if (ptr[i] != nullptr && size[i] == n) {
        void* p = ptr[i];
        ptr[i] = nullptr;
        return p;
      }
    }
    return nullptr;
  }
  bool give(void* p, size_t n) {
    if (n > kMaxBytes) return false;
    std::lock_guard<std::mutex> lock(mu);
    size_t held = 0;
    for (int i = 0; i < kSlots; ++i) held += ptr[i] ? size[i] : 0;
    for (int i = 0; i < kSlots; ++i) {
      if (ptr[i] == nullptr && held + n <= kMaxBytes) {
        ptr[i] = p;
        size[i] = n;
        return true;
      }
    }
    return false;
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: buffers may be freed during exit
  return *p;
}

}  // namespace

OwnedBytes& OwnedBytes::operator=(OwnedBytes&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = o.p_, n_ = o.n_, mapped_ = o.mapped_;
    o.p_ = nullptr, o.n_ = 0;
  }
  return *this;
}

void OwnedBytes::allocate(size_t n) {
  reset();
  if (n >= kMapThreshold) {
    if (void* reused = pool().take(n)) {
      p_ = static_cast<uint8_t*>(reused);
      n_ = n;
      mapped_ = true;
      return;
    }
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, n, MADV_HUGEPAGE);  // a hint: without THP it is plain pages
    p_ = static_cast<uint8_t*>(p);
    mapped_ = true;
  } else {
    p_ = static_cast<uint8_t*>(std::malloc(n == 0 ? 1 : n));
    if (p_ == nullptr) throw std::bad_alloc();
    mapped_ = false;
  }
  n_ = n;
}

void OwnedBytes::reset() noexcept {
  if (p_ == nullptr) return;
  if (mapped_) {
    if (!pool().give(p_, n_)) munmap(p_, n_);
  } else {
    std::free(p_);
  }
  p_ = nullptr;
  n_ = 0;
}

}  // namespace hotloop
