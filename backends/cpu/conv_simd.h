// A 16-float vector for the direct conv kernels, chosen at compile time: AVX-512 (one zmm), AVX2
// (two ymm), NEON (four q registers) or plain scalar arrays. VScalar always exists: it is the
// reference path the tests run against the native one (cpu::conv_force_scalar).
#pragma once
#include <cstdint>

#include "backends/cpu/always_inline.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__AVX__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace et::cpu {

struct VScalar {
  float v[16];
  static VScalar zero() { VScalar r; for (int i = 0; i < 16; ++i) r.v[i] = 0.f; return r; }
  static VScalar set1(float a) { VScalar r; for (int i = 0; i < 16; ++i) r.v[i] = a; return r; }
  static VScalar load(const float* p) { VScalar r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
  void store(float* p) const { for (int i = 0; i < 16; ++i) p[i] = v[i]; }
  // p = this + b; accumulated: p = p + (this + b) (an epilogue's bias and accumulation)
  void store_plus(float* p, float b, bool accumulate) const {
    for (int i = 0; i < 16; ++i) p[i] = accumulate ? p[i] + (v[i] + b) : v[i] + b;
  }
  // this += a * b
  void fma(const VScalar& a, const VScalar& b) { for (int i = 0; i < 16; ++i) v[i] += a.v[i] * b.v[i]; }
  // this += w * b: fma(set1(w), b), the same bits (NEON: one multiply-add by element, no splat)
  void fma_scalar(float w, const VScalar& b) { for (int i = 0; i < 16; ++i) v[i] += w * b.v[i]; }
  float hsum() const { float s = 0.f; for (int i = 0; i < 16; ++i) s += v[i]; return s; }
};

#if defined(__AVX512F__)
struct VNative {
  __m512 v;
  static VNative zero() { return {_mm512_setzero_ps()}; }
  static VNative set1(float a) { return {_mm512_set1_ps(a)}; }
  static VNative load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_plus(float* p, float b, bool accumulate) const {
    const __m512 r = _mm512_add_ps(v, _mm512_set1_ps(b));
    _mm512_storeu_ps(p, accumulate ? _mm512_add_ps(_mm512_loadu_ps(p), r) : r);
  }
  void fma(const VNative& a, const VNative& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  void fma_scalar(float w, const VNative& b) { v = _mm512_fmadd_ps(_mm512_set1_ps(w), b.v, v); }
  // Through memory, in a fixed tree order (the intrinsic reductions trip GCC 12's
  // -Wmaybe-uninitialized through their _mm256_undefined_* operands).
  float hsum() const {
    alignas(64) float t[16];
    _mm512_store_ps(t, v);
    for (int w = 8; w > 0; w /= 2)
      for (int i = 0; i < w; ++i) t[i] += t[i + w];
    return t[0];
  }
};
#elif defined(__AVX2__)
struct VNative {
  __m256 a, b;
  static VNative zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static VNative set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static VNative load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const { _mm256_storeu_ps(p, a); _mm256_storeu_ps(p + 8, b); }
  void store_plus(float* p, float c, bool accumulate) const {
    const __m256 vc = _mm256_set1_ps(c), ra = _mm256_add_ps(a, vc), rb = _mm256_add_ps(b, vc);
    _mm256_storeu_ps(p, accumulate ? _mm256_add_ps(_mm256_loadu_ps(p), ra) : ra);
    _mm256_storeu_ps(p + 8, accumulate ? _mm256_add_ps(_mm256_loadu_ps(p + 8), rb) : rb);
  }
  void fma(const VNative& x, const VNative& y) { a = _mm256_fmadd_ps(x.a, y.a, a); b = _mm256_fmadd_ps(x.b, y.b, b); }
  void fma_scalar(float w, const VNative& y) {
    const __m256 x = _mm256_set1_ps(w);
    a = _mm256_fmadd_ps(x, y.a, a);
    b = _mm256_fmadd_ps(x, y.b, b);
  }
  float hsum() const {
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_add_ps(a, b));
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};
#elif defined(__ARM_NEON)
// Four named registers, not an array: GCC 12 kept an array member of the accumulator blocks in
// memory, storing it on every step of the kernels' loops.
struct VNative {
  float32x4_t q0, q1, q2, q3;
  static VNative zero() { const float32x4_t z = vdupq_n_f32(0.f); return {z, z, z, z}; }
  static VNative set1(float a) { const float32x4_t x = vdupq_n_f32(a); return {x, x, x, x}; }
  static VNative load(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}; }
  void store(float* p) const { vst1q_f32(p, q0); vst1q_f32(p + 4, q1); vst1q_f32(p + 8, q2); vst1q_f32(p + 12, q3); }
  void store_plus(float* p, float b, bool accumulate) const {
    const float32x4_t vb = vdupq_n_f32(b);
    const float32x4_t r[4] = {vaddq_f32(q0, vb), vaddq_f32(q1, vb), vaddq_f32(q2, vb), vaddq_f32(q3, vb)};
    for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, accumulate ? vaddq_f32(vld1q_f32(p + 4 * i), r[i]) : r[i]);
  }
  void fma(const VNative& a, const VNative& b) {
    q0 = vfmaq_f32(q0, a.q0, b.q0);
    q1 = vfmaq_f32(q1, a.q1, b.q1);
    q2 = vfmaq_f32(q2, a.q2, b.q2);
    q3 = vfmaq_f32(q3, a.q3, b.q3);
  }
  void fma_scalar(float w, const VNative& b) {
    q0 = vfmaq_n_f32(q0, b.q0, w);
    q1 = vfmaq_n_f32(q1, b.q1, w);
    q2 = vfmaq_n_f32(q2, b.q2, w);
    q3 = vfmaq_n_f32(q3, b.q3, w);
  }
  float hsum() const { return vaddvq_f32(vaddq_f32(vaddq_f32(q0, q1), vaddq_f32(q2, q3))); }
};
#else
using VNative = VScalar;
#endif

