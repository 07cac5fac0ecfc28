// Stride-1 max pooling on AVX2 (AVX-512 hosts too) and NEON (lanes8.h), the pool of BrainSlug's <MaxPool 3x3 s1 p1,
// BN, ReLU> block, included by pool_planes.h: the backward of the layer, and forward and backward
// of a fused BN -> ReLU -> max-pool stack straight from the BN's input (fused.cpp). Same
// definitions as the reference loops (max_forward_reference, max_backward_reference, then
// relu_backward's rule), same bits: each window's first maximum found row first, then across
// rows; each input gathers the dy of the windows it won, in the reference's order.
//
// pool_planes.h's general loops do the same per input row through tables of tap pointers, ring
// tags, masked loads at both ends of every row and a division per row; on 32x32 planes that was
// five times the instructions of the arithmetic. Here rows stream in order: each input row is
// copied once into a buffer padded with -inf, its maxima taken once and each output row's
// arguments once (both in rings of kRingRows), and the output rows are stored padded with
// arguments of -1, so every tap is a plain load and every tap of the gather one compare, one blend
// and one add per 8 lanes, unrolled for 3x3 windows.
//
// The pool's input comes through a policy: PlaneInput reads the plane; BnReluInput reads the BN's
// input x and applies the BN and the ReLU on the way (bn_rows::apply's FMA, relu_forward's rule),
// so a fused stack needs no scratch plane for them, and the backward applies the ReLU's mask to dz
// as it stores it.
#pragma once

#include "backends/cpu/always_inline.h"
#include "backends/cpu/lanes8.h"

// AVX-512 hosts take these 8-lane kernels too: on a Zen 4 host (bench fusion --depth 8, batch 128,
// three interleaved pairs) the fused step went 120-128 -> 85-96 ms against pool_planes.h's 16-lane
// loops and the stage-by-stage fused path, the unfused step 179-183 -> 163-178 ms.
#if defined(ET_LANES8)
#define ET_POOL_STRIDE1 1
namespace et {
namespace pool_planes {

inline bool stride1_applies(const Plane& g) {
  return g.stride_h == 1 && g.stride_w == 1 && fast_max_applies(g) && g.pad_h < g.R;
}

// The pool's input as the rows of x give it: value(x vector).
struct PlaneInput {
  static constexpr bool kReluMask = false;
  lanes8::F8 value(lanes8::F8 x) const { return x; }
};
// relu(x * scale + shift) of the BN's input x (one rounding; NaN and -0 give +0), and the ReLU's
// mask: lanes where that is > 0.
struct BnReluInput {
  static constexpr bool kReluMask = true;
  lanes8::F8 scale, shift;
  BnReluInput(float sc, float sh) : scale(lanes8::splat(sc)), shift(lanes8::splat(sh)) {}
  lanes8::F8 value(lanes8::F8 x) const { return lanes8::relu(lanes8::fmadd(x, scale, shift)); }
  lanes8::F8 passes(const float* xh, int64_t col, int64_t W) const {  // the lanes inside the row
    const lanes8::F8 x = lanes8::load_inside(xh + col, col, W, lanes8::splat(0.f));
    return lanes8::greater(lanes8::fmadd(x, scale, shift), lanes8::splat(0.f));
  }
};

// Rows ahead that the kernels touch in x and dy: a plane of CIFAR's size is one 4 KiB page, where
// the hardware prefetcher stops; the next plane follows in memory.
constexpr int64_t kPrefetchRows = 4;

// The input rows as the taps read them: in.value of row h at [pw, pw + W) of a buffer of -inf
// (which never wins, as padding never does in the reference), so every tap is a plain load. Two
// buffers, row h + 1 written while row h is read: a load that straddles stores still in flight
// would wait for them.
template <class In>
class PaddedRows {
 public:
  PaddedRows(const Plane& g, const float* x, const In& in) : g_(g), x_(x), in_(in) {
    const int64_t L = padded_row_floats(g);
    for (auto& b : buf_)
      for (int64_t j = 0; j < L; ++j) b[j] = -INFINITY;
  }
  // Row h (rows are asked for in order from 0), column col of its padded form at [0, 8).
  const float* row(int64_t h) {
    if (h == 0) fill(0);
    if (h + 1 < g_.H) fill(h + 1);
    return buf_[h & 1];
  }

