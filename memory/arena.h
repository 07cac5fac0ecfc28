// Arena: one anonymous mapping holding every tensor of a training step, carved at planned offsets.
// Owning the pages (instead of malloc) is what lets USS follow the plan: release() hands pages the
// step no longer needs back to the OS (MADV_DONTNEED), which glibc's free() would not.
#pragma once
#include <cstddef>
#include <string>

namespace et {

class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  // Maps `bytes` (rounded up to pages). Throws UserError naming `what` if the OS refuses.
  void reserve(size_t bytes, const std::string& what);
  void* at(size_t offset) const;
  size_t size() const { return size_; }
  // Returns the whole pages inside [offset, offset + bytes) to the OS; their contents become zero.
  void release(size_t offset, size_t bytes);
  // Bytes of its pages that are resident now (mincore): what of it USS counts.
  size_t resident_bytes() const;

  static constexpr size_t kAlign = 64;
  static size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace et
