// Sixteen float lanes in one AVX-512 register, with the names and meanings of lanes8.h, so the
// kernels written once over a lane type (pool_stride1.h) take either. A lane holds a float or a
// 32-bit integer in a float's bits; a mask is a mask register (M), where lanes8.h's is a vector of
// all-ones and zero lanes. Each lane computes what lanes8.h's does, so both give the same bits.
//
// Why a 16-lane form beside the 8-lane one: on a host with full-width 512-bit units (Zen 5) it
// issues half the instructions for the same arithmetic; on Zen 4, which splits each 512-bit
// operation in two, the instruction count still halves (docs/fusion-log.md, session 40).
#pragma once
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ET_LANES512 1

namespace et {
namespace lanes512 {

constexpr int kWidth = 16;
using F = __m512;
using M = __mmask16;
inline F splat(float v) { return _mm512_set1_ps(v); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline void stream(float* p, F v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned; the caller fences
inline F load_int(const int32_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
inline void store_int(int32_t* p, F v) { _mm512_storeu_ps(reinterpret_cast<float*>(p), v); }
// Lanes l with first + l in [0, n): on.
inline M inside(int64_t first, int64_t n) {
  const __m512i l = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_cmpgt_epi32_mask(l, _mm512_set1_epi32(int32_t(-first - 1))) &
         _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int32_t(n - first)), l);
}
// p[0, 16) where inside(first, n) (p = row + first), `outside` elsewhere; reads nothing outside
// (a masked load does not fault on the lanes off).
inline F load_inside(const float* p, int64_t first, int64_t n, F outside) {
  if (first >= 0 && first + 16 <= n) return _mm512_loadu_ps(p);
  return _mm512_mask_loadu_ps(outside, inside(first, n), p);
}
// p[0, 16) = v where first + l < n (first >= 0: row ends only); writes nothing past n.
inline void store_inside(float* p, int64_t first, int64_t n, F v) {
  if (__builtin_expect(first + 16 <= n, 1)) return _mm512_storeu_ps(p, v);
  _mm512_mask_storeu_ps(p, inside(first, n), v);
}
inline M greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }  // false on NaN
inline F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, a, b); }    // m ? b : a
// max in its maskz form, all lanes on: the same instruction, without the unmasked intrinsic's
// undefined source, which GCC 12 reports as -Wmaybe-uninitialized.
inline F keep_greater(F v, F m) { return _mm512_maskz_max_ps(0xFFFF, v, m); }  // v > m ? v : m
inline F keep_where(F v, M m) { return _mm512_maskz_mov_ps(m, v); }         // m ? v : +0
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline F relu(F v) { return _mm512_maskz_max_ps(0xFFFF, v, _mm512_setzero_ps()); }  // v > 0 ? v : +0
inline F int_splat(int32_t v) { return _mm512_castsi512_ps(_mm512_set1_epi32(v)); }
inline F int_add(F a, F b) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}
// base[kOff, kOff + 16) for base 64-byte aligned, from the two whole vectors around it: a load that
// straddles two vectors stored a moment ago waits until both stores have completed, where whole
// aligned vectors come from the store queue; valignd then shifts the lanes. Reads base up to
// [kOff + 32) rounded down to 16.
template <int kOff>
inline F load_at(const float* base) {
  static_assert(kOff >= 0, "offsets from the aligned base forward");
  constexpr int lo = kOff / 16 * 16, shift = kOff % 16;
  if constexpr (shift == 0) {
    return _mm512_loadu_ps(base + lo);
  } else {
    const __m512i a = _mm512_castps_si512(_mm512_loadu_ps(base + lo));
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(base + lo + 16));
    return _mm512_castsi512_ps(_mm512_maskz_alignr_epi32(0xFFFF, b, a, shift));  // maskz: as keep_greater
  }
}
// The lanes one place on, the lane that enters from the neighbouring vector: {prev[15], cur[0, 15)}
// and {cur[1, 16), next[0]} (valignd; maskz: as keep_greater).
inline F shift_in_left(F prev, F cur) {
  return _mm512_castsi512_ps(_mm512_maskz_alignr_epi32(0xFFFF, _mm512_castps_si512(cur), _mm512_castps_si512(prev), 15));
}
inline F shift_in_right(F cur, F next) {
  return _mm512_castsi512_ps(_mm512_maskz_alignr_epi32(0xFFFF, _mm512_castps_si512(next), _mm512_castps_si512(cur), 1));
}
// acc + v where m, acc as it is elsewhere (lanes8.h's add of -0, in one masked add).
inline F add_where(F acc, M m, F v) { return _mm512_mask_add_ps(acc, m, acc, v); }
// Small integer codes (a pool window's tap, -1 for none) stored a byte a lane: a row of 16 codes
// is one 16-byte load where 32-bit lanes took a 64-byte one (the gather's loads bound it).
using Code = int8_t;
inline void store_codes(Code* p, F codes) {  // codes: 32-bit integers in [-128, 127]
  _mm512_mask_cvtepi32_storeu_epi8(p, 0xFFFF, _mm512_castps_si512(codes));  // vpmovdb to memory
}
inline M codes_equal(const Code* p, int32_t c) {
  return _mm_cmpeq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(char(c)));
}

}  // namespace lanes512
}  // namespace et
#endif
