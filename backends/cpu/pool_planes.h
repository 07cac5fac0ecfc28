// Pooling of one (n, c) plane on CPU, shared by the pooling layers (pooling.cpp) and the fused
// stacks (fused.cpp), so fused and unfused pooling agree bit for bit. The *_reference functions
// are the definitions, one output at a time. The fast ones give the same bits: the max pool
// separably (row maxima, then across rows) with a gather for the stride-1 backward (below); the
// average pool as vectors over the interior columns, each lane taking the window's taps in the
// reference's order, with the border columns and the gradient scatter in the reference loops.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "backends/backend.h"
#include "backends/cpu/lanes8.h"
#include "backends/cpu/pool_pairs.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace et {
namespace pool_planes {

struct Plane {
  int64_t H = 0, W = 0, P = 0, Q = 0;  // input and output plane
  int64_t R = 1, S = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
};
inline Plane of(const Conv2dGeom& g) { return {g.H, g.W, g.P, g.Q, g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w}; }
inline Plane of(const FusedStage& s) {
  return {s.H, s.W, s.P, s.Q, s.pool.R, s.pool.S, s.pool.stride_h, s.pool.stride_w, s.pool.pad_h, s.pool.pad_w};
}

// Windows that tile each plane exactly (stride = window, no padding, P * R = H): G consecutive
// planes pool as one plane of G * H rows, since no window crosses two planes. The pooling layers
// and the fused small-plane blocks call the plane functions on such stacks of planes: on late
// stages' small planes a call per plane costs more than its work.
// 2x2 windows at stride 2 without padding: pool_pairs.h (AVX-512, AVX2, NEON).
#if defined(__AVX512F__) || defined(__AVX2__) || (defined(__ARM_NEON) && defined(__aarch64__))
#define ET_POOL_PAIRS 1
#endif
inline bool pairs_apply(const Plane& g) {
#if defined(ET_POOL_PAIRS)
  return pool_pairs::applies(g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.Q, g.H, g.W);
#else
  (void)g;
  return false;
#endif
}

inline bool pools_as_one_plane(const Plane& g) {
  return g.stride_h == g.R && g.stride_w == g.S && g.pad_h == 0 && g.pad_w == 0 && g.P * g.R == g.H;
}
inline Plane stacked(Plane g, int64_t planes) {
  g.H *= planes;
  g.P *= planes;
  return g;
}

// One output of the max window at (p, q): its maximum (padding never wins) and, in *arg, the
// flat index of its first maximum (PyTorch's rule), -1 if the window lies outside the plane.
inline float max_at(const Plane& g, const float* x, int64_t p, int64_t q, int64_t* arg) {
  float m = -FLT_MAX;
  *arg = -1;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t h = p * g.stride_h - g.pad_h + r;
    if (h < 0 || h >= g.H) continue;
    for (int64_t s = 0; s < g.S; ++s) {
      const int64_t w = q * g.stride_w - g.pad_w + s;
      if (w >= 0 && w < g.W && x[h * g.W + w] > m) {
        m = x[h * g.W + w];
        *arg = h * g.W + w;
      }
    }
  }
  return m;
}

// One output of the average window at (p, q), count_include_pad = true (PyTorch's default).
inline float avg_at(const Plane& g, const float* x, int64_t p, int64_t q) {
  float s = 0.f;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t h = p * g.stride_h - g.pad_h + r;
    if (h < 0 || h >= g.H) continue;
    for (int64_t t = 0; t < g.S; ++t) {
      const int64_t w = q * g.stride_w - g.pad_w + t;
      if (w >= 0 && w < g.W) s += x[h * g.W + w];
    }
  }
  return s * (1.f / float(g.R * g.S));
}

// y [P,Q] = max over each window of x [H,W].
inline void max_forward_reference(const Plane& g, const float* x, float* y) {
  int64_t arg;
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) y[p * g.Q + q] = max_at(g, x, p, q, &arg);
}

