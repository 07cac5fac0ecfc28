// Where a backend keeps its tensors. The executor's arena and the stash region are one allocation
// each, sized by the plan, from the backend's DeviceMemory (Backend::memory()): anonymous mappings
// on the CPU (host_memory()), device allocations on a GPU. Backend neutral, C++14.
#pragma once
#include <cstddef>

#include "engine/tensor.h"

namespace et {

// Appended to every out-of-memory message (the arena's, the stash region's, a GPU's own buffers'):
// the way out.
constexpr const char* kMemoryBudgetHint = " (memory.budget_mb = N plans a step that fits N MB: docs/config.md)";

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual Device device() const = 0;
  // Allocation granularity (the page size on the host): allocate() takes multiples of it.
  virtual size_t granularity() const = 0;
  // Zeroed memory of `bytes`; nullptr when the system refuses.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  // Hands the whole pages inside [p, p + bytes) back to the system, their contents becoming zero
  // (memory.release_pages); a device without paging may leave them.
  virtual void release(void* p, size_t bytes) = 0;
  // Bytes of [p, p + bytes) resident now: what USS counts of it on the host.
  virtual size_t resident_bytes(const void* p, size_t bytes) const = 0;
  // Asks for large pages under [p, p + bytes), an allocation whose pages are all touched and kept
  // (the executor's arena); a hint, nothing where the system has none.
  virtual void advise_large_pages(void* p, size_t bytes) {
    (void)p;
    (void)bytes;
  }
  // The whole device's memory in use and in total, as its driver reports it (a GPU's
  // cudaMemGetInfo); false where there is no such report (the host: USS measures it instead).
  virtual bool usage(size_t* used, size_t* total) const {
    (void)used;
    (void)total;
    return false;
  }
};

// The host's: private anonymous mappings (MAP_PRIVATE | MAP_ANONYMOUS), MADV_DONTNEED, mincore.
DeviceMemory& host_memory();

}  // namespace et
