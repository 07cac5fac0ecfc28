// Max pooling with 2x2 windows at stride 2 and no padding (every VGG pool), AVX-512 (AVX2 and NEON:
// the sections at the end). The row-first loops of pool_planes.h read such rows through a padded copy
// and scatter the backward one output at a time, and the gathers read 16 scattered taps per
// vector: both well under the memory's speed (VGG-16-BN's 32x32 pool backward moved 16 GB/s).
// Here a vector of 16 outputs loads the 32 floats of its top input row and the 32 of its bottom
// row, and two permutes split each into the even and odd columns: the four taps of 16 windows in
// four registers, compared in the reference's (r, s) order with its compare, so values and
// arguments equal the reference's. The backward splits dx the same way, adds dy to the tap that
// won, and interleaves it back.
//
// (The shifts are maskz forms: the plain ones make GCC 12 warn of an uninitialised operand.)
// A vector covers part of one output row (Q >= 16, the last one masked), or 16 / Q whole output
// rows for Q of 8 or 4: their top-row pieces of 2Q floats lie 2W apart. Q of 1 or 2 keeps the
// gathers (pool_planes.h). Rows and columns past the last window (odd H or W) are never read.
#pragma once
#include <cfloat>
#include <climits>
#include <cstdint>

namespace et {
namespace pool_pairs {

// The AVX2 and NEON sections' outputs [j0, j1) past their last whole vector, the reference's way
// (planes of W = 2Q): y, and arg (if given) the flat index of each first maximum, -1 where none
// beat -FLT_MAX; backward, dx += dy there.
inline int32_t first_max_at(const float* x, int64_t W, int64_t Q, int64_t j, float* m) {
  const int64_t top = 2 * (j / Q) * W + 2 * (j % Q), at[4] = {top, top + 1, top + W, top + W + 1};
  int32_t arg = -1;
  *m = -FLT_MAX;
  for (int64_t k = 0; k < 4; ++k)
    if (x[at[k]] > *m) *m = x[at[k]], arg = int32_t(at[k]);
  return arg;
}
inline void forward_tail(int64_t W, int64_t Q, const float* x, int64_t j0, int64_t j1, float* y, int32_t* arg) {
  for (int64_t j = j0; j < j1; ++j) {
    const int32_t a = first_max_at(x, W, Q, j, y + j);
    if (arg) arg[j] = a;
  }
}
inline void backward_tail(int64_t W, int64_t Q, const float* x, const float* dy, int64_t j0, int64_t j1, float* dx) {
  for (int64_t j = j0; j < j1; ++j) {
    float m;
    const int32_t a = first_max_at(x, W, Q, j, &m);
    if (a >= 0) dx[a] += dy[j];
  }
}

}  // namespace pool_pairs
}  // namespace et

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

#elif defined(__AVX2__)
// AVX2 (8 floats a register): the same deinterleave and compare, 8 outputs a vector, where each
// output row is whole vectors or the plane is rows of W = 2Q with Q of 4, 2 or 1 (VGG's 8x8, 4x4
// and 2x2 planes, pooled as one tall plane by the callers): then a vector's 8 windows are 32
// consecutive floats. Outputs past the last whole vector (a tall plane of an odd count of rows)
// take the reference's loop, one at a time.
#include <immintrin.h>

