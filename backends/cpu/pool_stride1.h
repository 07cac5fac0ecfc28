// Stride-1 max pooling on AVX-512 (lanes512.h), AVX2 and NEON (lanes8.h), the pool of BrainSlug's
// <MaxPool 3x3 s1 p1, BN, ReLU> block, included by pool_planes.h: the backward of the layer, and forward and backward
// of a fused BN -> ReLU -> max-pool stack straight from the BN's input (fused.cpp, fused_backward.cpp). Same
// definitions as the reference loops (max_forward_reference, max_backward_reference, then
// relu_backward's rule), same bits: each window's first maximum found row first, then across
// rows; each input gathers the dy of the windows it won, in the reference's order.
//
// pool_planes.h's general loops do the same per input row through tables of tap pointers, ring
// tags, masked loads at both ends of every row and a division per row; on 32x32 planes that was
// five times the instructions of the arithmetic. Here rows stream in order: each input row is
// copied once into a buffer padded with -inf, its maxima taken once and each output row's
// arguments once (both in rings of kRingRows), and the output rows are stored padded with
// arguments of -1, so every tap is a plain load and every tap of the gather one compare and one
// (masked) add a vector, unrolled for 3x3 windows. An argument is the window's tap r * S + s
// (a byte a lane on AVX-512), so the gather compares with a constant per tap. Rows start at
// 64-byte boundaries: at 16 lanes a store split across two lines, and the loads after it, were
// slower than the 8-lane kernel (session 40).
//
// BrainSlug's own window (3x3, pad 1) on planes 16 or 32 wide goes to pool_3x3_rows.h instead:
// rows in registers and a backward in two phases over the plane (2-4.5x these kernels on 32x32).
//
// The pool's input comes through a policy: PlaneInput reads the plane; BnReluInput reads the BN's
// input x and applies the BN and the ReLU on the way (bn_rows::apply's FMA, relu_forward's rule),
// so a fused stack needs no scratch plane for them, and the backward applies the ReLU's mask to dz
// as it stores it.
#pragma once

#include "backends/cpu/always_inline.h"
#include "backends/cpu/lanes512.h"
#include "backends/cpu/lanes8.h"

