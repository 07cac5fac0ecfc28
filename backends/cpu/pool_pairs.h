// Max pooling with 2x2 windows at stride 2 and no padding (every VGG pool), AVX-512. The row-first
// loops of pool_planes.h read such rows through a padded copy and scatter the backward one output
// at a time, and the gathers read 16 scattered taps per vector: both well under the memory's
// speed (VGG-16-BN's 32x32 pool backward moved 16 GB/s). Here a vector of 16 outputs loads the 32
// floats of its top input row and the 32 of its bottom row, and two permutes split each into the
// even and odd columns: the four taps of 16 windows in four registers, compared in the reference's
// (r, s) order with its compare, so values and arguments equal the reference's. The backward
// splits dx the same way, adds dy to the tap that won, and interleaves it back.
//
// (The shifts are maskz forms: the plain ones make GCC 12 warn of an uninitialised operand.)
// A vector covers part of one output row (Q >= 16, the last one masked), or 16 / Q whole output
// rows for Q of 8 or 4: their top-row pieces of 2Q floats lie 2W apart. Q of 1 or 2 keeps the
// gathers (pool_planes.h). Rows and columns past the last window (odd H or W) are never read.
#pragma once
#include <cfloat>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace et {
namespace pool_pairs {

inline bool applies(int64_t R, int64_t S, int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t Q,
                    int64_t H, int64_t W) {
  return R == 2 && S == 2 && stride_h == 2 && stride_w == 2 && pad_h == 0 && pad_w == 0 &&
         (Q == 4 || Q == 8 || Q >= 16) && H * W <= INT32_MAX;
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n > 0 ? n : 0)) - 1); }

// Where a vector of up to 16 outputs reads: its top input row as 2 pieces of 16 floats or 4 of 8.
struct Span {
  int64_t out = 0;          // its first output, flat
  int live = 0;             // outputs in it
  int pieces = 2;           // 2 of 16 floats or 4 of 8
  int64_t at[4] = {};       // offset of each piece in the top input row
  int64_t valid[4] = {};    // floats of each piece inside the plane
  int64_t p = 0, q0 = 0;    // its first output's row and column
};

// Calls f(span) for every vector of outputs of an H x W plane pooled to P x Q.
template <class F>
inline void for_each_span(int64_t W, int64_t P, int64_t Q, F f) {
  Span s;
  if (Q >= 16) {
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q0 = 0; q0 < Q; q0 += 16) {
        s.p = p, s.q0 = q0, s.out = p * Q + q0;
        s.live = int(Q - q0 < 16 ? Q - q0 : 16);
        s.pieces = 2;
        s.at[0] = 2 * p * W + 2 * q0, s.at[1] = s.at[0] + 16;
        s.valid[0] = 2 * s.live < 16 ? 2 * s.live : 16, s.valid[1] = 2 * s.live - s.valid[0];
        f(s);
      }
    return;
  }
  const int64_t rows = 16 / Q;  // output rows per vector: 2 or 4
  for (int64_t p = 0; p < P; p += rows) {
    s.p = p, s.q0 = 0, s.out = p * Q;
    const int64_t have = P - p < rows ? P - p : rows;
    s.live = int(have * Q);
    s.pieces = int(rows);
    for (int64_t k = 0; k < rows; ++k) {
      s.at[k] = 2 * (p + k) * W;
      s.valid[k] = k < have ? 2 * Q : 0;
    }
    f(s);
  }
}

// The 32 floats of a span's input row (row = 0: top, W: bottom) as two registers.
inline void load_row(const float* x, const Span& s, int64_t row, __m512* lo, __m512* hi) {
  if (s.pieces == 2) {
    *lo = _mm512_maskz_loadu_ps(first_lanes(s.valid[0]), x + s.at[0] + row);
    *hi = _mm512_maskz_loadu_ps(first_lanes(s.valid[1]), x + s.at[1] + row);
    return;
  }
  // Lanes 8-15 come from a load 8 floats before the piece, masked to its upper half.
  *lo = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(first_lanes(s.valid[0]), x + s.at[0] + row),
                             __mmask16(first_lanes(s.valid[1]) << 8), x + s.at[1] + row - 8);
  *hi = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(first_lanes(s.valid[2]), x + s.at[2] + row),
                             __mmask16(first_lanes(s.valid[3]) << 8), x + s.at[3] + row - 8);
}
inline void store_row(float* x, const Span& s, int64_t row, __m512 lo, __m512 hi) {
  if (s.pieces == 2) {
    _mm512_mask_storeu_ps(x + s.at[0] + row, first_lanes(s.valid[0]), lo);
    _mm512_mask_storeu_ps(x + s.at[1] + row, first_lanes(s.valid[1]), hi);
    return;
  }
  _mm512_mask_storeu_ps(x + s.at[0] + row, first_lanes(s.valid[0]), lo);
  _mm512_mask_storeu_ps(x + s.at[1] + row - 8, __mmask16(first_lanes(s.valid[1]) << 8), lo);
  _mm512_mask_storeu_ps(x + s.at[2] + row, first_lanes(s.valid[2]), hi);
  _mm512_mask_storeu_ps(x + s.at[3] + row - 8, __mmask16(first_lanes(s.valid[3]) << 8), hi);
}

