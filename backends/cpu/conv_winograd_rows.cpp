// Winograd F(2x2, 3x3) by rows of tiles: the forward and data gradient of 3x3 stride-1 pad-1
// convs on 32x32, 16x16 and 8x8 planes (CIFAR ResNets' three stages, VGG's first two), on AVX-512
// and on AVX2 and NEON, whose 16 lanes are lanes16.h's (two ymm, four q registers), with their own
// multiply-add blocks (domain_point), placing and interleaving, and the same bits.
// (The weight gradient: conv_winograd_wgrad.cpp; the input transform's pieces both use:
// conv_winograd_rows.h.)
//
// conv_winograd.cpp's form packs the transforms into SGEMM slivers with the channels along the
// vectors; with 16 channels its transforms and packing cost more than the multiply-adds they save
// (resnet20 16 -> 16 at 32x32: 90 GFLOP/s against the direct kernels' 270). Here a vector holds
// 16 tiles of one plane instead, so nothing is transposed or packed:
//   - 32x32: a row of 16 tiles of 2 columns; 16x16: two rows of 8 tiles (lanes 0-7, 8-15); 8x8:
//     the whole plane's 4 x 4 tiles (rows_image8: each point of the input window gathered from
//     the plane's four vectors by permutes, one vector of tiles per product);
//   - each input row is placed once as its four column phases, so tile q's four columns
//     2q .. 2q+3 are four aligned loads (place_columns, place_columns16), no shuffles after;
//   - per vector of tiles and input channel, V = B^T d B is 16 vectors (one per point xi of the
//     4x4 domain), plain adds; on 32x32 two rows of tiles share the two padded rows between them;
//   - M[xi][o] = sum_c U[xi][c][o] * V[xi][c]: U broadcast against two vectors of tiles, 8 output
//     channels x 2 = 16 accumulators (10 loads for 16 multiply-adds); the weights transformed
//     once per call, G g G^T in double, rounded;
//   - Y = A^T M A gives the output rows' even and odd columns, interleaved by two permutes.
// Per 16 tiles and 16 x 16 channels: 4096 multiply-adds against the direct kernels' 9216.
//
// Arithmetic: tile results are sums over c in order 0..C-1 per domain point, then the fixed
// output transform: deterministic, independent of the thread count, but not the direct kernels'
// bits (the same rounding as conv_winograd.cpp's F(2x2, 3x3): transforms with 0, +-1, +-1/2).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/always_inline.h"
#include "backends/cpu/balance.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/carve.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_winograd.h"
#include "backends/cpu/conv_winograd_rows.h"
#include "backends/cpu/fused_elementwise.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace et::cpu {

