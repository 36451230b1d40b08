#include "hotloop/input_queue.h"

namespace hotloop {

bool InputQueue::put(void* item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.load(std::memory_order_relaxed)) return false;
    items_.push_back(item);
    // Every writer of size_ holds mu_: a plain store is enough and, unlike a locked add, does not stall on
    // the cache line the consumer is spinning on.
    size_.store(items_.size(), std::memory_order_release);
  }
  bell_.ring();
  return true;
}

bool InputQueue::try_pop(void*& item) {
  if (size_.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  if (items_.empty()) return false;
  item = items_.front();
  items_.pop_front();
  size_.store(items_.size(), std::memory_order_release);
  return true;
}

size_t InputQueue::drain(std::vector<void*>& out, size_t max_items) {
  if (size_.load(std::memory_order_acquire) == 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = items_.size();
  if (max_items != 0 && max_items < n) n = max_items;
  out.insert(out.end(), items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(n));
  items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(n));
  size_.store(items_.size(), std::memory_order_release);
  return n;
}

void InputQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.store(true, std::memory_order_release);
  }
  bell_.ring();
}

}  // namespace hotloop
