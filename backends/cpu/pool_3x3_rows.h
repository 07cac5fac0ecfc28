// BrainSlug's window (3x3, stride 1, pad 1) on planes one or two AVX-512 vectors wide (16 or 32
// columns: CIFAR's 32x32 and 16x16 maps), forward and backward, included by pool_stride1.h, which
// takes these where they apply. Same definitions and bits as its general kernels (and so as the
// reference loops): each window's first maximum found row first, then across rows; each input
// gathers the dy of the windows it won in the reference's order.
//
// Why a form of its own: on 32-column planes a third of the general kernels' time went to the work
// around each row (rings of rows, a padded copy of every input row, lambdas per block of columns,
// a memcpy of each dy row), not to the vectors (docs/fusion-log.md, session 43). Here a row is NV
// registers: its horizontal taps are lane shifts (valignd) with -inf shifted in at the plane's
// sides, the maxima of three input rows stay in registers while the output rows pass over them,
// and the backward runs in two phases over the plane: first every output's argument (a byte, as
// pool_stride1.h's) and dy into plane-sized buffers padded with "no argument", then the gather,
// nine taps a vector, each a compare and a masked add, with no row in flight.
#pragma once
#if defined(ET_LANES512) && !defined(ET_POOL_STRIDE1_LANES8)
#define ET_POOL_3X3_ROWS 1

