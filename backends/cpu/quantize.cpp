// CPU quantizers (quantize.h) and the CpuBackend entry points that thread them.
#include "backends/cpu/quantize.h"

#include <omp.h>

#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define ET_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ET_QUANT_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define ET_QUANT_NEON 1
#endif

#include "backends/cpu/cpu_backend.h"

namespace et::cpu {

namespace {
bool g_force_scalar = false;
constexpr int kParts = 8;  // fixed split of the statistics (thread-count independent)
constexpr int kLanes = 16;

struct PartStats {
  double sq[kLanes] = {}, ab[kLanes] = {};
  float max_abs = 0;
  bool finite = true;
};

// Lane j accumulates the elements i = j (mod 16) of the part, as the vector path does.
// Without moments only the maximum and finiteness (the FP4 alpha needs no more).
template <bool Moments>
void stats_scalar(const float* x, int64_t n, PartStats* s) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (!std::isfinite(v)) {
      s->finite = false;
      continue;
    }
    s->max_abs = std::fmax(s->max_abs, std::fabs(v));
    if (!Moments) continue;
    const double d = double(v);
    s->sq[i % kLanes] = std::fma(d, d, s->sq[i % kLanes]);  // as _mm512_fmadd_pd
    s->ab[i % kLanes] += std::fabs(d);
  }
}

#if ET_QUANT_AVX512
// GCC 12's unmasked AVX-512 intrinsics (_mm512_max_ps, _mm512_srli_epi32, _mm512_cvtps_pd, ...)
// pass an _mm512_undefined_*() merge operand to their masked builtins and trip
// -Wmaybe-uninitialized. The code below uses the maskz_ forms with an all-ones mask instead:
// the same instructions, so the same bits.
constexpr __mmask16 kAll16 = 0xFFFF;
constexpr __mmask8 kAll8 = 0xFF;

// Half H (0: low, 1: high) of a: _mm512_extractf64x4_pd, which _mm512_castps512_ps256 is in GCC 12, too.
template <int H>
__m256 half_ps(__m512 a) {
  return _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xF, _mm512_castps_pd(a), H));
}

// _mm512_reduce_max_ps with the same operations in the same order as GCC 12's
// (__MM512_REDUCE_OP in avx512fintrin.h: 512 -> 256 -> 128 -> 64 -> 32 bits, high half first).
float reduce_max_ps(__m512 a) {
  const __m256 t1 = half_ps<1>(a);
  const __m256 t2 = half_ps<0>(a);
  const __m256 t3 = _mm256_max_ps(t1, t2);
  const __m128 t4 = _mm256_extractf128_ps(t3, 1);
  const __m128 t5 = _mm256_extractf128_ps(t3, 0);
  const __m128 t6 = _mm_max_ps(t4, t5);
  const __m128 t7 = _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2));  // lanes {2, 3, 0, 1}
  const __m128 t8 = _mm_max_ps(t6, t7);
  const __m128 t9 = _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1));  // lanes {1, 0, 1, 0}
  return _mm_cvtss_f32(_mm_max_ps(t8, t9));
}

template <bool Moments>
void stats_avx512(const float* x, int64_t n, PartStats* s) {
  __m512d sq_lo = _mm512_setzero_pd(), sq_hi = sq_lo, ab_lo = sq_lo, ab_hi = sq_lo;
  __m512 mx = _mm512_setzero_ps();
  __mmask16 bad = 0;
  const __m512 inf = _mm512_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 a = _mm512_abs_ps(v);
    const __mmask16 fin = _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ);  // false for inf and NaN
    bad |= __mmask16(m & ~fin);
    mx = _mm512_maskz_max_ps(kAll16, mx, _mm512_maskz_mov_ps(fin, a));
    if (!Moments) continue;
    v = _mm512_maskz_mov_ps(fin, v);
    const __m512d lo = _mm512_maskz_cvtps_pd(kAll8, half_ps<0>(v));
    const __m512d hi = _mm512_maskz_cvtps_pd(kAll8, half_ps<1>(v));
    sq_lo = _mm512_fmadd_pd(lo, lo, sq_lo);
    sq_hi = _mm512_fmadd_pd(hi, hi, sq_hi);
    ab_lo = _mm512_add_pd(ab_lo, _mm512_abs_pd(lo));
    ab_hi = _mm512_add_pd(ab_hi, _mm512_abs_pd(hi));
  }
  double t[kLanes];
  _mm512_storeu_pd(t, sq_lo);
  _mm512_storeu_pd(t + 8, sq_hi);
  for (int j = 0; j < kLanes; ++j) s->sq[j] += t[j];
  _mm512_storeu_pd(t, ab_lo);
  _mm512_storeu_pd(t + 8, ab_hi);
  for (int j = 0; j < kLanes; ++j) s->ab[j] += t[j];
  s->max_abs = std::fmax(s->max_abs, reduce_max_ps(mx));
  s->finite = s->finite && bad == 0;
}
#endif