// dx [H,W] += dy routed to the first maximum of each window of x.
inline void max_backward_reference(const Plane& g, const float* x, const float* dy, float* dx) {
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      int64_t arg;
      max_at(g, x, p, q, &arg);
      if (arg >= 0) dx[arg] += dy[p * g.Q + q];
    }
}

inline void avg_forward_reference(const Plane& g, const float* x, float* y) {
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) y[p * g.Q + q] = avg_at(g, x, p, q);
}

// Global average pooling: the mean of a plane of n floats, and the gradient of a plane (dy / n in
// every element, dx += that where accumulate). The layer and the fused stacks that end in one call
// these out-of-line functions (pooling.cpp), so their sums are the same bits.
float plane_mean(const float* x, int64_t n);
void plane_mean_backward(float dy, int64_t n, float* dx, bool accumulate);

inline void avg_backward(const Plane& g, const float* dy, float* dx) {
  const float inv = 1.f / float(g.R * g.S);
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      const float v = dy[p * g.Q + q] * inv;
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t h = p * g.stride_h - g.pad_h + r;
        if (h < 0 || h >= g.H) continue;
        for (int64_t t = 0; t < g.S; ++t) {
          const int64_t w = q * g.stride_w - g.pad_w + t;
          if (w >= 0 && w < g.W) dx[h * g.W + w] += v;
        }
      }
    }
}

// The fast max pool: row first, then across rows. Each input row gets its running first maximum
// over the S taps of every output column, the taps outside the row reading -inf (which never wins,
// as padding never does in the reference); then each output row takes the running first maximum
// over its R rows. The first maximum in (r, s) order is the first maximum of the first row holding
// the window's maximum, so values (signed zeros included) and arguments equal the reference's.
// Input rows are cached in a ring of R rows, so each is reduced once for the R output rows that
// read it. Rows are rounded up to whole vectors (kLanes) in the ring, so no loop has a scalar tail.
constexpr int64_t kLanes = 16;
constexpr int64_t kRingRows = 8;    // windows up to this height and width take the fast loops
constexpr int64_t kRingCols = 256;  // padded row widths up to this take the fast loops
inline int64_t round_lanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

inline int64_t padded_row_floats(const Plane& g) { return (round_lanes(g.Q) - 1) * g.stride_w + g.S; }
inline int64_t gather_row_ints(const Plane& g) {  // arg / dy rows of the stride-1 backward, padded
  return std::max(round_lanes(g.W) + g.pad_w + g.S, round_lanes(g.Q) + 2 * g.S);
}
inline bool fast_max_applies(const Plane& g) {
  return g.R <= kRingRows && g.S <= kRingRows && g.pad_w < g.S && padded_row_floats(g) <= kRingCols &&
         gather_row_ints(g) <= kRingCols && g.H * g.W <= INT32_MAX && g.P > 0 && g.Q > 0;
}

// AVX-512 and AVX2 keep the running maximum and its argument in registers across the taps and
// read rows in place, masked where a vector crosses the row's ends; the portable loops (NEON, by
// the compiler) keep them in memory tap by tap and read a copy of the row padded with -inf. Their
// selects are bit selects: a select stored back to memory became a branch on the lane mask, or
// no vectorisation at all.
#if defined(__AVX512F__)
inline __m512i lane_iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#elif defined(__AVX2__)

