// BrainSlug's window (3x3, stride 1, pad 1) on planes 16 or 32 columns wide (CIFAR's 32x32 and
// 16x16 maps), forward and backward, included by pool_stride1.h, which takes these where they
// apply. Written once over its lane type lv (16 lanes on AVX-512, 8 on AVX2 and NEON), as
// pool_stride1.h's general kernels are; same definitions and bits as they (and so as the reference
// loops): each window's first maximum found row first, then across rows; each input gathers the
// dy of the windows it won in the reference's order.
//
// Why a form of its own: on 32-column planes a third of the general kernels' time went to the work
// around each row (rings of rows, a padded copy of every input row, lambdas per block of columns,
// a memcpy of each dy row), not to the vectors (docs/fusion-log.md, session 43). Here a row is NV
// registers: its horizontal taps are lane shifts (lv::shift_in_left / right) with -inf shifted in
// at the plane's sides, the maxima of three input rows stay in registers while the output rows
// pass over them, and the backward runs in two phases over the plane: first every output's
// argument (lv::Code, as pool_stride1.h's) and dy into plane-sized buffers padded with "no
// argument", then the gather, nine taps a vector, each a compare and a masked add, with no row of
// stores in flight under its loads.
#pragma once
#if defined(ET_LANES8)
#define ET_POOL_3X3_ROWS 1

