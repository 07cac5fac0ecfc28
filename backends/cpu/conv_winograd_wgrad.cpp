// Winograd F(2x2, 3x3) weight gradient of 3x3 stride-1 pad-1 convs on 32x32, 16x16 and 8x8 planes
// (the CIFAR ResNets' three stages; AVX-512, AVX2 and NEON), by vectors of tiles as conv_winograd_rows.cpp's
// forward: a vector holds a row of 16 tiles (32x32), two rows of 8 (16x16), or the whole plane's
// 4 x 4 (8x8).
//
// The forward is Y = A^T [(G g G^T) . (B^T d B)] A per tile; its transpose gives the weight
// gradient as
//   dg = G^T M G,   M[xi] = sum over images and tiles of W[xi] * V[xi],
//   V = B^T d B (the forward's input transform), W = A dY A^T (dY: the tile's 2 x 2 output
//   gradients; adds only),
// 16 products a tile and pair of channels against the direct kernels' 36.
//
// The sum over tiles runs along the vectors' lanes: per domain point xi and block of 4 output x 4
// input channels, 16 accumulators take the products of a chunk of vectors (8 images of 8x8, 2 of
// 16x16, 1 of 32x32), then one transposing add tree (lane_sums16) turns the 16 vectors into their
// 16 lane sums, added into the thread's partial M. The threads split the batch; their partials are
// added in thread order and transformed (G^T M G) in double: deterministic for a given thread
// count, not the direct kernels' bits (tolerance, as for the forward).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/carve.h"
#include "backends/cpu/conv_winograd.h"
#include "backends/cpu/conv_winograd_rows.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

// The geometry in the kernel's terms: vectors of tiles per plane, images per chunk, and the
// chunk's vectors (the lanes' sums are taken once per chunk).
struct WgradShape {
  int64_t side, per_plane, images, vecs;
  // Floats from one domain point's V (or W) to the next: the points' blocks one line apart beyond
  // whole pages, so a transform's 16 stores to one tile's points fall in 16 cache sets (at a
  // multiple of 4 KiB they all met in one set and evicted each other: 1.3x slower, session 48).
  int64_t v_stride(int64_t channels) const { return channels * vecs * 16 + 16; }
};
WgradShape wgrad_shape(const Conv2dGeom& g) {
  const int64_t side = g.W;
  const int64_t per_plane = side == 32 ? 16 : side == 16 ? 4 : 1;
  const int64_t images = side == 32 ? 1 : side == 16 ? 2 : 8;
  return {side, per_plane, images, images * per_plane};
}

struct WgradLayout {
  int64_t v_n, w_n, part_n, plane_n, placed_n;
  size_t thread_bytes;
};

// Per thread: V [16][C][vecs] and W [16][K][vecs] vectors of a chunk, the partial M [16][K][C] and
// db [K], the decoded input (an image of 8x8, else a plane), and one channel's placed rows.
WgradLayout wgrad_layout(const Conv2dGeom& g) {
  const WgradShape s = wgrad_shape(g);
  WgradLayout l;
  l.v_n = 16 * s.v_stride(g.C);
  l.w_n = 16 * s.v_stride(g.K);
  l.part_n = 16 * g.K * g.C + g.K;
  l.plane_n = s.side == 8 ? g.C * 64 : s.side * s.side;
  l.placed_n = s.side == 32 ? 34 * kRowFloats : s.side == 16 ? 16 * kRowFloats : 0;
  // A multiple of 64 bytes: every thread's pieces then lie at the same offsets in its part.
  const size_t bytes = CarveSize()
                           .add<float>(l.v_n)
                           .add<float>(l.w_n)
                           .add<float>(l.part_n)
                           .add<float>(l.plane_n)
                           .add<float>(l.placed_n)
                           .bytes;
  l.thread_bytes = (bytes + 63) / 64 * 64;
  return l;
}