#if ET_QUANT_AVX2
// 16 elements a step in four vectors of 4 doubles: lane j of the scalar reference (i mod 16) is
// lane j mod 4 of vector j / 4. A tail of fewer than 16 takes the scalar loop, whose lanes are the
// same (the part starts on a multiple of 16).
template <bool Moments>
void stats_avx2(const float* x, int64_t n, PartStats* s) {
  __m256d sq[4], ab[4];
  for (int k = 0; k < 4; ++k) sq[k] = _mm256_setzero_pd(), ab[k] = _mm256_setzero_pd();
  __m256 mx = _mm256_setzero_ps();
  const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.f);
  const __m256d dsign = _mm256_set1_pd(-0.0);
  int bad = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_loadu_ps(x + i + 8 * h);
      const __m256 a = _mm256_andnot_ps(sign, v);
      const __m256 fin = _mm256_cmp_ps(a, inf, _CMP_LT_OQ);  // false for inf and NaN
      bad |= _mm256_movemask_ps(fin) ^ 0xFF;
      mx = _mm256_max_ps(mx, _mm256_and_ps(fin, a));
      if (!Moments) continue;
      v = _mm256_and_ps(fin, v);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      sq[2 * h] = _mm256_fmadd_pd(lo, lo, sq[2 * h]);
      sq[2 * h + 1] = _mm256_fmadd_pd(hi, hi, sq[2 * h + 1]);
      ab[2 * h] = _mm256_add_pd(ab[2 * h], _mm256_andnot_pd(dsign, lo));
      ab[2 * h + 1] = _mm256_add_pd(ab[2 * h + 1], _mm256_andnot_pd(dsign, hi));
    }
  double t[kLanes];
  for (int k = 0; k < 4; ++k) _mm256_storeu_pd(t + 4 * k, sq[k]);
  for (int j = 0; j < kLanes; ++j) s->sq[j] += t[j];
  for (int k = 0; k < 4; ++k) _mm256_storeu_pd(t + 4 * k, ab[k]);
  for (int j = 0; j < kLanes; ++j) s->ab[j] += t[j];
  alignas(32) float m[8];
  _mm256_store_ps(m, mx);
  for (float v : m) s->max_abs = std::fmax(s->max_abs, v);
  s->finite = s->finite && bad == 0;
  stats_scalar<Moments>(x + i, n - i, s);  // i is a multiple of 16: the tail's lanes line up
}
#endif