namespace {

// The per-call geometry in the kernel's own terms: Ci input planes in, Co output planes out, of
// side x side (32 or 16).
struct RowsGeom {
  int64_t N, Ci, Co, side;
  // Vectors of tiles per plane: 16 rows of 16 tiles (side 32), or 4 pairs of rows of 8 tiles.
  int64_t vectors() const { return side == 32 ? 16 : side == 16 ? 4 : 1; }
  // Floats from one domain point's V (M) to the next: the vectors of tiles a channel (2 on 32x32
  // and 16x16 planes, 1 on 8x8) for every input (output) channel, plus one line, so a tile's 16
  // points do not all fall in one cache set where the channels fill whole pages (as
  // conv_winograd_wgrad.cpp's V and W).
  int64_t vecs() const { return side == 8 ? 1 : 2; }
  int64_t v_stride() const { return Ci * vecs() * 16 + 16; }
  int64_t m_stride() const { return Co * vecs() * 16 + 16; }
  // Placed rows per input plane: the 34 padded rows (side 32); 4 rows for each of the 4 vectors,
  // both halves (side 16).
  int64_t placed_rows() const { return side == 32 ? side + 2 : side == 16 ? 16 : 0; }  // 8: none (rows_image8)
};

struct RowsLayout {
  int64_t u_n, placed_n, v_n, m_n, plane_n, lanes_n;
  size_t shared_bytes, thread_bytes;
};

RowsLayout rows_layout(const RowsGeom& g) {
  RowsLayout l;
  l.u_n = 16 * g.Ci * g.Co;
  l.placed_n = g.Ci * g.placed_rows() * kRowFloats;
  l.v_n = 16 * g.v_stride();  // [xi][c][2 rows of tiles][16 tiles]
  l.m_n = 16 * g.m_stride();
  l.plane_n = g.side * g.side;
  l.lanes_n = g.Co;  // per output plane, the first sweep's running sums
  l.shared_bytes = CarveSize().add<float>(l.u_n).bytes;
  l.thread_bytes = CarveSize()
                       .add<float>(l.placed_n)
                       .add<float>(l.v_n)
                       .add<float>(l.m_n)
                       .add<float>(l.plane_n)
                       .add<bn_rows::GradLanes>(l.lanes_n)
                       .bytes;
  return l;
}

RowsGeom rows_geom(const Conv2dGeom& g, ConvPass pass) {
  return pass == ConvPass::Forward ? RowsGeom{g.N, g.C, g.K, g.W} : RowsGeom{g.N, g.K, g.C, g.W};
}

#if defined(ET_WINOGRAD_ROWS)
// U[xi][c][o] = (G g G^T)[a][b], xi = 4a + b, with g the 3x3 kernel from input plane c to output
// plane o: w[o][c] forward, w[c][o] flipped for the data gradient (o: an input channel of the
// conv, c: one of its output channels).
// Input channels [c0, c1) (the threads split them: 64 x 128 channels are 8192 kernels).
void transform_weights(const float* w, int64_t K, int64_t C, bool data_gradient, int64_t c0, int64_t c1, float* U) {
  const int64_t Ci = data_gradient ? K : C, Co = data_gradient ? C : K;
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t o = 0; o < Co; ++o) {
      double g[3][3];
      for (int r = 0; r < 3; ++r)
        for (int s = 0; s < 3; ++s)
          g[r][s] = data_gradient ? w[((c * C + o) * 3 + (2 - r)) * 3 + (2 - s)] : w[((o * C + c) * 3 + r) * 3 + s];
      double t[4][3];  // G g
      for (int s = 0; s < 3; ++s) {
        t[0][s] = g[0][s];
        t[1][s] = 0.5 * (g[0][s] + g[1][s] + g[2][s]);
        t[2][s] = 0.5 * (g[0][s] - g[1][s] + g[2][s]);
        t[3][s] = g[2][s];
      }
      for (int a = 0; a < 4; ++a) {
        const double u[4] = {t[a][0], 0.5 * (t[a][0] + t[a][1] + t[a][2]), 0.5 * (t[a][0] - t[a][1] + t[a][2]),
                             t[a][2]};
        for (int b = 0; b < 4; ++b) U[((4 * a + b) * Ci + c) * Co + o] = float(u[b]);
      }
    }
}

