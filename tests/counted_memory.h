// Test helper: the host's memory, counting what it holds (live, peak) and refusing what would take
// it past `cap` bytes, as a small device does (allocate() returns nullptr: the arena's and the
// stash's out-of-memory messages).
#pragma once
#include <algorithm>
#include <cstddef>
#include <limits>

#include "memory/device_memory.h"

namespace et::test {

class CountedHostMemory final : public DeviceMemory {
 public:
  explicit CountedHostMemory(size_t cap = std::numeric_limits<size_t>::max()) : cap(cap) {}
  size_t cap, live = 0, peak = 0;
  Device device() const override { return host_memory().device(); }
  size_t granularity() const override { return host_memory().granularity(); }
  void* allocate(size_t bytes) override {
    if (bytes > cap - live) return nullptr;
    live += bytes;
    peak = std::max(peak, live);
    return host_memory().allocate(bytes);
  }
  void deallocate(void* p, size_t bytes) override {
    live -= bytes;
    host_memory().deallocate(p, bytes);
  }
  void release(void* p, size_t bytes) override { host_memory().release(p, bytes); }
  size_t resident_bytes(const void* p, size_t bytes) const override { return host_memory().resident_bytes(p, bytes); }
};

}  // namespace et::test