// The running first maximum: v > m takes v (and its argument). Without arguments one max does it:
// max_ps returns its second operand where v is NaN or equal to m, where v > m is false.
template <bool kArg>
inline void take_if_greater8(__m256 v, __m256 arg, __m256* m, __m256* a) {
  if (!kArg) {
    *m = _mm256_max_ps(v, *m);
    return;
  }
  const __m256 gt = _mm256_cmp_ps(v, *m, _CMP_GT_OQ);  // false on NaN
  *m = _mm256_blendv_ps(*m, v, gt);
  *a = _mm256_blendv_ps(*a, arg, gt);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// row_max's vectors q0 .. q0 + 8V of a stride-1 row (xh: the row, base: the flat index of its
// padded column 0), V running maxima side by side.
template <bool kArg, int V>
inline void row_max_vectors8(const Plane& g, const float* xh, int32_t base, int64_t q0, float* m, int32_t* a) {
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 mv[V], av[V];
  for (int v = 0; v < V; ++v) {
    mv[v] = _mm256_set1_ps(-FLT_MAX);
    av[v] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  }
  for (int64_t s = 0; s < g.S; ++s)
    for (int v = 0; v < V; ++v) {
      const int64_t col = q0 + 8 * v + s - g.pad_w;  // column of lane 0
      const __m256 x = lanes8::load_inside(xh + col, col, g.W, minus_inf);  // row ends masked
      take_if_greater8<kArg>(x, kArg ? lanes8::int_iota(base + int32_t(q0 + 8 * v + s)) : x, &mv[v], &av[v]);
    }
  for (int v = 0; v < V; ++v) {
    _mm256_store_ps(m + q0 + 8 * v, mv[v]);
    if (kArg) _mm256_store_ps(reinterpret_cast<float*>(a + q0 + 8 * v), av[v]);
  }
}
#endif

// Row maxima of input row h for every output column: m[q], and in a[q] the flat index of the first
// maximum (kArg) or nothing; -FLT_MAX / -1 where every tap is padding or NaN.
template <bool kArg>
inline void row_max(const Plane& g, const float* x, int64_t h, float* m, int32_t* a) {
  const int64_t Qr = round_lanes(g.Q), sw = g.stride_w;
  const float* xh = x + h * g.W;
  const int32_t base = int32_t(h * g.W - g.pad_w);  // flat index of padded column 0
#if defined(__AVX512F__)
  if (sw == 1) {  // masked loads read the row in place; lanes outside it load -inf
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t q0 = 0; q0 < Qr; q0 += kLanes) {
      __m512 mv = _mm512_set1_ps(-FLT_MAX);
      __m512i av = _mm512_set1_epi32(-1);
      for (int64_t s = 0; s < g.S; ++s) {
        const int64_t col = q0 + s - g.pad_w;  // column of lane 0
        const int64_t lo = std::max<int64_t>(0, -col), hi = std::min<int64_t>(kLanes, g.W - col);
        const __mmask16 inside =
            hi <= lo ? __mmask16(0) : __mmask16(((hi >= kLanes ? 0x10000u : 1u << hi) - 1u) & ~((1u << lo) - 1u));
        const __m512 v = _mm512_mask_loadu_ps(minus_inf, inside, xh + col);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);  // false on NaN, as v > m
        mv = _mm512_mask_mov_ps(mv, gt, v);
        if (kArg) av = _mm512_mask_mov_epi32(av, gt, _mm512_add_epi32(_mm512_set1_epi32(base + int32_t(q0 + s)), lane_iota()));
      }
      _mm512_store_ps(m + q0, mv);
      if (kArg) _mm512_store_si512(a + q0, av);
    }
    return;
  }
#elif defined(__AVX2__)
  if (sw == 1) {  // blocks of 4 vectors: 4 chains of compares, the latency of one behind the others
    int64_t q0 = 0;
    for (; q0 + 32 <= Qr; q0 += 32) row_max_vectors8<kArg, 4>(g, xh, base, q0, m, a);
    for (; q0 < Qr; q0 += 8) row_max_vectors8<kArg, 1>(g, xh, base, q0, m, a);
    return;
  }
#endif
  alignas(64) float xr[kRingCols];  // the row padded with -inf
  const int64_t L = padded_row_floats(g);
  for (int64_t j = 0; j < L; ++j) xr[j] = -INFINITY;
  const int64_t copy = std::min(g.W, L - g.pad_w);
  if (copy > 0) std::memcpy(xr + g.pad_w, xh, sizeof(float) * size_t(copy));
  for (int64_t q = 0; q < Qr; ++q) {
    m[q] = -FLT_MAX;
    if (kArg) a[q] = -1;
  }
  for (int64_t s = 0; s < g.S; ++s) {
#pragma omp simd
    for (int64_t q = 0; q < Qr; ++q) {
      const float v = xr[q * sw + s], cur = m[q];
      if (kArg) {
        const int32_t take = -int32_t(v > cur);  // a bit select, not a conditional store
        a[q] = ((base + int32_t(q * sw + s)) & take) | (a[q] & ~take);
      }
      m[q] = v > cur ? v : cur;
    }
  }
}

