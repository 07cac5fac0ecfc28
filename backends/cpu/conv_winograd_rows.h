// Winograd F(2x2, 3x3) by vectors of tiles: the input transform's pieces shared by
// conv_winograd_rows.cpp (forward, data gradient) and conv_winograd_wgrad.cpp (weight gradient):
// 32x32 and 16x16 planes placed as rows of column phases, 8x8 planes gathered from their four
// vectors. Internal to the CPU backend.
//
// A vector of tiles is 16 float lanes: AVX-512's __m512, or lanes16.h's Lanes16 where vectors are
// narrower (AVX2: two ymm; NEON: four q registers). The transforms are the same adds in the same
// lanes on all of them, so every ISA computes the same bits. What moves data between lanes (the
// placing of rows, the 8x8 gathers) is written per ISA.
#pragma once
#include <cstdint>
#include <cstring>

#include "backends/cpu/lanes16.h"

namespace et::cpu {
constexpr int64_t kRowFloats = 64;  // one placed row: E, O, E1, O1 (place_columns*)
}  // namespace et::cpu

#if defined(__AVX512F__) || defined(ET_LANES16)
#define ET_WINOGRAD_ROWS 1
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/always_inline.h"

namespace et::cpu {

// The 16-lane operations the transforms use (p: 64-byte aligned where the name has no u).
namespace wrows {
#if defined(__AVX512F__)
using V16 = __m512;
ET_ALWAYS_INLINE inline V16 vload(const float* p) { return _mm512_load_ps(p); }
ET_ALWAYS_INLINE inline V16 vloadu(const float* p) { return _mm512_loadu_ps(p); }
ET_ALWAYS_INLINE inline void vstore(float* p, V16 v) { _mm512_store_ps(p, v); }
ET_ALWAYS_INLINE inline void vstoreu(float* p, V16 v) { _mm512_storeu_ps(p, v); }
ET_ALWAYS_INLINE inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
ET_ALWAYS_INLINE inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
ET_ALWAYS_INLINE inline V16 vsplat(float f) { return _mm512_set1_ps(f); }
#else
using V16 = lanes16::Lanes16;
ET_ALWAYS_INLINE inline V16 vload(const float* p) { return lanes16::load16(lanes16::Full{}, p); }
ET_ALWAYS_INLINE inline V16 vloadu(const float* p) { return lanes16::load16(lanes16::Full{}, p); }
ET_ALWAYS_INLINE inline void vstore(float* p, const V16& v) { lanes16::store16(lanes16::Full{}, p, v); }
ET_ALWAYS_INLINE inline void vstoreu(float* p, const V16& v) { lanes16::store16(lanes16::Full{}, p, v); }
ET_ALWAYS_INLINE inline V16 vadd(const V16& a, const V16& b) { return lanes16::add16(a, b); }
ET_ALWAYS_INLINE inline V16 vsub(const V16& a, const V16& b) { return lanes16::sub16(a, b); }
ET_ALWAYS_INLINE inline V16 vsplat(float f) { return lanes16::splat16(f); }
#endif
}  // namespace wrows

// B^T d B in two steps: along a row of the window (d0..d3: its four columns' vectors), then down
// the columns of four such rows (ti: row i's), each of the 16 results V[xi] stored at v + xi * stride.
using wrows::V16;
ET_ALWAYS_INLINE inline void bt_row(const V16& d0, const V16& d1, const V16& d2, const V16& d3, V16* t) {
  t[0] = wrows::vsub(d0, d2);
  t[1] = wrows::vadd(d1, d2);
  t[2] = wrows::vsub(d2, d1);
  t[3] = wrows::vsub(d1, d3);
}
ET_ALWAYS_INLINE inline void bt_columns(const V16* t0, const V16* t1, const V16* t2, const V16* t3, float* v,
                                        int64_t stride) {
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    wrows::vstore(v + (0 * 4 + j) * stride, wrows::vsub(t0[j], t2[j]));
    wrows::vstore(v + (1 * 4 + j) * stride, wrows::vadd(t1[j], t2[j]));
    wrows::vstore(v + (2 * 4 + j) * stride, wrows::vsub(t2[j], t1[j]));
    wrows::vstore(v + (3 * 4 + j) * stride, wrows::vsub(t1[j], t3[j]));
  }
}

#if defined(__AVX512F__)
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

