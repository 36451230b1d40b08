#include "hotloop/flag.h"

namespace hotloop {

void Flag::set() noexcept {
  value_.store(1, std::memory_order_release);
  bell_.ring();
}

}  // namespace hotloop
