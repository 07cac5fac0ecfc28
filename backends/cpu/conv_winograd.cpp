// Winograd F(2x2, 3x3) for dense 3x3 stride-1 convs: forward and data gradient here, the weight
// gradient (its transpose, F(3x3, 2x2)) further down (see conv_winograd.h).
//
// Output 2x2 tiles; tile t reads a 4x4 input patch d and, per channel pair (o, c),
//   y_tile = A^T [ sum_c (G g G^T) .* (B^T d B) ] A
// so the 16 element-wise products become 16 independent GEMMs (xi = 0..15 of the 4x4 domain):
//   M_xi [tiles, Co] = V_xi [tiles, Ci] x U_xi [Ci, Co],   V = B^T d B,  U = G g G^T
// 16 x Ci x Co multiply-adds per tile instead of 36 x Ci x Co: 2.25x fewer flops. The data
// gradient is the same correlation over dy padded by 2 - pad with the kernel flipped and transposed.
//
// Layout: U is packed once per call straight into the SGEMM's B slivers (output channels along
// the vector). Per chunk of images, the input is copied channels-last (8 channels per vector in
// the transform), V goes straight into the SGEMM's A slivers (tiles x channels, 8x8 transposes),
// and the output transform reads M [tiles][Co] with output channels along the vector. Chunks are
// independent (one thread each; a tile's result does not depend on its chunk), so any schedule
// gives the same bits. Transforms use only 0, +-1, +-1/2: F(2x2, 3x3) keeps float32 accuracy.
#include "backends/cpu/conv_winograd.h"
#include "backends/cpu/fused_elementwise.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_implicit.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/gemm.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

constexpr int64_t kTileTarget = 256;      // tiles per chunk
constexpr int64_t kPanelFloats = 1 << 15;  // tiles x Ci of one V panel (128 KiB): bounds the chunk for wide layers
constexpr int64_t kUBlockFloats = 1 << 16;  // Ci x output channels of U per GEMM call (256 KiB, L2)
constexpr int kMaxMR = 16, kMaxNR = 32;    // bounds over the tiles of sgemm_tile(), for sizing