 private:
  void fill(int64_t h) {
    const float* xh = x_ + h * g_.W;
    for (int64_t w = 0; w < g_.W; w += 16) __builtin_prefetch(xh + kPrefetchRows * g_.W + w);
    float* d = buf_[h & 1] + g_.pad_w;
    int64_t w = 0;
    for (; w + 8 <= g_.W; w += 8) lanes8::store(d + w, in_.value(lanes8::load(xh + w)));
    if (w < g_.W)  // the tail: nothing past the row is read or written
      lanes8::store_inside(d + w, w, g_.W, in_.value(lanes8::load_inside(xh + w, w, g_.W, lanes8::splat(0.f))));
  }
  const Plane& g_;
  const float* x_;
  const In& in_;
  alignas(64) float buf_[2][kRingCols];
};

// dy as the BN after the pool leaves it when it hands its second backward sweep on to this pool
// (FusedGrads::dy_coef): dy = (a * d + b * y) + c0, d the buffer dy points at and y the pool's output,
// whose values the backward finds again as its windows' maxima; bn_rows::grad_apply's arithmetic.
struct DyAffine {
  lanes8::F8 a, b, c0;
  DyAffine(float va, float vb, float vc0) : a(lanes8::splat(va)), b(lanes8::splat(vb)), c0(lanes8::splat(vc0)) {}
  explicit DyAffine(const float* k) : DyAffine(k ? k[0] : 0.f, k ? k[1] : 0.f, k ? k[2] : 0.f) {}  // a, b, c0
  lanes8::F8 value(lanes8::F8 d, lanes8::F8 y) const {
    return lanes8::add(lanes8::fmadd(a, d, lanes8::mul(b, y)), c0);
  }
};

// Vectors of output columns [0, Qr) in blocks of V side by side (V independent chains): 4, then 2
// (Qr is a multiple of 16).
template <class Block>
inline void for_column_blocks(int64_t Qr, Block block) {
  int64_t q0 = 0;
  for (; q0 + 32 <= Qr; q0 += 32) block(q0, std::integral_constant<int, 4>{});
  for (; q0 < Qr; q0 += 16) block(q0, std::integral_constant<int, 2>{});
}

// y [P,Q] = the max over each window of the input in's rows of x (values only: max_ps(v, m) is the
// running first maximum's value, m where v is NaN or equal). Each input row's maxima once, in a
// ring.
template <int kR, int kS, class In>
inline void max_forward_stride1_window(const Plane& g, const float* x, const In& in, float* y) {
  const int64_t R = kR > 0 ? kR : g.R, S = kS > 0 ? kS : g.S;
  const int64_t Qr = round_lanes(g.Q), ph = g.pad_h;
  alignas(64) float row_m[kRingRows][kRingCols];
  PaddedRows<In> rows(g, x, in);
  int64_t next_h = 0;
  for (int64_t p = 0; p < g.P; ++p) {
    const int64_t h0 = std::max<int64_t>(0, p - ph), h1 = std::min(g.H, p - ph + R);
    for (; next_h < h1; ++next_h) {
      const float* xr = rows.row(next_h);  // column q0 + s - pw at xr + q0 + s
      float* m = row_m[next_h & (kRingRows - 1)];
      for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
        constexpr int V = decltype(blocks)::value;
        lanes8::F8 mv[V];
        for (int k = 0; k < V; ++k) mv[k] = lanes8::splat(-FLT_MAX);
        for (int64_t s = 0; s < S; ++s)
          for (int k = 0; k < V; ++k) mv[k] = lanes8::keep_greater(lanes8::load(xr + q0 + 8 * k + s), mv[k]);
        for (int k = 0; k < V; ++k) lanes8::store(m + q0 + 8 * k, mv[k]);
      });
    }
    float* yp = y + p * g.Q;
    for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      lanes8::F8 mv[V];
      for (int k = 0; k < V; ++k) mv[k] = lanes8::splat(-FLT_MAX);
      for (int64_t h = h0; h < h1; ++h)
        for (int k = 0; k < V; ++k)
          mv[k] = lanes8::keep_greater(lanes8::load(row_m[h & (kRingRows - 1)] + q0 + 8 * k), mv[k]);
      for (int k = 0; k < V; ++k) {
        const int64_t q = q0 + 8 * k;
        if (q + 8 <= g.Q)
          lanes8::store(yp + q, mv[k]);
        else if (q < g.Q)
          lanes8::store_inside(yp + q, q, g.Q, mv[k]);
      }
    });
  }
}
template <class In>
inline void max_forward_stride1(const Plane& g, const float* x, const In& in, float* y) {
  if (g.R == 3 && g.S == 3) return max_forward_stride1_window<3, 3>(g, x, in, y);
  max_forward_stride1_window<0, 0>(g, x, in, y);
}