// Output row p: ym[q] and (kArg) ya[q] over the window's rows, from a ring of cached row maxima.
template <bool kArg>
struct MaxRows {
  alignas(64) float m[kRingRows][kRingCols];
  alignas(64) int32_t a[kRingRows][kArg ? kRingCols : 1];
  int64_t tag[kRingRows];
  MaxRows() {
    for (int64_t& t : tag) t = -1;
  }
  void output_row(const Plane& g, const float* x, int64_t p, float* ym, int32_t* ya) {
    const float* rm[kRingRows];
    const int32_t* ra[kRingRows];
    int64_t n = 0;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t h = p * g.stride_h - g.pad_h + r;
      if (h < 0 || h >= g.H) continue;
      // The R rows of a window fall in distinct slots (a 32-bit modulo: a 64-bit division is slow).
      const int64_t slot = int64_t(uint32_t(h) % uint32_t(g.R));
      if (tag[slot] != h) {
        row_max<kArg>(g, x, h, m[slot], kArg ? a[slot] : nullptr);
        tag[slot] = h;
      }
      rm[n] = m[slot];
      ra[n++] = kArg ? a[slot] : nullptr;
    }
    const int64_t Qr = round_lanes(g.Q);
#if defined(__AVX512F__)
    for (int64_t q0 = 0; q0 < Qr; q0 += kLanes) {
      __m512 mv = _mm512_set1_ps(-FLT_MAX);
      __m512i av = _mm512_set1_epi32(-1);
      for (int64_t k = 0; k < n; ++k) {
        const __m512 v = _mm512_load_ps(rm[k] + q0);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);
        mv = _mm512_mask_mov_ps(mv, gt, v);
        if (kArg) av = _mm512_mask_mov_epi32(av, gt, _mm512_load_si512(ra[k] + q0));
      }
      _mm512_storeu_ps(ym + q0, mv);
      if (kArg) _mm512_storeu_si512(ya + q0, av);
    }
#elif defined(__AVX2__)
    auto vectors = [&](int64_t q0, auto vectors_side_by_side) {
      constexpr int V = decltype(vectors_side_by_side)::value;
      __m256 mv[V], av[V];
      for (int v = 0; v < V; ++v) {
        mv[v] = _mm256_set1_ps(-FLT_MAX);
        av[v] = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      }
      for (int64_t k = 0; k < n; ++k)
        for (int v = 0; v < V; ++v)
          take_if_greater8<kArg>(_mm256_load_ps(rm[k] + q0 + 8 * v),
                                 kArg ? _mm256_load_ps(reinterpret_cast<const float*>(ra[k] + q0 + 8 * v)) : mv[v],
                                 &mv[v], &av[v]);
      for (int v = 0; v < V; ++v) {
        _mm256_storeu_ps(ym + q0 + 8 * v, mv[v]);
        if (kArg) _mm256_storeu_ps(reinterpret_cast<float*>(ya + q0 + 8 * v), av[v]);
      }
    };
    int64_t q0 = 0;
    for (; q0 + 32 <= Qr; q0 += 32) vectors(q0, std::integral_constant<int, 4>{});
    for (; q0 < Qr; q0 += 8) vectors(q0, std::integral_constant<int, 1>{});
#else
    for (int64_t q = 0; q < Qr; ++q) {
      ym[q] = -FLT_MAX;
      if (kArg) ya[q] = -1;
    }
    for (int64_t k = 0; k < n; ++k) {
#pragma omp simd
      for (int64_t q = 0; q < Qr; ++q) {
        const float v = rm[k][q], cur = ym[q];
        if (kArg) {
          const int32_t take = -int32_t(v > cur);
          ya[q] = (ra[k][q] & take) | (ya[q] & ~take);
        }
        ym[q] = v > cur ? v : cur;
      }
    }