float* align64(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
struct Carve {
  float* p;
  float* take(int64_t n) { float* r = align64(p); p = r + n; return r; }
};

struct Wino {
  int64_t N, Ci, Hi, Wi, ph, pw, Co, Ho, Wo;
  int64_t th, tw, Hp, Wp;  // tiles per image (rows, columns); padded channels-last image [Hp][Wp][Ci]
  int64_t TI() const { return th * tw; }
  int64_t img() const { return Hp * Wp * Ci; }
};

Wino make_wino(int64_t N, int64_t Ci, int64_t Hi, int64_t Wi, int64_t ph, int64_t pw, int64_t Co, int64_t Ho,
               int64_t Wo) {
  const int64_t th = (Ho + 1) / 2, tw = (Wo + 1) / 2;
  return Wino{N, Ci, Hi, Wi, ph, pw, Co, Ho, Wo, th, tw, 2 * th + 2, 2 * tw + 2};
}
Wino fwd_wino(const Conv2dGeom& g) { return make_wino(g.N, g.C, g.H, g.W, g.pad_h, g.pad_w, g.K, g.P, g.Q); }
Wino data_wino(const Conv2dGeom& g) { return make_wino(g.N, g.K, g.P, g.Q, 2 - g.pad_h, 2 - g.pad_w, g.C, g.H, g.W); }

struct Layout {
  int64_t nb, tiles, u_n, xn_n, v_n, m_n, per_thread;
};

Layout layout(const Wino& w, int threads) {
  Layout l;
  const int64_t target = std::min(kTileTarget, std::max<int64_t>(32, kPanelFloats / w.Ci));
  l.nb = std::clamp<int64_t>(target / w.TI(), 1, (w.N + threads - 1) / threads);
  l.tiles = l.nb * w.TI();
  l.u_n = 16 * w.Ci * (w.Co + kMaxNR);
  l.xn_n = l.nb * w.img();
  l.v_n = 16 * (l.tiles + kMaxMR) * w.Ci;
  l.m_n = 16 * l.tiles * w.Co;
  l.per_thread = l.xn_n + l.v_n + l.m_n + (16 * 64 + 128) + 4 * 16;  // + scratch + alignment of 4 pieces
  return l;
}

// U_xi = G g G^T packed as NR-column slivers [Ci][NR] (columns = output channels, zero past Co),
// panel xi at up + xi * Ci * round_up(Co, NR). Forward: g(o, c) = w[o][c]; flip (data gradient):
// g(o, c) = w[c][o] rotated by 180 degrees. 16 output channels o0.. at a time, one per lane, so
// that the transform vectorises and every store is 16 contiguous floats (a kernel at a time, with
// 16 stores a panel apart, was 8 ms per call on 512x512 layers).
void pack_kernels(const Wino& w, const float* wt, bool flip, int NR, int64_t o0, float* up) {
  const int64_t CoR = round_up(w.Co, NR), Ci = w.Ci, n = std::min<int64_t>(16, w.Co - o0);
  for (int64_t c = 0; c < Ci; ++c) {
    float k[3][3][16], t[4][3][16], u[16][16];
    for (int64_t l = 0; l < 16; ++l) {
      const float* g = l < n ? wt + (flip ? c * w.Co + o0 + l : (o0 + l) * Ci + c) * 9 : nullptr;
      for (int r = 0; r < 3; ++r)
        for (int s = 0; s < 3; ++s) k[r][s][l] = g ? (flip ? g[(2 - r) * 3 + (2 - s)] : g[r * 3 + s]) : 0.f;
    }
    for (int s = 0; s < 3; ++s)
      for (int l = 0; l < 16; ++l) {
        t[0][s][l] = k[0][s][l];
        t[1][s][l] = 0.5f * (k[0][s][l] + k[1][s][l] + k[2][s][l]);
        t[2][s][l] = 0.5f * (k[0][s][l] - k[1][s][l] + k[2][s][l]);
        t[3][s][l] = k[2][s][l];
      }
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 16; ++l) {
        u[i * 4 + 0][l] = t[i][0][l];
        u[i * 4 + 1][l] = 0.5f * (t[i][0][l] + t[i][1][l] + t[i][2][l]);
        u[i * 4 + 2][l] = 0.5f * (t[i][0][l] - t[i][1][l] + t[i][2][l]);
        u[i * 4 + 3][l] = t[i][2][l];
      }
    float* d = up + ((o0 / NR) * Ci + c) * NR + o0 % NR;
    for (int xi = 0; xi < 16; ++xi) std::memcpy(d + xi * Ci * CoR, u[xi], sizeof(float) * 16);
  }
}

// V = B^T d B for 8 channels of one tile: d points at the patch's top-left element of a
// channels-last image (row stride Wp*Ci); cb <= 8 channels, v [16][8].
inline void input_transform(const float* d, int64_t ci, int64_t row, int64_t cb, float (*v)[8]) {
  float e[4][4][8];
  for (int s = 0; s < 4; ++s) {
    const float* p0 = d + s * ci;
    float x[4][8];
    if (cb == 8) {  // the common case, branch-free so that it vectorises
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 8; ++c) x[r][c] = p0[r * row + c];
    } else {
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 8; ++c) x[r][c] = c < cb ? p0[r * row + c] : 0.f;
    }
    for (int c = 0; c < 8; ++c) {
      e[0][s][c] = x[0][c] - x[2][c];
      e[1][s][c] = x[1][c] + x[2][c];
      e[2][s][c] = x[2][c] - x[1][c];
      e[3][s][c] = x[1][c] - x[3][c];
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 8; ++c) {
      v[r * 4 + 0][c] = e[r][0][c] - e[r][2][c];
      v[r * 4 + 1][c] = e[r][1][c] + e[r][2][c];
      v[r * 4 + 2][c] = e[r][2][c] - e[r][1][c];
      v[r * 4 + 3][c] = e[r][1][c] - e[r][3][c];
    }
}