#if ET_QUANT_NEON
// 16 elements a step in eight vectors of 2 doubles: lane j of the scalar reference (i mod 16) is
// lane j mod 2 of vector j / 2; the tail takes the scalar loop, as on AVX2.
template <bool Moments>
void stats_neon(const float* x, int64_t n, PartStats* s) {
  float64x2_t sq[8], ab[8];
  for (int k = 0; k < 8; ++k) sq[k] = vdupq_n_f64(0.0), ab[k] = vdupq_n_f64(0.0);
  float32x4_t mx = vdupq_n_f32(0.f);
  const float32x4_t inf = vdupq_n_f32(INFINITY);
  uint32x4_t all_finite = vdupq_n_u32(~0u);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int h = 0; h < 4; ++h) {
      float32x4_t v = vld1q_f32(x + i + 4 * h);
      const float32x4_t a = vabsq_f32(v);
      const uint32x4_t fin = vcltq_f32(a, inf);  // false for inf and NaN
      all_finite = vandq_u32(all_finite, fin);
      mx = vmaxq_f32(mx, vreinterpretq_f32_u32(vandq_u32(fin, vreinterpretq_u32_f32(a))));
      if (!Moments) continue;
      v = vreinterpretq_f32_u32(vandq_u32(fin, vreinterpretq_u32_f32(v)));
      const float64x2_t lo = vcvt_f64_f32(vget_low_f32(v)), hi = vcvt_high_f64_f32(v);
      sq[2 * h] = vfmaq_f64(sq[2 * h], lo, lo);
      sq[2 * h + 1] = vfmaq_f64(sq[2 * h + 1], hi, hi);
      ab[2 * h] = vaddq_f64(ab[2 * h], vabsq_f64(lo));
      ab[2 * h + 1] = vaddq_f64(ab[2 * h + 1], vabsq_f64(hi));
    }
  double t[kLanes];
  for (int k = 0; k < 8; ++k) vst1q_f64(t + 2 * k, sq[k]);
  for (int j = 0; j < kLanes; ++j) s->sq[j] += t[j];
  for (int k = 0; k < 8; ++k) vst1q_f64(t + 2 * k, ab[k]);
  for (int j = 0; j < kLanes; ++j) s->ab[j] += t[j];
  s->max_abs = std::fmax(s->max_abs, vmaxvq_f32(mx));
  s->finite = s->finite && vminvq_u32(all_finite) != 0;
  stats_scalar<Moments>(x + i, n - i, s);  // i is a multiple of 16: the tail's lanes line up
}
#endif

template <bool Moments>
void stats_part(const float* x, int64_t n, PartStats* s) {
#if ET_QUANT_AVX512
  if (!g_force_scalar) return stats_avx512<Moments>(x, n, s);
#elif ET_QUANT_AVX2
  if (!g_force_scalar) return stats_avx2<Moments>(x, n, s);
#elif ET_QUANT_NEON
  if (!g_force_scalar) return stats_neon<Moments>(x, n, s);
#endif
  stats_scalar<Moments>(x, n, s);
}

int8_t int4_scalar(float v, float inv, float lo, float hi) {
  float r = std::nearbyint(v * inv);
  r = std::fmin(std::fmax(r, lo), hi);
  return int8_t(int(r));
}

void fp4_scalar(const float* g, int64_t begin, int64_t end, float inv_alpha, int levels, Fp4Rounding mode,
                quant::RngKey key, int8_t* q) {
  for (int64_t i = begin; i < end; ++i) {
    const float a = std::fabs(g[i]) * inv_alpha;
    const int f = quant::fp4_field(a, levels, mode, quant::rng_bits(key, uint32_t(i)));
    q[i] = quant::fp4_value(std::signbit(g[i]) ? 1 : 0, f);
  }
}