namespace et {
namespace pool_pairs {

inline bool applies(int64_t R, int64_t S, int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t Q,
                    int64_t H, int64_t W) {
  return R == 2 && S == 2 && stride_h == 2 && stride_w == 2 && pad_h == 0 && pad_w == 0 && W == 2 * Q &&
         (Q % 8 == 0 || Q == 4 || Q == 2 || Q == 1) && H * W <= INT32_MAX;
}

inline __m256 evens8(__m256 a, __m256 b) {  // a's lanes 0, 2, 4, 6, then b's
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
}
inline __m256 odds8(__m256 a, __m256 b) {  // a's lanes 1, 3, 5, 7, then b's
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
// The inverse of (evens8, odds8): a and b back from e and o.
inline void interleave8(__m256 e, __m256 o, __m256* a, __m256* b) {
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
  *a = _mm256_permute2f128_ps(lo, hi, 0x20);
  *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// The four taps, (r, s) = (0,0), (0,1), (1,0), (1,1), of outputs j0 .. j0 + 7 (j0 a multiple of 8).
inline void load_taps(const float* x, int64_t W, int64_t Q, int64_t j0, __m256 t[4]) {
  if (Q >= 8) {  // one output row: its top input row's 16 floats, then the bottom row's
    const float* top = x + 2 * (j0 / Q) * W + 2 * (j0 % Q);
    const __m256 a = _mm256_loadu_ps(top), b = _mm256_loadu_ps(top + 8);
    const __m256 c = _mm256_loadu_ps(top + W), d = _mm256_loadu_ps(top + W + 8);
    t[0] = evens8(a, b), t[1] = odds8(a, b), t[2] = evens8(c, d), t[3] = odds8(c, d);
    return;
  }
  const float* p = x + 4 * j0;  // 8 / Q output rows of 4Q floats each (a top row, a bottom row)
  const __m256 x0 = _mm256_loadu_ps(p), x1 = _mm256_loadu_ps(p + 8), x2 = _mm256_loadu_ps(p + 16),
               x3 = _mm256_loadu_ps(p + 24);
  if (Q == 4) {  // x0 top, x1 bottom of one output row; x2, x3 the next
    t[0] = evens8(x0, x2), t[1] = odds8(x0, x2), t[2] = evens8(x1, x3), t[3] = odds8(x1, x3);
  } else if (Q == 2) {  // each register: a top row of 4, then its bottom row
    const __m256 a = _mm256_permute2f128_ps(x0, x1, 0x20), b = _mm256_permute2f128_ps(x2, x3, 0x20);
    const __m256 c = _mm256_permute2f128_ps(x0, x1, 0x31), d = _mm256_permute2f128_ps(x2, x3, 0x31);
    t[0] = evens8(a, b), t[1] = odds8(a, b), t[2] = evens8(c, d), t[3] = odds8(c, d);
  } else {  // Q = 1: each window's 4 floats in a row, tap order
    const __m256 e0 = evens8(x0, x1), e1 = evens8(x2, x3), o0 = odds8(x0, x1), o1 = odds8(x2, x3);
    t[0] = evens8(e0, e1), t[1] = evens8(o0, o1), t[2] = odds8(e0, e1), t[3] = odds8(o0, o1);
  }
}
// The inverse of load_taps: the taps back to their places.
inline void store_taps(float* x, int64_t W, int64_t Q, int64_t j0, const __m256 t[4]) {
  if (Q >= 8) {
    float* top = x + 2 * (j0 / Q) * W + 2 * (j0 % Q);
    __m256 a, b, c, d;
    interleave8(t[0], t[1], &a, &b);
    interleave8(t[2], t[3], &c, &d);
    _mm256_storeu_ps(top, a), _mm256_storeu_ps(top + 8, b);
    _mm256_storeu_ps(top + W, c), _mm256_storeu_ps(top + W + 8, d);
    return;
  }
  float* p = x + 4 * j0;
  __m256 x0, x1, x2, x3;
  if (Q == 4) {
    interleave8(t[0], t[1], &x0, &x2);
    interleave8(t[2], t[3], &x1, &x3);
  } else if (Q == 2) {
    __m256 a, b, c, d;
    interleave8(t[0], t[1], &a, &b);
    interleave8(t[2], t[3], &c, &d);
    x0 = _mm256_permute2f128_ps(a, c, 0x20), x1 = _mm256_permute2f128_ps(a, c, 0x31);
    x2 = _mm256_permute2f128_ps(b, d, 0x20), x3 = _mm256_permute2f128_ps(b, d, 0x31);
  } else {
    __m256 e0, e1, o0, o1;
    interleave8(t[0], t[2], &e0, &e1);
    interleave8(t[1], t[3], &o0, &o1);
    interleave8(e0, o0, &x0, &x1);
    interleave8(e1, o1, &x2, &x3);
  }
  _mm256_storeu_ps(p, x0), _mm256_storeu_ps(p + 8, x1), _mm256_storeu_ps(p + 16, x2), _mm256_storeu_ps(p + 24, x3);
}

// The running first maximum over the taps in order from -FLT_MAX (NaN never wins, as v > m is
// false); which: the winning tap's number, -1 where none won.
inline __m256 window_max(const __m256 t[4], __m256i* which) {
  __m256 m = _mm256_set1_ps(-FLT_MAX), w = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int k = 0; k < 4; ++k) {
    const __m256 gt = _mm256_cmp_ps(t[k], m, _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, t[k], gt);
    w = _mm256_blendv_ps(w, _mm256_castsi256_ps(_mm256_set1_epi32(k)), gt);
  }
  *which = _mm256_castps_si256(w);
  return m;
}

inline int64_t whole_vectors_end(int64_t P, int64_t Q) { return P * Q / 8 * 8; }

inline void max_forward(int64_t W, int64_t P, int64_t Q, const float* x, float* y) {
  const int64_t end = whole_vectors_end(P, Q);
  for (int64_t j0 = 0; j0 < end; j0 += 8) {
    __m256 t[4];
    __m256i which;
    load_taps(x, W, Q, j0, t);
    _mm256_storeu_ps(y + j0, window_max(t, &which));
  }
  forward_tail(W, Q, x, end, P * Q, y, nullptr);
}

// max_forward, and arg = the flat index of each window's first maximum (-1: none).
inline void max_forward_args(int64_t W, int64_t P, int64_t Q, const float* x, float* y, int32_t* arg) {
  const int64_t end = whole_vectors_end(P, Q);
  alignas(32) int32_t lane_top_left[8];  // lane l's top-left tap from the vector's first output's row
  for (int l = 0; l < 8; ++l)
    lane_top_left[l] = int32_t(Q >= 8 ? 2 * l : 2 * (l / Q) * W + 2 * (l % Q));
  const __m256i offsets = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_top_left));
  const __m256i W1 = _mm256_set1_epi32(int32_t(W)), one = _mm256_set1_epi32(1), none = _mm256_set1_epi32(-1);
  for (int64_t j0 = 0; j0 < end; j0 += 8) {
    __m256 t[4];
    __m256i which;
    load_taps(x, W, Q, j0, t);
    _mm256_storeu_ps(y + j0, window_max(t, &which));
    const __m256i top_left = _mm256_add_epi32(_mm256_set1_epi32(int32_t(2 * (j0 / Q) * W + 2 * (j0 % Q))), offsets);
    // tap k lies k / 2 rows and k % 2 columns from the top-left one
    const __m256i at = _mm256_add_epi32(top_left, _mm256_add_epi32(_mm256_mullo_epi32(_mm256_srai_epi32(which, 1), W1),
                                                                   _mm256_and_si256(which, one)));
    const __m256i some = _mm256_cmpgt_epi32(which, none);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(arg + j0), _mm256_blendv_epi8(none, at, some));
  }
  forward_tail(W, Q, x, end, P * Q, y, arg);
}