// V panels of a chunk: panel xi at vp + xi * round_up(tiles, MR) * Ci, MR-row slivers [Ci][MR]
// (rows = tiles). With MR == 8, 8 tiles x 8 channels go through one 8x8 transpose per xi.
void transform_inputs(const Wino& w, const float* xn, int64_t tiles, int MR, float* vp, float* scratch) {
  const int64_t Ci = w.Ci, TR = round_up(tiles, MR), row = w.Wp * Ci, panel = TR * Ci;
  float(*v)[8] = reinterpret_cast<float(*)[8]>(scratch);  // [16][8]
  for (int64_t t0 = 0; t0 < tiles; t0 += MR) {
    const int64_t mt = std::min<int64_t>(MR, tiles - t0);
    for (int64_t c0 = 0; c0 < Ci; c0 += 8) {
      const int64_t cb = std::min<int64_t>(8, Ci - c0);
      float* dst = vp + (t0 / MR * Ci + c0) * MR;
      const bool block = MR == 8 && mt == 8 && cb == 8;
      for (int64_t i = 0; i < mt; ++i) {
        const int64_t t = t0 + i, b = t / w.TI(), ti = (t % w.TI()) / w.tw, tj = t % w.tw;
        input_transform(xn + b * w.img() + (2 * ti * w.Wp + 2 * tj) * Ci + c0, Ci, row, cb, v);
        if (block) {  // stage [xi][tile][8 channels], transposed below
          for (int xi = 0; xi < 16; ++xi) std::memcpy(scratch + 128 + (xi * 8 + i) * 8, v[xi], sizeof(float) * 8);
        } else {
          for (int xi = 0; xi < 16; ++xi)
            for (int64_t c = 0; c < cb; ++c) dst[xi * panel + c * MR + i] = v[xi][c];
        }
      }
      if (block)
        for (int xi = 0; xi < 16; ++xi) transpose8x8(scratch + 128 + xi * 64, 8, dst + xi * panel, 8);
    }
  }
}

// y tile = A^T m A for the chunk's tiles, output channels in blocks of 16 along the vector;
// m panel xi at mb + xi * tiles * Co ([tiles][Co]). Writes NCHW out (+ bias, += when accumulating).
void transform_outputs(const Wino& w, const float* mb, int64_t tiles, int64_t n0, const float* bias, bool accumulate,
                       float* out) {
  const int64_t Co = w.Co, PQ = w.Ho * w.Wo, panel = tiles * Co;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t / w.TI(), ti = (t % w.TI()) / w.tw, tj = t % w.tw;
    const int64_t p0 = 2 * ti, q0 = 2 * tj;
    const bool full = p0 + 1 < w.Ho && q0 + 1 < w.Wo;
    float* ob = out + (n0 + b) * Co * PQ + p0 * w.Wo + q0;
    for (int64_t o0 = 0; o0 < Co; o0 += 16) {
      const int64_t ob_n = std::min<int64_t>(16, Co - o0);
      float q[2][4][16], y[2][2][16], m[4][16];
      for (int s = 0; s < 4; ++s) {
        for (int r = 0; r < 4; ++r) {
          const float* src = mb + (r * 4 + s) * panel + t * Co + o0;
          if (ob_n == 16) std::memcpy(m[r], src, sizeof(float) * 16);  // branch-free loads in the common case
          else
            for (int c = 0; c < 16; ++c) m[r][c] = c < ob_n ? src[c] : 0.f;
        }
        for (int c = 0; c < 16; ++c) {
          q[0][s][c] = m[0][c] + m[1][c] + m[2][c];
          q[1][s][c] = m[1][c] - m[2][c] - m[3][c];
        }
      }
      for (int a = 0; a < 2; ++a)
        for (int c = 0; c < 16; ++c) {
          y[a][0][c] = q[a][0][c] + q[a][1][c] + q[a][2][c];
          y[a][1][c] = q[a][1][c] - q[a][2][c] - q[a][3][c];
        }
      if (bias)
        for (int a = 0; a < 2; ++a)
          for (int e = 0; e < 2; ++e)
            for (int64_t c = 0; c < ob_n; ++c) y[a][e][c] += bias[o0 + c];
      float* d = ob + o0 * PQ;
      if (full && !accumulate) {
        for (int64_t c = 0; c < ob_n; ++c, d += PQ) {
          d[0] = y[0][0][c];
          d[1] = y[0][1][c];
          d[w.Wo] = y[1][0][c];
          d[w.Wo + 1] = y[1][1][c];
        }
        continue;
      }
      for (int64_t c = 0; c < ob_n; ++c, d += PQ)
        for (int a = 0; a < 2; ++a)
          for (int e = 0; e < 2; ++e) {
            if (p0 + a >= w.Ho || q0 + e >= w.Wo) continue;
            float& r = d[a * w.Wo + e];
            r = accumulate ? r + y[a][e][c] : y[a][e][c];
          }
    }
  }
}

