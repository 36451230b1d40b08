#include "hotloop/step_counter.h"

namespace hotloop {

void StepCounter::complete(uint64_t token) noexcept {
  // Completions arrive in order; a late duplicate must not move the counter backwards.
  uint64_t cur = completed_.load(std::memory_order_relaxed);
  while (cur < token && !completed_.compare_exchange_weak(cur, token, std::memory_order_release)) {
  }
  bell_.ring();
}

void StepCounter::fail(uint64_t token, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (failed_at_.load(std::memory_order_relaxed) == 0) {
      error_ = why;
      failed_at_.store(token, std::memory_order_release);
    }
  }
  complete(token);
}

void StepCounter::check_issued(uint64_t token) const {
  if (token == 0) throw std::invalid_argument("step token 0 is never issued: tokens start at 1 (use mark())");
  uint64_t issued = issued_.load(std::memory_order_relaxed);
  if (token > issued) {
    throw std::invalid_argument("step token " + std::to_string(token) + " was not issued by this notifier (" +
                                std::to_string(issued) + " marked so far): pass a token from its own mark()");
  }
}

bool StepCounter::done(uint64_t token) const {
  if (completed_.load(std::memory_order_acquire) >= token && token != 0) {
    uint64_t failed = failed_at_.load(std::memory_order_acquire);
    if (failed != 0 && token >= failed) {
      std::lock_guard<std::mutex> lock(error_mu_);
      throw StepError("step " + std::to_string(failed) + " failed: " + error_);
    }
    return true;
  }
  check_issued(token);
  return false;
}

}  // namespace hotloop