// The kernels are written once over a lane type lv (lanes8.h's names): 16 lanes on AVX-512
// (lanes512.h), 8 on AVX2 and NEON. ET_POOL_STRIDE1_LANES8 keeps AVX-512 hosts on the 8-lane form
// (to measure one against the other). Every lane takes the same elements in the same order either
// way, so both give the same bits.
// History: on a Zen 4 host (bench fusion --depth 8, batch 128, three interleaved pairs) the 8-lane
// form took the fused step 120-128 -> 85-96 ms against pool_planes.h's 16-lane loops and the
// stage-by-stage fused path, the unfused step 179-183 -> 163-178 ms (session 36); the 16-lane form
// of these kernels followed on a Zen 5 host (session 40, docs/fusion-log.md).
#if defined(ET_LANES8)
#define ET_POOL_STRIDE1 1
namespace et {
namespace pool_planes {

#if defined(ET_LANES512) && !defined(ET_POOL_STRIDE1_LANES8)
namespace lv = lanes512;
#else
namespace lv = lanes8;
#endif
constexpr int kW = lv::kWidth;  // lanes a vector
static_assert(kLanes % kW == 0 && 32 % kW == 0, "rows are whole vectors, blocks of 32 and 16 columns");

inline bool stride1_applies(const Plane& g) {
  return g.stride_h == 1 && g.stride_w == 1 && fast_max_applies(g) && g.pad_h < g.R;
}

// The pool's input as the rows of x give it: value(x vector).
struct PlaneInput {
  static constexpr bool kReluMask = false;
  static constexpr bool kNonNegative = false;  // any value: NaN, -inf, -0 included
  lv::F value(lv::F x) const { return x; }
};
// relu(x * scale + shift) of the BN's input x (one rounding; NaN and -0 give +0), and the ReLU's
// mask: lanes where that is > 0.
struct BnReluInput {
  static constexpr bool kReluMask = true;
  static constexpr bool kNonNegative = true;  // value() is >= +0: never NaN, never -0
  lv::F scale, shift;
  BnReluInput(float sc, float sh) : scale(lv::splat(sc)), shift(lv::splat(sh)) {}
  lv::F value(lv::F x) const { return lv::relu(lv::fmadd(x, scale, shift)); }
  lv::M passes(const float* xh, int64_t col, int64_t W) const {  // the lanes inside the row
    const lv::F x = lv::load_inside(xh + col, col, W, lv::splat(0.f));
    return lv::greater(lv::fmadd(x, scale, shift), lv::splat(0.f));
  }
};

// Rows ahead that the kernels touch in x and dy: a plane of CIFAR's size is one 4 KiB page, where
// the hardware prefetcher stops; the next plane follows in memory.
constexpr int64_t kPrefetchRows = 4;

// The input rows as the taps read them: in.value of row h at [pw, pw + W) of a buffer of -inf
// (which never wins, as padding never does in the reference), so every tap is a plain load. A ring
// of kRows buffers: row h + 1 is written while row h is read (a load that straddles stores still in
// flight would wait for them), and the backward's gather finds row h's values again for the ReLU's
// mask while it lies at most kRows - 1 rows behind the last one filled.
template <class In, int64_t kRows = 2>
class PaddedRows {
 public:
  PaddedRows(const Plane& g, const float* x, const In& in) : g_(g), x_(x), in_(in) {
    const int64_t L = kLeft - g.pad_w + padded_row_floats(g) + 16;  // + 16: load_at's reach
    for (auto& b : buf_)
      for (int64_t j = 0; j < L; ++j) b[j] = -INFINITY;
  }
  static constexpr int64_t kLeft = 16;  // x's column 0 at a 64-byte boundary
  static_assert(kRows >= 2 && (kRows & (kRows - 1)) == 0, "a ring of a power of two");
  // Lanes [w, w + kW) of row h's values > 0 (row h filled, at most kRows - 1 rows behind the last;
  // lanes past the row: off). For BnReluInput: the lanes the ReLU passes, as BnReluInput::passes,
  // from the values here instead of x again (15 % of the backward kernel, session 40).
  lv::M positive(int64_t h, int64_t w) const {
    return lv::greater(lv::load(buf_[h & (kRows - 1)] + kLeft + w), lv::splat(0.f));
  }
  // Row h (rows are asked for in order from 0), column col of its padded form at col.
  const float* row(int64_t h) { return aligned_row(h) + kLeft - g_.pad_w; }
  // The same row's buffer, 64-byte aligned: x's column c at kLeft + c.
  const float* aligned_row(int64_t h) {
    if (h == 0) fill(0);
    if (h + 1 < g_.H) fill(h + 1);
    return buf_[h & (kRows - 1)];
  }