size_t workspace(const Wino& w, int threads) {
  const Layout l = layout(w, threads);
  return size_t(l.u_n + 16 + threads * l.per_thread) * sizeof(float);
}

// in: the input images (the forward's ConvInput: where x is a fused stack's output, computed from
// the stack's input as each image is copied channels-last).
void run(const Wino& w, const ConvInput& in, const float* wt, bool flip, const float* bias, float* out,
         bool accumulate, void* ws, float* sum1 = nullptr, float* sum2 = nullptr,
         const DzSumsEpilogue* dz_sums = nullptr) {
  const GemmTile tile = sgemm_tile();
  const int MR = tile.mr, NR = tile.nr;
  const int threads = omp_get_max_threads();
  const Layout l = layout(w, threads);
  const int64_t CoR = round_up(w.Co, NR), chunks = (w.N + l.nb - 1) / l.nb;
  Carve shared{static_cast<float*>(ws)};
  float* up = shared.take(l.u_n);
  float* thread_base = shared.p;
#pragma omp parallel num_threads(threads)
  {
    Carve cv{thread_base + omp_get_thread_num() * l.per_thread};
    float* xn = cv.take(l.xn_n);
    float* vp = cv.take(l.v_n);
    float* mb = cv.take(l.m_n);
    float* scratch = cv.take(16 * 64 + 128);
    std::memset(xn, 0, sizeof(float) * size_t(l.xn_n));  // padding stays zero; interiors are overwritten
#pragma omp for schedule(static)
    for (int64_t o = 0; o < CoR; o += 16) pack_kernels(w, wt, flip, NR, o, up);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const int64_t n0 = ch * l.nb, nb = std::min(l.nb, w.N - n0), tiles = nb * w.TI();
      for (int64_t b = 0; b < nb; ++b)
        to_channels_last(in.planes + (n0 + b) * w.Ci * w.Hi * w.Wi, w.Ci, w.Hi, w.Wi, w.ph, w.pw, w.Hp, w.Wp,
                         xn + b * w.img(), in.stack);
      transform_inputs(w, xn, tiles, MR, vp, scratch);
      // Output channels in blocks whose U slivers stay in L2 while every tile sliver passes over
      // them (a whole U_xi is 1 MiB at 512 channels: streaming it from L3 per 8 tiles halved the
      // speed of the 4x4 layers).
      const int64_t vpanel = round_up(tiles, MR) * w.Ci, ncb = std::max<int64_t>(NR, kUBlockFloats / w.Ci / NR * NR);
      for (int xi = 0; xi < 16; ++xi)
        for (int64_t j0 = 0; j0 < w.Co; j0 += ncb)
          sgemm_packed(tiles, std::min(ncb, w.Co - j0), w.Ci, vp + xi * vpanel, MR * w.Ci, up + xi * w.Ci * CoR + j0 * w.Ci,
                       false, mb + xi * tiles * w.Co + j0, w.Co);
      transform_outputs(w, mb, tiles, n0, bias, accumulate, out);
      if (sum1)  // the chunk's planes, still in this core's cache
        for (int64_t pl = n0 * w.Co; pl < (n0 + nb) * w.Co; ++pl)
          bn_rows::plane_sums(out + pl * w.Ho * w.Wo, w.Ho * w.Wo, sum1 + pl, sum2 + pl);
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
      if (dz_sums) fused_elementwise::dz_sums_images(*dz_sums, n0, n0 + nb, w.Co, w.Ho * w.Wo, out);
#endif
    }
  }
}