#if ET_QUANT_AVX512
__m512i fmix32_v(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_maskz_srli_epi32(kAll16, h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_maskz_srli_epi32(kAll16, h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_maskz_srli_epi32(kAll16, h, 16));
}

void fp4_avx512(const float* g, int64_t begin, int64_t end, float inv_alpha, int levels, Fp4Rounding mode,
                quant::RngKey key, int8_t* q) {
  const __m512 inv = _mm512_set1_ps(inv_alpha), one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  const __m512i k0 = _mm512_set1_epi32(int(key.k0)), k1 = _mm512_set1_epi32(int(key.k1));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i mant_mask = _mm512_set1_epi32(0x7FFFFF), top = _mm512_set1_epi32(levels - 1);
  const __m512i half_mant = _mm512_set1_epi32(0x400000), ones_i = _mm512_set1_epi32(1);
  const bool stochastic = mode == Fp4Rounding::Stochastic;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 v = _mm512_loadu_ps(g + i);
    const __m512 a = _mm512_mul_ps(_mm512_abs_ps(v), inv);
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int(uint32_t(i))), lane);
    const __m512i rnd = fmix32_v(_mm512_add_epi32(fmix32_v(_mm512_xor_si512(idx, k0)), k1));
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i e = _mm512_sub_epi32(_mm512_maskz_srli_epi32(kAll16, bits, 23), _mm512_set1_epi32(127));
    const __m512i mant = _mm512_and_si512(bits, mant_mask);
    // Between powers of two (a >= 1).
    const __mmask16 up_n = stochastic ? _mm512_cmplt_epu32_mask(_mm512_maskz_srli_epi32(kAll16, rnd, 9), mant)
                                      : _mm512_cmpge_epu32_mask(mant, half_mant);
    __m512i f = _mm512_add_epi32(_mm512_add_epi32(e, ones_i), _mm512_maskz_mov_epi32(up_n, ones_i));
    f = _mm512_mask_mov_epi32(f, _mm512_cmpge_epi32_mask(e, top), _mm512_set1_epi32(levels));
    // Below alpha (a < 1): 0 or 1.
    const __mmask16 under = _mm512_cmp_ps_mask(a, one, _CMP_LT_OQ);
    const __mmask16 up_u =
        stochastic ? _mm512_cmp_ps_mask(
                         _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(kAll16, _mm512_maskz_srli_epi32(kAll16, rnd, 8)),
                                       _mm512_set1_ps(0x1p-24f)),
                         a, _CMP_LT_OQ)
                   : _mm512_cmp_ps_mask(a, half, _CMP_GE_OQ);
    f = _mm512_mask_mov_epi32(f, under, _mm512_maskz_mov_epi32(up_u, ones_i));
    // Value +-2^(f-1), 0 for f = 0.
    __m512i mag = _mm512_maskz_sllv_epi32(_mm512_cmpgt_epi32_mask(f, _mm512_setzero_si512()), ones_i,
                                          _mm512_sub_epi32(f, ones_i));
    const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(v));  // sign bit
    mag = _mm512_mask_sub_epi32(mag, neg, _mm512_setzero_si512(), mag);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_maskz_cvtepi32_epi8(kAll16, mag));
  }
  fp4_scalar(g, i, end, inv_alpha, levels, mode, key, q);
}
#endif

#if ET_QUANT_AVX2
// 8 int32 lanes (each within int8) to 8 bytes at q.
void store_bytes8(int8_t* q, __m256i v) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));  // 8 x int16
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
}

__m256i fmix32_v8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0x85EBCA6Bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0xC2B2AE35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// quant::fp4_field on 8 lanes (the AVX-512 path's steps; the unsigned compares are signed ones
// here, every operand being below 2^24).
void fp4_avx2(const float* g, int64_t begin, int64_t end, float inv_alpha, int levels, Fp4Rounding mode,
              quant::RngKey key, int8_t* q) {
  const __m256 inv = _mm256_set1_ps(inv_alpha), one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f);
  const __m256 sign = _mm256_set1_ps(-0.f), unit = _mm256_set1_ps(1.f / 16777216.f);
  const __m256i k0 = _mm256_set1_epi32(int(key.k0)), k1 = _mm256_set1_epi32(int(key.k1));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), ones = _mm256_set1_epi32(1);
  const __m256i mant_mask = _mm256_set1_epi32(0x7FFFFF), below_half = _mm256_set1_epi32(0x3FFFFF);
  const __m256i top_less1 = _mm256_set1_epi32(levels - 2), top = _mm256_set1_epi32(levels);
  const bool stochastic = mode == Fp4Rounding::Stochastic;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    const __m256 a = _mm256_mul_ps(_mm256_andnot_ps(sign, v), inv);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(i))), lane);
    const __m256i rnd = fmix32_v8(_mm256_add_epi32(fmix32_v8(_mm256_xor_si256(idx, k0)), k1));
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    const __m256i mant = _mm256_and_si256(bits, mant_mask);
    // Between powers of two (a >= 1): e + 1, + 1 rounding up; the top level from e >= levels - 1.
    const __m256i up_n = stochastic ? _mm256_cmpgt_epi32(mant, _mm256_srli_epi32(rnd, 9))
                                    : _mm256_cmpgt_epi32(mant, below_half);
    __m256i f = _mm256_sub_epi32(_mm256_add_epi32(e, ones), up_n);  // up_n is -1 where true
    f = _mm256_blendv_epi8(f, top, _mm256_cmpgt_epi32(e, top_less1));
    // Below alpha (a < 1): 0 or 1.
    const __m256 under = _mm256_cmp_ps(a, one, _CMP_LT_OQ);
    const __m256 up_u = stochastic ? _mm256_cmp_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(rnd, 8)), unit), a,
                                                   _CMP_LT_OQ)
                                   : _mm256_cmp_ps(a, half, _CMP_GE_OQ);
    f = _mm256_blendv_epi8(f, _mm256_and_si256(_mm256_castps_si256(up_u), ones), _mm256_castps_si256(under));
    // Value +-2^(f-1), 0 for f = 0 (a shift by 2^32 - 1 gives 0).
    __m256i mag = _mm256_sllv_epi32(ones, _mm256_sub_epi32(f, ones));
    const __m256i neg = _mm256_srai_epi32(_mm256_castps_si256(v), 31);  // the sign bit, as all ones
    mag = _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg);               // -mag where negative
    store_bytes8(q + i, mag);
  }
  fp4_scalar(g, i, end, inv_alpha, levels, mode, key, q);
}
#endif