 private:
  void fill(int64_t h) {
    const float* xh = x_ + h * g_.W;
    for (int64_t w = 0; w < g_.W; w += 16) __builtin_prefetch(xh + kPrefetchRows * g_.W + w);
    float* d = buf_[h & (kRows - 1)] + kLeft;  // aligned: a store split across two lines would be slow
    int64_t w = 0;
    for (; w + kW <= g_.W; w += kW) lv::store(d + w, in_.value(lv::load(xh + w)));
    if (w < g_.W)  // the tail: nothing past the row is read or written
      lv::store_inside(d + w, w, g_.W, in_.value(lv::load_inside(xh + w, w, g_.W, lv::splat(0.f))));
  }
  const Plane& g_;
  const float* x_;
  const In& in_;
  alignas(64) float buf_[kRows][kLeft + kRingCols + 16];
};

// dy as the BN after the pool leaves it when it hands its second backward sweep on to this pool
// (FusedGrads::dy_coef): dy = (a * d + b * y) + c0, d the buffer dy points at and y the pool's output,
// whose values the backward finds again as its windows' maxima; bn_rows::grad_apply's arithmetic.
struct DyAffine {
  lv::F a, b, c0;
  DyAffine(float va, float vb, float vc0) : a(lv::splat(va)), b(lv::splat(vb)), c0(lv::splat(vc0)) {}
  explicit DyAffine(const float* k) : DyAffine(k ? k[0] : 0.f, k ? k[1] : 0.f, k ? k[2] : 0.f) {}  // a, b, c0
  lv::F value(lv::F d, lv::F y) const {
    return lv::add(lv::fmadd(a, d, lv::mul(b, y)), c0);
  }
};

// Vectors of columns [0, Qr) in blocks of V side by side (V independent chains): 32 columns, then
// 16 (Qr is a multiple of 16).
template <class Block>
inline void for_column_blocks(int64_t Qr, Block block) {
  int64_t q0 = 0;
  for (; q0 + 32 <= Qr; q0 += 32) block(q0, std::integral_constant<int, 32 / kW>{});
  for (; q0 < Qr; q0 += 16) block(q0, std::integral_constant<int, 16 / kW>{});
}

// f(0), f(1), ..., f(N - 1), each index a constant (std::integral_constant), for taps whose
// offsets are template arguments (load_at).
template <class Fn, int... I>
ET_ALWAYS_INLINE inline void unroll_each(Fn& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class Fn>
ET_ALWAYS_INLINE inline void unroll(Fn f) {
  unroll_each(f, std::make_integer_sequence<int, N>{});
}

// Where the forward's output vectors go: put(p, q, v) for output row p, columns [q, q + kW) (q
// past Q: lanes of the rounded row only). YRows stores them into y [P,Q], masked at the row's end;
// a fused stack's sink also sums them for the next BN and may stream them (fused.cpp).
struct YRows {
  float* y;
  int64_t Q;
  ET_ALWAYS_INLINE void put(int64_t p, int64_t q, lv::F v) const {
    float* yp = y + p * Q;
    if (q + kW <= Q)
      lv::store(yp + q, v);
    else if (q < Q)
      lv::store_inside(yp + q, q, Q, v);
  }
};

// y [P,Q] = the max over each window of the input in's rows of x (values only: max_ps(v, m) is the
// running first maximum's value, m where v is NaN or equal), into out (YRows: y). Each input row's
// maxima once, in a ring. kPw >= 0: the padding's width as a constant (with kS), so the taps are
// aligned loads and shifts (load_at), else g's.
template <int kR, int kS, int kPw, class In, class Out>
inline void max_forward_stride1_window(const Plane& g, const float* x, const In& in, Out& out) {
  static_assert(kPw < 0 || kS > 0, "a constant padding with a constant window");
  const int64_t R = kR > 0 ? kR : g.R, S = kS > 0 ? kS : g.S;
  const int64_t Qr = round_lanes(g.Q), ph = g.pad_h;
  alignas(64) float row_m[kRingRows][kRingCols];
  PaddedRows<In> rows(g, x, in);
  int64_t next_h = 0;
  for (int64_t p = 0; p < g.P; ++p) {
    const int64_t h0 = std::max<int64_t>(0, p - ph), h1 = std::min(g.H, p - ph + R);
    for (; next_h < h1; ++next_h) {
      const float* xa = rows.aligned_row(next_h);  // column q0 + s - pw at xa + kLeft - pw + q0 + s
      const float* xr = xa + PaddedRows<In>::kLeft - g.pad_w;
      float* m = row_m[next_h & (kRingRows - 1)];
      for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
        constexpr int V = decltype(blocks)::value;
        lv::F mv[V];
        for (int k = 0; k < V; ++k) mv[k] = lv::splat(-FLT_MAX);
        if constexpr (kPw >= 0) {
          unroll<kS>([&](auto s) {
            unroll<V>([&](auto k) {
              constexpr int o = int(PaddedRows<In>::kLeft) - kPw + kW * k + s;
              mv[k] = lv::keep_greater(lv::load_at<o>(xa + q0), mv[k]);
            });
          });
        } else {
          for (int64_t s = 0; s < S; ++s)
            for (int k = 0; k < V; ++k) mv[k] = lv::keep_greater(lv::load(xr + q0 + kW * k + s), mv[k]);
        }
        for (int k = 0; k < V; ++k) lv::store(m + q0 + kW * k, mv[k]);
      });
    }
    for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      lv::F mv[V];
      for (int k = 0; k < V; ++k) mv[k] = lv::splat(-FLT_MAX);
      for (int64_t h = h0; h < h1; ++h)
        for (int k = 0; k < V; ++k)
          mv[k] = lv::keep_greater(lv::load(row_m[h & (kRingRows - 1)] + q0 + kW * k), mv[k]);
      for (int k = 0; k < V; ++k) out.put(p, q0 + kW * k, mv[k]);
    });
  }
}
}  // namespace pool_planes
}  // namespace et
#include "backends/cpu/pool_3x3_rows.h"  // NOLINT(build/include_order): uses DyAffine, kPrefetchRows
namespace et {
namespace pool_planes {

template <class In, class Out>
inline void max_forward_stride1_to(const Plane& g, const float* x, const In& in, Out& out) {
#if defined(ET_POOL_3X3_ROWS)
  if (rows3x3::applies(g))
    return g.W == 16 ? rows3x3::max_forward<16>(g, x, in, out) : rows3x3::max_forward<32>(g, x, in, out);
#endif
  if (g.R == 3 && g.S == 3 && g.pad_w == 1) return max_forward_stride1_window<3, 3, 1>(g, x, in, out);
  if (g.R == 3 && g.S == 3) return max_forward_stride1_window<3, 3, -1>(g, x, in, out);
  max_forward_stride1_window<0, 0, -1>(g, x, in, out);
}
template <class In>
inline void max_forward_stride1(const Plane& g, const float* x, const In& in, float* y) {
  YRows out{y, g.Q};
  max_forward_stride1_to(g, x, in, out);
}

// dx [H,W] (+)= dy routed to each window's first maximum (accumulate: onto dx; else dx is written
// whole, as if zeroed first), then with BnReluInput the ReLU's mask (+0 where it stops; dx is then
// always written whole: the mask applies to the pool's gradient alone). Input
// (h, w) lies in the windows of outputs (h + ph - r, w + pw - s), which come in the reference's
// raster order for r, then s, descending.
// kAffine: dy is that of a BN after the pool (*affine, DyAffine), else dy as it is (a separate
// instance: the plain one as tight as before).
// kR, kS: the window as constants (the taps unrolled), or 0: g's, at run time.
template <int kR, int kS, int kPw, class In, bool kAffine>
inline void max_backward_stride1_window(const Plane& g, const float* x, const In& in, const float* dy, float* dx,
                                        bool accumulate, const DyAffine* affine) {
  static_assert(kPw < 0 || (kR > 0 && kS > 0), "a constant padding with a constant window");
  const int64_t R = kR > 0 ? kR : g.R, S = kS > 0 ? kS : g.S;
  // Output column q at off + q of its row: off >= S - 1 leaves room for the taps left of column 0,
  // and 16 keeps the row's stores aligned (a store split across two lines is slow, and a load
  // waiting on it slower).
  constexpr int64_t off = 16;
  const int64_t Qr = round_lanes(g.Q), Wr = round_lanes(g.W), B = off + gather_row_ints(g);
  const int64_t pw = g.pad_w, ph = g.pad_h;
  // A window's argument as its tap, r * S + s (-1: none), so the gather compares with a constant
  // per tap, and on AVX-512 a byte a lane (lanes512.h, Code).
  alignas(64) float row_m[kRingRows][kRingCols];            // per input row: the running maxima over s ...
  alignas(64) int32_t row_a[kRingRows][kRingCols];          // ... and their s
  alignas(64) lv::Code out_a[kRingRows + 1][off + kRingCols];  // per output row q at off + q: its tap;
  alignas(64) float out_dy[kRingRows + 1][off + kRingCols];    // dy alike; the last row: outside the plane
  alignas(64) float yrow[kRingCols];                        // kAffine: the output row's maxima, y
  auto clear_output_row = [&](int64_t slot) {
    for (int64_t j = 0; j < B; ++j) {
      out_a[slot][j] = -1;
      out_dy[slot][j] = 0.f;
    }
  };
  for (int64_t k = 0; k < std::min(g.P, kRingRows); ++k) clear_output_row(k);  // the slots p & 7 takes
  clear_output_row(kRingRows);
  using lv::F;
  // The running first maximum over taps: v > m takes v and its argument (false on NaN).
  auto take = [](F v, F arg, F* m, F* a) {
    *a = lv::select(lv::greater(v, *m), *a, arg);
    *m = lv::keep_greater(v, *m);
  };

  // Input row h's maxima over the S taps of each output column, in the reference's s order. With
  // the ReLU's mask, a ring deep enough to find row h's values again in its gather: rows up to
  // h + ahead + R (ahead = 1) have been filled by then.
  constexpr bool kMaskFromRows = In::kReluMask && kR > 0 && kR + 2 <= kRingRows;
  using Rows = PaddedRows<In, kMaskFromRows ? kRingRows : 2>;
  Rows rows(g, x, in);
  auto row_stage = [&](int64_t h) ET_ALWAYS_INLINE {
    const float* xa = rows.aligned_row(h);  // column q0 + s - pw at xa + kLeft - pw + q0 + s
    const float* xr = xa + Rows::kLeft - pw;
    float* m = row_m[h & (kRingRows - 1)];
    int32_t* a = row_a[h & (kRingRows - 1)];
    for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      F mv[V], av[V];
      for (int k = 0; k < V; ++k) mv[k] = lv::splat(-FLT_MAX), av[k] = lv::int_splat(-1);
      if constexpr (kPw >= 0) {
        unroll<kS>([&](auto s) {
          unroll<V>([&](auto k) {
            constexpr int o = int(Rows::kLeft) - kPw + kW * k + s;
            take(lv::load_at<o>(xa + q0), lv::int_splat(s), &mv[k], &av[k]);
          });
        });
      } else {
        for (int64_t s = 0; s < S; ++s) {
          const F tap = lv::int_splat(int32_t(s));
          for (int k = 0; k < V; ++k) take(lv::load(xr + q0 + kW * k + s), tap, &mv[k], &av[k]);
        }
      }
      for (int k = 0; k < V; ++k) {
        lv::store(m + q0 + kW * k, mv[k]);
        lv::store_int(a + q0 + kW * k, av[k]);
      }
    });
  };
  int64_t next_h = 0;  // input rows [0, next_h) have their row maxima
  // Output row p's arguments (the first row holding the window's maximum, in r order) and dy.
  auto output_row = [&](int64_t p) ET_ALWAYS_INLINE {
    const int64_t h0 = std::max<int64_t>(0, p - ph), h1 = std::min(g.H, p - ph + R);
    while (next_h < h1) row_stage(next_h++);
    lv::Code* a = out_a[p & (kRingRows - 1)] + off;
    float* dyr = out_dy[p & (kRingRows - 1)] + off;
    const float* dyp = dy + p * g.Q;
    for (int64_t q = 0; q < g.Q; q += 16) __builtin_prefetch(dyp + kPrefetchRows * g.Q + q);
    for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      F mv[V], av[V];
      for (int k = 0; k < V; ++k) mv[k] = lv::splat(-FLT_MAX), av[k] = lv::int_splat(-1);
      for (int64_t h = h0; h < h1; ++h) {
        const F row_tap = lv::int_splat(int32_t((h - (p - ph)) * S));  // r * S: row h is the window's row r
        for (int k = 0; k < V; ++k) {
          const int64_t j = q0 + kW * k, slot = h & (kRingRows - 1);
          take(lv::load(row_m[slot] + j), lv::int_add(row_tap, lv::load_int(row_a[slot] + j)), &mv[k], &av[k]);
        }
      }
      for (int k = 0; k < V; ++k) lv::store_codes(a + q0 + kW * k, av[k]);
      if constexpr (kAffine)
        for (int k = 0; k < V; ++k) lv::store(yrow + q0 + kW * k, mv[k]);
    });
    if constexpr (kAffine) {  // in a loop of its own: beside the maxima above it cost 3x as much
      const DyAffine k = *affine;
      int64_t q = 0;
      for (; q + kW <= g.Q; q += kW) lv::store(dyr + q, k.value(lv::load(dyp + q), lv::load(yrow + q)));
      if (q < g.Q)
        lv::store(dyr + q, k.value(lv::load_inside(dyp + q, q, g.Q, lv::splat(0.f)), lv::load(yrow + q)));
    }
    for (int64_t q = g.Q; q < Qr; ++q) a[q] = -1;  // lanes past the row
    if constexpr (!kAffine) std::memcpy(dyr, dyp, sizeof(float) * size_t(g.Q));
  };
  int64_t next_p = 0;  // output rows [0, next_p) have their arguments
  const int64_t ahead = R < kRingRows ? 1 : 0;

  for (int64_t h = 0; h < g.H; ++h) {
    // One output row ahead where the ring has room: a row's stores have reached the cache
    // before the gather reads them at other offsets (a load that straddles stores still in
    // flight waits for them).
    while (next_p < std::min(g.P, h + ph + 1 + ahead)) output_row(next_p++);
    const lv::Code* ta[kRingRows];  // output row h + ph - r of tap row r, from r = R - 1 down, at lane 0, s = 0
    const float* td[kRingRows];
    for (int64_t r = R - 1, t = 0; r >= 0; --r, ++t) {
      const int64_t p = h + ph - r;
      const int64_t slot = p >= 0 && p < g.P ? (p & (kRingRows - 1)) : kRingRows;
      ta[t] = out_a[slot] + off + pw;
      td[t] = out_dy[slot] + off + pw;
    }
    float* dxh = dx + h * g.W;
    // V vectors side by side: each lane's additions are a chain in tap order (lanes that are not
    // the argument add nothing). The taps' loads, not the chains, bound it: two rows at a time
    // (2V chains, and the loads of the output rows they share) were no faster (session 40), and
    // neither were aligned loads shifted into place (valignd, as the row maxima take them).
    auto columns = [&](int64_t w0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      F acc[V];
      for (int k = 0; k < V; ++k) {
        const int64_t w = w0 + kW * k;
        const F zero = lv::splat(0.f);
        acc[k] = !accumulate || In::kReluMask ? zero : lv::load_inside(dxh + w, w, g.W, zero);
      }
      for (int64_t t = 0; t < R; ++t)
        for (int64_t s = S - 1; s >= 0; --s) {
          const int32_t tap = int32_t((R - 1 - t) * S + s);  // this input, seen from output (h + ph - r, w + pw - s)
          for (int k = 0; k < V; ++k) {
            const int64_t j = w0 + kW * k - s;
            acc[k] = lv::add_where(acc[k], lv::codes_equal(ta[t] + j, tap), lv::load(td[t] + j));
          }
        }
      for (int k = 0; k < V; ++k) {
        const int64_t w = w0 + kW * k;
        if constexpr (In::kReluMask) {  // +0 where the ReLU stopped x
          if constexpr (kMaskFromRows)
            acc[k] = lv::keep_where(acc[k], rows.positive(h, w));
          else
            acc[k] = lv::keep_where(acc[k], in.passes(x + h * g.W, w, g.W));
        }
        if (w + kW <= g.W)
          lv::store(dxh + w, acc[k]);
        else if (w < g.W)
          lv::store_inside(dxh + w, w, g.W, acc[k]);
      }
    };
    for_column_blocks(Wr, columns);  // Wr: a multiple of 16
  }
}