// ---------------------------------------------------------------- weight gradient
// Transposing the forward identity y = A^T [(G g) .* (B^T d)] gives, per 2x2 tile of dy and its
// 4x4 input patch d, the 3x3 weight gradient dg = G^T [(A dy A^T) .* (B^T d B)] G: the same V as
// the forward, and the sum over tiles happens in the 4x4 domain, as 16 GEMMs whose depth is the
// tiles:  M_xi [K, C] += DY_xi [K, tiles] x V_xi [tiles, C];  dw = G^T M G at the end.
// Thread t owns the input channels [c0, c1) (whole NR slivers) over every chunk, in order: each dw
// element is summed by one thread in an order fixed by the geometry.

struct WgradLayout {
  int64_t nb, tiles, cols, xn_n, dyn_n, v_n, dy_n, m_n, x_n, per_thread;
};

WgradLayout wgrad_layout(const Wino& w, int threads) {
  WgradLayout l;
  // Chunk depth: up to 512 tiles, fewer when wide (V + DY panels ~ 16 x tiles x (C + K) floats,
  // 8 MiB at most). Geometry only, not the thread count: it fixes the summation order.
  const int64_t target = std::clamp<int64_t>((1 << 17) / (w.Ci + w.Co), 32, 512);
  l.nb = std::clamp<int64_t>(target / w.TI(), 1, w.N);
  l.tiles = l.nb * w.TI();
  l.cols = round_up((w.Ci + threads - 1) / threads, kMaxNR) + kMaxNR;  // >= any thread's columns
  l.xn_n = l.nb * w.img();
  l.dyn_n = l.tiles * 4 * w.Co;
  l.v_n = 16 * l.tiles * l.cols;
  l.dy_n = 16 * (w.Co + kMaxMR) * l.tiles;
  l.m_n = 16 * (w.Co + kMaxMR) * l.cols;
  l.x_n = w.Ci * w.Hi * w.Wi;  // one image of a stashed x, decoded (StoredReader)
  l.per_thread = l.xn_n + l.dyn_n + l.v_n + l.dy_n + l.m_n + l.x_n + 128 + 7 * 16;
  return l;
}

// DY panels (SGEMM A slivers [tiles][MR], rows = output channels): A dy A^T of each 2x2 tile of
// the channels-last dy chunk dyn [tile rows * 2][tile cols * 2][Co], 8 channels per vector.
void transform_dy(const Wino& w, const float* dyn, int64_t nb, int MR, float* dp) {
  const int64_t Co = w.Co, tiles = nb * w.TI(), panel = round_up(Co, MR) * tiles, row = 2 * w.tw * Co;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t / w.TI(), ti = (t % w.TI()) / w.tw, tj = t % w.tw;
    const float* src = dyn + b * 4 * w.TI() * Co + (2 * ti * 2 * w.tw + 2 * tj) * Co;
    for (int64_t k0 = 0; k0 < Co; k0 += 8) {
      const int64_t kb = std::min<int64_t>(8, Co - k0);
      float d[2][2][8], e[4][2][8], u[16][8];
      for (int a = 0; a < 2; ++a)
        for (int c = 0; c < 2; ++c) {
          const float* p = src + a * row + c * Co + k0;
          if (kb == 8) std::memcpy(d[a][c], p, sizeof(float) * 8);  // branch-free in the common case
          else
            for (int l = 0; l < 8; ++l) d[a][c][l] = l < kb ? p[l] : 0.f;
        }
      for (int c = 0; c < 2; ++c)
        for (int l = 0; l < 8; ++l) {
          e[0][c][l] = d[0][c][l];
          e[1][c][l] = d[0][c][l] + d[1][c][l];
          e[2][c][l] = d[0][c][l] - d[1][c][l];
          e[3][c][l] = -d[1][c][l];
        }
      for (int r = 0; r < 4; ++r)
        for (int l = 0; l < 8; ++l) {
          u[r * 4 + 0][l] = e[r][0][l];
          u[r * 4 + 1][l] = e[r][0][l] + e[r][1][l];
          u[r * 4 + 2][l] = e[r][0][l] - e[r][1][l];
          u[r * 4 + 3][l] = -e[r][1][l];
        }
      if (kb == 8 && MR % 8 == 0) {  // 8 rows of one sliver: contiguous
        float* d0 = dp + ((k0 / MR) * tiles + t) * MR + k0 % MR;
        for (int xi = 0; xi < 16; ++xi) std::memcpy(d0 + xi * panel, u[xi], sizeof(float) * 8);
        continue;
      }
      for (int64_t l = 0; l < kb; ++l) {  // rows k0 + l of sliver (k0 + l) / MR
        const int64_t k = k0 + l;
        float* d0 = dp + ((k / MR) * tiles + t) * MR + k % MR;
        for (int xi = 0; xi < 16; ++xi) d0[xi * panel] = u[xi][l];
      }
    }
  }
}

