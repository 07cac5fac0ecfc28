#include "memory/uss.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace et {
namespace {

// Sums, per key, the kB values of the lines starting with it ("Private_Dirty:", "VmHWM:") in a
// /proc file. Reads with a fixed buffer: no allocation, so the profiler does not disturb what it
// measures. False if the file cannot be opened.
bool sum_fields_kb(const char* path, const char* const* keys, int nkeys, size_t* kb) {
  for (int k = 0; k < nkeys; ++k) kb[k] = 0;
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  static thread_local char buf[1 << 16];
  size_t carry = 0;
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
      for (int k = 0; k < nkeys; ++k)
        if (!std::strncmp(line, keys[k], std::strlen(keys[k])))
          kb[k] += std::strtoull(std::strchr(line, ':') + 1, nullptr, 10);
      line_start = i + 1;
    }
    carry = len - line_start;
    std::memmove(buf, buf + line_start, carry);
  }
  close(fd);
  return true;
}

// High-water mark and RSS (bytes) from /proc/self/status.
bool read_high_water(const char* status, size_t* hwm, size_t* rss) {
  static const char* const keys[] = {"VmHWM:", "VmRSS:"};
  size_t kb[2];
  if (!sum_fields_kb(status, keys, 2, kb) || kb[0] == 0) return false;
  *hwm = kb[0] * 1024;
  *rss = kb[1] * 1024;
  return true;
}

// "5" to clear_refs: the high-water mark becomes the current RSS (no page is walked).
bool reset_high_water(const char* clear_refs) {
  const int fd = open(clear_refs, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = write(fd, "5", 1) == 1;
  close(fd);
  return ok;
}

}  // namespace

std::optional<size_t> read_uss_bytes(const ProcFiles& files) {
  static const char* const keys[] = {"Private_Clean:", "Private_Dirty:", "Private_Hugetlb:"};
  size_t kb[3];
  if (!sum_fields_kb(files.smaps_rollup, keys, 3, kb) && !sum_fields_kb(files.smaps, keys, 3, kb)) return std::nullopt;
  return (kb[0] + kb[1] + kb[2]) * 1024;
}

const char* uss_method_name(UssMethod m) {
  switch (m) {
    case UssMethod::HighWater: return "high-water mark (VmHWM)";
    case UssMethod::Samples: return "samples after forward / backward / update";
    case UssMethod::None: break;
  }
  return "unavailable";
}

void UssPeak::begin_step() {
  in_high_water_ = reset_high_water(files_.clear_refs);
  step_max_ = 0;
}

void UssPeak::phase() {
  if (in_high_water_) return;  // the mark sees everything; a sample would only cost a page walk
  if (const auto u = read_uss_bytes(files_)) step_max_ = std::max(step_max_, *u);
}

void UssPeak::end_step() {
  const auto u = read_uss_bytes(files_);
  size_t hwm = 0, rss = 0;
  const bool high_water = in_high_water_ && u && read_high_water(files_.status, &hwm, &rss);
  in_high_water_ = false;
  if (!u) return;
  // The kernel's per-CPU RSS counters may lag by a few pages: never below the sample itself.
  const size_t step = std::max(step_max_, *u + (high_water && hwm > rss ? hwm - rss : 0));
  record(step, high_water);
  last_step_ = step;
}

void UssPeak::sample() {
  if (const auto u = read_uss_bytes(files_)) record(*u, false);
}

void UssPeak::record(size_t bytes, bool high_water) {
  if (!peak_ || bytes > *peak_) peak_ = bytes;
  (high_water ? used_high_water_ : used_samples_) = true;
}

void UssPeak::reset() {
  peak_.reset();
  last_step_.reset();
  in_high_water_ = used_high_water_ = used_samples_ = false;
}

UssMethod UssPeak::method() const {
  if (!peak_) return UssMethod::None;
  return used_samples_ ? UssMethod::Samples : UssMethod::HighWater;
}

}  // namespace et
