// What the fused-stack kernels share (fused.cpp and fused_backward.cpp: stacks headed by a BN; fused_relu_pool.cpp:
// a ReLU and a pool): the per-thread plane scratch, prefetching of the next plane, and y's bitmap
// words written in the stash's own layout.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/balance.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/dropout_mask.h"
#include "backends/cpu/pool_planes.h"
#include "engine/check.h"
#include "engine/fused_stack.h"

#if defined(ET_POOL_STRIDE1)
#define ET_BN_RELU_POOL_STRIDE1 1  // pool_stride1.h's BnReluInput (AVX2 and AVX-512 hosts, NEON)
#if defined(ET_LANES512) && !defined(ET_POOL_STRIDE1_LANES8)
#define ET_POOL_STRIDE1_SUMS 1  // its 16-lane forward sums y as it writes it (SummedY)
#endif
#endif

namespace et {
namespace fused_planes {

constexpr int64_t kMaxStages = 8;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // 64-byte multiples of floats

// The largest plane of any stage's input or output, in floats.
inline int64_t plane_floats(const FusedStack& s) {
  int64_t m = 0;
  for (const FusedStage& st : s.stages) m = std::max({m, st.H * st.W, st.P * st.Q});
  return m;
}
inline int64_t max_plane(const FusedStack& s) { return round16(plane_floats(s)); }

// One stage buffer of the thread's scratch: a whole plane, or a band's rows (FusedStack::band_rows).
inline int64_t stage_buffer(const FusedStack& s) { return s.band_rows > 0 ? band_buffer_floats(s) : max_plane(s); }

// Per thread: one buffer per stage output, two gradient buffers, x's rows widened from a 16-bit
// stash, and with a folded side BN (FusedStack::side_bn) its output's plane (side_plane_buffer).
inline int64_t thread_floats(const FusedStack& s) {
  return stage_buffer(s) * int64_t(s.stages.size() + 3 + (s.side_bn ? 1 : 0));
}
inline int64_t side_plane_buffer(const FusedStack& s) { return stage_buffer(s) * int64_t(s.stages.size() + 3); }

// The pool's plane over a band (fused.cpp): its output rows [o0, o1), the input rows their windows
// read, which start *in_offset floats into the band's input-side buffer (rows from b0), and the top
// padding left of pad_h there. Rows past the band's last input row are the plane's bottom border or
// lie in no window of these outputs, so the plane kernels' clipping at H is the whole plane's.
inline pool_planes::Plane band_pool_plane(const FusedStage& st, const BandRows& b, int64_t* in_offset) {
  pool_planes::Plane g = pool_planes::of(st);
  int64_t pb0, pb1;
  pool_input_rows(st, b.o0, b.o1, &pb0, &pb1);
  g.H = pb1 - pb0;
  g.P = b.o1 - b.o0;
  g.pad_h = pb0 - b.o0 * st.pool.stride_h + st.pool.pad_h;
  *in_offset = (pb0 - b.b0) * st.W;
  return g;
}

// Small planes (fused_blocks.cpp), per thread: a block (tile_channels planes) per stage output, two
// gradient blocks and x's block widened from a 16-bit stash.
inline int64_t block_thread_floats(const FusedStack& s) {
  return round16(s.tile_channels * plane_floats(s) * int64_t(s.stages.size() + 3));
}

// The tables all threads share (memory order, fused.cpp / fused_blocks.cpp): two sums per plane
// [N, C]; large planes: five floats of coefficients per channel; small planes: six coefficient
// arrays expanded per element [C, H, W].
constexpr int kBlockExpanded = 6;
inline int64_t table_floats(const FusedStack& s, int64_t N) {
  int64_t sums = round16(2 * N * s.C) + round16(4 * s.C);  // and two doubles per channel
  if (s.side_bn) sums += round16(2 * N * s.C) + round16(4 * s.C) + round16(5 * s.C);  // side_bn_tables
  if (s.small_planes()) return sums + kBlockExpanded * round16(s.C * s.stages[0].H * s.stages[0].W);
  return sums + round16(5 * s.C);
}

// The start of the shared tables (table_floats): the [N, C] sums, two doubles per channel, then
// `rest` for the coefficients.
struct SumTables {
  float *sum1, *sum2;
  double *d1, *d2;
  float* rest;
  SumTables(float* p, int64_t N, int64_t C) {
    sum1 = p, sum2 = p + N * C;
    p += round16(2 * N * C);
    d1 = reinterpret_cast<double*>(p), d2 = d1 + C;
    rest = p + round16(4 * C);
  }
};

// A folded side BN's tables (FusedStack::side_bn), after the stack's own (large planes): the same
// layout, its `rest` holding its forward scale and shift or its backward coefficients.
inline SumTables side_bn_tables(float* tables, int64_t N, int64_t C) {
  return SumTables(tables + round16(2 * N * C) + round16(4 * C) + round16(5 * C), N, C);
}

// The planes of a sweep in memory order, balanced over the threads (balance.h): chunks of about
// 64 KiB of floats. Each plane's results (its sums, its words, its kept count) are its own, so the
// thread that runs it changes no bit.
inline cpu::StealingRanges plane_ranges(int64_t planes, int64_t plane_floats) {
  return cpu::StealingRanges(planes, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, plane_floats)),
                        omp_get_max_threads());
}