// V panels (SGEMM B slivers [tiles][NR], columns = input channels [c0, c1)).
void transform_inputs_cols(const Wino& w, const float* xn, int64_t tiles, int64_t c0, int64_t c1, int NR,
                           int64_t cr, float* vp) {
  const int64_t Ci = w.Ci, row = w.Wp * Ci, panel = tiles * cr;
  float v[16][8];
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t / w.TI(), ti = (t % w.TI()) / w.tw, tj = t % w.tw;
    for (int64_t c = c0; c < c1; c += 8) {
      const int64_t cb = std::min<int64_t>(8, c1 - c);
      input_transform(xn + b * w.img() + (2 * ti * w.Wp + 2 * tj) * Ci + c, Ci, row, cb, v);
      const int64_t j = c - c0;  // column; 8-channel runs never straddle an NR sliver
      float* d = vp + ((j / NR) * tiles + t) * NR + j % NR;
      if (cb == 8)
        for (int xi = 0; xi < 16; ++xi) std::memcpy(d + xi * panel, v[xi], sizeof(float) * 8);
      else
        for (int xi = 0; xi < 16; ++xi) std::memcpy(d + xi * panel, v[xi], sizeof(float) * size_t(cb));
    }
  }
}

// dw [Co][Ci][3][3] (+)= G^T m G for this thread's input channels; m panel xi at mb + xi * (Co * cr).
void finish_wgrad(const Wino& w, const float* mb, int64_t c0, int64_t c1, int64_t cr, bool accumulate, float* dw) {
  const int64_t panel = w.Co * cr;
  for (int64_t k = 0; k < w.Co; ++k)
    for (int64_t c = c0; c < c1; ++c) {
      float m[4][4], t[3][4];
      for (int xi = 0; xi < 16; ++xi) m[xi / 4][xi % 4] = mb[xi * panel + k * cr + (c - c0)];
      for (int s = 0; s < 4; ++s) {
        t[0][s] = m[0][s] + 0.5f * (m[1][s] + m[2][s]);
        t[1][s] = 0.5f * (m[1][s] - m[2][s]);
        t[2][s] = 0.5f * (m[1][s] + m[2][s]) + m[3][s];
      }
      float* d = dw + (k * w.Ci + c) * 9;
      for (int i = 0; i < 3; ++i) {
        const float g[3] = {t[i][0] + 0.5f * (t[i][1] + t[i][2]), 0.5f * (t[i][1] - t[i][2]),
                            0.5f * (t[i][1] + t[i][2]) + t[i][3]};
        for (int j = 0; j < 3; ++j) d[i * 3 + j] = accumulate ? d[i * 3 + j] + g[j] : g[j];
      }
    }
}