// M[xi] = sum_c U[xi][c] * V[xi][c] for one domain point, over NV vectors of tiles (V and M hold
// NV vectors per channel: [c][NV]), each lane's sum over c in order 0..Ci-1 by multiply-adds from
// zero on every ISA (the same bits).
#if defined(__AVX512F__)
// Each broadcast of U feeds NV multiply-adds: NV = 2 (two rows of
// tiles) takes 2 loads of V and KB broadcasts for 2 KB multiply-adds, KB = 8: 16 accumulators;
// NV = 1 (8x8 planes, a vector per image) blocks of 16 output channels.
// m[o][r] = sum_c u[c * Co + o] * v[c][r] for KB output channels o, each vector r.
template <int NV, int KB>
ET_ALWAYS_INLINE inline void domain_point_block(const float* v, const float* u, int64_t Ci, int64_t Co, float* m) {
  __m512 acc[KB][NV];
#pragma GCC unroll 16
  for (int k = 0; k < KB; ++k)
    for (int r = 0; r < NV; ++r) acc[k][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < Ci; ++c) {
    __m512 x[NV];
    for (int r = 0; r < NV; ++r) x[r] = _mm512_load_ps(v + (c * NV + r) * 16);
    const float* uc = u + c * Co;
#pragma GCC unroll 16
    for (int k = 0; k < KB; ++k) {
      const __m512 b = _mm512_set1_ps(uc[k]);
      for (int r = 0; r < NV; ++r) acc[k][r] = _mm512_fmadd_ps(b, x[r], acc[k][r]);
    }
  }
#pragma GCC unroll 16
  for (int k = 0; k < KB; ++k)
    for (int r = 0; r < NV; ++r) _mm512_store_ps(m + (k * NV + r) * 16, acc[k][r]);
}

// All output channels of one domain point: blocks of 16 / NV, then 8, 4, 2, 1 (down to NV's).
template <int NV>
inline void domain_point(const float* v, const float* u, int64_t Ci, int64_t Co, float* m) {
  constexpr int64_t kWide = 16 / NV;
  int64_t o = 0;
  for (; o + kWide <= Co; o += kWide) domain_point_block<NV, kWide>(v, u + o, Ci, Co, m + o * NV * 16);
  if (NV == 1 && o + 8 <= Co) domain_point_block<NV, 8>(v, u + o, Ci, Co, m + o * NV * 16), o += 8;
  if (o + 4 <= Co) domain_point_block<NV, 4>(v, u + o, Ci, Co, m + o * NV * 16), o += 4;
  if (o + 2 <= Co) domain_point_block<NV, 2>(v, u + o, Ci, Co, m + o * NV * 16), o += 2;
  if (o < Co) domain_point_block<NV, 1>(v, u + o, Ci, Co, m + o * NV * 16);
}
#elif defined(__AVX2__)
// A vector of tiles is two ymm: KB = 6 output channels of one vector r of tiles take 12
// accumulators, the vector's two halves and a broadcast (15 of the 16 registers): 2 loads and 6
// broadcasts for 12 multiply-adds.
template <int NV, int KB>
ET_ALWAYS_INLINE inline void domain_point_block(const float* v, const float* u, int64_t Ci, int64_t Co, int r,
                                                float* m) {
  __m256 acc[KB][2];
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < Ci; ++c) {
    const __m256 x0 = _mm256_loadu_ps(v + (c * NV + r) * 16), x1 = _mm256_loadu_ps(v + (c * NV + r) * 16 + 8);
    const float* uc = u + c * Co;
#pragma GCC unroll 8
    for (int k = 0; k < KB; ++k) {
      const __m256 b = _mm256_broadcast_ss(uc + k);
      acc[k][0] = _mm256_fmadd_ps(b, x0, acc[k][0]);
      acc[k][1] = _mm256_fmadd_ps(b, x1, acc[k][1]);
    }
  }
