// Per descriptor states (descriptor_state.h).
#include "preload/descriptor_state.h"

#include <atomic>

namespace dnvme::preload {
namespace {

constexpr int kMaxTracked = 1 << 20;
std::atomic<uint8_t> g_state[kMaxTracked];  // zero (kUnknown) until classified

}  // namespace

DescriptorState StateOf(int fd) {
  if (fd < 0 || fd >= kMaxTracked) return kNotOurs;
  return static_cast<DescriptorState>(g_state[fd].load(std::memory_order_acquire));
}

void SetState(int fd, DescriptorState s) {
  if (fd >= 0 && fd < kMaxTracked) g_state[fd].store(s, std::memory_order_release);
}

}  // namespace dnvme::preload
