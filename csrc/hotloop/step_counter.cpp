#include "hotloop/step_counter.h"

namespace hotloop {
namespace {

uint64_t next_base() noexcept {
  // Counter ids 1, 2, ... (wrapping within 24 bits, skipping 0) so that tokens name their counter.
  static std::atomic<uint64_t> next_id{0};
  uint64_t id = next_id.fetch_add(1, std::memory_order_relaxed) % ((uint64_t(1) << 24) - 1) + 1;
  return id << StepCounter::kStepBits;
}

}  // namespace

StepCounter::StepCounter() noexcept : base_(next_base()), completed_(base_), issued_(base_) {}

void StepCounter::complete(uint64_t token) noexcept {
  // Completions arrive in order; a late duplicate must not move the counter backwards.
  completed_ns_.store(now_ns(), std::memory_order_relaxed);  // published by the release below
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
  uint64_t step = token - base_;
  if ((token >> kStepBits) != (base_ >> kStepBits)) {
    throw std::invalid_argument("step token " + std::to_string(token) +
                                " was not issued by this notifier (it belongs to another one, or is not a token): "
                                "pass a token from this notifier's own mark()");
  }
  uint64_t issued = issued_.load(std::memory_order_relaxed) - base_;
  if (step == 0 || step > issued) {
    throw std::invalid_argument("step token " + std::to_string(token) + " is step " + std::to_string(step) +
                                " of this notifier, which has issued only " + std::to_string(issued) +
                                ": pass a token returned by its mark()");
  }
}

bool StepCounter::done(uint64_t token) const {
  if ((token >> kStepBits) == (base_ >> kStepBits) && token != base_ &&
      completed_.load(std::memory_order_acquire) >= token) {
    uint64_t failed = failed_at_.load(std::memory_order_acquire);
    if (failed != 0 && token >= failed) {
      std::lock_guard<std::mutex> lock(error_mu_);
      throw StepError("step " + std::to_string(failed - base_) + " failed: " + error_);
    }
    return true;
  }
  check_issued(token);
  return false;
}

}  // namespace hotloop