namespace et {
namespace pool_planes {
namespace rows3x3 {

constexpr int64_t kMaxRows = 64;  // the backward's buffers hold a plane of up to this many rows

inline bool applies(const Plane& g) {
  return g.R == 3 && g.S == 3 && g.pad_h == 1 && g.pad_w == 1 && g.stride_h == 1 && g.stride_w == 1 &&
         (g.W == 16 || g.W == 32) && g.H >= 1 && g.H <= kMaxRows && g.P == g.H && g.Q == g.W;
}

using lv::F;

// The values of an input row as the windows see them: in.value of x's NV vectors.
template <int NV, class In>
ET_ALWAYS_INLINE inline void input_row(const float* xh, const In& in, F (&v)[NV]) {
  for (int k = 0; k < NV; ++k) v[k] = in.value(lv::load(xh + kW * k));
}

// Columns w - 1 and w + 1 at w (taps s = 0 and 2), -inf from outside the row.
template <int NV>
ET_ALWAYS_INLINE inline F left_taps(const F (&v)[NV], int k) {
  return lv::shift_in_left(k > 0 ? v[k - 1] : lv::splat(-INFINITY), v[k]);
}
template <int NV>
ET_ALWAYS_INLINE inline F right_taps(const F (&v)[NV], int k) {
  return lv::shift_in_right(v[k], k + 1 < NV ? v[k + 1] : lv::splat(-INFINITY));
}

// The running first maximum over taps: v > m takes v and its argument (false on NaN).
ET_ALWAYS_INLINE inline void take(F v, F arg, F* m, F* a) {
  *a = lv::select(lv::greater(v, *m), *a, arg);
  *m = lv::keep_greater(v, *m);
}

// An input row's running first maximum over the taps s = 0, 1, 2 of each output column, and its s
// (-1: no tap won, as max_at's -FLT_MAX start). kNonNegative: In's values are >= +0 (BN + ReLU),
// so the first tap wins wherever it is inside the row, and where it is not (column 0's -inf) the
// second does: the start costs nothing.
template <int NV, bool kNonNegative>
ET_ALWAYS_INLINE inline void row_args(const F (&v)[NV], F (&m)[NV], F (&a)[NV]) {
  const F lowest = lv::splat(-FLT_MAX);
  for (int k = 0; k < NV; ++k) {
    const F l = left_taps(v, k);
    if constexpr (kNonNegative) {
      m[k] = l;
      a[k] = lv::int_splat(0);
    } else {
      m[k] = lowest;
      a[k] = lv::int_splat(-1);
      take(l, lv::int_splat(0), &m[k], &a[k]);
    }
    take(v[k], lv::int_splat(1), &m[k], &a[k]);
    take(right_taps(v, k), lv::int_splat(2), &m[k], &a[k]);
  }
}
// The values only, with the same running maximum (max_forward_stride1_window's).
template <int NV>
ET_ALWAYS_INLINE inline void row_maxima(const F (&v)[NV], F (&m)[NV]) {
  const F lowest = lv::splat(-FLT_MAX);
  for (int k = 0; k < NV; ++k) {
    m[k] = lv::keep_greater(left_taps(v, k), lowest);
    m[k] = lv::keep_greater(v[k], m[k]);
    m[k] = lv::keep_greater(right_taps(v, k), m[k]);
  }
}

// y [H,W] = the max over each window of in's values of x, into out (YRows or a fused sink), in
// max_forward_stride1_window's order of put calls. Rows outside the plane are -FLT_MAX rows (the
// running maximum's start: they change nothing).
template <int W, class In, class Out>
inline void max_forward(const Plane& g, const float* x, const In& in, Out& out) {
  constexpr int NV = W / kW;
  const int64_t H = g.H;
  F v[NV], top[NV], mid[NV], bot[NV];
  for (int k = 0; k < NV; ++k) top[k] = lv::splat(-FLT_MAX);
  input_row<NV>(x, in, v);
  row_maxima<NV>(v, mid);
  for (int64_t p = 0; p < H; ++p) {
    if (p + 1 < H) {
      for (int j = 0; j < W; j += 16) __builtin_prefetch(x + (p + 1 + kPrefetchRows) * W + j);
      input_row<NV>(x + (p + 1) * W, in, v);
      row_maxima<NV>(v, bot);
    } else {
      for (int k = 0; k < NV; ++k) bot[k] = lv::splat(-FLT_MAX);
    }
    for (int k = 0; k < NV; ++k) {
      out.put(p, kW * k, lv::keep_greater(bot[k], lv::keep_greater(mid[k], top[k])));
      top[k] = mid[k];
      mid[k] = bot[k];
    }
  }
}

// dx [H,W] (+)= dy routed to each window's first maximum, as max_backward_stride1_window (the
// same accumulate, ReLU mask and DyAffine rules).
template <int W, class In, bool kAffine>
inline void max_backward(const Plane& g, const float* x, const In& in, const float* dy, float* dx, bool accumulate,
                         const DyAffine* affine) {
  constexpr int NV = W / kW;
  constexpr int64_t RS = W + 16;  // a buffer row: 16 lanes of padding, then the output row
  const int64_t H = g.H;
  // Output (p, q) at (p + 1) * RS + 16 + q for p in [-1, H]: rows -1 and H and each row's padding
  // (which is also the previous row's column W) say "no argument" (-1) with dy 0.
  alignas(64) lv::Code codes[(kMaxRows + 2) * RS + 16];
  alignas(64) float dys[(kMaxRows + 2) * RS + 16];
  lv::M passes[kMaxRows][NV];  // kReluMask: the lanes of input row h whose value is > 0
  const F zero = lv::splat(0.f), none = lv::int_splat(-1);
  auto clear = [&](int64_t from, int64_t n) {  // n a multiple of kW
    for (int64_t j = from; j < from + n; j += kW) {
      lv::store_codes(codes + j, none);
      lv::store(dys + j, zero);
    }
  };
  clear(0, RS);                  // row -1 (row 0's padding comes with row 0)
  clear((H + 1) * RS, RS + 16);  // row H, and its column W

  // Phase 1: every output's argument r * 3 + s and its dy, row by row, the maxima of input rows
  // p - 1, p and p + 1 in registers (rows outside the plane: -FLT_MAX, no argument).
  F v[NV], m_top[NV], m_mid[NV], m_bot[NV], a_top[NV], a_mid[NV], a_bot[NV];
  for (int k = 0; k < NV; ++k) m_top[k] = lv::splat(-FLT_MAX), a_top[k] = none;
  input_row<NV>(x, in, v);
  if constexpr (In::kReluMask)
    for (int k = 0; k < NV; ++k) passes[0][k] = lv::greater(v[k], zero);
  row_args<NV, In::kNonNegative>(v, m_mid, a_mid);
  const F three = lv::int_splat(3), six = lv::int_splat(6);
  const DyAffine dy_affine = kAffine ? *affine : DyAffine(0.f, 0.f, 0.f);
  for (int64_t p = 0; p < H; ++p) {
    if (p + 1 < H) {
      const float* xn = x + (p + 1) * W;
      for (int j = 0; j < W; j += 16) __builtin_prefetch(xn + kPrefetchRows * W + j);
      input_row<NV>(xn, in, v);
      if constexpr (In::kReluMask)
        for (int k = 0; k < NV; ++k) passes[p + 1][k] = lv::greater(v[k], zero);
      row_args<NV, In::kNonNegative>(v, m_bot, a_bot);
    } else {
      for (int k = 0; k < NV; ++k) m_bot[k] = lv::splat(-FLT_MAX), a_bot[k] = none;
    }
    const float* dyp = dy + p * W;
    for (int j = 0; j < W; j += 16) __builtin_prefetch(dyp + kPrefetchRows * W + j);
    const int64_t row = (p + 1) * RS;
    clear(row, 16);  // the padding: column -1 (and W of row p - 1)
    for (int k = 0; k < NV; ++k) {
      // Row p - 1 is the window's row r = 0: its maximum and argument as they are.
      F m = m_top[k], a = a_top[k];
      take(m_mid[k], lv::int_add(a_mid[k], three), &m, &a);
      take(m_bot[k], lv::int_add(a_bot[k], six), &m, &a);
      lv::store_codes(codes + row + 16 + kW * k, a);
      F d = lv::load(dyp + kW * k);
      if constexpr (kAffine) d = dy_affine.value(d, m);
      lv::store(dys + row + 16 + kW * k, d);
      m_top[k] = m_mid[k], a_top[k] = a_mid[k];
      m_mid[k] = m_bot[k], a_mid[k] = a_bot[k];
    }
  }

  // Phase 2: input (h, w) gathers from the windows (h + 1 - r, w + 1 - s) that chose their tap
  // r * 3 + s, in the reference's raster order: r = 2, 1, 0, then s = 2, 1, 0.
  for (int64_t h = 0; h < H; ++h) {
    float* dxh = dx + h * W;
    for (int k = 0; k < NV; ++k) {
      F acc = !accumulate || In::kReluMask ? zero : lv::load(dxh + kW * k);
      for (int r = 2; r >= 0; --r) {
        const int64_t base = (h + 2 - r) * RS + 16 + kW * k + 1;  // output row h + 1 - r, column w + 1
        for (int s = 2; s >= 0; --s)
          acc = lv::add_where(acc, lv::codes_equal(codes + base - s, r * 3 + s), lv::load(dys + base - s));
      }
      if constexpr (In::kReluMask) acc = lv::keep_where(acc, passes[h][k]);
      lv::store(dxh + kW * k, acc);
    }
  }
}

}  // namespace rows3x3
}  // namespace pool_planes
}  // namespace et
#endif
