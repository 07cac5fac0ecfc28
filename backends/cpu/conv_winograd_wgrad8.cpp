// Winograd F(2x2, 3x3) weight gradient of 3x3 stride-1 pad-1 convs on 8x8 planes (ResNet-20's
// third stage), AVX-512, by vectors of tiles as conv_winograd_rows.cpp's forward: a vector holds
// one plane's 16 tiles.
//
// The forward is Y = A^T [(G g G^T) . (B^T d B)] A per tile; its transpose gives the weight
// gradient as
//   dg = G^T M G,   M[xi] = sum over images and tiles of W[xi] * V[xi],
//   V = B^T d B (the forward's input transform, input_transform8), W = A dY A^T (dY: the tile's
//   2 x 2 output gradients; adds only),
// 16 products a tile and pair of channels against the direct kernels' 36.
//
// The sum over tiles runs along the vectors' lanes: per domain point xi and block of 4 output x 4
// input channels, 16 accumulators take the products of a chunk of images, then one transposing
// add tree (lane_sums16) turns the 16 vectors into their 16 lane sums, added into the thread's
// partial M. The threads split the batch; their partials are added in thread order and
// transformed (G^T M G) in double: deterministic for a given thread count, not the direct
// kernels' bits (tolerance, as for the forward).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/carve.h"
#include "backends/cpu/conv_winograd.h"
#include "backends/cpu/conv_winograd_rows.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

constexpr int64_t kImages = 8;  // per chunk: the lanes' sums are taken once per chunk

struct Wgrad8Layout {
  int64_t v_n, w_n, part_n, plane_n;
  size_t thread_bytes;
};

// Per thread: V [16][C][kImages] and W [16][K][kImages] vectors of a chunk, the partial M
// [16][K][C] and db [K], and one decoded input image.
Wgrad8Layout wgrad8_layout(const Conv2dGeom& g) {
  Wgrad8Layout l;
  l.v_n = 16 * g.C * kImages * 16;
  l.w_n = 16 * g.K * kImages * 16;
  l.part_n = 16 * g.K * g.C + g.K;
  l.plane_n = g.C * 64;
  // A multiple of 64 bytes: every thread's pieces then lie at the same offsets in its part.
  const size_t bytes = CarveSize().add<float>(l.v_n).add<float>(l.w_n).add<float>(l.part_n).add<float>(l.plane_n).bytes;
  l.thread_bytes = (bytes + 63) / 64 * 64;
  return l;
}

#if defined(__AVX512F__)
// W = A dY A^T of an 8x8 gradient plane's 16 tiles into w + xi * stride. Tile (tr, q) (lane
// 4 tr + q) covers rows 2tr, 2tr + 1 and columns 2q, 2q + 1: its four values a b / c d come from
// vector tr of the plane (rows 2tr in elements 0-7, 2tr + 1 in 8-15) by one permute per pair of
// vectors and a blend.
struct Scatter8 {
  alignas(64) int32_t idx[4][16];  // a, b, c, d: lane L's element of vectors (0, 1) / (2, 3)
};
Scatter8 scatter8() {
  Scatter8 s{};
  for (int v = 0; v < 4; ++v)
    for (int L = 0; L < 16; ++L) {
      const int tr = L / 4, q = L % 4, off = (v >= 2 ? 8 : 0) + 2 * q + (v & 1);
      s.idx[v][L] = (tr % 2) * 16 + off;
    }
  return s;
}

ET_ALWAYS_INLINE inline void grad_transform8(const Scatter8& s, const float* dy, float* w, int64_t stride) {
  const __m512 r0 = _mm512_loadu_ps(dy), r1 = _mm512_loadu_ps(dy + 16), r2 = _mm512_loadu_ps(dy + 32),
               r3 = _mm512_loadu_ps(dy + 48);
  __m512 e[4];  // a, b, c, d
  for (int v = 0; v < 4; ++v) {
    const __m512i idx = _mm512_load_si512(s.idx[v]);
    e[v] = _mm512_mask_mov_ps(_mm512_permutex2var_ps(r0, idx, r1), __mmask16(0xFF00), _mm512_permutex2var_ps(r2, idx, r3));
  }
  // Down the rows (A: [x0, x0 + x1, x0 - x1, -x1]), then along them.
  const __m512 zero = _mm512_setzero_ps();
  const __m512 rows[4][2] = {{e[0], e[1]},
                             {_mm512_add_ps(e[0], e[2]), _mm512_add_ps(e[1], e[3])},
                             {_mm512_sub_ps(e[0], e[2]), _mm512_sub_ps(e[1], e[3])},
                             {_mm512_sub_ps(zero, e[2]), _mm512_sub_ps(zero, e[3])}};
  for (int a = 0; a < 4; ++a) {
    const __m512 x = rows[a][0], y = rows[a][1];
    _mm512_store_ps(w + (4 * a + 0) * stride, x);
    _mm512_store_ps(w + (4 * a + 1) * stride, _mm512_add_ps(x, y));
    _mm512_store_ps(w + (4 * a + 2) * stride, _mm512_sub_ps(x, y));
    _mm512_store_ps(w + (4 * a + 3) * stride, _mm512_sub_ps(zero, y));
  }
}

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