#if defined(ET_WINOGRAD_ROWS)
// W = A dY A^T of one vector of tiles from each tile's four gradients a b / c d (rows 0, 1 of its
// 2 x 2), into w + xi * stride.
ET_ALWAYS_INLINE inline void grad_tile_transform(const V16& a, const V16& b, const V16& c, const V16& d, float* w,
                                                 int64_t stride) {
  using namespace wrows;
  // Down the rows (A: [x0, x0 + x1, x0 - x1, -x1]), then along them.
  const V16 zero = vsplat(0.f);
  const V16 rows[4][2] = {{a, b}, {vadd(a, c), vadd(b, d)}, {vsub(a, c), vsub(b, d)}, {vsub(zero, c), vsub(zero, d)}};
  for (int r = 0; r < 4; ++r) {
    const V16 x = rows[r][0], y = rows[r][1];
    vstore(w + (4 * r + 0) * stride, x);
    vstore(w + (4 * r + 1) * stride, vadd(x, y));
    vstore(w + (4 * r + 2) * stride, vsub(x, y));
    vstore(w + (4 * r + 3) * stride, vsub(zero, y));
  }
}

#if defined(__AVX512F__)
// Where each tile's gradients a, b, c, d come from, per plane size:
//   8x8: tile (tr, q) is lane 4 tr + q; from the plane's four vectors (rows 2tr in elements 0-7,
//        2tr + 1 in 8-15 of vector tr) by one permute per pair of vectors and a blend (idx8);
//   16x16: vector p holds tile rows 2p (lanes 0-7) and 2p + 1 (8-15), which cover output rows
//        4p, 4p + 1 and 4p + 2, 4p + 3; a is the even columns of rows 4p and 4p + 2 (idx16[0]);
//   32x32: vector tr is tile row tr, output rows 2tr and 2tr + 1, a its even columns (idx32[0]).
struct GradGather {
  alignas(64) int32_t idx8[4][16];
  alignas(64) int32_t idx16[2][16];  // even, odd columns of two 16-wide rows
  alignas(64) int32_t idx32[2][16];  // even, odd columns of one 32-wide row (two vectors)
};
GradGather grad_gather() {
  GradGather s{};
  for (int v = 0; v < 4; ++v)
    for (int L = 0; L < 16; ++L) {
      const int tr = L / 4, q = L % 4, off = (v >= 2 ? 8 : 0) + 2 * q + (v & 1);
      s.idx8[v][L] = (tr % 2) * 16 + off;
    }
  for (int odd = 0; odd < 2; ++odd)
    for (int L = 0; L < 16; ++L) {
      s.idx16[odd][L] = (L < 8 ? 0 : 16) + 2 * (L % 8) + odd;
      s.idx32[odd][L] = 2 * L + odd;
    }
  return s;
}

// W of one gradient plane dy [side, side] into w + slot * 16 (its first vector's slot), the
// plane's vectors in consecutive slots; stride: the next domain point's.
ET_ALWAYS_INLINE inline void grad_transform_plane(const GradGather& s, int64_t side, const float* dy, float* w,
                                                  int64_t stride) {
  if (side == 8) {
    const __m512 r0 = _mm512_loadu_ps(dy), r1 = _mm512_loadu_ps(dy + 16), r2 = _mm512_loadu_ps(dy + 32),
                 r3 = _mm512_loadu_ps(dy + 48);
    __m512 e[4];  // a, b, c, d
    for (int v = 0; v < 4; ++v) {
      const __m512i idx = _mm512_load_si512(s.idx8[v]);
      e[v] = _mm512_mask_mov_ps(_mm512_permutex2var_ps(r0, idx, r1), __mmask16(0xFF00),
                                _mm512_permutex2var_ps(r2, idx, r3));
    }
    return grad_tile_transform(e[0], e[1], e[2], e[3], w, stride);
  }
  // 16x16 and 32x32: a from the even columns of rows (a_lo, a_hi) (two 16-wide rows, or one 32-wide
  // row's halves), b their odd ones; c, d the same of rows (c_lo, c_hi).
  const int32_t(&idx)[2][16] = side == 16 ? s.idx16 : s.idx32;
  const __m512i ie = _mm512_load_si512(idx[0]), io = _mm512_load_si512(idx[1]);
  auto tiles = [&](__m512 a_lo, __m512 a_hi, __m512 c_lo, __m512 c_hi, float* wv) ET_ALWAYS_INLINE {
    grad_tile_transform(_mm512_permutex2var_ps(a_lo, ie, a_hi), _mm512_permutex2var_ps(a_lo, io, a_hi),
                        _mm512_permutex2var_ps(c_lo, ie, c_hi), _mm512_permutex2var_ps(c_lo, io, c_hi), wv, stride);
  };
  const int64_t vectors = side == 16 ? 4 : 16;  // each from 64 floats of dy: rows 4p .. 4p + 3, or 2tr, 2tr + 1
  for (int64_t v = 0; v < vectors; ++v) {
    const float* r = dy + 64 * v;
    const __m512 r0 = _mm512_loadu_ps(r), r1 = _mm512_loadu_ps(r + 16), r2 = _mm512_loadu_ps(r + 32),
                 r3 = _mm512_loadu_ps(r + 48);
    if (side == 16) tiles(r0, r2, r1, r3, w + v * 16);  // rows 4p, 4p + 2 (a, b); 4p + 1, 4p + 3 (c, d)
    else tiles(r0, r1, r2, r3, w + v * 16);             // row 2tr's halves (a, b); row 2tr + 1's (c, d)
  }
}