inline __m512i even_lanes() { return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30); }
inline __m512i odd_lanes() { return _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31); }
inline __m512i low_interleave() { return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23); }
inline __m512i high_interleave() {
  return _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

// The four taps of the span's 16 windows, (r, s) = (0,0), (0,1), (1,0), (1,1).
inline void load_taps(const float* x, const Span& s, int64_t W, __m512 t[4]) {
  __m512 lo, hi;
  load_row(x, s, 0, &lo, &hi);
  t[0] = _mm512_permutex2var_ps(lo, even_lanes(), hi);
  t[1] = _mm512_permutex2var_ps(lo, odd_lanes(), hi);
  load_row(x, s, W, &lo, &hi);
  t[2] = _mm512_permutex2var_ps(lo, even_lanes(), hi);
  t[3] = _mm512_permutex2var_ps(lo, odd_lanes(), hi);
}

// The running first maximum over the taps in order (padding-free windows start at -FLT_MAX, as
// the reference, and NaN never wins); which = the winning tap, -1 where none beat -FLT_MAX.
inline __m512 window_max(const __m512 t[4], __m512i* which) {
  __m512 m = _mm512_set1_ps(-FLT_MAX);
  __m512i w = _mm512_set1_epi32(-1);
  for (int k = 0; k < 4; ++k) {
    const __mmask16 gt = _mm512_cmp_ps_mask(t[k], m, _CMP_GT_OQ);
    m = _mm512_mask_mov_ps(m, gt, t[k]);
    w = _mm512_mask_mov_epi32(w, gt, _mm512_set1_epi32(k));
  }
  *which = w;
  return m;
}

inline void max_forward(int64_t W, int64_t P, int64_t Q, const float* x, float* y) {
  for_each_span(W, P, Q, [&](const Span& s) {
    __m512 t[4];
    __m512i which;
    load_taps(x, s, W, t);
    _mm512_mask_storeu_ps(y + s.out, first_lanes(s.live), window_max(t, &which));
  });
}

// max_forward, and arg = the flat index of each window's first maximum (-1: none).
inline void max_forward_args(int64_t W, int64_t P, int64_t Q, const float* x, float* y, int32_t* arg) {
  const int64_t Qv = Q < 16 ? Q : 16;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i row_in_vector = _mm512_maskz_srli_epi32(__mmask16(0xFFFF), lane, __builtin_ctz(unsigned(Qv)));
  const __m512i col_in_vector = _mm512_and_si512(lane, _mm512_set1_epi32(int32_t(Qv - 1)));
  for_each_span(W, P, Q, [&](const Span& s) {
    __m512 t[4];
    __m512i which;
    load_taps(x, s, W, t);
    const __mmask16 live = first_lanes(s.live);
    _mm512_mask_storeu_ps(y + s.out, live, window_max(t, &which));
    // top-left tap of each lane's window: row 2 (p + row_in_vector), column 2 (q0 + col_in_vector)
    const __mmask16 all = __mmask16(0xFFFF);
    const __m512i row = _mm512_add_epi32(_mm512_set1_epi32(int32_t(s.p)), row_in_vector);
    const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(int32_t(s.q0)), col_in_vector);
    const __m512i top_left = _mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32(int32_t(2 * W))),
                                              _mm512_maskz_slli_epi32(all, col, 1));
    // tap k lies k / 2 rows and k % 2 columns from the top-left one
    const __m512i offset =
        _mm512_add_epi32(_mm512_mullo_epi32(_mm512_maskz_srai_epi32(all, which, 1), _mm512_set1_epi32(int32_t(W))),
                         _mm512_and_si512(which, _mm512_set1_epi32(1)));
    const __mmask16 some = _mm512_cmpge_epi32_mask(which, _mm512_setzero_si512());
    _mm512_mask_storeu_epi32(arg + s.out, live,
                             _mm512_mask_add_epi32(_mm512_set1_epi32(-1), some, top_left, offset));
  });
}

// dx += dy at each window's first maximum of x (windows do not overlap: one add per element at most).
inline void max_backward(int64_t W, int64_t P, int64_t Q, const float* x, const float* dy, float* dx) {
  for_each_span(W, P, Q, [&](const Span& s) {
    __m512 t[4], d[4];
    __m512i which;
    load_taps(x, s, W, t);
    window_max(t, &which);
    load_taps(dx, s, W, d);
    const __mmask16 live = first_lanes(s.live);
    const __m512 g = _mm512_maskz_loadu_ps(live, dy + s.out);
    for (int k = 0; k < 4; ++k) {
      const __mmask16 won = _mm512_mask_cmpeq_epi32_mask(live, which, _mm512_set1_epi32(k));
      d[k] = _mm512_mask_add_ps(d[k], won, d[k], g);
    }
    store_row(dx, s, 0, _mm512_permutex2var_ps(d[0], low_interleave(), d[1]),
              _mm512_permutex2var_ps(d[0], high_interleave(), d[1]));
    store_row(dx, s, W, _mm512_permutex2var_ps(d[2], low_interleave(), d[3]),
              _mm512_permutex2var_ps(d[2], high_interleave(), d[3]));
  });
}

}  // namespace pool_pairs
}  // namespace et
#endif
