// Random 4-bit code tensors for the integer-kernel tests (a fixed LCG, so every run sees the same).
#pragma once
#include <cstdint>
#include <vector>

#include "quant/codes.h"

namespace et::test {

inline uint32_t lcg(uint32_t& s) { return s = s * 1664525u + 1013904223u; }

// n codes uniform in [lo, hi] (INT4: -7..7 signed, 0..15 unsigned).
inline std::vector<int8_t> codes(size_t n, int lo, int hi, uint32_t seed) {
  std::vector<int8_t> v(n);
  for (auto& c : v) c = int8_t(lo + int((lcg(seed) >> 8) % uint32_t(hi - lo + 1)));
  return v;
}

// n FP4 code bytes: signed powers of two and zeros.
inline std::vector<int8_t> fp4_codes(size_t n, uint32_t seed) {
  std::vector<int8_t> v(n);
  for (auto& c : v) {
    const uint32_t r = lcg(seed) >> 8;
    c = quant::fp4_value(int(r & 1), int((r >> 1) % 8));
  }
  return v;
}

}  // namespace et::test
