// AVX-512's 16 float lanes where vectors are narrower: AVX2 (two ymm, lanes 0-7 and 8-15) and
// aarch64 NEON (four q registers). The row kernels written for AVX-512's lanes (the BN gradient
// sums and apply, batchnorm_rows.h; the element-wise fused stacks, fused.cpp) keep their lane
// order on these, so each lane takes the same elements in the same order and every sum, FMA and
// max gives the same bits as on AVX-512 and as the portable loops.
//
// A mask is a Lanes16 of all-ones (on) and zero (off) lanes. `Full` stands for all 16 on: whole
// vectors take plain loads and stores. Loads under a mask give +0 in the lanes off and read
// nothing there (a tail may end at a page); stores under a mask write the lanes on only.
#pragma once
#include <cstdint>

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define ET_LANES16 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define ET_LANES16 1
#endif

#if defined(ET_LANES16)
namespace et {
namespace lanes16 {

struct Full {};

#if defined(__AVX2__)
struct Lanes16 {
  __m256 lo, hi;
};
inline Lanes16 lanes_first(int64_t n) {  // lanes [0, n) on
  const __m256i vn = _mm256_set1_epi32(int(n));
  return {_mm256_castsi256_ps(_mm256_cmpgt_epi32(vn, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
          _mm256_castsi256_ps(_mm256_cmpgt_epi32(vn, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)))};
}
inline Lanes16 lanes_of_bits(uint32_t bits) {  // lane j on where bit j of the low 16 is set
  const __m256i b = _mm256_set1_epi32(int(bits & 0xFFFF));
  const __m256i lo = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i hi = _mm256_setr_epi32(256, 512, 1024, 2048, 4096, 8192, 16384, 32768);
  return {_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lo), lo)),
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, hi), hi))};
}
inline Lanes16 on16(Full) {
  const __m256 ones = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  return {ones, ones};
}
inline Lanes16 splat16(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Lanes16 load16(Full, const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Lanes16 load16(const Lanes16& m, const float* p) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
inline void store16(Full, float* p, const Lanes16& v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store16(const Lanes16& m, float* p, const Lanes16& v) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), v.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), v.hi);
}
// Streaming stores (p 32-byte aligned); the caller fences.
inline void stream16(float* p, const Lanes16& v) {
  _mm256_stream_ps(p, v.lo);
  _mm256_stream_ps(p + 8, v.hi);
}
inline void stream_fence() { _mm_sfence(); }
inline Lanes16 and16(const Lanes16& a, const Lanes16& b) { return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
inline Lanes16 add16(const Lanes16& a, const Lanes16& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes16 sub16(const Lanes16& a, const Lanes16& b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Lanes16 mul16(const Lanes16& a, const Lanes16& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Lanes16 fmadd16(const Lanes16& a, const Lanes16& b, const Lanes16& c) {  // a * b + c, one rounding
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
// v > 0 ? v : +0 (NaN and -0 give +0): max returns its second operand when unordered or equal.
inline Lanes16 relu16(const Lanes16& v) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_max_ps(v.lo, z), _mm256_max_ps(v.hi, z)};
}
inline Lanes16 gt_zero16(const Lanes16& v) {  // lanes where v > 0 (ordered: not NaN)
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_cmp_ps(v.lo, z, _CMP_GT_OQ), _mm256_cmp_ps(v.hi, z, _CMP_GT_OQ)};
}
inline Lanes16 blend16(const Lanes16& a, const Lanes16& b, const Lanes16& m) {  // m ? b : a
  return {_mm256_blendv_ps(a.lo, b.lo, m.lo), _mm256_blendv_ps(a.hi, b.hi, m.hi)};
}
// Bit j set where lane j's bits, as an unsigned 32-bit integer, are >= t (the bitmap's keep rule).
inline uint32_t bits_at_least16(const Lanes16& v, uint32_t t) {
  const __m256i vt = _mm256_set1_epi32(int32_t(t));
  auto half = [&](__m256 h) {
    const __m256i b = _mm256_castps_si256(h);
    return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_max_epu32(b, vt), b))));
  };
  return half(v.lo) | half(v.hi) << 8;
}
// The halving tree of AVX-512's reductions and the portable loops: lane j + 8 into j, then 4, 2, 1.
inline float halving_sum(const Lanes16& v) {
  const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#else  // aarch64 NEON: q[k] holds lanes 4k .. 4k + 3
struct Lanes16 {
  float32x4_t q[4];
};
inline Lanes16 from_u32(uint32x4_t a, uint32x4_t b, uint32x4_t c, uint32x4_t d) {
  return {{vreinterpretq_f32_u32(a), vreinterpretq_f32_u32(b), vreinterpretq_f32_u32(c), vreinterpretq_f32_u32(d)}};
}
inline uint32x4_t u32(float32x4_t v) { return vreinterpretq_u32_f32(v); }
inline Lanes16 lanes_first(int64_t n) {
  const int32x4_t vn = vdupq_n_s32(int32_t(n));
  const int32_t base[4] = {0, 1, 2, 3};
  const int32x4_t iota = vld1q_s32(base);
  return from_u32(vcltq_s32(iota, vn), vcltq_s32(vaddq_s32(iota, vdupq_n_s32(4)), vn),
                  vcltq_s32(vaddq_s32(iota, vdupq_n_s32(8)), vn), vcltq_s32(vaddq_s32(iota, vdupq_n_s32(12)), vn));
}
inline Lanes16 lanes_of_bits(uint32_t bits) {
  const uint32x4_t b = vdupq_n_u32(bits & 0xFFFF);
  const uint32_t base[4] = {1, 2, 4, 8};
  const uint32x4_t sel = vld1q_u32(base);
  return from_u32(vtstq_u32(b, sel), vtstq_u32(b, vshlq_n_u32(sel, 4)), vtstq_u32(b, vshlq_n_u32(sel, 8)),
                  vtstq_u32(b, vshlq_n_u32(sel, 12)));
}
inline Lanes16 on16(Full) {
  const uint32x4_t ones = vdupq_n_u32(0xFFFFFFFFu);
  return from_u32(ones, ones, ones, ones);
}
inline Lanes16 splat16(float v) {
  const float32x4_t s = vdupq_n_f32(v);
  return {{s, s, s, s}};
}
inline Lanes16 load16(Full, const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline Lanes16 load16(const Lanes16& m, const float* p) {  // lane by lane: NEON has no masked loads
  alignas(16) float t[16], on[16];
  for (int k = 0; k < 4; ++k) vst1q_f32(on + 4 * k, m.q[k]);
  for (int j = 0; j < 16; ++j) {
    uint32_t bitsj;
    __builtin_memcpy(&bitsj, on + j, 4);
    t[j] = bitsj ? p[j] : 0.f;
  }
  return load16(Full{}, t);
}
inline void store16(Full, float* p, const Lanes16& v) {
  for (int k = 0; k < 4; ++k) vst1q_f32(p + 4 * k, v.q[k]);
}
inline void store16(const Lanes16& m, float* p, const Lanes16& v) {
  alignas(16) float t[16], on[16];
  store16(Full{}, t, v);
  for (int k = 0; k < 4; ++k) vst1q_f32(on + 4 * k, m.q[k]);
  for (int j = 0; j < 16; ++j) {
    uint32_t bitsj;
    __builtin_memcpy(&bitsj, on + j, 4);
    if (bitsj) p[j] = t[j];
  }
}
inline void stream16(float* p, const Lanes16& v) { store16(Full{}, p, v); }
inline void stream_fence() {}
#define ET_LANES16_MAP(expr)                       \
  Lanes16 r;                                       \
  for (int k = 0; k < 4; ++k) r.q[k] = (expr);     \
  return r
inline Lanes16 and16(const Lanes16& a, const Lanes16& b) {
  ET_LANES16_MAP(vreinterpretq_f32_u32(vandq_u32(u32(a.q[k]), u32(b.q[k]))));
}
inline Lanes16 add16(const Lanes16& a, const Lanes16& b) { ET_LANES16_MAP(vaddq_f32(a.q[k], b.q[k])); }
inline Lanes16 sub16(const Lanes16& a, const Lanes16& b) { ET_LANES16_MAP(vsubq_f32(a.q[k], b.q[k])); }
inline Lanes16 mul16(const Lanes16& a, const Lanes16& b) { ET_LANES16_MAP(vmulq_f32(a.q[k], b.q[k])); }
inline Lanes16 fmadd16(const Lanes16& a, const Lanes16& b, const Lanes16& c) {
  ET_LANES16_MAP(vfmaq_f32(c.q[k], a.q[k], b.q[k]));
}
// v > 0 ? v : +0 by a select (vmaxq_f32 would pass NaN on).
inline Lanes16 relu16(const Lanes16& v) {
  ET_LANES16_MAP(vbslq_f32(vcgtq_f32(v.q[k], vdupq_n_f32(0.f)), v.q[k], vdupq_n_f32(0.f)));
}
inline Lanes16 gt_zero16(const Lanes16& v) { ET_LANES16_MAP(vreinterpretq_f32_u32(vcgtq_f32(v.q[k], vdupq_n_f32(0.f)))); }
inline Lanes16 blend16(const Lanes16& a, const Lanes16& b, const Lanes16& m) { ET_LANES16_MAP(vbslq_f32(u32(m.q[k]), b.q[k], a.q[k])); }
#undef ET_LANES16_MAP
inline uint32_t bits_at_least16(const Lanes16& v, uint32_t t) {
  const uint32_t base[4] = {1, 2, 4, 8};
  const uint32x4_t sel = vld1q_u32(base), vt = vdupq_n_u32(t);
  uint32_t bits = 0;
  for (int k = 0; k < 4; ++k) bits |= vaddvq_u32(vandq_u32(vcgeq_u32(u32(v.q[k]), vt), sel)) << (4 * k);
  return bits;
}
inline float halving_sum(const Lanes16& v) {
  const float32x4_t s8a = vaddq_f32(v.q[0], v.q[2]), s8b = vaddq_f32(v.q[1], v.q[3]);  // j + 8 into j
  const float32x4_t s4 = vaddq_f32(s8a, s8b);                                          // j + 4 into j
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));                // j + 2 into j
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);                                  // j + 1 into j
}
#endif

inline Lanes16 on16(const Lanes16& m) { return m; }

}  // namespace lanes16
}  // namespace et
#endif