// dx [H,W] (+)= dy routed to each window's first maximum (accumulate: onto dx; else dx is written
// whole, as if zeroed first), then with BnReluInput the ReLU's mask (+0 where it stops; dx is then
// always written whole: the mask applies to the pool's gradient alone). Input
// (h, w) lies in the windows of outputs (h + ph - r, w + pw - s), which come in the reference's
// raster order for r, then s, descending.
// kAffine: dy is that of a BN after the pool (*affine, DyAffine), else dy as it is (a separate
// instance: the plain one as tight as before).
// kR, kS: the window as constants (the taps unrolled), or 0: g's, at run time.
template <int kR, int kS, class In, bool kAffine>
inline void max_backward_stride1_window(const Plane& g, const float* x, const In& in, const float* dy, float* dx,
                                        bool accumulate, const DyAffine* affine) {
  const int64_t R = kR > 0 ? kR : g.R, S = kS > 0 ? kS : g.S;
  const int64_t Qr = round_lanes(g.Q), Wr = round_lanes(g.W), B = gather_row_ints(g), off = S - 1;
  const int64_t pw = g.pad_w, ph = g.pad_h;
  alignas(64) float row_m[kRingRows][kRingCols];            // per input row: the running maxima over s ...
  alignas(64) int32_t row_a[kRingRows][kRingCols];          // ... and their flat indices
  alignas(64) int32_t out_a[kRingRows + 1][kRingCols];      // per output row q at off + q: its argument;
  alignas(64) float out_dy[kRingRows + 1][kRingCols];       // dy alike; the last row: outside the plane
  alignas(64) float yrow[kRingCols];                        // kAffine: the output row's maxima, y
  auto clear_output_row = [&](int64_t slot) {
    for (int64_t j = 0; j < B; ++j) {
      out_a[slot][j] = -1;
      out_dy[slot][j] = 0.f;
    }
  };
  for (int64_t k = 0; k < std::min(g.P, kRingRows); ++k) clear_output_row(k);  // the slots p & 7 takes
  clear_output_row(kRingRows);
  using lanes8::F8;
  // The running first maximum over taps: v > m takes v and its argument (false on NaN).
  auto take = [](F8 v, F8 arg, F8* m, F8* a) {
    *a = lanes8::select(lanes8::greater(v, *m), *a, arg);
    *m = lanes8::keep_greater(v, *m);
  };

  // Input row h's maxima over the S taps of each output column, in the reference's s order.
  PaddedRows<In> rows(g, x, in);
  auto row_stage = [&](int64_t h) ET_ALWAYS_INLINE {
    const float* xr = rows.row(h);  // column q0 + s - pw at xr + q0 + s
    float* m = row_m[h & (kRingRows - 1)];
    int32_t* a = row_a[h & (kRingRows - 1)];
    const int32_t base = int32_t(h * g.W - pw);  // the flat index of padded column 0
    for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      F8 mv[V], av[V];
      for (int k = 0; k < V; ++k) mv[k] = lanes8::splat(-FLT_MAX), av[k] = lanes8::int_splat(-1);
      const F8 first = lanes8::int_iota(base + int32_t(q0));  // the indices of the block's first vector
      for (int64_t s = 0; s < S; ++s)
        for (int k = 0; k < V; ++k) {
          const int64_t j = q0 + 8 * k + s;  // + 8 k + s: a constant where the loops unroll
          take(lanes8::load(xr + j), lanes8::int_add(first, lanes8::int_splat(int32_t(8 * k + s))), &mv[k], &av[k]);
        }
      for (int k = 0; k < V; ++k) {
        lanes8::store(m + q0 + 8 * k, mv[k]);
        lanes8::store_int(a + q0 + 8 * k, av[k]);
      }
    });
  };
  int64_t next_h = 0;  // input rows [0, next_h) have their row maxima
  // Output row p's arguments (the first row holding the window's maximum, in r order) and dy.
  auto output_row = [&](int64_t p) ET_ALWAYS_INLINE {
    const int64_t h0 = std::max<int64_t>(0, p - ph), h1 = std::min(g.H, p - ph + R);
    while (next_h < h1) row_stage(next_h++);
    int32_t* a = out_a[p & (kRingRows - 1)] + off;
    float* dyr = out_dy[p & (kRingRows - 1)] + off;
    const float* dyp = dy + p * g.Q;
    for (int64_t q = 0; q < g.Q; q += 16) __builtin_prefetch(dyp + kPrefetchRows * g.Q + q);
    for_column_blocks(Qr, [&](int64_t q0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      F8 mv[V], av[V];
      for (int k = 0; k < V; ++k) mv[k] = lanes8::splat(-FLT_MAX), av[k] = lanes8::int_splat(-1);
      for (int64_t h = h0; h < h1; ++h)
        for (int k = 0; k < V; ++k) {
          const int64_t j = q0 + 8 * k, slot = h & (kRingRows - 1);
          take(lanes8::load(row_m[slot] + j), lanes8::load_int(row_a[slot] + j), &mv[k], &av[k]);
        }
      for (int k = 0; k < V; ++k) lanes8::store_int(a + q0 + 8 * k, av[k]);
      if constexpr (kAffine)
        for (int k = 0; k < V; ++k) lanes8::store(yrow + q0 + 8 * k, mv[k]);
    });
    if constexpr (kAffine) {  // in a loop of its own: beside the maxima above it cost 3x as much
      const DyAffine k = *affine;
      int64_t q = 0;
      for (; q + 8 <= g.Q; q += 8) lanes8::store(dyr + q, k.value(lanes8::load(dyp + q), lanes8::load(yrow + q)));
      if (q < g.Q)
        lanes8::store(dyr + q, k.value(lanes8::load_inside(dyp + q, q, g.Q, lanes8::splat(0.f)), lanes8::load(yrow + q)));
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
    const int32_t* ta[kRingRows];  // output row h + ph - r of tap row r, from r = R - 1 down, at lane 0, s = 0
    const float* td[kRingRows];
    for (int64_t r = R - 1, t = 0; r >= 0; --r, ++t) {
      const int64_t p = h + ph - r;
      const int64_t slot = p >= 0 && p < g.P ? (p & (kRingRows - 1)) : kRingRows;
      ta[t] = out_a[slot] + off + pw;
      td[t] = out_dy[slot] + off + pw;
    }
    float* dxh = dx + h * g.W;
    const int32_t row0 = int32_t(h * g.W);
    // V blocks of 8 lanes side by side: each lane's additions are a chain in tap order (lanes that
    // are not the argument add -0, which leaves every value as it is), so the adds' latency, not
    // their number, bounds one block.
    auto columns = [&](int64_t w0, auto blocks) {
      constexpr int V = decltype(blocks)::value;
      F8 acc[V], me[V];
      for (int k = 0; k < V; ++k) {
        const int64_t w = w0 + 8 * k;
        const F8 zero = lanes8::splat(0.f);
        acc[k] = !accumulate || In::kReluMask ? zero : lanes8::load_inside(dxh + w, w, g.W, zero);
        me[k] = lanes8::int_iota(row0 + int32_t(w));
      }
      for (int64_t t = 0; t < R; ++t)
        for (int64_t s = S - 1; s >= 0; --s)
          for (int k = 0; k < V; ++k) {
            const int64_t j = w0 + 8 * k - s;
            acc[k] = lanes8::add_where_equal(acc[k], lanes8::load_int(ta[t] + j), me[k], lanes8::load(td[t] + j));
          }
      for (int k = 0; k < V; ++k) {
        const int64_t w = w0 + 8 * k;
        if constexpr (In::kReluMask) acc[k] = lanes8::bit_and(acc[k], in.passes(x + h * g.W, w, g.W));  // else +0
        if (w + 8 <= g.W)
          lanes8::store(dxh + w, acc[k]);
        else if (w < g.W)
          lanes8::store_inside(dxh + w, w, g.W, acc[k]);
      }
    };
    int64_t w0 = 0;
    for (; w0 + 32 <= Wr; w0 += 32) columns(w0, std::integral_constant<int, 4>{});
    for (; w0 < Wr; w0 += 16) columns(w0, std::integral_constant<int, 2>{});  // Wr: a multiple of 16
  }
}

template <class In>
inline void max_backward_stride1(const Plane& g, const float* x, const In& in, const float* dy, float* dx,
                                 bool accumulate, const DyAffine* affine = nullptr) {
  const bool k3 = g.R == 3 && g.S == 3;
  if (affine) {
    if (k3) return max_backward_stride1_window<3, 3, In, true>(g, x, in, dy, dx, accumulate, affine);
    return max_backward_stride1_window<0, 0, In, true>(g, x, in, dy, dx, accumulate, affine);
  }
  if (k3) return max_backward_stride1_window<3, 3, In, false>(g, x, in, dy, dx, accumulate, nullptr);
  max_backward_stride1_window<0, 0, In, false>(g, x, in, dy, dx, accumulate, nullptr);
}

}  // namespace pool_planes
}  // namespace et
#endif