#else
// Narrow vectors: a, b are the even and odd columns of rows 4p and 4p + 2 (16x16: lanes 0-7 and
// 8-15), of row 2tr (32x32), or of rows 0, 2, 4, 6 (8x8: lanes 4 tr .. 4 tr + 3 each); c, d those
// of the rows below.
struct GradGather {};
inline GradGather grad_gather() { return {}; }
#if defined(__AVX2__)
ET_ALWAYS_INLINE inline V16 halves(const Half8& lo, const Half8& hi) { return {lo, hi}; }
#else
ET_ALWAYS_INLINE inline V16 halves(const Half8& lo, const Half8& hi) { return {{lo.a, lo.b, hi.a, hi.b}}; }
#endif
ET_ALWAYS_INLINE inline void grad_transform_plane(const GradGather&, int64_t side, const float* dy, float* w,
                                                  int64_t stride) {
  if (side == 8) {  // group tr of a, b: the even, odd columns of row 2 tr; of c, d: of row 2 tr + 1
    Quad e[8], o[8];
    for (int h = 0; h < 8; ++h) split_row8(dy + 8 * h, e[h], o[h]);
    return grad_tile_transform(from_quads(e[0], e[2], e[4], e[6]), from_quads(o[0], o[2], o[4], o[6]),
                               from_quads(e[1], e[3], e[5], e[7]), from_quads(o[1], o[3], o[5], o[7]), w, stride);
  }
  const int64_t vectors = side == 16 ? 4 : 16;
  for (int64_t v = 0; v < vectors; ++v) {
    const float* r = dy + 64 * v;
    V16 a, b, c, d;
    if (side == 16) {
      Half8 e[4], o[4];  // rows 4p .. 4p + 3
      for (int i = 0; i < 4; ++i) deinterleave8(r + 16 * i, e[i], o[i]);
      a = halves(e[0], e[2]), b = halves(o[0], o[2]), c = halves(e[1], e[3]), d = halves(o[1], o[3]);
    } else {
      deinterleave16(r, a, b);
      deinterleave16(r + 32, c, d);
    }
    grad_tile_transform(a, b, c, d, w + v * 16, stride);
  }
}
#endif

// V of one input plane x [side, side] (16x16, 32x32: through this thread's placed rows, whose
// padding rows stay zero), its vectors in consecutive slots from v; stride: the next domain point's.
ET_ALWAYS_INLINE inline void input_transform_plane(int64_t side, const float* x, float* placed, float* v,
                                                   int64_t stride) {
  if (side == 16) {
    place_columns16(x, placed);
    for (int64_t p = 0; p < 4; ++p) input_transform_one(placed + 4 * p * kRowFloats, v + p * 16, stride);
    return;
  }
  place_columns(x, placed);
  for (int64_t tr = 0; tr < 16; tr += 2) input_transform_pair(placed, tr, v + tr * 16, stride);
}