// The calling thread's share [c0, c1) of C channels.
inline void thread_channels(int64_t C, int64_t* c0, int64_t* c1) {
  const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
  *c0 = C * t / T;
  *c1 = C * (t + 1) / T;
}

// For channels [c0, c1): d1[c], d2[c] = the [N, C] tables' column c summed in double over n in
// order (the BN layer's order), walking the tables row by row.
inline void sum_over_batch(const float* t1, const float* t2, int64_t N, int64_t C, int64_t c0, int64_t c1, double* d1,
                           double* d2) {
  std::fill(d1 + c0, d1 + c1, 0.0);
  std::fill(d2 + c0, d2 + c1, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = c0; c < c1; ++c) d1[c] += double(t1[n * C + c]), d2[c] += double(t2[n * C + c]);
}

// The planes of one channel lie C planes apart, and a CIFAR plane is one 4 KiB page, where the
// hardware prefetcher stops. Touching the first lines of the next plane early starts the
// prefetcher on its page; more than a few lines per stream would stall on the fill buffers.
constexpr int64_t kPrefetchFloats = 256;
inline void prefetch_plane(const float* p, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kPrefetchFloats); i += 16) __builtin_prefetch(p + i);
}
inline void prefetch_plane_for_write(float* p, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kPrefetchFloats); i += 16) __builtin_prefetch(p + i, 1);
}

// The stack's output is >= +0 (a ReLU, then only pools): the bitmap keep rule applies to it.
inline bool output_nonnegative(const FusedStack& s) {
  bool nonneg = false;
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedKind kind = s.stages[k].kind;
    nonneg = kind == FusedKind::Relu ||
             (nonneg && (kind == FusedKind::MaxPool || kind == FusedKind::AvgPool || kind == FusedKind::Dropout ||
                         kind == FusedKind::GlobalAvgPool));
  }
  return nonneg;
}

// Whether the backward rebuilds the stages' values from x: for a ReLU's mask or a max-pool's input.
// A last ReLU reads y's saved mask, unless x is exact and no Add precedes it (recomputing its mask
// from x, read anyway, saves reading the mask).
inline bool needs_recompute(const FusedStack& s, bool x_exact) {
  const bool has_add = s.add_stage() >= 0;
  for (size_t k = 1; k < s.stages.size(); ++k) {
    const FusedKind kind = s.stages[k].kind;
    if (kind == FusedKind::MaxPool) return true;
    if (kind == FusedKind::Relu && (k + 1 < s.stages.size() || !s.saves_output_mask || (x_exact && !has_add)))
      return true;
  }
  return false;
}

// Pools of L consecutive planes (L = 1: one plane): where the windows tile each plane, as one tall
// plane (pool_planes::pools_as_one_plane), else plane by plane.
inline void pool_forward(const FusedStage& st, int64_t L, const float* in, float* out) {
  const bool max = st.kind == FusedKind::MaxPool;
  const pool_planes::Plane g = pool_planes::of(st);
  if (pool_planes::pools_as_one_plane(g)) {
    const pool_planes::Plane t = pool_planes::stacked(g, L);
    return max ? pool_planes::max_forward(t, in, out) : pool_planes::avg_forward(t, in, out);
  }
  for (int64_t l = 0; l < L; ++l) {
    if (max)
      pool_planes::max_forward(g, in + l * g.H * g.W, out + l * g.P * g.Q);
    else
      pool_planes::avg_forward(g, in + l * g.H * g.W, out + l * g.P * g.Q);
  }
}

