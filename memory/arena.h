// Arena: one allocation holding every tensor of a training step, carved at planned offsets. On
// the host it is an anonymous mapping (memory/device_memory.h): owning the pages (instead of
// malloc) is what lets USS follow the plan, since release() hands pages the step no longer needs
// back to the OS (MADV_DONTNEED), which glibc's free() would not.
#pragma once
#include <cstddef>
#include <string>

#include "memory/device_memory.h"

namespace et {

class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  // Allocates `bytes` (rounded up to the memory's granularity) from `memory`. Throws UserError
  // naming `what` if the system refuses. large_pages: DeviceMemory::advise_large_pages, for an
  // arena whose pages are all touched and kept (the executor's, without memory.release_pages).
  void reserve(size_t bytes, const std::string& what, DeviceMemory& memory = host_memory(),
               bool large_pages = false);
  // reserve()'s size without its memory: an arena that is planned and never used (a plan-only
  // executor, Executor::PlanOnly). at() then gives null pointers.
  void plan(size_t bytes, DeviceMemory& memory = host_memory());
  // Frees the allocation and takes one of `bytes` from the same memory (contents not kept; the
  // old one goes first, so the two are never held at once). Throws UserError as reserve().
  void reallocate(size_t bytes, const std::string& what);
  // `bytes` as reserve() would round it (a reserved arena's memory).
  size_t rounded(size_t bytes) const;
  void* at(size_t offset) const;
  size_t size() const { return size_; }
  Device device() const { return memory_ ? memory_->device() : Device::CPU; }
  // Returns the whole pages inside [offset, offset + bytes) to the system; their contents become zero.
  void release(size_t offset, size_t bytes);
  // Bytes of it that are resident now: what of it USS counts.
  size_t resident_bytes() const;

  static constexpr size_t kAlign = 64;
  static size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

 private:
  DeviceMemory* memory_ = nullptr;
  char* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace et