#endif
  }
};

// Windows that tile the plane (stride = window, no padding) with Q dividing 16: a vector of 16
// outputs is 16 / Q whole output rows, so its taps lie at fixed offsets from one pointer and
// AVX-512 gathers them. Each lane takes its window's taps in the reference's order with the
// reference's compare, so values and arguments equal the reference's. For the narrow planes of
// late stages (Q of 1 to 8: VGG's 2x2 to 8x8 outputs), where a row at a time fills a sixteenth to
// a half of a vector.
inline bool tiled_windows(const Plane& g) {
  return g.stride_h == g.R && g.stride_w == g.S && g.pad_h == 0 && g.pad_w == 0 && g.Q <= 8 && 16 % g.Q == 0 &&
         g.P * g.R <= g.H && g.Q * g.S <= g.W && g.R * g.S <= 16 && g.H * g.W <= INT32_MAX;
}

#if defined(__AVX512F__)
// For outputs [j0, j0 + 16) (lanes past P * Q masked off): the maxima and their flat arguments.
inline void tiled_max_vector(const Plane& g, const float* x, int64_t j0, __mmask16* live, __m512* best,
                             __m512i* arg) {
  const int32_t rows = int32_t(16 / g.Q);
  const __m512i lane = lane_iota();
  // window j: row (j / Q) * R, column (j % Q) * S, from the vector's first row
  const __m512i q = _mm512_and_si512(lane, _mm512_set1_epi32(int32_t(g.Q - 1)));  // Q is a power of 2
  // (maskz: the unmasked form makes GCC 12 warn of an uninitialised operand inside it)
  const __m512i p = _mm512_maskz_srli_epi32(__mmask16(0xFFFF), lane, __builtin_ctz(unsigned(g.Q)));
  const int32_t row0 = int32_t(j0 / 16) * rows * int32_t(g.R * g.W);
  const __m512i base = _mm512_add_epi32(
      _mm512_set1_epi32(row0), _mm512_add_epi32(_mm512_mullo_epi32(p, _mm512_set1_epi32(int32_t(g.R * g.W))),
                                                _mm512_mullo_epi32(q, _mm512_set1_epi32(int32_t(g.S)))));
  const int64_t left = g.P * g.Q - j0;
  *live = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  __m512 mv = _mm512_set1_ps(-FLT_MAX);
  __m512i av = _mm512_set1_epi32(-1);
  for (int64_t r = 0; r < g.R; ++r)
    for (int64_t t = 0; t < g.S; ++t) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(int32_t(r * g.W + t)));
      const __m512 v = _mm512_mask_i32gather_ps(mv, *live, idx, x, 4);
      const __mmask16 gt = _mm512_mask_cmp_ps_mask(*live, v, mv, _CMP_GT_OQ);  // false on NaN, as v > m
      mv = _mm512_mask_mov_ps(mv, gt, v);
      av = _mm512_mask_mov_epi32(av, gt, idx);
    }
  *best = mv;
  *arg = av;
}
#endif

}  // namespace pool_planes
}  // namespace et
#include "backends/cpu/pool_stride1.h"  // NOLINT(build/include_order): uses the helpers above
namespace et {
namespace pool_planes {

inline void max_forward(const Plane& g, const float* x, float* y) {
#if defined(ET_POOL_STRIDE1)
  if (stride1_applies(g)) return max_forward_stride1(g, x, PlaneInput{}, y);
#endif
#if defined(ET_POOL_PAIRS)
  if (pairs_apply(g)) return pool_pairs::max_forward(g.W, g.P, g.Q, x, y);
#endif
#if defined(__AVX512F__)
  if (tiled_windows(g)) {
    for (int64_t j0 = 0; j0 < g.P * g.Q; j0 += 16) {
      __mmask16 live;
      __m512 m;
      __m512i a;
      tiled_max_vector(g, x, j0, &live, &m, &a);
      _mm512_mask_storeu_ps(y + j0, live, m);
    }
    return;
  }
#endif
  if (!fast_max_applies(g)) return max_forward_reference(g, x, y);
  MaxRows<false> rows;
  alignas(64) float ym[kRingCols];
  for (int64_t p = 0; p < g.P; ++p) {
    rows.output_row(g, x, p, ym, nullptr);
    std::memcpy(y + p * g.Q, ym, sizeof(float) * size_t(g.Q));
  }
}

// max_forward, and arg [P,Q] = the flat index of each window's first maximum (-1: none), as
// max_backward routes dy (a fused stack without a BN keeps only where they fall).
inline void max_forward_args(const Plane& g, const float* x, float* y, int32_t* arg) {
#if defined(ET_POOL_PAIRS)
  if (pairs_apply(g)) return pool_pairs::max_forward_args(g.W, g.P, g.Q, x, y, arg);
#endif
  if (!fast_max_applies(g)) {
    for (int64_t p = 0; p < g.P; ++p)
      for (int64_t q = 0; q < g.Q; ++q) {
        int64_t a;
        y[p * g.Q + q] = max_at(g, x, p, q, &a);
        arg[p * g.Q + q] = int32_t(a);
      }
    return;
  }
  MaxRows<true> rows;
  alignas(64) float ym[kRingCols];
  alignas(64) int32_t ya[kRingCols];
  for (int64_t p = 0; p < g.P; ++p) {
    rows.output_row(g, x, p, ym, ya);
    std::memcpy(y + p * g.Q, ym, sizeof(float) * size_t(g.Q));
    std::memcpy(arg + p * g.Q, ya, sizeof(int32_t) * size_t(g.Q));
  }
}

#if !defined(__AVX512F__)
// One tap of the gather: acc[w] += dy of the output whose argument is input row0 + w. (Every
// AVX2 / NEON host takes pool_stride1.h but where pad_h >= R; there AVX-512 has its own gathers.)
inline void gather_tap(const int32_t* __restrict arg, const float* __restrict dy, int32_t row0, int32_t lanes,
                       float* __restrict acc) {
  // Adding -0 leaves every value as it is (-0 included), so the lanes that are not the argument
  // add -0: a bit select (dy's bits or -0's) the compiler cannot turn back into a branch.
#pragma omp simd
  for (int32_t w = 0; w < lanes; ++w) {
    const int32_t take = -int32_t(arg[w] == row0 + w);
    int32_t bits;
    std::memcpy(&bits, dy + w, 4);
    bits = (bits & take) | (INT32_MIN & ~take);
    float add;
    std::memcpy(&add, &bits, 4);
    acc[w] += add;
  }
}
#endif

// dx [H,W] += dy routed to the first maximum of each window of x, in the reference's order.
// Stride 1 gathers: input (h, w) lies in the windows of outputs (h + ph - r, w + pw - s), which
// come in the reference's raster order for r, then s, descending; each lane (input column) adds
// the dy of those whose argument it is, in that order, so every dx element sees the same additions
// in the same order. The argument and dy rows are kept padded with -1 / 0 in a ring of R output
// rows. Other strides scatter in the reference's order from the fast arguments.
// accumulate = false: dx is written whole, as if zeroed first (the same bits).
inline void max_backward(const Plane& g, const float* x, const float* dy, float* dx, bool accumulate = true) {
#if defined(ET_POOL_STRIDE1)
  if (stride1_applies(g)) return max_backward_stride1(g, x, PlaneInput{}, dy, dx, accumulate);
#endif
  if (!accumulate) std::memset(dx, 0, sizeof(float) * size_t(g.H * g.W));
#if defined(ET_POOL_PAIRS)
  if (pairs_apply(g)) return pool_pairs::max_backward(g.W, g.P, g.Q, x, dy, dx);
#endif
#if defined(__AVX512F__)
  if (tiled_windows(g)) {  // windows do not overlap: each input takes at most one dy, no conflicts
    for (int64_t j0 = 0; j0 < g.P * g.Q; j0 += 16) {
      __mmask16 live;
      __m512 m;
      __m512i a;
      tiled_max_vector(g, x, j0, &live, &m, &a);
      const __mmask16 some = _mm512_mask_cmpge_epi32_mask(live, a, _mm512_setzero_si512());
      const __m512 d = _mm512_add_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), some, a, dx, 4),
                                     _mm512_maskz_loadu_ps(some, dy + j0));
      _mm512_mask_i32scatter_ps(dx, some, a, d, 4);
    }
    return;
  }