// dx += dy at each window's first maximum of x (windows do not overlap: one add per element at most).
inline void max_backward(int64_t W, int64_t P, int64_t Q, const float* x, const float* dy, float* dx) {
  const int64_t end = whole_vectors_end(P, Q);
  for (int64_t j0 = 0; j0 < end; j0 += 8) {
    __m256 t[4], d[4];
    __m256i which;
    load_taps(x, W, Q, j0, t);
    window_max(t, &which);
    load_taps(dx, W, Q, j0, d);
    const __m256 g = _mm256_loadu_ps(dy + j0);
    for (int k = 0; k < 4; ++k) {
      const __m256 won = _mm256_castsi256_ps(_mm256_cmpeq_epi32(which, _mm256_set1_epi32(k)));
      d[k] = _mm256_blendv_ps(d[k], _mm256_add_ps(d[k], g), won);
    }
    store_taps(dx, W, Q, j0, d);
  }
  backward_tail(W, Q, x, dy, end, P * Q, dx);
}

}  // namespace pool_pairs
}  // namespace et

#elif defined(__ARM_NEON) && defined(__aarch64__)
// NEON (4 floats a register): the same, 4 outputs a vector, where vld2q / vld4q split the columns
// as they load. Each output row is whole vectors (Q a multiple of 4), or the plane is rows of W = 2Q
// with Q of 2 or 1 (4x4 and 2x2 planes stacked as one tall plane): a vector's 4 windows are then 16
// consecutive floats. Outputs past the last whole vector take the reference's loop.
#include <arm_neon.h>

