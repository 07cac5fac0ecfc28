// Internal to the bitmap codec (bitmap.cpp, bitmap_simd.cpp): the keep predicate and tail helpers.
#pragma once
#include <cstdint>
#include <cstring>

#include "memory/bitmap.h"

namespace et::bitmap::detail {

inline uint32_t fbits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
// Element x is kept iff (bits(x) & 0x7FFFFFFF) >= threshold_bits(t), compared as unsigned
// integers: for t = 0 that is x != +-0 (denormals and NaN kept); for t > 0, |x| >= t or NaN.
inline uint32_t threshold_bits(float t) { return keep_threshold_bits(t); }
inline bool keep(float x, uint32_t tb) { return (fbits(x) & 0x7FFFFFFFu) >= tb; }

// The scalar reference on a partial word (fewer than 64 elements), used by the SIMD kernels.
int64_t tail_make_bits(const float* x, int64_t n, float thr, uint64_t* bits);
void tail_pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t);
int64_t tail_pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t);
void tail_unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out);

}  // namespace et::bitmap::detail