#pragma GCC unroll 8
  for (int k = 0; k < KB; ++k) {
    _mm256_storeu_ps(m + (k * NV + r) * 16, acc[k][0]);
    _mm256_storeu_ps(m + (k * NV + r) * 16 + 8, acc[k][1]);
  }
}
template <int NV>
inline void domain_point(const float* v, const float* u, int64_t Ci, int64_t Co, float* m) {
  for (int r = 0; r < NV; ++r) {
    int64_t o = 0;
    for (; o + 6 <= Co; o += 6) domain_point_block<NV, 6>(v, u + o, Ci, Co, r, m + o * NV * 16);
    if (o + 4 <= Co) domain_point_block<NV, 4>(v, u + o, Ci, Co, r, m + o * NV * 16), o += 4;
    if (o + 2 <= Co) domain_point_block<NV, 2>(v, u + o, Ci, Co, r, m + o * NV * 16), o += 2;
    if (o < Co) domain_point_block<NV, 1>(v, u + o, Ci, Co, r, m + o * NV * 16);
  }
}
#else  // NEON
// A vector of tiles is four q registers: KB = 4 output channels of one vector r of tiles take 16
// accumulators, the vector and U's 4 weights in one register, multiplied by lane (21 of 32
// registers): 5 loads for 16 multiply-adds.
template <int NV, int KB>
ET_ALWAYS_INLINE inline void domain_point_block(const float* v, const float* u, int64_t Ci, int64_t Co, int r,
                                                float* m) {
  float32x4_t acc[KB][4];
#pragma GCC unroll 4
  for (int k = 0; k < KB; ++k)
    for (int j = 0; j < 4; ++j) acc[k][j] = vdupq_n_f32(0.f);
  for (int64_t c = 0; c < Ci; ++c) {
    const float* vc = v + (c * NV + r) * 16;
    const float32x4_t x[4] = {vld1q_f32(vc), vld1q_f32(vc + 4), vld1q_f32(vc + 8), vld1q_f32(vc + 12)};
    const float* uc = u + c * Co;
    if constexpr (KB == 4) {
      const float32x4_t w = vld1q_f32(uc);
      for (int j = 0; j < 4; ++j) {
        acc[0][j] = vfmaq_laneq_f32(acc[0][j], x[j], w, 0);
        acc[1][j] = vfmaq_laneq_f32(acc[1][j], x[j], w, 1);
        acc[2][j] = vfmaq_laneq_f32(acc[2][j], x[j], w, 2);
        acc[3][j] = vfmaq_laneq_f32(acc[3][j], x[j], w, 3);
      }
    } else {
#pragma GCC unroll 4
      for (int k = 0; k < KB; ++k)
        for (int j = 0; j < 4; ++j) acc[k][j] = vfmaq_n_f32(acc[k][j], x[j], uc[k]);
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < KB; ++k)
    for (int j = 0; j < 4; ++j) vst1q_f32(m + (k * NV + r) * 16 + 4 * j, acc[k][j]);
}
template <int NV>
inline void domain_point(const float* v, const float* u, int64_t Ci, int64_t Co, float* m) {
  for (int r = 0; r < NV; ++r) {
    int64_t o = 0;
    for (; o + 4 <= Co; o += 4) domain_point_block<NV, 4>(v, u + o, Ci, Co, r, m + o * NV * 16);
    if (o + 2 <= Co) domain_point_block<NV, 2>(v, u + o, Ci, Co, r, m + o * NV * 16), o += 2;
    if (o < Co) domain_point_block<NV, 1>(v, u + o, Ci, Co, r, m + o * NV * 16);
  }
}
#endif

// Y = A^T M A of one vector of tiles from M[xi] (at m + xi * stride): y[p][s] holds each tile's
// output (p, s), row p and column s of its 2 x 2.
ET_ALWAYS_INLINE inline void at_m_a(const float* m, int64_t stride, V16 y[2][2]) {
  using namespace wrows;
  V16 s[4][2];
  for (int a = 0; a < 4; ++a) {
    const V16 m0 = vload(m + (4 * a + 0) * stride), m1 = vload(m + (4 * a + 1) * stride);
    const V16 m2 = vload(m + (4 * a + 2) * stride), m3 = vload(m + (4 * a + 3) * stride);
    s[a][0] = vadd(vadd(m0, m1), m2);
    s[a][1] = vsub(vsub(m1, m2), m3);
  }
  for (int c = 0; c < 2; ++c) {
    y[0][c] = vadd(vadd(s[0][c], s[1][c]), s[2][c]);
    y[1][c] = vsub(vsub(s[1][c], s[2][c]), s[3][c]);
  }
}

// Lanes 0-7 of the even and odd columns interleaved into a (16 floats), lanes 8-15 into b; each
// plus the bias, then (accumulate) added onto what a and b hold.
#if defined(__AVX512F__)
ET_ALWAYS_INLINE inline void interleave_store(V16 even, V16 odd, V16 vb, bool accumulate, float* ya, float* yb) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  __m512 a = _mm512_add_ps(_mm512_permutex2var_ps(even, lo, odd), vb);
  __m512 b = _mm512_add_ps(_mm512_permutex2var_ps(even, hi, odd), vb);
  if (accumulate) {
    a = _mm512_add_ps(_mm512_loadu_ps(ya), a);
    b = _mm512_add_ps(_mm512_loadu_ps(yb), b);
  }
  _mm512_storeu_ps(ya, a);
  _mm512_storeu_ps(yb, b);
}
#elif defined(__AVX2__)
// Lanes 0-3 of e and o interleaved into ya (8 floats), lanes 4-7 into yb.
ET_ALWAYS_INLINE inline void interleave_half(__m256 e, __m256 o, __m256 vb, bool accumulate, float* ya, float* yb) {
  const __m256 l = _mm256_unpacklo_ps(e, o), h = _mm256_unpackhi_ps(e, o);  // e0 o0 e1 o1 | e4 o4 e5 o5, ...
  __m256 a = _mm256_add_ps(_mm256_permute2f128_ps(l, h, 0x20), vb);
  __m256 b = _mm256_add_ps(_mm256_permute2f128_ps(l, h, 0x31), vb);
  if (accumulate) {
    a = _mm256_add_ps(_mm256_loadu_ps(ya), a);
    b = _mm256_add_ps(_mm256_loadu_ps(yb), b);
  }
  _mm256_storeu_ps(ya, a);
  _mm256_storeu_ps(yb, b);
}
ET_ALWAYS_INLINE inline void interleave_store(const V16& even, const V16& odd, const V16& vb, bool accumulate,
                                              float* ya, float* yb) {
  interleave_half(even.lo, odd.lo, vb.lo, accumulate, ya, ya + 8);
  interleave_half(even.hi, odd.hi, vb.hi, accumulate, yb, yb + 8);
}
// 8x8 planes: output row 2 tr + p of y from lanes 4 tr .. 4 tr + 3 of the tiles' even and odd
// columns of their row p.
ET_ALWAYS_INLINE inline void store_rows8(const V16& even, const V16& odd, const V16& vb, bool accumulate, float* y,
                                         int p) {
  interleave_half(even.lo, odd.lo, vb.lo, accumulate, y + p * 8, y + (2 + p) * 8);
  interleave_half(even.hi, odd.hi, vb.hi, accumulate, y + (4 + p) * 8, y + (6 + p) * 8);
}
#else  // NEON: vst2 interleaves 4 + 4 lanes
// e and o interleaved into y (8 floats), each plus b, then (accumulate) added onto what y holds.
ET_ALWAYS_INLINE inline void store_interleaved(float32x4_t e, float32x4_t o, float32x4_t b, bool accumulate, float* y) {
  float32x4x2_t p = {{vaddq_f32(e, b), vaddq_f32(o, b)}};
  if (accumulate) {
    const float32x4x2_t old = vld2q_f32(y);
    p.val[0] = vaddq_f32(old.val[0], p.val[0]);
    p.val[1] = vaddq_f32(old.val[1], p.val[1]);
  }
  vst2q_f32(y, p);
}
ET_ALWAYS_INLINE inline void interleave_store(const V16& even, const V16& odd, const V16& vb, bool accumulate,
                                              float* ya, float* yb) {
  for (int k = 0; k < 4; ++k)
    store_interleaved(even.q[k], odd.q[k], vb.q[k], accumulate, (k < 2 ? ya : yb) + 8 * (k % 2));
}
ET_ALWAYS_INLINE inline void store_rows8(const V16& even, const V16& odd, const V16& vb, bool accumulate, float* y,
                                         int p) {
  for (int tr = 0; tr < 4; ++tr)
    store_interleaved(even.q[tr], odd.q[tr], vb.q[tr], accumulate, y + (2 * tr + p) * 8);
}
#endif

