// Array conversions f32 <-> fp16 / bf16 for the stash: streaming passes, AVX-512, F16C / AVX2 or NEON
// where the target has them, the bit-exact scalar conversion otherwise; large arrays split over the
// bitmap module's OpenMP threads (these run once per saved tensor per step, like pack / unpack, and
// on short rows inside kernels that read a 16-bit stash in place: BN's backward, StoredReader).
#include "memory/half.h"

#include <algorithm>
#include <cstring>

#include <omp.h>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define ET_HALF_NEON 1  // AArch64's conversions: round to nearest even (FPCR's default), NaN quieted as F16C does
#endif

#include "memory/bitmap.h"

namespace et {

namespace {

#if defined(__F16C__) || defined(__AVX512F__)  // the rounding macros exist only with immintrin.h
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif

// Runs body(i0, i1) over [0, n) in parts whose bounds are multiples of 64 elements.
template <typename Body>
void parallel_range(int64_t n, Body body) {
  const int T = n >= bitmap::kParallelMinElements ? bitmap::threads() : 1;
  if (T <= 1) {
    body(int64_t(0), n);
    return;
  }
  const int64_t blocks = (n + 63) / 64;
#pragma omp parallel num_threads(T)
  {
    const int p = omp_get_num_threads(), i = omp_get_thread_num();
    const int64_t i0 = std::min(n, blocks * i / p * 64), i1 = std::min(n, blocks * (i + 1) / p * 64);
    body(i0, i1);
  }
}

void to_f16(const float* x, int64_t i, int64_t end, uint16_t* out) {
#if defined(__AVX512F__)  // maskz forms: GCC 12 warns about the unmasked ones
  for (; i + 16 <= end; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_maskz_cvtps_ph(0xFFFF, _mm512_loadu_ps(x + i), kRound));
#elif defined(__F16C__)
  for (; i + 8 <= end; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), kRound));
#elif defined(ET_HALF_NEON)
  for (; i + 8 <= end; i += 8) {
    const float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(vld1q_f32(x + i)), vld1q_f32(x + i + 4));
    vst1q_u16(out + i, vreinterpretq_u16_f16(h));
  }
#endif
  for (; i < end; ++i) out[i] = bitmap::f32_to_f16(x[i]);
}

void from_f16(const uint16_t* x, int64_t i, int64_t end, float* out) {
#if defined(__AVX512F__)  // maskz forms: GCC 12 warns about the unmasked ones
  for (; i + 16 <= end; i += 16)
    _mm512_storeu_ps(out + i, _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
#elif defined(__F16C__)
  for (; i + 8 <= end; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#elif defined(ET_HALF_NEON)
  for (; i + 8 <= end; i += 8) {
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(x + i));
    vst1q_f32(out + i, vcvt_f32_f16(vget_low_f16(h)));
    vst1q_f32(out + i + 4, vcvt_high_f32_f16(h));
  }
#endif
  for (; i < end; ++i) out[i] = bitmap::f16_to_f32(x[i]);
}

// bfloat16: the upper 16 bits of the f32, rounded to nearest even; NaN keeps its upper bits with
// the quiet bit set (a NaN whose payload sits in the low bits must not round to inf). The vector
// forms compute the same integer expression as bf16_one; AVX-512 BF16's vcvtneps2bf16 is not used:
// it flushes denormals to zero.
inline uint16_t bf16_one(uint32_t u) {
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? uint16_t((u >> 16) | 0x40u) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void to_bf16(const float* x, int64_t i, int64_t end, uint16_t* out) {
#if defined(__AVX512F__)  // maskz forms with every lane: GCC 12 warns about the unmasked shifts / narrowing
  constexpr __mmask16 all = 0xFFFF;
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
  for (; i + 16 <= end; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __m512i hi = _mm512_maskz_srli_epi32(all, u, 16);
    const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(hi, one));
    const __m512i rounded = _mm512_maskz_srli_epi32(all, sum, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i r = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_maskz_cvtepi32_epi16(all, r));
  }
#elif defined(__AVX2__)
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
  for (; i + 8 <= end; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
    // |u| > inf as signed compares: both sides are below 2^31.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
    // Every lane is below 2^16: the unsigned-saturating pack is exact.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
#elif defined(ET_HALF_NEON)
  const uint32x4_t abs_mask = vdupq_n_u32(0x7FFFFFFFu), inf = vdupq_n_u32(0x7F800000u);
  const uint32x4_t bias = vdupq_n_u32(0x7FFFu), one = vdupq_n_u32(1u), quiet = vdupq_n_u32(0x40u);
  for (; i + 4 <= end; i += 4) {
    const uint32x4_t u = vreinterpretq_u32_f32(vld1q_f32(x + i));
    const uint32x4_t hi = vshrq_n_u32(u, 16);
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(u, bias), vandq_u32(hi, one)), 16);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, abs_mask), inf);
    vst1_u16(out + i, vmovn_u32(vbslq_u32(nan, vorrq_u32(hi, quiet), rounded)));
  }
#endif
  for (; i < end; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    out[i] = bf16_one(u);
  }
}

// Exact: the 16 bits become the upper half of the f32.
void from_bf16(const uint16_t* x, int64_t i, int64_t end, float* out) {
#if defined(__AVX512F__)  // maskz forms, as above
  constexpr __mmask16 all = 0xFFFF;
  for (; i + 16 <= end; i += 16) {
    const __m512i w = _mm512_maskz_cvtepu16_epi32(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    _mm512_storeu_si512(out + i, _mm512_maskz_slli_epi32(all, w, 16));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= end; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(w, 16));
  }
#elif defined(ET_HALF_NEON)
  for (; i + 8 <= end; i += 8) {
    const uint16x8_t h = vld1q_u16(x + i);
    vst1q_f32(out + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)));
    vst1q_f32(out + i + 4, vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)));
  }
#endif
  for (; i < end; ++i) {
    const uint32_t u = uint32_t(x[i]) << 16;
    std::memcpy(out + i, &u, 4);
  }
}

}  // namespace

void f32_to_f16(const float* x, int64_t n, uint16_t* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) { to_f16(x, i0, i1, out); });
}

void f16_to_f32(const uint16_t* x, int64_t n, float* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) { from_f16(x, i0, i1, out); });
}

void f32_to_bf16(const float* x, int64_t n, uint16_t* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) { to_bf16(x, i0, i1, out); });
}

void bf16_to_f32(const uint16_t* x, int64_t n, float* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) { from_bf16(x, i0, i1, out); });
}

}  // namespace et
