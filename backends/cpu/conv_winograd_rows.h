// Winograd F(2x2, 3x3) by vectors of tiles, AVX-512: the input transform's pieces shared by
// conv_winograd_rows.cpp (forward, data gradient) and conv_winograd_wgrad.cpp (weight gradient):
// 32x32 and 16x16 planes placed as rows of column phases, 8x8 planes gathered from their four
// vectors. Internal to the CPU backend.
#pragma once
#include <cstdint>

namespace et::cpu {
constexpr int64_t kRowFloats = 64;  // one placed row: E, O, E1, O1 (place_columns*)
}  // namespace et::cpu

#if defined(__AVX512F__)
#include <immintrin.h>

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

// One input plane [32, 32] into its padded rows (rows 0 and 33 stay zero). Tile q of a row of
// tiles reads columns 2q .. 2q+3 of the padded row (column j is x's column j - 1, zero at j = 0
// and 33), placed as four aligned vectors, so the transform loads nothing unaligned:
//   E[q] = col 2q, O[q] = col 2q + 1, E1[q] = col 2q + 2, O1[q] = col 2q + 3.
inline void place_columns(const float* x, float* rows) {
  const __m512i e = _mm512_set_epi32(29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 0);  // lane 0 masked
  const __m512i o = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i e1 = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i o1 = _mm512_set_epi32(0, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2);  // lane 15 masked
  for (int64_t h = 0; h < 32; ++h) {
    const __m512 a = _mm512_loadu_ps(x + h * 32), b = _mm512_loadu_ps(x + h * 32 + 16);
    float* row = rows + (h + 1) * kRowFloats;
    _mm512_store_ps(row, _mm512_maskz_permutex2var_ps(0xFFFE, a, e, b));
    _mm512_store_ps(row + 16, _mm512_permutex2var_ps(a, o, b));
    _mm512_store_ps(row + 32, _mm512_permutex2var_ps(a, e1, b));
    _mm512_store_ps(row + 48, _mm512_maskz_permutex2var_ps(0x7FFF, a, o1, b));
  }
}

// The same for a [16, 16] plane, 8 tiles a row: vector p holds tile rows 2p (lanes 0-7) and
// 2p + 1 (lanes 8-15), which read padded rows 4p .. 4p+3 and 4p+2 .. 4p+5; so padded row r goes
// to placed row i = r % 4 of vector r / 4 (lower half) and of vector (r - 2) / 4 (upper half).
// Rows 0 and 17 are never written (zero).
// d[0..7] = lanes 0-7 (lower) or lanes 8-15 (upper) of v.
inline void store_lower8(float* d, __m512 v) { _mm512_mask_storeu_ps(d, 0x00FF, v); }
inline void store_upper8(float* d, __m512 v) { _mm512_mask_storeu_ps(d - 8, 0xFF00, v); }
inline void place_columns16(const float* x, float* rows) {
  const __m512i eo = _mm512_set_epi32(14, 12, 10, 8, 6, 4, 2, 0, 13, 11, 9, 7, 5, 3, 1, 0);  // E (lane 0 masked), O
  const __m512i eo1 = _mm512_set_epi32(0, 14, 12, 10, 8, 6, 4, 2, 15, 13, 11, 9, 7, 5, 3, 1);  // E1, O1 (lane 15 masked)
  for (int64_t h = 0; h < 16; ++h) {
    const __m512 xv = _mm512_loadu_ps(x + h * 16);
    const __m512 a = _mm512_maskz_permutexvar_ps(0xFFFE, eo, xv), b = _mm512_maskz_permutexvar_ps(0x7FFF, eo1, xv);
    const int64_t r = h + 1;
    auto put = [&](float* d) {
      store_lower8(d, a);
      store_upper8(d + 16, a);
      store_lower8(d + 32, b);
      store_upper8(d + 48, b);
    };
    if (r < 16) put(rows + r * kRowFloats);                  // vector r / 4, row r % 4, lanes 0-7
    if (r >= 2) put(rows + (r - 2) * kRowFloats + 8);        // vector (r - 2) / 4, row (r - 2) % 4, lanes 8-15
  }
}

ET_ALWAYS_INLINE inline void bt_placed_row(const float* row, __m512* t) {  // a placed row: E, O, E1, O1
  bt_row(_mm512_load_ps(row), _mm512_load_ps(row + 16), _mm512_load_ps(row + 32), _mm512_load_ps(row + 48), t);
}
// V of one vector of tiles from its 4 placed rows (rows: the first); stride: Ci * 32.
ET_ALWAYS_INLINE inline void input_transform_one(const float* rows, float* v, int64_t stride) {
  __m512 t[4][4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) bt_placed_row(rows + i * kRowFloats, t[i]);
  bt_columns(t[0], t[1], t[2], t[3], v, stride);
}

// V of tile rows tr and tr + 1 from one channel's padded rows 2tr .. 2tr+5:
// v[(xi * Ci + c) * 32 + r * 16 + q] for row of tiles tr + r (v points at channel c; stride: Ci * 32).
// Rows 2tr+2 and 2tr+3 belong to both rows of tiles: each padded row's B^T d is taken once.
ET_ALWAYS_INLINE inline void input_transform_pair(const float* rows_c, int64_t tr, float* v, int64_t stride) {
  __m512 t[6][4];
#pragma GCC unroll 6
  for (int i = 0; i < 6; ++i) bt_placed_row(rows_c + (2 * tr + i) * kRowFloats, t[i]);
  bt_columns(t[0], t[1], t[2], t[3], v, stride);
  bt_columns(t[2], t[3], t[4], t[5], v + 16, stride);
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