// One vector of tiles' outputs of plane o from M[xi][o] (stride Co vectors): Y = A^T M A (+ bias),
// even and odd columns interleaved; written, or added onto y. The tiles' output row p (0, 1) is
// 32 floats from lanes 0-15, which go to a0 + p * step (lanes 0-7's 16 columns) and b0 + p * step
// (lanes 8-15's): one 32-wide row (b0 = a0 + 16), or rows of two tile rows of a 16-wide plane.
ET_ALWAYS_INLINE inline void output_transform(const float* m, int64_t stride, float bias, bool accumulate, float* a0,
                                              float* b0, int64_t step) {
  V16 y[2][2];
  at_m_a(m, stride, y);
  const V16 vb = wrows::vsplat(bias);
  for (int p = 0; p < 2; ++p) interleave_store(y[p][0], y[p][1], vb, accumulate, a0 + p * step, b0 + p * step);
}

// One image: Ci input planes (x: its own planes, or computed by the fused stack) -> Co output
// planes of out.
// After plane o's last rows: its BN sums (sum1 / sum2), while the plane is in this core's cache.
// The first sweep of the stack before (dz_sums) goes by pieces instead: each pair of vectors of
// tiles writes 128 elements of every output plane (4 rows of 32, 8 rows of 16), and the sweep
// takes them at once, its sums carried per plane in `lanes` (bn_rows::GradLanes: the same bits
// as the whole plane at once). Its reads of x then interleave with the multiply-adds instead of
// following them in a burst per image: 1.25-1.29x -> 1.10-1.19x the plain data gradient on
// ResNet-20's 16 -> 16 at 32x32 (session 48, Zen 5). (The BN sums by pieces measured slower:
// their eight running vectors a plane go to memory and back every piece.)
struct RowsEpilogue {
  float *sum1 = nullptr, *sum2 = nullptr;
  const DzSumsEpilogue* dz_sums = nullptr;
};

