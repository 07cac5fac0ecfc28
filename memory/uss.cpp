#include "memory/uss.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace et {
namespace {

// Sums the private fields of an smaps-style file. Reads with a fixed buffer: no allocation, so the
// profiler does not disturb what it measures.
size_t sum_private_kb(const char* path, bool* ok) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  *ok = fd >= 0;
  if (fd < 0) return 0;
  static thread_local char buf[1 << 16];
  size_t total_kb = 0, carry = 0;
  for (;;) {
    const ssize_t n = read(fd, buf + carry, sizeof(buf) - 1 - carry);
    if (n <= 0) break;
    const size_t len = carry + size_t(n);
    buf[len] = 0;
    size_t line_start = 0;
    for (size_t i = 0; i < len; ++i) {
      if (buf[i] != '\n') continue;
      buf[i] = 0;
      const char* line = buf + line_start;
      if (!std::strncmp(line, "Private_Clean:", 14) || !std::strncmp(line, "Private_Dirty:", 14) ||
          !std::strncmp(line, "Private_Hugetlb:", 16))
        total_kb += std::strtoull(std::strchr(line, ':') + 1, nullptr, 10);
      line_start = i + 1;
    }
    carry = len - line_start;
    std::memmove(buf, buf + line_start, carry);
  }
  close(fd);
  return total_kb;
}

}  // namespace

size_t read_uss_bytes() {
  bool ok = false;
  size_t kb = sum_private_kb("/proc/self/smaps_rollup", &ok);
  if (!ok) kb = sum_private_kb("/proc/self/smaps", &ok);
  return kb * 1024;
}

void UssPeak::sample() {
  const size_t u = read_uss_bytes();
  if (u > peak_) peak_ = u;
}

}  // namespace et
