// Eight float lanes: one AVX2 register, or two NEON q registers (aarch64), for the kernels written
// once for both (pool_stride1.h). A lane holds a float, a mask (all ones: on; zero: off) or a
// 32-bit integer in a float's bits. Every operation gives the same bits on both: the running
// maximum and the ReLU are compares and selects where NEON's max would pass NaN on, the FMA rounds
// once.
#pragma once
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#define ET_LANES8 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define ET_LANES8 1
#endif

#if defined(ET_LANES8)
namespace et {
namespace lanes8 {

constexpr int kWidth = 8;
#if defined(__AVX2__)
using F8 = __m256;
using F = F8;
using M = F8;  // a mask: lanes of all ones (on) and zeros (off)
inline F8 splat(float v) { return _mm256_set1_ps(v); }
inline F8 load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F8 v) { _mm256_storeu_ps(p, v); }
inline F8 load_int(const int32_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
inline void store_int(int32_t* p, F8 v) { _mm256_storeu_ps(reinterpret_cast<float*>(p), v); }
// Lanes l with first + l in [0, n): on.
inline F8 inside(int64_t first, int64_t n) {
  const __m256i l = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(l, _mm256_set1_epi32(int32_t(-first - 1))),
                                              _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(n - first)), l)));
}
// p[0, 8) where inside(first, n) (p = row + first), `outside` elsewhere; reads nothing outside.
inline F8 load_inside(const float* p, int64_t first, int64_t n, F8 outside) {
  if (first >= 0 && first + 8 <= n) return _mm256_loadu_ps(p);
  const F8 in = inside(first, n);
  return _mm256_blendv_ps(outside, _mm256_maskload_ps(p, _mm256_castps_si256(in)), in);
}
// p[0, 8) = v where first + l < n (first >= 0: row ends only); writes nothing past n. The masked
// store only at the end (on Zen it is many times a plain store's cost).
inline void store_inside(float* p, int64_t first, int64_t n, F8 v) {
  if (__builtin_expect(first + 8 <= n, 1)) return _mm256_storeu_ps(p, v);
  _mm256_maskstore_ps(p, _mm256_castps_si256(inside(first, n)), v);
}
inline F8 greater(F8 a, F8 b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }  // false on NaN
inline F8 select(F8 m, F8 a, F8 b) { return _mm256_blendv_ps(a, b, m); }    // m ? b : a
inline F8 keep_greater(F8 v, F8 m) { return _mm256_max_ps(v, m); }         // v > m ? v : m
inline F8 bit_and(F8 a, F8 b) { return _mm256_and_ps(a, b); }
inline F8 keep_where(F8 v, M m) { return bit_and(v, m); }  // m ? v : +0
inline F8 add(F8 a, F8 b) { return _mm256_add_ps(a, b); }
inline F8 mul(F8 a, F8 b) { return _mm256_mul_ps(a, b); }
inline F8 fmadd(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline F8 relu(F8 v) { return _mm256_max_ps(v, _mm256_setzero_ps()); }  // v > 0 ? v : +0
inline F8 int_splat(int32_t v) { return _mm256_castsi256_ps(_mm256_set1_epi32(v)); }
inline F8 int_iota(int32_t first) {  // first, first + 1, ..., first + 7
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline F8 int_equal(F8 a, F8 b) {
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}
inline F8 int_add(F8 a, F8 b) {
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}
// acc + (m ? v : -0): acc as it is in the other lanes (x + -0 is x, bit for bit).
inline F8 add_where(F8 acc, M m, F8 v) { return _mm256_add_ps(acc, _mm256_blendv_ps(_mm256_set1_ps(-0.f), v, m)); }
// The lanes one place on, the lane that enters from the neighbouring vector: {prev[7], cur[0, 7)}
// and {cur[1, 8), next[0]} (the halves that meet, then a byte shift within each 128-bit half).
inline F8 shift_in_left(F8 prev, F8 cur) {
  const __m256 t = _mm256_permute2f128_ps(prev, cur, 0x21);  // prev's high half, cur's low half
  return _mm256_castsi256_ps(_mm256_alignr_epi8(_mm256_castps_si256(cur), _mm256_castps_si256(t), 12));
}
inline F8 shift_in_right(F8 cur, F8 next) {
  const __m256 t = _mm256_permute2f128_ps(cur, next, 0x21);  // cur's high half, next's low half
  return _mm256_castsi256_ps(_mm256_alignr_epi8(_mm256_castps_si256(t), _mm256_castps_si256(cur), 4));
}

#else  // aarch64 NEON: lo holds lanes 0-3, hi lanes 4-7
struct F8 {
  float32x4_t lo, hi;
};
using F = F8;
using M = F8;  // a mask: lanes of all ones (on) and zeros (off)
inline uint32x4_t u32(float32x4_t v) { return vreinterpretq_u32_f32(v); }
inline float32x4_t f32(uint32x4_t v) { return vreinterpretq_f32_u32(v); }
inline F8 splat(float v) { return {vdupq_n_f32(v), vdupq_n_f32(v)}; }
inline F8 load(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void store(float* p, F8 v) { vst1q_f32(p, v.lo), vst1q_f32(p + 4, v.hi); }
inline F8 load_int(const int32_t* p) { return load(reinterpret_cast<const float*>(p)); }
inline void store_int(int32_t* p, F8 v) { store(reinterpret_cast<float*>(p), v); }
inline F8 load_inside(const float* p, int64_t first, int64_t n, F8 outside) {  // lane by lane at the ends
  if (first >= 0 && first + 8 <= n) return load(p);
  alignas(16) float t[8];
  store(t, outside);
  for (int64_t l = 0; l < 8; ++l)
    if (first + l >= 0 && first + l < n) t[l] = p[l];
  return load(t);
}
inline void store_inside(float* p, int64_t first, int64_t n, F8 v) {  // first >= 0
  if (first + 8 <= n) return store(p, v);
  alignas(16) float t[8];
  store(t, v);
  for (int64_t l = 0; first + l < n; ++l) p[l] = t[l];
}
inline F8 greater(F8 a, F8 b) { return {f32(vcgtq_f32(a.lo, b.lo)), f32(vcgtq_f32(a.hi, b.hi))}; }
inline F8 select(F8 m, F8 a, F8 b) { return {vbslq_f32(u32(m.lo), b.lo, a.lo), vbslq_f32(u32(m.hi), b.hi, a.hi)}; }
inline F8 keep_greater(F8 v, F8 m) { return select(greater(v, m), m, v); }
inline F8 bit_and(F8 a, F8 b) { return {f32(vandq_u32(u32(a.lo), u32(b.lo))), f32(vandq_u32(u32(a.hi), u32(b.hi)))}; }
inline F8 keep_where(F8 v, M m) { return bit_and(v, m); }  // m ? v : +0
inline F8 add(F8 a, F8 b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline F8 mul(F8 a, F8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline F8 fmadd(F8 a, F8 b, F8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline F8 relu(F8 v) {
  const F8 zero = splat(0.f);
  return select(greater(v, zero), zero, v);
}
inline F8 int_splat(int32_t v) { return {f32(vdupq_n_u32(uint32_t(v))), f32(vdupq_n_u32(uint32_t(v)))}; }
inline F8 int_equal(F8 a, F8 b) { return {f32(vceqq_u32(u32(a.lo), u32(b.lo))), f32(vceqq_u32(u32(a.hi), u32(b.hi)))}; }
inline F8 int_add(F8 a, F8 b) { return {f32(vaddq_u32(u32(a.lo), u32(b.lo))), f32(vaddq_u32(u32(a.hi), u32(b.hi)))}; }
inline F8 add_where(F8 acc, M m, F8 v) { return add(acc, select(m, splat(-0.f), v)); }
// As the AVX2 forms: {prev[7], cur[0, 7)} and {cur[1, 8), next[0]}.
inline F8 shift_in_left(F8 prev, F8 cur) { return {vextq_f32(prev.hi, cur.lo, 3), vextq_f32(cur.lo, cur.hi, 3)}; }
inline F8 shift_in_right(F8 cur, F8 next) { return {vextq_f32(cur.lo, cur.hi, 1), vextq_f32(cur.hi, next.lo, 1)}; }
#endif

// Small integer codes (a pool window's tap, -1 for none), a 32-bit lane each (lanes512.h: a byte).
using Code = int32_t;
inline void store_codes(Code* p, F8 codes) { store_int(p, codes); }
inline M codes_equal(const Code* p, int32_t c) { return int_equal(load_int(p), int_splat(c)); }

// base[kOff, kOff + 8): lanes512.h's aligned form is for its 16 lanes; here a plain load.
template <int kOff>
inline F8 load_at(const float* base) {
  return load(base + kOff);
}
}  // namespace lanes8
}  // namespace et
#endif
