// InputQueue: an in-process multi-producer queue of opaque pointers, and a wait_any source.
//
// Producers: put() from any thread; FIFO per producer; the doorbell rings after the item is visible.
// Consumer: designed for one (an engine loop); pop/drain are nevertheless safe from several threads.
// ready(): one atomic load (non-empty, or closed so a waiter wakes and learns it).
// close(): later puts fail (return false); items already queued stay and can still be taken, so nothing
// is lost; a waiter wakes.
// Cost: put = an uncontended mutex + one atomic increment + a doorbell ring (no syscall unless the consumer
// is parked). The queue owns no item: whoever holds the pointers frees them (the Python binding decrefs what
// is left on destruction).
// Ordering: size_ and closed_ are written under mu_ with release stores and read without it with acquire loads
// (ready(), the fast empty check); the item itself is handed over under mu_. put() and close() ring after
// unlocking: the ring's seq_cst increment orders the new size before the wake-up (doorbell.h, "Ordering").
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <mutex>
#include <vector>

#include "hotloop/source.h"

namespace hotloop {

class InputQueue : public Source {
 public:
  // Returns false (and takes nothing) if the queue is closed.
  bool put(void* item);
  // Takes the oldest item if there is one.
  bool try_pop(void*& item);
  // Appends up to max_items (0 = all) items to out, oldest first; returns how many.
  size_t drain(std::vector<void*>& out, size_t max_items = 0);

  void close();
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  size_t size() const noexcept { return size_.load(std::memory_order_acquire); }

  bool ready() const noexcept override { return size() > 0 || closed(); }
  Doorbell* doorbell() noexcept override { return &bell_; }

 private:
  Doorbell bell_;
  // Read by the consumer's spin loop, written by producers: its own line, away from the doorbell and lock.
  alignas(kCacheLine) std::atomic<size_t> size_{0};
  std::atomic<bool> closed_{false};
  alignas(kCacheLine) std::mutex mu_;
  std::deque<void*> items_;
};

}  // namespace hotloop