void rows_image(const RowsGeom& g, const ConvInput& x, int64_t n, const float* U, const float* bias, bool accumulate,
                const RowsEpilogue& epi, float* placed, float* v, float* m, float* plane, bn_rows::GradLanes* lanes,
                float* out) {
  const int64_t side = g.side, HW = side * side, per_plane = g.placed_rows() * kRowFloats;
  for (int64_t c = 0; c < g.Ci; ++c) {
    const float* src = x.planes + (n * g.Ci + c) * HW;
    if (x.stack) {  // the fused stack's output plane, computed straight into the buffer
      const int64_t pl = n * g.Ci + c;
      x.stack->run(src, x.stack->scale, x.stack->shift, g.Ci, HW, pl * HW, HW, plane);
      src = plane;
    }
    if (side == 32) place_columns(src, placed + c * per_plane);
    else place_columns16(src, placed + c * per_plane);
  }
  for (int64_t j = 0; j < g.vectors(); j += 2) {  // vectors j and j + 1 of tiles
    for (int64_t c = 0; c < g.Ci; ++c) {
      if (side == 32) {
        input_transform_pair(placed + c * per_plane, j, v + c * 32, g.v_stride());
      } else {
        input_transform_one(placed + c * per_plane + 4 * j * kRowFloats, v + c * 32, g.v_stride());
        input_transform_one(placed + c * per_plane + 4 * (j + 1) * kRowFloats, v + c * 32 + 16, g.v_stride());
      }
    }
    for (int xi = 0; xi < 16; ++xi)
      domain_point<2>(v + xi * g.v_stride(), U + xi * g.Ci * g.Co, g.Ci, g.Co, m + xi * g.m_stride());
    for (int64_t o = 0; o < g.Co; ++o) {
      float* y = out + (n * g.Co + o) * HW;
      const float b = bias ? bias[o] : 0.f;
      for (int64_t r = 0; r < 2; ++r) {
        const int64_t q = j + r;  // side 32: tile row q (output rows 2q, 2q+1); 16: tile rows 2q, 2q+1
        float* a0 = side == 32 ? y + 2 * q * 32 : y + 4 * q * 16;
        float* b0 = side == 32 ? a0 + 16 : y + (4 * q + 2) * 16;
        output_transform(m + o * 32 + r * 16, g.m_stride(), b, accumulate, a0, b0, side);
      }
      const int64_t pl = n * g.Co + o;
      const bool last = j + 2 >= g.vectors();
      if (epi.dz_sums) {
        const DzSumsEpilogue& e = *epi.dz_sums;
        bn_rows::GradLanes& lg = lanes[o];
        const int64_t at = pl * HW + 64 * j;  // this pair's piece: elements [64 j, 64 j + 128)
        if (j == 0) lg = bn_rows::GradLanes{};
        fused_elementwise::dz_sums_piece(e, o, at, out + at, 128, &lg);
        if (last) bn_rows::grad_sums_finish(lg, e.sum1 + pl, e.sum2 + pl);
      }
      if (last && epi.sum1) bn_rows::plane_sums(y, HW, epi.sum1 + pl, epi.sum2 + pl);
    }
  }
}