#if defined(__AVX512F__)
// s[i] = the sum of a[i]'s 16 lanes, for 16 vectors at once: pairs interleaved and added within
// 128-bit lanes, then quads, then the four 128-bit lanes across.
// (Zeroing forms with every lane set: GCC 12 warns about the plain forms' undefined pass-through.)
ET_ALWAYS_INLINE inline __m512 lane_sums16(const __m512 (&a)[16]) {
  constexpr __mmask16 kAll = 0xFFFF;
  __m512 t[8], u[4];
  for (int p = 0; p < 8; ++p)  // per 128-bit lane: a[2p] in positions 0, 2, a[2p + 1] in 1, 3
    t[p] = _mm512_add_ps(_mm512_maskz_unpacklo_ps(kAll, a[2 * p], a[2 * p + 1]), _mm512_maskz_unpackhi_ps(kAll, a[2 * p], a[2 * p + 1]));
  for (int q = 0; q < 4; ++q)  // per 128-bit lane: the lane's sums of a[4q .. 4q + 3]
    u[q] = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, t[2 * q], t[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_maskz_shuffle_ps(kAll, t[2 * q], t[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z01 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_maskz_shuffle_f32x4(kAll, u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z23 = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_maskz_shuffle_f32x4(kAll, u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_maskz_shuffle_f32x4(kAll, z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// px[k][c] += sum over the chunk's first nv vectors (of vecs a channel) of wx[k][b] . vx[c][b],
// lanes summed, for the block of 4 output x 4 input channels at (k0, c0).
constexpr int kKB = 4, kCB = 4;
ET_ALWAYS_INLINE inline void block_products(const float* vx, const float* wx, int64_t vecs, int64_t nv, int64_t k0,
                                            int64_t c0, int64_t C, float* px) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nv; ++b) {
    __m512 wv[4], vv[4];
    // Each in a register: GCC otherwise folds one side's loads into the multiply-adds, 20
    // loads for 16 of them instead of 8 (perf, session 48).
    for (int i = 0; i < 4; ++i) {
      wv[i] = _mm512_load_ps(wx + ((k0 + i) * vecs + b) * 16);
      asm("" : "+v"(wv[i]));
    }
    for (int j = 0; j < 4; ++j) {
      vv[j] = _mm512_load_ps(vx + ((c0 + j) * vecs + b) * 16);
      asm("" : "+v"(vv[j]));
    }
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc[4 * i + j] = _mm512_fmadd_ps(wv[i], vv[j], acc[4 * i + j]);
  }
  const __m512 s = lane_sums16(acc);  // s[4i + j]: output channel k0 + i, input channel c0 + j
  alignas(64) float sums[16];
  _mm512_store_ps(sums, s);
  for (int i = 0; i < 4; ++i) {
    float* row = px + (k0 + i) * C + c0;
    _mm_storeu_ps(row, _mm_add_ps(_mm_loadu_ps(row), _mm_load_ps(sums + 4 * i)));
  }
}

#else
// Narrow vectors: a vector of tiles is P native vectors (AVX2: 2 ymm, NEON: 4 q), all P added into
// the same accumulators; blocks of KB output x CB input channels (AVX2 4 x 2: 8 accumulators and
// 6 loads for 8 multiply-adds; NEON 4 x 4: 16 and 8 for 16), each accumulator's lanes summed
// once per chunk. (Not AVX-512's order of sums: deterministic, within the forward's tolerance.)
#if defined(__AVX2__)
using Native = __m256;
constexpr int kParts = 2, kCB = 2;
ET_ALWAYS_INLINE inline Native nload(const float* p) { return _mm256_loadu_ps(p); }
ET_ALWAYS_INLINE inline Native nzero() { return _mm256_setzero_ps(); }
ET_ALWAYS_INLINE inline Native nfma(Native a, Native b, Native c) { return _mm256_fmadd_ps(a, b, c); }
ET_ALWAYS_INLINE inline float nsum(Native v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#else
using Native = float32x4_t;
constexpr int kParts = 4, kCB = 4;
ET_ALWAYS_INLINE inline Native nload(const float* p) { return vld1q_f32(p); }
ET_ALWAYS_INLINE inline Native nzero() { return vdupq_n_f32(0.f); }
ET_ALWAYS_INLINE inline Native nfma(Native a, Native b, Native c) { return vfmaq_f32(c, a, b); }
ET_ALWAYS_INLINE inline float nsum(Native v) { return vaddvq_f32(v); }
#endif
constexpr int kKB = 4, kLanes = 16 / kParts;

ET_ALWAYS_INLINE inline void block_products(const float* vx, const float* wx, int64_t vecs, int64_t nv, int64_t k0,
                                            int64_t c0, int64_t C, float* px) {
  Native acc[kKB][kCB];
  for (int i = 0; i < kKB; ++i)
    for (int j = 0; j < kCB; ++j) acc[i][j] = nzero();
  for (int64_t b = 0; b < nv; ++b)
    for (int h = 0; h < kParts; ++h) {
      Native wv[kKB], vv[kCB];
      for (int i = 0; i < kKB; ++i) wv[i] = nload(wx + ((k0 + i) * vecs + b) * 16 + h * kLanes);
      for (int j = 0; j < kCB; ++j) vv[j] = nload(vx + ((c0 + j) * vecs + b) * 16 + h * kLanes);
      for (int i = 0; i < kKB; ++i)
        for (int j = 0; j < kCB; ++j) acc[i][j] = nfma(wv[i], vv[j], acc[i][j]);
    }
  for (int i = 0; i < kKB; ++i)
    for (int j = 0; j < kCB; ++j) px[(k0 + i) * C + c0 + j] += nsum(acc[i][j]);
}
#endif

// part[xi][k][c] += sum over the chunk's first nv vectors (of s.vecs a channel) of W[xi][k][b] .
// V[xi][c][b], lanes summed; by blocks of kKB output x kCB input channels (block_products).
void chunk_products(const WgradShape& s, const float* v, const float* w, int64_t C, int64_t K, int64_t nv,
                    float* part) {
  for (int xi = 0; xi < 16; ++xi) {
    const float* vx = v + xi * s.v_stride(C);
    const float* wx = w + xi * s.v_stride(K);
    float* px = part + xi * K * C;
    for (int64_t k0 = 0; k0 < K; k0 += kKB)
      for (int64_t c0 = 0; c0 < C; c0 += kCB) block_products(vx, wx, s.vecs, nv, k0, c0, C, px);
  }
}

// The sum of a gradient plane's HW elements (a multiple of 16), for db.
inline float plane_sum(const float* p, int64_t HW) {
  V16 s = wrows::vsplat(0.f);
  for (int64_t i = 0; i < HW; i += 16) s = wrows::vadd(s, wrows::vloadu(p + i));
  alignas(64) float lanes[16];  // (not _mm512_reduce_add_ps: GCC 12 warns of an uninitialised operand)
  wrows::vstore(lanes, s);
  float sum = 0.f;
  for (float f : lanes) sum += f;
  return sum;
}
#endif

}  // namespace

bool winograd_wgrad_rows_applies(const Conv2dGeom& g) {
#if defined(ET_WINOGRAD_ROWS)
  return g.groups == 1 && g.R == 3 && g.S == 3 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 1 &&
         g.pad_w == 1 && (g.W == 8 || g.W == 16 || g.W == 32) && g.H == g.W && g.P == g.W && g.Q == g.W &&
         g.C > 0 && g.K > 0 && g.C % 4 == 0 && g.K % 4 == 0 &&
         g.C * g.K <= 128 * 128;  // V and W of a chunk: 4 MiB a thread at 128 x 128 (16 vectors)
#else
  (void)g;
  return false;
#endif
}

size_t winograd_wgrad_rows_workspace(const Conv2dGeom& g, int threads) {
  return size_t(threads) * wgrad_layout(g).thread_bytes;
}

void winograd_wgrad_rows(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                         bool accumulate, void* ws) {
  ET_CHECK(winograd_wgrad_rows_applies(g), "winograd rows: weight gradient of this geometry");
#if defined(ET_WINOGRAD_ROWS)
  const WgradShape s = wgrad_shape(g);
  const WgradLayout l = wgrad_layout(g);
  const int64_t C = g.C, K = g.K, KC = K * C, HW = s.side * s.side, vecs = s.vecs;
  const Gather8 t8 = gather8();
  const GradGather gg = grad_gather();
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Carve carve(static_cast<uint8_t*>(ws) + size_t(t) * l.thread_bytes);
    float* v = carve.take<float>(l.v_n);
    float* w = carve.take<float>(l.w_n);
    float* part = carve.take<float>(l.part_n);
    float* plane = carve.take<float>(l.plane_n);
    float* placed = carve.take<float>(l.placed_n);
    std::memset(placed, 0, sizeof(float) * size_t(l.placed_n));  // the padding rows stay zero
    StoredReader xr(x, plane, l.plane_n);
    std::memset(part, 0, sizeof(float) * size_t(l.part_n));
    const int64_t n0 = g.N * t / nt, n1 = g.N * (t + 1) / nt;
    for (int64_t nc = n0; nc < n1; nc += s.images) {
      const int64_t nb = std::min(s.images, n1 - nc);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n = nc + b, slot = b * s.per_plane;
        if (s.side == 8) {
          const float* xn = xr.read(n * C * 64, C * 64);
          for (int64_t c = 0; c < C; ++c) input_transform8(t8, xn + c * 64, v + (c * vecs + slot) * 16, s.v_stride(C));
        } else {
          for (int64_t c = 0; c < C; ++c)
            input_transform_plane(s.side, xr.read((n * C + c) * HW, HW), placed, v + (c * vecs + slot) * 16,
                                  s.v_stride(C));
        }
        const float* dyn = dy + n * K * HW;
        for (int64_t k = 0; k < K; ++k)
          grad_transform_plane(gg, s.side, dyn + k * HW, w + (k * vecs + slot) * 16, s.v_stride(K));
        if (db)
          for (int64_t k = 0; k < K; ++k) part[16 * KC + k] += plane_sum(dyn + k * HW, HW);
      }
      chunk_products(s, v, w, C, K, nb * s.per_plane, part);
    }
#pragma omp barrier
    // dw[k][c] = G^T M G of M = the threads' partials added in thread order; each thread a slice.
    // Thread u's partials: at the offset this thread's have in its part (thread_bytes: whole 64s).
    const size_t part_offset = size_t(reinterpret_cast<uint8_t*>(part) - static_cast<uint8_t*>(ws)) -
                               size_t(t) * l.thread_bytes;
    const auto part_of = [&](int u) {
      return reinterpret_cast<const float*>(static_cast<uint8_t*>(ws) + size_t(u) * l.thread_bytes + part_offset);
    };
    const int64_t i0 = KC * t / nt, i1 = KC * (t + 1) / nt;
    for (int64_t i = i0; i < i1; ++i) {
      double m[4][4] = {};
      for (int u = 0; u < nt; ++u) {
        const float* p = part_of(u);
        for (int xi = 0; xi < 16; ++xi) m[xi / 4][xi % 4] += double(p[xi * KC + i]);
      }
      double tm[3][4];  // G^T M
      for (int b = 0; b < 4; ++b) {
        tm[0][b] = m[0][b] + 0.5 * (m[1][b] + m[2][b]);
        tm[1][b] = 0.5 * (m[1][b] - m[2][b]);
        tm[2][b] = 0.5 * (m[1][b] + m[2][b]) + m[3][b];
      }
      float* d = dw + i * 9;  // i = k * C + c: dw[k][c][r][s]
      for (int r = 0; r < 3; ++r) {
        const double g3[3] = {tm[r][0] + 0.5 * (tm[r][1] + tm[r][2]), 0.5 * (tm[r][1] - tm[r][2]),
                              0.5 * (tm[r][1] + tm[r][2]) + tm[r][3]};
        for (int c = 0; c < 3; ++c) d[r * 3 + c] = accumulate ? d[r * 3 + c] + float(g3[c]) : float(g3[c]);
      }
    }
    if (db && t == 0)
      for (int64_t k = 0; k < K; ++k) {
        float sum = 0.f;
        for (int u = 0; u < nt; ++u) sum += part_of(u)[16 * KC + k];
        db[k] = accumulate ? db[k] + sum : sum;
      }
  }
#else
  (void)x, (void)dy, (void)dw, (void)db, (void)accumulate, (void)ws;
#endif
}

}  // namespace et::cpu