namespace et {
namespace pool_pairs {

inline bool applies(int64_t R, int64_t S, int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t Q,
                    int64_t H, int64_t W) {
  return R == 2 && S == 2 && stride_h == 2 && stride_w == 2 && pad_h == 0 && pad_w == 0 && W == 2 * Q &&
         (Q % 4 == 0 || Q == 2 || Q == 1) && H * W <= INT32_MAX;
}

// The four taps, (r, s) = (0,0), (0,1), (1,0), (1,1), of outputs j0 .. j0 + 3 (j0 a multiple of 4).
inline void load_taps(const float* x, int64_t W, int64_t Q, int64_t j0, float32x4_t t[4]) {
  if (Q >= 4) {  // one output row: its top input row's 8 floats, then the bottom row's
    const float* top = x + 2 * (j0 / Q) * W + 2 * (j0 % Q);
    const float32x4x2_t a = vld2q_f32(top), b = vld2q_f32(top + W);
    t[0] = a.val[0], t[1] = a.val[1], t[2] = b.val[0], t[3] = b.val[1];
  } else if (Q == 2) {  // two output rows, each a top row of 4 floats, then its bottom row
    const float* p = x + 4 * j0;
    const float32x4_t x0 = vld1q_f32(p), x1 = vld1q_f32(p + 4), x2 = vld1q_f32(p + 8), x3 = vld1q_f32(p + 12);
    t[0] = vuzp1q_f32(x0, x2), t[1] = vuzp2q_f32(x0, x2), t[2] = vuzp1q_f32(x1, x3), t[3] = vuzp2q_f32(x1, x3);
  } else {  // Q = 1: each window's 4 floats in a row, tap order
    const float32x4x4_t v = vld4q_f32(x + 4 * j0);
    for (int k = 0; k < 4; ++k) t[k] = v.val[k];
  }
}
// The inverse of load_taps: the taps back to their places.
inline void store_taps(float* x, int64_t W, int64_t Q, int64_t j0, const float32x4_t t[4]) {
  if (Q >= 4) {
    float* top = x + 2 * (j0 / Q) * W + 2 * (j0 % Q);
    vst2q_f32(top, (float32x4x2_t{{t[0], t[1]}}));
    vst2q_f32(top + W, (float32x4x2_t{{t[2], t[3]}}));
  } else if (Q == 2) {
    float* p = x + 4 * j0;
    vst1q_f32(p, vzip1q_f32(t[0], t[1]));
    vst1q_f32(p + 4, vzip1q_f32(t[2], t[3]));
    vst1q_f32(p + 8, vzip2q_f32(t[0], t[1]));
    vst1q_f32(p + 12, vzip2q_f32(t[2], t[3]));
  } else {
    vst4q_f32(x + 4 * j0, (float32x4x4_t{{t[0], t[1], t[2], t[3]}}));
  }
}

// The running first maximum over the taps in order from -FLT_MAX (NaN never wins: v > m is false);
// which: the winning tap's number, -1 (all ones) where none won.
inline float32x4_t window_max(const float32x4_t t[4], uint32x4_t* which) {
  float32x4_t m = vdupq_n_f32(-FLT_MAX);
  uint32x4_t w = vdupq_n_u32(0xFFFFFFFFu);
  for (uint32_t k = 0; k < 4; ++k) {
    const uint32x4_t gt = vcgtq_f32(t[k], m);
    m = vbslq_f32(gt, t[k], m);
    w = vbslq_u32(gt, vdupq_n_u32(k), w);
  }
  *which = w;
  return m;
}

inline int64_t whole_vectors_end(int64_t P, int64_t Q) { return P * Q / 4 * 4; }

inline void max_forward(int64_t W, int64_t P, int64_t Q, const float* x, float* y) {
  const int64_t end = whole_vectors_end(P, Q);
  for (int64_t j0 = 0; j0 < end; j0 += 4) {
    float32x4_t t[4];
    uint32x4_t which;
    load_taps(x, W, Q, j0, t);
    vst1q_f32(y + j0, window_max(t, &which));
  }
  forward_tail(W, Q, x, end, P * Q, y, nullptr);
}

// max_forward, and arg = the flat index of each window's first maximum (-1: none).
inline void max_forward_args(int64_t W, int64_t P, int64_t Q, const float* x, float* y, int32_t* arg) {
  const int64_t end = whole_vectors_end(P, Q);
  int32_t lane_top_left[4];  // lane l's top-left tap from the vector's first output's
  for (int l = 0; l < 4; ++l) lane_top_left[l] = int32_t(Q >= 4 ? 2 * l : 2 * (l / Q) * W + 2 * (l % Q));
  const int32x4_t offsets = vld1q_s32(lane_top_left), W1 = vdupq_n_s32(int32_t(W)), one = vdupq_n_s32(1);
  for (int64_t j0 = 0; j0 < end; j0 += 4) {
    float32x4_t t[4];
    uint32x4_t which;
    load_taps(x, W, Q, j0, t);
    vst1q_f32(y + j0, window_max(t, &which));
    const int32x4_t w = vreinterpretq_s32_u32(which);
    const int32x4_t top_left = vaddq_s32(vdupq_n_s32(int32_t(2 * (j0 / Q) * W + 2 * (j0 % Q))), offsets);
    // tap k lies k / 2 rows and k % 2 columns from the top-left one
    const int32x4_t at = vaddq_s32(top_left, vaddq_s32(vmulq_s32(vshrq_n_s32(w, 1), W1), vandq_s32(w, one)));
    vst1q_s32(arg + j0, vbslq_s32(vcgeq_s32(w, vdupq_n_s32(0)), at, vdupq_n_s32(-1)));
  }
  forward_tail(W, Q, x, end, P * Q, y, arg);
}

// dx += dy at each window's first maximum of x (windows do not overlap: one add per element at most).
inline void max_backward(int64_t W, int64_t P, int64_t Q, const float* x, const float* dy, float* dx) {
  const int64_t end = whole_vectors_end(P, Q);
  for (int64_t j0 = 0; j0 < end; j0 += 4) {
    float32x4_t t[4], d[4];
    uint32x4_t which;
    load_taps(x, W, Q, j0, t);
    window_max(t, &which);
    load_taps(dx, W, Q, j0, d);
    const float32x4_t g = vld1q_f32(dy + j0);
    for (uint32_t k = 0; k < 4; ++k) d[k] = vbslq_f32(vceqq_u32(which, vdupq_n_u32(k)), vaddq_f32(d[k], g), d[k]);
    store_taps(dx, W, Q, j0, d);
  }
  backward_tail(W, Q, x, dy, end, P * Q, dx);
}

}  // namespace pool_pairs
}  // namespace et
#endif