// dx [L planes] = the pool's gradient of dy (accumulate: dx += it); in is the pool's input.
inline void pool_backward(const FusedStage& st, int64_t L, const float* in, const float* dy, float* dx,
                          bool accumulate) {
  const bool max = st.kind == FusedKind::MaxPool;
  const pool_planes::Plane g = pool_planes::of(st);
  if (!max && !accumulate) std::memset(dx, 0, sizeof(float) * size_t(L * g.H * g.W));
  if (pool_planes::pools_as_one_plane(g)) {
    const pool_planes::Plane t = pool_planes::stacked(g, L);
    return max ? pool_planes::max_backward(t, in, dy, dx, accumulate) : pool_planes::avg_backward(t, dy, dx);
  }
  for (int64_t l = 0; l < L; ++l) {
    if (max)
      pool_planes::max_backward(g, in + l * g.H * g.W, dy + l * g.P * g.Q, dx + l * g.H * g.W, accumulate);
    else
      pool_planes::avg_backward(g, dy + l * g.P * g.Q, dx + l * g.H * g.W);
  }
}

// One stage after the BN over L consecutive planes: o = stage(in) (side: the Add's other operand).
// o[i] = relu(in[i]), relu_forward's rule (NaN -> 0); in place allowed.
inline void relu_run(const float* in, int64_t n, float* o) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;
}

// A dropout stage's draw: the layer's seed for the step, the index of in[0] in the stage's input
// tensor, and whether it drops at all (training; in evaluation it passes its input on).
struct DropoutDraw {
  uint64_t seed = 0;
  int64_t first = 0;
  bool training = false;
};

inline void stage_forward(const FusedStage& st, int64_t L, const float* in, const float* side, float* o,
                          const DropoutDraw& d = {}) {
  const int64_t n = L * st.H * st.W;
  switch (st.kind) {
    case FusedKind::Dropout:
      if (d.training && st.p > 0.f)
        dropout_mask::forward(st.p, d.seed, d.first, in, n, o);
      else if (o != in)
        std::memcpy(o, in, sizeof(float) * size_t(n));
      break;
    case FusedKind::Relu: relu_run(in, n, o); break;
    case FusedKind::Add:
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = in[i] + side[i];
      break;
    case FusedKind::MaxPool:
    case FusedKind::AvgPool: pool_forward(st, L, in, o); break;
    case FusedKind::GlobalAvgPool:
      for (int64_t l = 0; l < L; ++l) o[l] = pool_planes::plane_mean(in + l * st.H * st.W, st.H * st.W);
      break;
    default: ET_CHECK(false, "fused stage kind ", int(st.kind));
  }
}

// Where the stages' forward and backward work: L whole planes, or one band of rows of a plane
// (FusedStack::band_rows, fused.cpp). geo[k] is stage k with H / P set to the rows it covers.
struct StageRows {
  FusedStage geo[kMaxStages];
  int64_t L = 1;            // planes
  int64_t y_off = 0;        // elements of y (and dy, y's mask) before these rows
  int64_t side_off = 0;     // elements of the side input before them
  int64_t pool_off = 0;     // where the pool's input rows start in its input buffer (bands: the halo above)
  int64_t pool_span = 0;    // floats of the pool's input buffer, its gradient zeroed over them
  int64_t first[kMaxStages] = {};  // stage k's first element here, its index in the stage's input tensor
  uint64_t seed = 0;        // a dropout stage's (FusedTensors::seed)
  DropoutDraw draw(int64_t k, bool training) const { return {seed, first[k], training}; }
};

// L whole planes from plane b0.
inline StageRows whole_planes(const FusedStack& s, int64_t b0, int64_t L, uint64_t seed) {
  StageRows r;
  r.seed = seed;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    r.geo[k] = s.stages[k];
    r.first[k] = b0 * s.stages[k].H * s.stages[k].W;
  }
  r.L = L;
  r.y_off = b0 * s.last().P * s.last().Q;
  const int add = s.add_stage();
  r.side_off = add >= 0 ? b0 * s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const int k = pool_stage(s);
  r.pool_span = k >= 0 ? L * s.stages[size_t(k)].H * s.stages[size_t(k)].W : 0;
  return r;
}