namespace et {
namespace pool_planes {
namespace rows3x3 {

constexpr int64_t kMaxRows = 64;  // the backward's buffers hold a plane of up to this many rows

inline bool applies(const Plane& g) {
  return g.R == 3 && g.S == 3 && g.pad_h == 1 && g.pad_w == 1 && g.stride_h == 1 && g.stride_w == 1 &&
         (g.W == 16 || g.W == 32) && g.H >= 1 && g.H <= kMaxRows && g.P == g.H && g.Q == g.W;
}

// The values of an input row as the windows see them: in.value of x's NV vectors.
template <int NV, class In>
ET_ALWAYS_INLINE inline void input_row(const float* xh, const In& in, __m512 (&v)[NV]) {
  for (int k = 0; k < NV; ++k) v[k] = in.value(_mm512_loadu_ps(xh + 16 * k));
}

// Lanes shifted one column right (column w - 1 at w) and left (w + 1 at w), -inf from outside.
template <int NV>
ET_ALWAYS_INLINE inline __m512 left_taps(const __m512 (&v)[NV], int k) {
  const __m512i prev = _mm512_castps_si512(k > 0 ? v[k - 1] : _mm512_set1_ps(-INFINITY));
  return _mm512_castsi512_ps(_mm512_maskz_alignr_epi32(0xFFFF, _mm512_castps_si512(v[k]), prev, 15));
}
template <int NV>
ET_ALWAYS_INLINE inline __m512 right_taps(const __m512 (&v)[NV], int k) {
  const __m512i next = _mm512_castps_si512(k + 1 < NV ? v[k + 1] : _mm512_set1_ps(-INFINITY));
  return _mm512_castsi512_ps(_mm512_maskz_alignr_epi32(0xFFFF, next, _mm512_castps_si512(v[k]), 1));
}

// An input row's running first maximum over the taps s = 0, 1, 2 of each output column, and its s
// (-1: no tap won, as max_at's -FLT_MAX start). kFinite: In's values are never NaN nor below
// -FLT_MAX (BN + ReLU gives >= +0), so the first tap wins wherever it is inside the row, and where
// it is not (column 0's -inf) the second does: the start costs nothing.
template <int NV, bool kFinite>
ET_ALWAYS_INLINE inline void row_args(const __m512 (&v)[NV], __m512 (&m)[NV], __m512i (&a)[NV]) {
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
  for (int k = 0; k < NV; ++k) {
    const __m512 l = left_taps(v, k), r = right_taps(v, k);
    if constexpr (kFinite) {
      m[k] = l;
      a[k] = _mm512_setzero_si512();
    } else {
      a[k] = _mm512_mask_mov_epi32(_mm512_set1_epi32(-1), lanes512::greater(l, lowest), _mm512_setzero_si512());
      m[k] = lanes512::keep_greater(l, lowest);
    }
    __mmask16 t = lanes512::greater(v[k], m[k]);
    a[k] = _mm512_mask_mov_epi32(a[k], t, _mm512_set1_epi32(1));
    m[k] = lanes512::keep_greater(v[k], m[k]);
    t = lanes512::greater(r, m[k]);
    a[k] = _mm512_mask_mov_epi32(a[k], t, _mm512_set1_epi32(2));
    m[k] = lanes512::keep_greater(r, m[k]);
  }
}
// The values only, with the same running maximum (max_forward_stride1_window's).
template <int NV>
ET_ALWAYS_INLINE inline void row_maxima(const __m512 (&v)[NV], __m512 (&m)[NV]) {
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
  for (int k = 0; k < NV; ++k) {
    m[k] = lanes512::keep_greater(left_taps(v, k), lowest);
    m[k] = lanes512::keep_greater(v[k], m[k]);
    m[k] = lanes512::keep_greater(right_taps(v, k), m[k]);
  }
}

// y [H,W] = the max over each window of in's values of x, into out (YRows or a fused sink), in
// max_forward_stride1_window's order of put calls. Rows outside the plane are -FLT_MAX rows (the
// running maximum's start: they change nothing).
template <int NV, class In, class Out>
inline void max_forward(const Plane& g, const float* x, const In& in, Out& out) {
  constexpr int64_t W = 16 * NV;
  const int64_t H = g.H;
  __m512 v[NV], top[NV], mid[NV], bot[NV];
  for (int k = 0; k < NV; ++k) top[k] = _mm512_set1_ps(-FLT_MAX);
  input_row<NV>(x, in, v);
  row_maxima<NV>(v, mid);
  for (int64_t p = 0; p < H; ++p) {
    if (p + 1 < H) {
      __builtin_prefetch(x + (p + 1 + kPrefetchRows) * W);
      if (NV == 2) __builtin_prefetch(x + (p + 1 + kPrefetchRows) * W + 16);
      input_row<NV>(x + (p + 1) * W, in, v);
      row_maxima<NV>(v, bot);
    } else {
      for (int k = 0; k < NV; ++k) bot[k] = _mm512_set1_ps(-FLT_MAX);
    }
    for (int k = 0; k < NV; ++k) {
      const __m512 m = lanes512::keep_greater(bot[k], lanes512::keep_greater(mid[k], top[k]));
      out.put(p, 16 * k, m);
      top[k] = mid[k];
      mid[k] = bot[k];
    }
  }
}

// dx [H,W] (+)= dy routed to each window's first maximum, as max_backward_stride1_window (the
// same accumulate, ReLU mask and DyAffine rules).
template <int NV, class In, bool kAffine>
inline void max_backward(const Plane& g, const float* x, const In& in, const float* dy, float* dx, bool accumulate,
                         const DyAffine* affine) {
  constexpr int64_t W = 16 * NV;
  constexpr int64_t RS = W + 16;  // a buffer row: 16 lanes of padding, then the output row
  constexpr bool kFinite = In::kReluMask;
  const int64_t H = g.H;
  // Output (p, q) at (p + 1) * RS + 16 + q for p in [-1, H]: rows -1 and H and each row's padding
  // (which is also the previous row's column W) say "no argument" (-1) with dy 0.
  alignas(64) int8_t codes[(kMaxRows + 2) * RS + 16];
  alignas(64) float dys[(kMaxRows + 2) * RS + 16];
  __mmask16 passes[kMaxRows][NV];  // kReluMask: the lanes of input row h whose value is > 0
  const __m512 zero = _mm512_setzero_ps();
  const __m128i none = _mm_set1_epi8(-1);
  auto clear = [&](int64_t from, int64_t n) {  // n a multiple of 16
    for (int64_t j = from; j < from + n; j += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), none);
      _mm512_store_ps(dys + j, zero);
    }
  };
  clear(0, RS);                // row -1 and row 0's padding come next
  clear((H + 1) * RS, RS + 16);  // row H, and its column W