#if ET_QUANT_NEON
// 4 int32 lanes (each within int8) to 4 bytes at q.
void store_bytes4(int8_t* q, int32x4_t v) {
  const int16x4_t h = vmovn_s32(v);
  const int8x8_t b = vmovn_s16(vcombine_s16(h, h));
  vst1_lane_s32(reinterpret_cast<int32_t*>(q), vreinterpret_s32_s8(b), 0);
}

uint32x4_t fmix32_v4(uint32x4_t h) {
  h = veorq_u32(h, vshrq_n_u32(h, 16));
  h = vmulq_u32(h, vdupq_n_u32(0x85EBCA6Bu));
  h = veorq_u32(h, vshrq_n_u32(h, 13));
  h = vmulq_u32(h, vdupq_n_u32(0xC2B2AE35u));
  return veorq_u32(h, vshrq_n_u32(h, 16));
}

// quant::fp4_field on 4 lanes (the AVX-512 path's steps).
void fp4_neon(const float* g, int64_t begin, int64_t end, float inv_alpha, int levels, Fp4Rounding mode,
              quant::RngKey key, int8_t* q) {
  const float32x4_t inv = vdupq_n_f32(inv_alpha), one = vdupq_n_f32(1.f), half = vdupq_n_f32(0.5f);
  const float32x4_t unit = vdupq_n_f32(1.f / 16777216.f);
  const uint32x4_t k0 = vdupq_n_u32(key.k0), k1 = vdupq_n_u32(key.k1), ones = vdupq_n_u32(1);
  const uint32_t lanes[4] = {0, 1, 2, 3};
  const uint32x4_t lane = vld1q_u32(lanes);
  const int32x4_t top = vdupq_n_s32(levels);
  const bool stochastic = mode == Fp4Rounding::Stochastic;
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    const float32x4_t v = vld1q_f32(g + i);
    const float32x4_t a = vmulq_f32(vabsq_f32(v), inv);
    const uint32x4_t idx = vaddq_u32(vdupq_n_u32(uint32_t(i)), lane);
    const uint32x4_t rnd = fmix32_v4(vaddq_u32(fmix32_v4(veorq_u32(idx, k0)), k1));
    const uint32x4_t bits = vreinterpretq_u32_f32(a);
    const int32x4_t e = vsubq_s32(vreinterpretq_s32_u32(vshrq_n_u32(bits, 23)), vdupq_n_s32(127));
    const uint32x4_t mant = vandq_u32(bits, vdupq_n_u32(0x7FFFFF));
    // Between powers of two (a >= 1): e + 1, + 1 rounding up; the top level from e >= levels - 1.
    const uint32x4_t up_n = stochastic ? vcltq_u32(vshrq_n_u32(rnd, 9), mant) : vcgeq_u32(mant, vdupq_n_u32(0x400000));
    int32x4_t f = vaddq_s32(vaddq_s32(e, vdupq_n_s32(1)), vreinterpretq_s32_u32(vandq_u32(up_n, ones)));
    f = vbslq_s32(vcgeq_s32(e, vdupq_n_s32(levels - 1)), top, f);
    // Below alpha (a < 1): 0 or 1.
    const uint32x4_t under = vcltq_f32(a, one);
    const uint32x4_t up_u =
        stochastic ? vcltq_f32(vmulq_f32(vcvtq_f32_u32(vshrq_n_u32(rnd, 8)), unit), a) : vcgeq_f32(a, half);
    f = vbslq_s32(under, vreinterpretq_s32_u32(vandq_u32(up_u, ones)), f);
    // Value +-2^(f-1), 0 for f = 0 (a shift by -1 is a right shift of 1).
    int32x4_t mag = vreinterpretq_s32_u32(vshlq_u32(ones, vsubq_s32(f, vdupq_n_s32(1))));
    const uint32x4_t neg = vcltq_s32(vreinterpretq_s32_f32(v), vdupq_n_s32(0));  // the sign bit
    mag = vbslq_s32(neg, vnegq_s32(mag), mag);
    store_bytes4(q + i, mag);
  }
  fp4_scalar(g, i, end, inv_alpha, levels, mode, key, q);
}
#endif

}  // namespace