// Band b of plane pl: the stages before the pool on rows [b0, b1), the pool on its windows' rows
// (band_pool_plane), the stages after it on rows [o0, o1).
inline StageRows one_band(const FusedStack& s, const BandRows& b, int64_t pl, uint64_t seed) {
  StageRows r = whole_planes(s, pl, 1, seed);
  r.y_off += b.o0 * s.last().Q;
  r.side_off += b.b0 * s.stages[0].W;  // an Add has no pool before it: its rows are the band's
  bool after_pool = false;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    FusedStage& st = r.geo[k];
    if (st.kind == FusedKind::MaxPool || st.kind == FusedKind::AvgPool) {
      const pool_planes::Plane g = band_pool_plane(st, b, &r.pool_off);
      st.H = g.H;
      st.P = g.P;
      st.pool.pad_h = g.pad_h;
      r.pool_span = (b.b1 - b.b0) * st.W;
      after_pool = true;
    } else {
      st.H = st.P = after_pool ? b.o1 - b.o0 : b.b1 - b.b0;
      r.first[k] += (after_pool ? b.o0 : b.b0) * st.W;
    }
  }
  return r;
}

// The stages' backward, last to first, over the rows r describes, from dy (the stack's output
// gradient at these rows); returns the buffer (ga or gb) that holds dz, the gradient of the BN
// output. A last pool reads dy where it is and writes gb; else dy is copied into ga, which the
// stages after the pool change in place. out[k]: stage k's recomputed output where a stage needs
// it. The first sweep also writes the side input's gradient, which the Add stage hands on unchanged.
inline float* stages_backward(const FusedStack& s, const StageRows& r, FusedGrads& g, float* const* out,
                              const float* dy, float* ga, float* gb, bool first_sweep, bool read_y_mask) {
  const int64_t S = int64_t(s.stages.size()), L = r.L;
  const FusedKind last = s.stages.back().kind;
  const bool pool_reads_dy = last == FusedKind::MaxPool || last == FusedKind::AvgPool || last == FusedKind::GlobalAvgPool;
  if (!pool_reads_dy) std::memcpy(ga, dy, sizeof(float) * size_t(L * r.geo[S - 1].P * r.geo[S - 1].Q));
  for (int64_t k = S - 1; k >= 1; --k) {
    const FusedStage& st = r.geo[k];
    const int64_t n_in = L * st.H * st.W;
    switch (st.kind) {
      case FusedKind::Relu:
        if (k == S - 1 && read_y_mask) {
          const int64_t o = r.y_off;
          if (g.y_mask.bits) {
            const uint64_t* bits = g.y_mask.bits;
            for (int64_t i = 0; i < n_in; ++i) ga[i] = (bits[(o + i) >> 6] >> ((o + i) & 63)) & 1 ? ga[i] : 0.f;
          } else {
            const float* m = g.y_mask.dense.f32() + o;
#pragma omp simd
            for (int64_t i = 0; i < n_in; ++i) ga[i] = m[i] > 0.f ? ga[i] : 0.f;
          }
        } else {
          const float* m = out[k];
#pragma omp simd
          for (int64_t i = 0; i < n_in; ++i) ga[i] = m[i] > 0.f ? ga[i] : 0.f;
        }
        break;
      case FusedKind::Add:
        if (first_sweep && g.dside.defined()) {
          float* d = g.dside.f32() + r.side_off;
          if (g.dside_accumulate) {
#pragma omp simd
            for (int64_t i = 0; i < n_in; ++i) d[i] += ga[i];
          } else {
            std::memcpy(d, ga, sizeof(float) * size_t(n_in));
          }
        }
        break;
      case FusedKind::Dropout:
        if (st.p > 0.f) dropout_mask::backward(st.p, r.seed, r.first[k], ga, n_in);
        break;
      case FusedKind::GlobalAvgPool:  // the last stage, on whole planes: dy is one value a plane
        for (int64_t l = 0; l < L; ++l) pool_planes::plane_mean_backward(dy[l], st.H * st.W, gb + l * st.H * st.W, false);
        std::swap(ga, gb);
        break;
      case FusedKind::MaxPool:
      case FusedKind::AvgPool: {
        const float* d = k == S - 1 ? dy : ga;
        if (r.pool_off == 0 && r.pool_span == L * st.H * st.W && st.P > 0) {  // the pool writes all of gb
          pool_backward(st, L, out[k - 1], d, gb, false);
        } else {  // a band: its rows past the pool's windows take no gradient
          std::memset(gb, 0, sizeof(float) * size_t(r.pool_span));
          if (st.P > 0) pool_backward(st, L, out[k - 1] + r.pool_off, d, gb + r.pool_off, true);
        }
        std::swap(ga, gb);
        break;
      }
      default: ET_CHECK(false, "fused stage kind ", int(st.kind));
    }
  }
  return ga;
}