  // Phase 1: every output's argument r * 3 + s and its dy, row by row, the maxima of input rows
  // p - 1, p and p + 1 in registers (rows outside the plane: -FLT_MAX, no argument).
  __m512 v[NV], m_top[NV], m_mid[NV], m_bot[NV];
  __m512i a_top[NV], a_mid[NV], a_bot[NV];
  for (int k = 0; k < NV; ++k) m_top[k] = _mm512_set1_ps(-FLT_MAX), a_top[k] = _mm512_set1_epi32(-1);
  input_row<NV>(x, in, v);
  if constexpr (In::kReluMask)
    for (int k = 0; k < NV; ++k) passes[0][k] = lanes512::greater(v[k], zero);
  row_args<NV, kFinite>(v, m_mid, a_mid);
  const __m512i three = _mm512_set1_epi32(3), six = _mm512_set1_epi32(6);
  const DyAffine dy_affine = kAffine ? *affine : DyAffine(0.f, 0.f, 0.f);
  for (int64_t p = 0; p < H; ++p) {
    if (p + 1 < H) {
      const float* xn = x + (p + 1) * W;
      __builtin_prefetch(xn + kPrefetchRows * W);
      if (NV == 2) __builtin_prefetch(xn + kPrefetchRows * W + 16);
      input_row<NV>(xn, in, v);
      if constexpr (In::kReluMask)
        for (int k = 0; k < NV; ++k) passes[p + 1][k] = lanes512::greater(v[k], zero);
      row_args<NV, kFinite>(v, m_bot, a_bot);
    } else {
      for (int k = 0; k < NV; ++k) m_bot[k] = _mm512_set1_ps(-FLT_MAX), a_bot[k] = _mm512_set1_epi32(-1);
    }
    const float* dyp = dy + p * W;
    __builtin_prefetch(dyp + kPrefetchRows * W);
    if (NV == 2) __builtin_prefetch(dyp + kPrefetchRows * W + 16);
    const int64_t row = (p + 1) * RS;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + row), none);  // the padding: column -1 (and W of row p - 1)
    _mm512_store_ps(dys + row, zero);
    for (int k = 0; k < NV; ++k) {
      __m512 m = m_top[k];
      __m512i a = a_top[k];
      __mmask16 t = lanes512::greater(m_mid[k], m);
      a = _mm512_mask_add_epi32(a, t, a_mid[k], three);
      m = lanes512::keep_greater(m_mid[k], m);
      t = lanes512::greater(m_bot[k], m);
      a = _mm512_mask_add_epi32(a, t, a_bot[k], six);
      m = lanes512::keep_greater(m_bot[k], m);
      lanes512::store_codes(codes + row + 16 + 16 * k, _mm512_castsi512_ps(a));
      __m512 d = _mm512_loadu_ps(dyp + 16 * k);
      if constexpr (kAffine) d = dy_affine.value(d, m);
      _mm512_store_ps(dys + row + 16 + 16 * k, d);
      m_top[k] = m_mid[k], a_top[k] = a_mid[k];
      m_mid[k] = m_bot[k], a_mid[k] = a_bot[k];
    }
  }

  // Phase 2: input (h, w) gathers from the windows (h + 1 - r, w + 1 - s) that chose their tap
  // r * 3 + s, in the reference's raster order: r = 2, 1, 0, then s = 2, 1, 0.
  for (int64_t h = 0; h < H; ++h) {
    float* dxh = dx + h * W;
    for (int k = 0; k < NV; ++k) {
      __m512 acc = !accumulate || In::kReluMask ? zero : _mm512_loadu_ps(dxh + 16 * k);
      for (int r = 2; r >= 0; --r) {
        const int64_t base = (h + 2 - r) * RS + 16 + 16 * k + 1;  // output row h + 1 - r, column w + 1
        for (int s = 2; s >= 0; --s)
          acc = lanes512::add_where(acc, lanes512::codes_equal(codes + base - s, r * 3 + s),
                                    _mm512_loadu_ps(dys + base - s));
      }
      if constexpr (In::kReluMask) acc = lanes512::keep_where(acc, passes[h][k]);
      _mm512_storeu_ps(dxh + 16 * k, acc);
    }
  }
}

}  // namespace rows3x3
}  // namespace pool_planes
}  // namespace et
#endif
