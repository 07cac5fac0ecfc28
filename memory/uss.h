// Unique set size (USS) of this process: Private_Clean + Private_Dirty (+ Private_Hugetlb) summed
// from /proc/self/smaps_rollup, or from /proc/self/smaps on kernels without it (Linux < 4.14, e.g.
// Jetson Nano's L4T). Returns bytes; 0 if /proc is unavailable.
#pragma once
#include <cstddef>

namespace et {

size_t read_uss_bytes();
// Tracks the maximum of read_uss_bytes() over explicit samples.
class UssPeak {
 public:
  void sample();
  void reset() { peak_ = 0; }
  size_t peak() const { return peak_; }

 private:
  size_t peak_ = 0;
};

}  // namespace et