// acc[i][v] += a[i] * x[v] for i < M, v < NV: the register block of the GEMM micro-kernel and the
// direct convs, a[] the M values of one step of a packed panel whose rows are MR floats apart.
template <int MR, class V, int M, int NV>
ET_ALWAYS_INLINE inline void fma_broadcast_rows(const float* a, const V (&x)[NV], V (&acc)[M][NV]) {
  for (int i = 0; i < M; ++i) {
    const V ai = V::set1(a[i]);
    for (int v = 0; v < NV; ++v) acc[i][v].fma(ai, x[v]);
  }
}

#if defined(__ARM_NEON) && !defined(__AVX512F__) && !defined(__AVX2__) && !defined(__AVX__)
// NEON: a[] in two registers and each multiply-add by lane (the same fmla, one rounding, so the
// same bits). With one broadcast register per a[i], 6 rows x 4 q accumulators + 4 q of x + 6
// broadcasts need 34 of the 32 q registers: GCC 12 stored every accumulator to the stack on every
// step of k (16 stores per 24 fmla in the GEMM's 6 x 16 block); this way they fit in 30.
template <int I, int M, int NV>
ET_ALWAYS_INLINE inline void fma_lane_rows(float32x4_t lo, float32x2_t hi, const VNative (&x)[NV],
                                           VNative (&acc)[M][NV]) {
  if constexpr (I < M) {
    for (int v = 0; v < NV; ++v) {
      VNative& c = acc[I][v];
      const VNative& b = x[v];
      if constexpr (I < 4) {
        c.q0 = vfmaq_laneq_f32(c.q0, b.q0, lo, I);
        c.q1 = vfmaq_laneq_f32(c.q1, b.q1, lo, I);
        c.q2 = vfmaq_laneq_f32(c.q2, b.q2, lo, I);
        c.q3 = vfmaq_laneq_f32(c.q3, b.q3, lo, I);
      } else {
        c.q0 = vfmaq_lane_f32(c.q0, b.q0, hi, I - 4);
        c.q1 = vfmaq_lane_f32(c.q1, b.q1, hi, I - 4);
        c.q2 = vfmaq_lane_f32(c.q2, b.q2, hi, I - 4);
        c.q3 = vfmaq_lane_f32(c.q3, b.q3, hi, I - 4);
      }
    }
    fma_lane_rows<I + 1, M, NV>(lo, hi, x, acc);
  }
}
template <int MR, int M, int NV>
ET_ALWAYS_INLINE inline void fma_broadcast_rows(const float* a, const VNative (&x)[NV], VNative (&acc)[M][NV]) {
  // Loads a[0, 4) and a[4, 6): within the panel's step of MR floats.
  static_assert(M <= 6 && MR >= 6, "NEON rows: a step of at least 6 floats, at most 6 rows");
  const float32x4_t lo = vld1q_f32(a);
  const float32x2_t hi = M > 4 ? vld1_f32(a + 4) : vdup_n_f32(0.f);
  fma_lane_rows<0, M, NV>(lo, hi, x, acc);
}
#endif

// Where a VNative spans several registers (AVX2: 2 of 16 ymm; NEON: 4 of 32 q; the portable
// build's arrays, SSE2: 4 of 16 xmm), the register blocks sized for AVX-512's 32 zmm (24
// accumulators) spill to the stack on every step: the direct kernels pick smaller blocks there
// (about 6 accumulators), with the same multiply-adds per element in the same order.
#if defined(__AVX512F__)
constexpr bool kNarrowVectors = false;
#else
constexpr bool kNarrowVectors = true;
#endif

// Keeps a loaded vector in a register: without it GCC 12 folds a load that several FMAs share into
// each of them as a memory operand (conv_channels_last.cpp: 27 loads instead of 9 per position).
inline void in_register(VScalar&) {}
#if defined(__AVX512F__)
inline void in_register(VNative& x) { asm("" : "+v"(x.v)); }
#elif defined(__AVX2__)
inline void in_register(VNative& x) { asm("" : "+x"(x.a), "+x"(x.b)); }
#elif defined(__ARM_NEON)
inline void in_register(VNative&) {}
#endif

// dst[k*ldd + i] = src[i*lds + k] for i, k < 8: the GEMM packing and the layout changes of the conv
// kernels transpose in 8x8 blocks (a scalar loop runs at about one element per cycle).
#if defined(__AVX__)
// Transposes 8 loaded rows r[i] (8 floats each) into dst[k*ldd + i]; r is clobbered.
inline void transpose8_rows(__m256 r[8], float* dst, int64_t ldd) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // r[0..3]: columns 0,1,2,3 of rows 0-3 (low lane) / columns 4,5,6,7 (high lane); r[4..7]: rows 4-7.
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
#if defined(__AVX__)
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  transpose8_rows(r, dst, ldd);
#else
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 8; ++k) dst[k * ldd + i] = src[i * lds + k];
#endif
}

}  // namespace et::cpu