#endif
  if (!fast_max_applies(g)) return max_backward_reference(g, x, dy, dx);
  MaxRows<true> rows;
  alignas(64) float ym[kRingCols];
  alignas(64) int32_t ya[kRingCols];
  if (g.stride_h != 1 || g.stride_w != 1) {
    for (int64_t p = 0; p < g.P; ++p) {
      rows.output_row(g, x, p, ym, ya);
      const float* dyr = dy + p * g.Q;
      for (int64_t q = 0; q < g.Q; ++q)
        if (ya[q] >= 0) dx[ya[q]] += dyr[q];
    }
    return;
  }
  // Ring of output rows: arg_ring[slot][S - 1 + q] = argument of (p, q), -1 outside [0, Q); dy
  // alike, 0 outside. The padding is written once; a row's Qr lanes land at S - 1.
  alignas(64) int32_t arg_ring[kRingRows][kRingCols];
  alignas(64) float dy_ring[kRingRows][kRingCols];
  int64_t tag[kRingRows];
  const int64_t B = gather_row_ints(g), Wr = round_lanes(g.W), Qr = round_lanes(g.Q), off = g.S - 1;
  for (int64_t k = 0; k < g.R; ++k) {
    tag[k] = -1;
    for (int64_t j = 0; j < B; ++j) {
      arg_ring[k][j] = -1;
      dy_ring[k][j] = 0.f;
    }
  }
  const int32_t* tap_arg[kRingRows * kRingRows];  // the taps of an input row, in the reference's order
  const float* tap_dy[kRingRows * kRingRows];
  for (int64_t h = 0; h < g.H; ++h) {
    int64_t taps = 0;
    for (int64_t r = g.R - 1; r >= 0; --r) {
      const int64_t p = h + g.pad_h - r;
      if (p < 0 || p >= g.P) continue;
      const int64_t slot = int64_t(uint32_t(p) % uint32_t(g.R));
      if (tag[slot] != p) {
        int32_t* ar = arg_ring[slot] + off;
        rows.output_row(g, x, p, ym, ar);
        for (int64_t q = g.Q; q < Qr; ++q) ar[q] = -1;  // lanes past the row
        std::memcpy(dy_ring[slot] + off, dy + p * g.Q, sizeof(float) * size_t(g.Q));
        tag[slot] = p;
      }
      for (int64_t s = g.S - 1; s >= 0; --s) {
        const int64_t shift = g.pad_w - s + off;  // column of output q = w + pw - s in the ring row
        tap_arg[taps] = arg_ring[slot] + shift;
        tap_dy[taps++] = dy_ring[slot] + shift;
      }
    }
    float* dxh = dx + h * g.W;
    const int32_t row0 = int32_t(h * g.W);
#if defined(__AVX512F__)
    // Two blocks of lanes at a time: each lane's additions are a chain in tap order, so two
    // independent chains hide the latency of the adds.
    auto live_of = [&](int64_t w0) {
      return g.W - w0 >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (g.W - w0)) - 1);
    };
    int64_t w0 = 0;
    for (; w0 + 2 * kLanes <= Wr; w0 += 2 * kLanes) {
      const __mmask16 live0 = live_of(w0), live1 = live_of(w0 + kLanes);
      __m512 v0 = _mm512_maskz_loadu_ps(live0, dxh + w0), v1 = _mm512_maskz_loadu_ps(live1, dxh + w0 + kLanes);
      const __m512i me0 = _mm512_add_epi32(_mm512_set1_epi32(row0 + int32_t(w0)), lane_iota());
      const __m512i me1 = _mm512_add_epi32(me0, _mm512_set1_epi32(int32_t(kLanes)));
      for (int64_t t = 0; t < taps; ++t) {
        const int32_t* ta = tap_arg[t] + w0;
        const float* td = tap_dy[t] + w0;
        const __mmask16 mine0 = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(ta), me0);
        const __mmask16 mine1 = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(ta + kLanes), me1);
        v0 = _mm512_mask_add_ps(v0, mine0, v0, _mm512_loadu_ps(td));
        v1 = _mm512_mask_add_ps(v1, mine1, v1, _mm512_loadu_ps(td + kLanes));
      }
      _mm512_mask_storeu_ps(dxh + w0, live0, v0);
      _mm512_mask_storeu_ps(dxh + w0 + kLanes, live1, v1);
    }
    for (; w0 < Wr; w0 += kLanes) {
      const __mmask16 live = live_of(w0);
      __m512 v = _mm512_maskz_loadu_ps(live, dxh + w0);
      const __m512i me = _mm512_add_epi32(_mm512_set1_epi32(row0 + int32_t(w0)), lane_iota());
      for (int64_t t = 0; t < taps; ++t) {
        const __mmask16 mine = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(tap_arg[t] + w0), me);
        v = _mm512_mask_add_ps(v, mine, v, _mm512_loadu_ps(tap_dy[t] + w0));
      }
      _mm512_mask_storeu_ps(dxh + w0, live, v);
    }
