// Array conversions f32 <-> fp16 / bf16 for the stash: streaming passes, AVX-512, F16C or NEON where
// the target has them, the bit-exact scalar conversion otherwise; large arrays split over the bitmap
// module's OpenMP threads (these run once per saved tensor per step, like pack / unpack).
#include "memory/half.h"

#include <algorithm>
#include <cstring>

#include <omp.h>

#if defined(__F16C__) || defined(__AVX512F__)
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

}  // namespace

void f32_to_f16(const float* x, int64_t n, uint16_t* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) { to_f16(x, i0, i1, out); });
}

void f16_to_f32(const uint16_t* x, int64_t n, float* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) { from_f16(x, i0, i1, out); });
}

void f32_to_bf16(const float* x, int64_t n, uint16_t* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
      const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
      out[i] = nan ? uint16_t((u >> 16) | 0x40u) : uint16_t(rounded);
    }
  });
}

void bf16_to_f32(const uint16_t* x, int64_t n, float* out) {
  parallel_range(n, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      const uint32_t u = uint32_t(x[i]) << 16;
      std::memcpy(out + i, &u, 4);
    }
  });
}

}  // namespace et
