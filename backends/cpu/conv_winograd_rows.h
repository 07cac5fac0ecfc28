// Winograd F(2x2, 3x3) by vectors of tiles, AVX-512: the input transform's pieces shared by
// conv_winograd_rows.cpp (forward, data gradient) and conv_winograd_wgrad8.cpp (8x8 weight
// gradient). Internal to the CPU backend.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

#include "backends/cpu/always_inline.h"

namespace et::cpu {

// B^T d B in two steps: along a row of the window (d0..d3: its four columns' vectors), then down
// the columns of four such rows (ti: row i's), each of the 16 results V[xi] stored at v + xi * stride.
ET_ALWAYS_INLINE inline void bt_row(__m512 d0, __m512 d1, __m512 d2, __m512 d3, __m512* t) {
  t[0] = _mm512_sub_ps(d0, d2);
  t[1] = _mm512_add_ps(d1, d2);
  t[2] = _mm512_sub_ps(d2, d1);
  t[3] = _mm512_sub_ps(d1, d3);
}
ET_ALWAYS_INLINE inline void bt_columns(const __m512* t0, const __m512* t1, const __m512* t2, const __m512* t3,
                                        float* v, int64_t stride) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    _mm512_store_ps(v + (0 * 4 + j) * stride, _mm512_sub_ps(t0[j], t2[j]));
    _mm512_store_ps(v + (1 * 4 + j) * stride, _mm512_add_ps(t1[j], t2[j]));
    _mm512_store_ps(v + (2 * 4 + j) * stride, _mm512_sub_ps(t2[j], t1[j]));
    _mm512_store_ps(v + (3 * 4 + j) * stride, _mm512_sub_ps(t1[j], t3[j]));
  }
}

// 8x8 planes: one vector holds the plane's 16 tiles (lane 4 tr + q), built from the plane's four
// vectors by two permutes and a blend per point (i, j) of the 4x4 input window (zero where the
// window reaches the padding); the products use one vector, U broadcast against it, 16 output
// channels of accumulators; the outputs go back into the plane's four vectors the same way.
struct Gather8 {
  alignas(64) int32_t in_idx[16][16];   // point (i, j) = 4 i + j: lane L's element of rows 0-3 / 4-7
  __mmask16 in_lo[16], in_hi[16];       // lanes read from rows 0-3 / 4-7 (neither: padding, zero)
  alignas(64) int32_t out_idx[4][16];   // output vector k (rows 2k, 2k+1): element e's lane of y_p0 / y_p1
};

inline Gather8 gather8() {
  Gather8 t{};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      for (int L = 0; L < 16; ++L) {
        const int r = 2 * (L / 4) + i - 1, c = 2 * (L % 4) + j - 1, f = r * 8 + c;
        t.in_idx[4 * i + j][L] = f & 31;
        if (r < 0 || r > 7 || c < 0 || c > 7) continue;
        (f < 32 ? t.in_lo : t.in_hi)[4 * i + j] |= __mmask16(1u << L);
      }
  for (int k = 0; k < 4; ++k)
    for (int e = 0; e < 16; ++e) {
      const int col = e % 8;
      t.out_idx[k][e] = (col % 2) * 16 + 4 * k + col / 2;
    }
  return t;
}

// V = B^T d B of an 8x8 plane's 16 tiles (one vector, lane 4 tr + q) into v + xi * stride.
ET_ALWAYS_INLINE inline void input_transform8(const Gather8& t, const float* src, float* v, int64_t stride) {
  const __m512 r0 = _mm512_loadu_ps(src), r1 = _mm512_loadu_ps(src + 16), r2 = _mm512_loadu_ps(src + 32),
               r3 = _mm512_loadu_ps(src + 48);
  __m512 d[4][4];
  for (int p = 0; p < 16; ++p) {
    const __m512i idx = _mm512_load_si512(t.in_idx[p]);
    d[p / 4][p % 4] = _mm512_mask_mov_ps(_mm512_maskz_permutex2var_ps(t.in_lo[p], r0, idx, r1), t.in_hi[p],
                                         _mm512_permutex2var_ps(r2, idx, r3));
  }
  __m512 tt[4][4];
  for (int i = 0; i < 4; ++i) bt_row(d[i][0], d[i][1], d[i][2], d[i][3], tt[i]);
  bt_columns(tt[0], tt[1], tt[2], tt[3], v, stride);
}

}  // namespace et::cpu
#endif