void quant_force_scalar(bool on) { g_force_scalar = on; }

TensorStats tensor_stats(const float* x, int64_t n, bool moments) {
  PartStats parts[kParts];
  // Part boundaries on multiples of 16, so every part's lanes line up with the vector path.
  const int64_t per = ((n + kParts - 1) / kParts + kLanes - 1) / kLanes * kLanes;
#pragma omp parallel for schedule(static)
  for (int p = 0; p < kParts; ++p) {
    const int64_t b = std::min<int64_t>(n, p * per), e = std::min<int64_t>(n, b + per);
    if (e > b) moments ? stats_part<true>(x + b, e - b, &parts[p]) : stats_part<false>(x + b, e - b, &parts[p]);
  }
  TensorStats s;
  for (const PartStats& p : parts) {
    for (int j = 0; j < kLanes; ++j) s.sum_sq += p.sq[j], s.sum_abs += p.ab[j];
    s.max_abs = std::fmax(s.max_abs, p.max_abs);
    s.finite = s.finite && p.finite;
  }
  return s;
}

void quantize_int4(const float* x, int64_t n, float inv_scale, int lo, int hi, int8_t* q) {
  const float flo = float(lo), fhi = float(hi);
#if ET_QUANT_AVX512
  if (!g_force_scalar) {
    const __m512 inv = _mm512_set1_ps(inv_scale), vlo = _mm512_set1_ps(flo), vhi = _mm512_set1_ps(fhi);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n / 16; ++i) {
      __m512 r = _mm512_maskz_roundscale_ps(kAll16, _mm512_mul_ps(_mm512_loadu_ps(x + i * 16), inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm512_maskz_min_ps(kAll16, _mm512_maskz_max_ps(kAll16, r, vlo), vhi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 16),
                       _mm512_maskz_cvtepi32_epi8(kAll16, _mm512_maskz_cvtps_epi32(kAll16, r)));
    }
    for (int64_t i = n / 16 * 16; i < n; ++i) q[i] = int4_scalar(x[i], inv_scale, flo, fhi);
    return;
  }
#endif
#if ET_QUANT_AVX2
  if (!g_force_scalar) {
    const __m256 inv = _mm256_set1_ps(inv_scale), vlo = _mm256_set1_ps(flo), vhi = _mm256_set1_ps(fhi);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n / 8; ++i) {
      __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i * 8), inv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, vlo), vhi);
      store_bytes8(q + i * 8, _mm256_cvtps_epi32(r));
    }
    for (int64_t i = n / 8 * 8; i < n; ++i) q[i] = int4_scalar(x[i], inv_scale, flo, fhi);
    return;
  }
#elif ET_QUANT_NEON
  if (!g_force_scalar) {
    const float32x4_t inv = vdupq_n_f32(inv_scale), vlo = vdupq_n_f32(flo), vhi = vdupq_n_f32(fhi);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n / 4; ++i) {
      float32x4_t r = vrndnq_f32(vmulq_f32(vld1q_f32(x + i * 4), inv));  // nearest, ties to even
      r = vminq_f32(vmaxq_f32(r, vlo), vhi);
      store_bytes4(q + i * 4, vcvtq_s32_f32(r));
    }
    for (int64_t i = n / 4 * 4; i < n; ++i) q[i] = int4_scalar(x[i], inv_scale, flo, fhi);
    return;
  }
