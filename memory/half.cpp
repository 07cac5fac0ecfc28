#include "memory/half.h"

#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "memory/bitmap.h"

namespace et {

void f32_to_f16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i] = bitmap::f32_to_f16(x[i]);
}

void f16_to_f32(const uint16_t* x, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) out[i] = bitmap::f16_to_f32(x[i]);
}

void f32_to_bf16(const float* x, int64_t n, uint16_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = nan ? uint16_t((u >> 16) | 0x40u) : uint16_t(rounded);
  }
}

void bf16_to_f32(const uint16_t* x, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(x[i]) << 16;
    std::memcpy(out + i, &u, 4);
  }
}

}  // namespace et