#else
// Narrow vectors: each x row split into its even and odd columns (deinterleave*), then stored so
// that the shifted phases fall out of overlapping stores: E[q] = odd[q - 1] and O1[q] =
// even[q + 1] are the odd and even vectors stored one float later / earlier, the stores in an
// order that leaves every phase right, and the two floats no store covers set to zero.
#if defined(__AVX2__)
// ev = x[0], x[2], .. x[2n - 2], od = x[1], x[3], .. of 16 floats (n = 8), one ymm each.
ET_ALWAYS_INLINE inline void deinterleave8(const float* x, __m256& ev, __m256& od) {
  const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
  ev = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  od = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
ET_ALWAYS_INLINE inline void deinterleave16(const float* x, V16& ev, V16& od) {
  deinterleave8(x, ev.lo, od.lo);
  deinterleave8(x + 16, ev.hi, od.hi);
}
ET_ALWAYS_INLINE inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
using Half8 = __m256;
#else  // NEON
struct Half8 {
  float32x4_t a, b;
};
ET_ALWAYS_INLINE inline void deinterleave8(const float* x, Half8& ev, Half8& od) {
  const float32x4x2_t p = vld2q_f32(x), q = vld2q_f32(x + 8);
  ev = {p.val[0], q.val[0]};
  od = {p.val[1], q.val[1]};
}
ET_ALWAYS_INLINE inline void deinterleave16(const float* x, V16& ev, V16& od) {
  for (int k = 0; k < 4; ++k) {
    const float32x4x2_t p = vld2q_f32(x + 8 * k);
    ev.q[k] = p.val[0];
    od.q[k] = p.val[1];
  }
}
ET_ALWAYS_INLINE inline void store8(float* p, const Half8& v) {
  vst1q_f32(p, v.a);
  vst1q_f32(p + 4, v.b);
}
#endif

inline void place_columns(const float* x, float* rows) {
  for (int64_t h = 0; h < 32; ++h) {
    V16 ev, od;
    deinterleave16(x + h * 32, ev, od);
    float* row = rows + (h + 1) * kRowFloats;
    wrows::vstoreu(row + 1, od);   // E[1..15]; row[16] until O's store
    wrows::vstore(row + 16, ev);   // O
    wrows::vstoreu(row + 47, ev);  // O1[0..14]; row[47] until E1's store
    wrows::vstore(row + 32, od);   // E1
    row[0] = 0.f;
    row[63] = 0.f;
  }
}

// 16x16 planes: the four phases of a row go to the lower or upper 8 lanes of two placed rows
// (the layout above); built in `phases` first (E, O, E1, O1, 8 floats each, by the same stores).
inline void place_columns16(const float* x, float* rows) {
  alignas(64) float phases[40];
  for (int64_t h = 0; h < 16; ++h) {
    Half8 ev, od;
    deinterleave8(x + h * 16, ev, od);
    store8(phases + 1, od);   // E[1..7]; phases[8] until O's store
    store8(phases + 8, ev);   // O
    store8(phases + 23, ev);  // O1[0..6]; phases[23] until E1's store
    store8(phases + 16, od);  // E1
    phases[0] = 0.f;
    phases[31] = 0.f;
    auto put = [&](float* d) {
      for (int k = 0; k < 4; ++k) std::memcpy(d + 16 * k, phases + 8 * k, 8 * sizeof(float));
    };
    const int64_t r = h + 1;
    if (r < 16) put(rows + r * kRowFloats);            // vector r / 4, row r % 4, lanes 0-7
    if (r >= 2) put(rows + (r - 2) * kRowFloats + 8);  // vector (r - 2) / 4, row (r - 2) % 4, lanes 8-15
  }
}
#endif

ET_ALWAYS_INLINE inline void bt_placed_row(const float* row, V16* t) {  // a placed row: E, O, E1, O1
  bt_row(wrows::vload(row), wrows::vload(row + 16), wrows::vload(row + 32), wrows::vload(row + 48), t);
}
// V of one vector of tiles from its 4 placed rows (rows: the first); stride: Ci * 32.
ET_ALWAYS_INLINE inline void input_transform_one(const float* rows, float* v, int64_t stride) {
  V16 t[4][4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) bt_placed_row(rows + i * kRowFloats, t[i]);
  bt_columns(t[0], t[1], t[2], t[3], v, stride);
}

// V of tile rows tr and tr + 1 from one channel's padded rows 2tr .. 2tr+5:
// v[(xi * Ci + c) * 32 + r * 16 + q] for row of tiles tr + r (v points at channel c; stride: Ci * 32).
// Rows 2tr+2 and 2tr+3 belong to both rows of tiles: each padded row's B^T d is taken once.
ET_ALWAYS_INLINE inline void input_transform_pair(const float* rows_c, int64_t tr, float* v, int64_t stride) {
  V16 t[6][4];
#pragma GCC unroll 6
  for (int i = 0; i < 6; ++i) bt_placed_row(rows_c + (2 * tr + i) * kRowFloats, t[i]);
  bt_columns(t[0], t[1], t[2], t[3], v, stride);
  bt_columns(t[2], t[3], t[4], t[5], v + 16, stride);
}

#if defined(__AVX512F__)
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
#else
// Narrow vectors: the 16 tiles' lanes 4 tr .. 4 tr + 3 are one 128-bit group (a q register, half a
// ymm) per row of tiles tr, so point (i, j) of the window is, in group tr, column phase j (E, O,
// E1, O1 as placed rows, 4 floats) of padded row 2 tr + i: each x row's phases are built once.
struct Gather8 {};
inline Gather8 gather8() { return {}; }
#if defined(__AVX2__)
using Quad = __m128;
ET_ALWAYS_INLINE inline void split_row8(const float* x, Quad& ev, Quad& od) {
  const __m128 a = _mm_loadu_ps(x), b = _mm_loadu_ps(x + 4);
  ev = _mm_shuffle_ps(a, b, 0x88);
  od = _mm_shuffle_ps(a, b, 0xDD);
}
ET_ALWAYS_INLINE inline Quad shift_up(Quad v) {  // [0, v0, v1, v2]
  return _mm_castsi128_ps(_mm_slli_si128(_mm_castps_si128(v), 4));
}
ET_ALWAYS_INLINE inline Quad shift_down(Quad v) {  // [v1, v2, v3, 0]
  return _mm_castsi128_ps(_mm_srli_si128(_mm_castps_si128(v), 4));
}
ET_ALWAYS_INLINE inline Quad quad_zero() { return _mm_setzero_ps(); }
ET_ALWAYS_INLINE inline V16 from_quads(Quad g0, Quad g1, Quad g2, Quad g3) {
  return {_mm256_set_m128(g1, g0), _mm256_set_m128(g3, g2)};
}
#else
using Quad = float32x4_t;
ET_ALWAYS_INLINE inline void split_row8(const float* x, Quad& ev, Quad& od) {
  const float32x4x2_t p = vld2q_f32(x);
  ev = p.val[0];
  od = p.val[1];
}
ET_ALWAYS_INLINE inline Quad shift_up(Quad v) { return vextq_f32(vdupq_n_f32(0.f), v, 3); }
ET_ALWAYS_INLINE inline Quad shift_down(Quad v) { return vextq_f32(v, vdupq_n_f32(0.f), 1); }
ET_ALWAYS_INLINE inline Quad quad_zero() { return vdupq_n_f32(0.f); }
ET_ALWAYS_INLINE inline V16 from_quads(Quad g0, Quad g1, Quad g2, Quad g3) { return {{g0, g1, g2, g3}}; }
#endif

// V = B^T d B of an 8x8 plane's 16 tiles (one vector, lane 4 tr + q) into v + xi * stride.
ET_ALWAYS_INLINE inline void input_transform8(const Gather8&, const float* src, float* v, int64_t stride) {
  Quad ph[10][4];  // padded rows 0..9 (0 and 9 zero): E, O, E1, O1
  for (int j = 0; j < 4; ++j) ph[0][j] = ph[9][j] = quad_zero();
  for (int h = 0; h < 8; ++h) {
    Quad ev, od;
    split_row8(src + 8 * h, ev, od);
    ph[h + 1][0] = shift_up(od);
    ph[h + 1][1] = ev;
    ph[h + 1][2] = od;
    ph[h + 1][3] = shift_down(ev);
  }
  V16 tt[4][4];
  for (int i = 0; i < 4; ++i) {
    V16 d[4];
    for (int j = 0; j < 4; ++j) d[j] = from_quads(ph[i][j], ph[2 + i][j], ph[4 + i][j], ph[6 + i][j]);
    bt_row(d[0], d[1], d[2], d[3], tt[i]);
  }
  bt_columns(tt[0], tt[1], tt[2], tt[3], v, stride);
}
#endif

}  // namespace et::cpu
#endif