// part[xi][k][c] += sum over the chunk's nb images of W[xi][k][b] . V[xi][c][b], lanes summed;
// blocks of 4 output x 4 input channels.
void chunk_products(const float* v, const float* w, int64_t C, int64_t K, int64_t nb, float* part) {
  for (int xi = 0; xi < 16; ++xi) {
    const float* vx = v + xi * C * kImages * 16;
    const float* wx = w + xi * K * kImages * 16;
    float* px = part + xi * K * C;
    for (int64_t k0 = 0; k0 < K; k0 += 4)
      for (int64_t c0 = 0; c0 < C; c0 += 4) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
          __m512 wv[4], vv[4];
          for (int i = 0; i < 4; ++i) wv[i] = _mm512_load_ps(wx + ((k0 + i) * kImages + b) * 16);
          for (int j = 0; j < 4; ++j) vv[j] = _mm512_load_ps(vx + ((c0 + j) * kImages + b) * 16);
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
  }
}
#endif

}  // namespace

bool winograd_wgrad8_applies(const Conv2dGeom& g) {
#if defined(__AVX512F__)
  return g.groups == 1 && g.R == 3 && g.S == 3 && g.stride_h == 1 && g.stride_w == 1 && g.pad_h == 1 &&
         g.pad_w == 1 && g.H == 8 && g.W == 8 && g.P == 8 && g.Q == 8 && g.C > 0 && g.K > 0 && g.C % 4 == 0 &&
         g.K % 4 == 0 && g.C * g.K <= 128 * 128;  // V and W of a chunk: 4 MiB a thread at 128 x 128
#else
  (void)g;
  return false;
#endif
}

size_t winograd_wgrad8_workspace(const Conv2dGeom& g, int threads) {
  return size_t(threads) * wgrad8_layout(g).thread_bytes;
}

void winograd_wgrad8(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db, bool accumulate,
                     void* ws) {
  ET_CHECK(winograd_wgrad8_applies(g), "winograd rows: weight gradient of this geometry");
#if defined(__AVX512F__)
  const Wgrad8Layout l = wgrad8_layout(g);
  const int64_t C = g.C, K = g.K, KC = K * C;
  const Gather8 t8 = gather8();
  const Scatter8 s8 = scatter8();
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Carve carve(static_cast<uint8_t*>(ws) + size_t(t) * l.thread_bytes);
    float* v = carve.take<float>(l.v_n);
    float* w = carve.take<float>(l.w_n);
    float* part = carve.take<float>(l.part_n);
    float* plane = carve.take<float>(l.plane_n);
    StoredReader xr(x, plane, C * 64);
    std::memset(part, 0, sizeof(float) * size_t(l.part_n));
    const int64_t n0 = g.N * t / nt, n1 = g.N * (t + 1) / nt;
    for (int64_t nc = n0; nc < n1; nc += kImages) {
      const int64_t nb = std::min(kImages, n1 - nc);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n = nc + b;
        const float* xn = xr.read(n * C * 64, C * 64);
        for (int64_t c = 0; c < C; ++c) input_transform8(t8, xn + c * 64, v + (c * kImages + b) * 16, C * kImages * 16);
        const float* dyn = dy + n * K * 64;
        for (int64_t k = 0; k < K; ++k) grad_transform8(s8, dyn + k * 64, w + (k * kImages + b) * 16, K * kImages * 16);
        if (db)
          for (int64_t k = 0; k < K; ++k) {
            float s = 0.f;
            for (int i = 0; i < 64; ++i) s += dyn[k * 64 + i];
            part[16 * KC + k] += s;
          }
      }
      chunk_products(v, w, C, K, nb, part);
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
        for (int s = 0; s < 3; ++s) d[r * 3 + s] = accumulate ? d[r * 3 + s] + float(g3[s]) : float(g3[s]);
      }
    }
    if (db && t == 0)
      for (int64_t k = 0; k < K; ++k) {
        float s = 0.f;
        for (int u = 0; u < nt; ++u) s += part_of(u)[16 * KC + k];
        db[k] = accumulate ? db[k] + s : s;
      }
  }
#else
  (void)x, (void)dy, (void)dw, (void)db, (void)accumulate, (void)ws;
#endif
}

}  // namespace et::cpu
