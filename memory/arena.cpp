#include "memory/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/check.h"

namespace et {

namespace {

// Mappings of kHugePage or more start at a multiple of it, so that large pages, where asked for
// (advise_large_pages: MADV_HUGEPAGE; the kernel's default policy, "madvise", gives transparent huge
// pages only to regions that ask), cover all of them.
constexpr size_t kHugePage = size_t(2) << 20;

class HostMemory final : public DeviceMemory {
 public:
  Device device() const override { return Device::CPU; }
  size_t granularity() const override { return page_; }
  void* allocate(size_t bytes) override {
    if (bytes < kHugePage) {
      void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      return m == MAP_FAILED ? nullptr : m;
    }
    // Map a huge page more, keep the aligned part: deallocate unmaps exactly [p, p + bytes).
    void* m = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    const uintptr_t a = reinterpret_cast<uintptr_t>(m), p = (a + kHugePage - 1) / kHugePage * kHugePage;
    const uintptr_t end = p + (bytes + page_ - 1) / page_ * page_, map_end = a + bytes + kHugePage;
    if (p > a) munmap(m, p - a);
    if (map_end > end) munmap(reinterpret_cast<void*>(end), map_end - end);
    return reinterpret_cast<void*>(p);
  }
  void advise_large_pages(void* p, size_t bytes) override { madvise(p, bytes, MADV_HUGEPAGE); }
  void deallocate(void* p, size_t bytes) override { munmap(p, bytes); }
  void release(void* p, size_t bytes) override {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t begin = (a + page_ - 1) / page_ * page_, end = (a + bytes) / page_ * page_;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
  size_t resident_bytes(const void* p, size_t bytes) const override {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) / page_ * page_;
    const size_t span = reinterpret_cast<uintptr_t>(p) + bytes - a, pages = (span + page_ - 1) / page_;
    std::vector<unsigned char> in(pages);
    if (mincore(reinterpret_cast<void*>(a), span, in.data()) != 0) return bytes;  // unknown: count it all
    size_t n = 0;
    for (unsigned char c : in) n += c & 1;
    return n * page_;
  }

 private:
  const size_t page_ = size_t(sysconf(_SC_PAGESIZE));
};

}  // namespace

DeviceMemory& host_memory() {
  static HostMemory m;
  return m;
}

Arena::~Arena() {
  if (base_) memory_->deallocate(base_, size_);
}

void Arena::reserve(size_t bytes, const std::string& what, DeviceMemory& memory, bool large_pages) {
  ET_CHECK(base_ == nullptr, "arena reserved twice");
  const size_t g = memory.granularity();
  const size_t size = std::max<size_t>(1, (bytes + g - 1) / g) * g;
  void* m = memory.allocate(size);
  if (!m) user_error("out of memory: could not allocate ", bytes, " bytes for ", what);
  if (large_pages) memory.advise_large_pages(m, size);
  memory_ = &memory;
  base_ = static_cast<char*>(m);
  size_ = size;
}

void Arena::plan(size_t bytes, DeviceMemory& memory) {
  ET_CHECK(base_ == nullptr && size_ == 0, "arena reserved twice");
  const size_t g = memory.granularity();
  memory_ = &memory;
  size_ = std::max<size_t>(1, (bytes + g - 1) / g) * g;
}

void Arena::reallocate(size_t bytes, const std::string& what) {
  ET_CHECK(base_ != nullptr, "reallocate of an arena never reserved");
  DeviceMemory& memory = *memory_;
  memory.deallocate(base_, size_);
  base_ = nullptr;
  size_ = 0;
  reserve(bytes, what, memory);
}

size_t Arena::rounded(size_t bytes) const {
  ET_CHECK(memory_ != nullptr, "rounded() of an arena never reserved");
  const size_t g = memory_->granularity();
  return std::max<size_t>(1, (bytes + g - 1) / g) * g;
}

void* Arena::at(size_t offset) const {
  ET_CHECK(offset <= size_, "arena offset ", offset, " beyond ", size_);
  return base_ ? base_ + offset : nullptr;  // (planned only: nothing to point at)
}

void Arena::release(size_t offset, size_t bytes) {
  ET_CHECK(offset + bytes <= size_, "arena release beyond its end");
  if (base_ && bytes > 0) memory_->release(base_ + offset, bytes);
}

size_t Arena::resident_bytes() const { return base_ ? memory_->resident_bytes(base_, size_) : 0; }

}  // namespace et