#endif
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) q[i] = int4_scalar(x[i], inv_scale, flo, fhi);
}

void quantize_fp4(const float* g, int64_t n, float inv_alpha, int levels, Fp4Rounding mode, quant::RngKey key,
                  int8_t* q) {
  ET_CHECK(levels >= 1 && levels <= quant::kFp4MaxLevels, "FP4 levels ", levels);
  ET_CHECK(n < (int64_t(1) << 32), "tensor too large for 32-bit RNG counters");
  // Threads take whole blocks of 4096 (16-aligned, so the vector path sees the same elements).
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < (n + 4095) / 4096; ++blk) {
    const int64_t b = blk * 4096, e = std::min<int64_t>(n, b + 4096);
#if ET_QUANT_AVX512
    if (!g_force_scalar) {
      fp4_avx512(g, b, e, inv_alpha, levels, mode, key, q);
      continue;
    }
#elif ET_QUANT_AVX2
    if (!g_force_scalar) {
      fp4_avx2(g, b, e, inv_alpha, levels, mode, key, q);
      continue;
    }
#elif ET_QUANT_NEON
    if (!g_force_scalar) {
      fp4_neon(g, b, e, inv_alpha, levels, mode, key, q);
      continue;
    }
#endif
    fp4_scalar(g, b, e, inv_alpha, levels, mode, key, q);
  }
}

void dequantize(const int8_t* q, int64_t n, float scale, float* y) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = float(q[i]) * scale;
}

int64_t sum_codes(const int8_t* q, int64_t n) {
  int64_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i];
  return s;
}

}  // namespace et::cpu

namespace et {

TensorStats CpuBackend::tensor_stats(const Tensor& x) {
  ET_CHECK(x.is_contiguous());
  return cpu::tensor_stats(x.f32(), x.numel(), true);
}

TensorStats CpuBackend::tensor_max_abs(const Tensor& x) {
  ET_CHECK(x.is_contiguous());
  return cpu::tensor_stats(x.f32(), x.numel(), false);
}

void CpuBackend::quantize_int4(const Tensor& x, Tensor& q) {
  ET_CHECK(x.numel() == q.numel() && q.host_scale() > 0.f && (q.dtype == DType::I4 || q.dtype == DType::U4));
  const bool u = q.dtype == DType::U4;
  cpu::quantize_int4(x.f32(), x.numel(), 1.f / q.host_scale(), u ? 0 : -quant::kInt4SignedMax,
                     u ? quant::kInt4UnsignedMax : quant::kInt4SignedMax, q.codes());
}

void CpuBackend::quantize_fp4(const Tensor& g, int levels, Fp4Rounding mode, const QuantDraw& draw, Tensor& q) {
  ET_CHECK(g.numel() == q.numel() && q.dtype == DType::F4);
  const float alpha = q.host_scale();
  if (alpha == 0.f) {  // an all-zero gradient: every code is zero
    std::memset(q.codes(), 0, size_t(q.numel()));
    return;
  }
  cpu::quantize_fp4(g.f32(), g.numel(), 1.f / alpha, levels, mode, draw.key(), q.codes());
}

// Scales in host memory (Backend::quant_scales_in_memory, which tests turn on): the layers' own
// computation, written where the code tensors point.
void CpuBackend::int4_scale_to(const Tensor& x, bool is_unsigned, float* scale, uint32_t* flag, uint32_t code) {
  const TensorStats s = tensor_stats(x);
  if (!s.finite && *flag == 0) *flag = code;
  *scale = quant::sawb_scale(s, x.numel(), is_unsigned);
}

void CpuBackend::fp4_alpha_to(const Tensor& g, int levels, float* alpha, uint32_t* flag, uint32_t code) {
  const TensorStats s = tensor_max_abs(g);
  if (!s.finite && *flag == 0) *flag = code;
  *alpha = quant::fp4_alpha(s.max_abs, levels);
}

void CpuBackend::divide_scale_to(const float* scale, int divisor, float* out) { *out = *scale / float(divisor); }

void CpuBackend::dequantize(const Tensor& q, Tensor& y) {
  ET_CHECK(q.numel() == y.numel());
  cpu::dequantize(q.codes(), q.numel(), q.host_scale(), y.f32());
}

}  // namespace et