void rows_image8(const RowsGeom& g, const Gather8& t, const ConvInput& x, int64_t n, const float* U,
                 const float* bias, bool accumulate, const RowsEpilogue& epi, float* v, float* m, float* plane,
                 float* out) {
  constexpr int64_t HW = 64;
  for (int64_t c = 0; c < g.Ci; ++c) {
    const float* src = x.planes + (n * g.Ci + c) * HW;
    if (x.stack) {
      const int64_t pl = n * g.Ci + c;
      x.stack->run(src, x.stack->scale, x.stack->shift, g.Ci, HW, pl * HW, HW, plane);
      src = plane;
    }
    input_transform8(t, src, v + c * 16, g.v_stride());
  }
  for (int xi = 0; xi < 16; ++xi)
    domain_point<1>(v + xi * g.v_stride(), U + xi * g.Ci * g.Co, g.Ci, g.Co, m + xi * g.m_stride());
  for (int64_t o = 0; o < g.Co; ++o) {
    V16 yt[2][2];
    at_m_a(m + o * 16, g.m_stride(), yt);
    const V16 vb = wrows::vsplat(bias ? bias[o] : 0.f);
    const int64_t pl = n * g.Co + o;
    float* y = out + pl * HW;
#if defined(__AVX512F__)
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = _mm512_load_si512(t.out_idx[k]);
      __m512 r = _mm512_mask_mov_ps(_mm512_permutex2var_ps(yt[0][0], idx, yt[0][1]), __mmask16(0xFF00),
                                    _mm512_permutex2var_ps(yt[1][0], idx, yt[1][1]));
      r = _mm512_add_ps(r, vb);
      if (accumulate) r = _mm512_add_ps(_mm512_loadu_ps(y + 16 * k), r);
      _mm512_storeu_ps(y + 16 * k, r);
    }
#else
    (void)t;
    for (int p = 0; p < 2; ++p) store_rows8(yt[p][0], yt[p][1], vb, accumulate, y, p);
#endif
    if (epi.sum1) bn_rows::plane_sums(y, HW, epi.sum1 + pl, epi.sum2 + pl);
    if (epi.dz_sums) fused_elementwise::dz_sums_planes(*epi.dz_sums, pl, pl + 1, g.Co, HW, out);
  }
}