void run_wgrad(const Wino& w, const Tensor& x, const float* dy, float* dw, float* db, bool accumulate, void* ws) {
  const GemmTile tile = sgemm_tile();
  const int MR = tile.mr, NR = tile.nr;
  const int threads = omp_get_max_threads();
  const WgradLayout l = wgrad_layout(w, threads);
  const int64_t PQ = w.Ho * w.Wo;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Carve cv{static_cast<float*>(ws) + t * l.per_thread};
    float* xn = cv.take(l.xn_n);
    float* dyn = cv.take(l.dyn_n);
    float* vp = cv.take(l.v_n);
    float* dp = cv.take(l.dy_n);
    float* mb = cv.take(l.m_n);
    StoredReader xr(x, cv.take(l.x_n), l.x_n);
    const int64_t units = (w.Ci + NR - 1) / NR;
    const int64_t c0 = std::min(w.Ci, units * t / nt * NR), c1 = std::min(w.Ci, units * (t + 1) / nt * NR);
    const int64_t cr = round_up(c1 - c0, NR);
    if (c1 > c0) {
      std::memset(xn, 0, sizeof(float) * size_t(l.xn_n));  // padding stays zero
      std::memset(dyn, 0, sizeof(float) * size_t(l.dyn_n));  // so do the odd map's last row / column
    }
    for (int64_t n0 = 0; n0 < w.N && c1 > c0; n0 += l.nb) {
      const int64_t nb = std::min(l.nb, w.N - n0), tiles = nb * w.TI();
      for (int64_t b = 0; b < nb; ++b) {
        image_to_channels_last(xr, n0 + b, w.Ci, w.Hi, w.Wi, w.ph, w.pw, w.Hp, w.Wp, xn + b * w.img());
        to_channels_last(dy + (n0 + b) * w.Co * PQ, w.Co, w.Ho, w.Wo, 0, 0, 2 * w.th, 2 * w.tw,
                         dyn + b * 4 * w.TI() * w.Co);
      }
      transform_inputs_cols(w, xn, tiles, c0, c1, NR, cr, vp);
      transform_dy(w, dyn, nb, MR, dp);
      const int64_t dpanel = round_up(w.Co, MR) * tiles;
      for (int xi = 0; xi < 16; ++xi)
        sgemm_packed(w.Co, c1 - c0, tiles, dp + xi * dpanel, MR * tiles, vp + xi * tiles * cr, n0 > 0,
                     mb + xi * w.Co * cr, cr);
    }
    if (c1 > c0) finish_wgrad(w, mb, c0, c1, cr, accumulate, dw);
    if (db) {
#pragma omp for schedule(static)
      for (int64_t k = 0; k < w.Co; ++k) {
        float s = 0.f;
        for (int64_t n = 0; n < w.N; ++n)
          for (int64_t j = 0; j < PQ; ++j) s += dy[(n * w.Co + k) * PQ + j];
        db[k] = accumulate ? db[k] + s : s;
      }
    }
  }
}

}  // namespace

bool winograd_applies(const Conv2dGeom& g, ConvPass) {
  return g.groups == 1 && g.R == 3 && g.S == 3 && g.stride_h == 1 &&
         g.stride_w == 1 && g.pad_h <= 2 && g.pad_w <= 2 && g.P > 0 && g.Q > 0;
}

size_t winograd_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  if (pass == ConvPass::BackwardWeight) return size_t(threads * wgrad_layout(fwd_wino(g), threads).per_thread) * sizeof(float);
  return workspace(pass == ConvPass::Forward ? fwd_wino(g) : data_wino(g), threads);
}

void winograd_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                      float* sum1, float* sum2) {
  run(fwd_wino(g), ConvInput(x), w, false, b, y, false, ws, sum1, sum2);
}

void winograd_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                            void* ws, const DzSumsEpilogue* dz_sums) {
  run(data_wino(g), ConvInput(dy), w, true, nullptr, dx, accumulate, ws, nullptr, nullptr, dz_sums);
}

void winograd_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                              bool accumulate, void* ws) {
  run_wgrad(fwd_wino(g), x, dy, dw, db, accumulate, ws);
}

}  // namespace et::cpu