template <class In>
inline void max_backward_stride1(const Plane& g, const float* x, const In& in, const float* dy, float* dx,
                                 bool accumulate, const DyAffine* affine = nullptr) {
#if defined(ET_POOL_3X3_ROWS)
  if (rows3x3::applies(g)) {
    if (affine)
      return g.W == 16 ? rows3x3::max_backward<16, In, true>(g, x, in, dy, dx, accumulate, affine)
                       : rows3x3::max_backward<32, In, true>(g, x, in, dy, dx, accumulate, affine);
    return g.W == 16 ? rows3x3::max_backward<16, In, false>(g, x, in, dy, dx, accumulate, nullptr)
                     : rows3x3::max_backward<32, In, false>(g, x, in, dy, dx, accumulate, nullptr);
  }
#endif
  const bool k3 = g.R == 3 && g.S == 3, p1 = k3 && g.pad_w == 1;  // BrainSlug's 3x3 pad 1: aligned taps
  if (affine) {
    if (p1) return max_backward_stride1_window<3, 3, 1, In, true>(g, x, in, dy, dx, accumulate, affine);
    if (k3) return max_backward_stride1_window<3, 3, -1, In, true>(g, x, in, dy, dx, accumulate, affine);
    return max_backward_stride1_window<0, 0, -1, In, true>(g, x, in, dy, dx, accumulate, affine);
  }
  if (p1) return max_backward_stride1_window<3, 3, 1, In, false>(g, x, in, dy, dx, accumulate, nullptr);
  if (k3) return max_backward_stride1_window<3, 3, -1, In, false>(g, x, in, dy, dx, accumulate, nullptr);
  max_backward_stride1_window<0, 0, -1, In, false>(g, x, in, dy, dx, accumulate, nullptr);
}

}  // namespace pool_planes
}  // namespace et
#endif
