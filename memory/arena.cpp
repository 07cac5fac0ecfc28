#include "memory/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#include "engine/check.h"

namespace et {

static size_t page_size() {
  static const size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}

Arena::~Arena() {
  if (base_) munmap(base_, size_);
}

void Arena::reserve(size_t bytes, const std::string& what) {
  ET_CHECK(base_ == nullptr, "arena reserved twice");
  const size_t p = page_size();
  size_ = (bytes + p - 1) / p * p;
  if (size_ == 0) size_ = p;
  void* m = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    size_ = 0;
    user_error("out of memory: could not map ", bytes, " bytes for ", what);
  }
  base_ = static_cast<char*>(m);
}

void* Arena::at(size_t offset) const {
  ET_CHECK(offset <= size_, "arena offset ", offset, " beyond ", size_);
  return base_ + offset;
}

void Arena::release(size_t offset, size_t bytes) {
  const size_t p = page_size();
  size_t begin = (offset + p - 1) / p * p;
  size_t end = (offset + bytes) / p * p;
  if (end > begin) madvise(base_ + begin, end - begin, MADV_DONTNEED);
}

size_t Arena::resident_bytes() const {
  if (!base_) return 0;
  const size_t p = page_size(), pages = size_ / p;
  std::vector<unsigned char> in(pages);
  if (mincore(base_, size_, in.data()) != 0) return size_;  // unknown: count it all
  size_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return n * p;
}

}  // namespace et