// Both passes: the images balanced over the threads (balance.h); sums / dz_sums on each plane as
// written.
void rows_run(const RowsGeom& g, const ConvInput& x, const float* w, int64_t K, int64_t C, bool data_gradient,
              const float* bias, bool accumulate, float* out, void* ws, float* sum1, float* sum2,
              const DzSumsEpilogue* dz_sums) {
  const RowsLayout l = rows_layout(g);
  Carve shared(static_cast<uint8_t*>(ws));
  float* U = shared.take<float>(l.u_n);
  uint8_t* thread_base = static_cast<uint8_t*>(ws) + l.shared_bytes;
  const Gather8 t8 = g.side == 8 ? gather8() : Gather8{};
  RowsEpilogue epi;
  epi.sum1 = sum1;
  epi.sum2 = sum2;
  epi.dz_sums = dz_sums;
  StealingRanges images(g.N, 1, omp_get_max_threads());
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    transform_weights(w, K, C, data_gradient, g.Ci * t / nt, g.Ci * (t + 1) / nt, U);
    Carve tc(thread_base + size_t(t) * l.thread_bytes);
    float* placed = tc.take<float>(l.placed_n);
    float* v = tc.take<float>(l.v_n);
    float* m = tc.take<float>(l.m_n);
    float* plane = tc.take<float>(l.plane_n);
    bn_rows::GradLanes* lanes = tc.take<bn_rows::GradLanes>(l.lanes_n);
    std::memset(placed, 0, sizeof(float) * size_t(l.placed_n));  // the padding stays zero
#pragma omp barrier
    images.run([&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        if (g.side == 8) rows_image8(g, t8, x, n, U, bias, accumulate, epi, v, m, plane, out);
        else rows_image(g, x, n, U, bias, accumulate, epi, placed, v, m, plane, lanes, out);
      }
    });
  }
}
#endif

}  // namespace

bool winograd_rows_applies(const Conv2dGeom& g, ConvPass pass) {
  if (pass == ConvPass::BackwardWeight) return winograd_wgrad_rows_applies(g);
#if defined(ET_WINOGRAD_ROWS)
  return g.groups == 1 && g.R == 3 && g.S == 3 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 1 &&
         g.pad_w == 1 && (g.W == 32 || g.W == 16 || g.W == 8) && g.H == g.W && g.P == g.W && g.Q == g.W &&
         g.C > 0 && g.K > 0;
#else
  (void)g, (void)pass;
  return false;
#endif
}

size_t winograd_rows_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  if (pass == ConvPass::BackwardWeight) return winograd_wgrad_rows_workspace(g, threads);
  const RowsLayout l = rows_layout(rows_geom(g, pass));
  return l.shared_bytes + size_t(threads) * l.thread_bytes;
}

void winograd_rows_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                           float* sum1, float* sum2) {
  ET_CHECK(winograd_rows_applies(g, ConvPass::Forward), "winograd rows: forward of this geometry");
#if defined(ET_WINOGRAD_ROWS)
  rows_run(rows_geom(g, ConvPass::Forward), ConvInput(x), w, g.K, g.C, false, b, false, y, ws, sum1, sum2, nullptr);
#else
  (void)x, (void)w, (void)b, (void)y, (void)ws, (void)sum1, (void)sum2;
#endif
}

void winograd_rows_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                                 void* ws, const DzSumsEpilogue* dz_sums) {
  ET_CHECK(winograd_rows_applies(g, ConvPass::BackwardData), "winograd rows: data gradient of this geometry");
#if defined(ET_WINOGRAD_ROWS)
  rows_run(rows_geom(g, ConvPass::BackwardData), ConvInput(dy), w, g.K, g.C, true, nullptr, accumulate, dx, ws,
           nullptr, nullptr, dz_sums);
#else
  (void)dy, (void)w, (void)dx, (void)accumulate, (void)ws, (void)dz_sums;
#endif
}

}  // namespace et::cpu