// y's bitmap words [w0, w1) with the stash's keep rule (y >= +0 by construction here, so it is one
// unsigned compare, as in relu_forward). Returns the set bits.
inline int64_t mask_words(const float* y, int64_t w0, int64_t w1, uint32_t tb, uint64_t* bits) {
  int64_t kept = 0;
  for (int64_t w = w0; w < w1; ++w) {
    uint64_t m = 0;
    const float* v = y + w * 64;
#if defined(__AVX512F__)
    const __m512i thr = _mm512_set1_epi32(int32_t(tb));
    for (int j = 0; j < 4; ++j)
      m |= uint64_t(_mm512_cmpge_epu32_mask(_mm512_castps_si512(_mm512_loadu_ps(v + 16 * j)), thr)) << (16 * j);
    bits[w] = m;
    kept += __builtin_popcountll(m);
    continue;
#endif
    for (int t = 0; t < 64; ++t) {
      uint32_t u;
      std::memcpy(&u, v + t, 4);
      m |= uint64_t(u >= tb) << t;
    }
    bits[w] = m;
    kept += __builtin_popcountll(m);
  }
  return kept;
}

// Values packed in the pass (fused.cpp, `PackRounds`): each thread's share of a round, in bytes of
// y, kept small enough to stay in a core's L2 (256 KiB on a Jetson Orin's Cortex-A78AE) until the
// thread packs it. Tests set it smaller, for many rounds and uneven ones.
size_t pack_round_bytes();
void set_pack_round_bytes(size_t bytes);  // 0: the default

// The rows r describes (whole planes, or a band: FusedStack::band_rows) through the first `stages`
// stages: out[k] receives stage k's output (out[last] may be y). x and side start at the first
// input-side row; the pool reads its windows' rows from r.pool_off on.
inline void forward_rows(const FusedStack& s, const StageRows& r, size_t stages, const float* x, const float* side,
                         float scale, float shift, float* const* out, bool training) {
  bn_rows::apply(x, scale, shift, r.L * r.geo[0].H * r.geo[0].W, out[0]);
  for (size_t k = 1; k < stages; ++k) {
    const FusedStage& st = r.geo[k];
    const bool pool = st.kind == FusedKind::MaxPool || st.kind == FusedKind::AvgPool;
    if (pool && st.P == 0) continue;  // a backward band in no window: nothing to pool
    stage_forward(st, r.L, out[k - 1] + (pool ? r.pool_off : 0), side, out[k], r.draw(int64_t(k), training));
  }
}

// BN -> ReLU -> stride-1 max-pool on whole planes (BrainSlug's block): the pool reads x through the
// BN and the ReLU, and its backward applies the ReLU's mask as it writes dz (pool_stride1.h), so
// neither the forward nor the backward writes the BN's or the ReLU's output to scratch (lanes512.h, lanes8.h).
inline bool bn_relu_pool_stride1(const FusedStack& s) {
#if defined(ET_BN_RELU_POOL_STRIDE1)
  return s.stages.size() == 3 && s.stages[1].kind == FusedKind::Relu && s.stages[2].kind == FusedKind::MaxPool &&
         s.band_rows == 0 && pool_planes::stride1_applies(pool_planes::of(s.stages[2]));
#else
  (void)s;
  return false;
#endif
}

}  // namespace fused_planes
}  // namespace et