#else
    alignas(64) float acc[kRingCols];
    for (int64_t w = 0; w < Wr; ++w) acc[w] = w < g.W ? dxh[w] : 0.f;  // lanes past the row are discarded
    for (int64_t t = 0; t < taps; ++t) gather_tap(tap_arg[t], tap_dy[t], row0, int32_t(Wr), acc);
    std::memcpy(dxh, acc, sizeof(float) * size_t(g.W));
#endif
  }
}

// Output columns [lo, hi) whose whole window lies inside the row.
inline void interior_columns(const Plane& g, int64_t* lo, int64_t* hi) {
  *lo = std::min(g.Q, (g.pad_w + g.stride_w - 1) / g.stride_w);
  const int64_t last = g.W - 1 + g.pad_w - (g.S - 1);  // largest q * stride_w that fits
  *hi = last < 0 ? *lo : std::max(*lo, std::min(g.Q, last / g.stride_w + 1));
}

constexpr int64_t kMaxFastColumns = 1024;  // wider rows take the reference loops

inline void avg_forward(const Plane& g, const float* x, float* y) {
  int64_t lo, hi;
  interior_columns(g, &lo, &hi);
  if (g.Q > kMaxFastColumns) return avg_forward_reference(g, x, y);
  const float inv = 1.f / float(g.R * g.S);
  const int64_t sw = g.stride_w;
  alignas(64) float acc[kMaxFastColumns];
  for (int64_t p = 0; p < g.P; ++p) {
    float* yr = y + p * g.Q;
    for (int64_t q = 0; q < lo; ++q) yr[q] = avg_at(g, x, p, q);
    for (int64_t q = hi; q < g.Q; ++q) yr[q] = avg_at(g, x, p, q);
    for (int64_t q = lo; q < hi; ++q) acc[q] = 0.f;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t h = p * g.stride_h - g.pad_h + r;
      if (h < 0 || h >= g.H) continue;
      for (int64_t t = 0; t < g.S; ++t) {
        const float* xr = x + h * g.W - g.pad_w + t;
        if (sw == 1) {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) acc[q] += xr[q];
        } else {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) acc[q] += xr[q * sw];
        }
      }
    }
    for (int64_t q = lo; q < hi; ++q) yr[q] = acc[q] * inv;
  }
}

}  // namespace pool_planes
}  // namespace et
