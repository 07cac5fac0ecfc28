// Winograd F(2x2, 3x3) for dense 3x3 stride-1 convs: forward and data gradient (see conv_winograd.h).
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

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/conv_implicit.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/gemm.h"

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

void run(const Wino& w, const float* in, const float* wt, bool flip, const float* bias, float* out, bool accumulate,
         void* ws) {
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
        to_channels_last(in + (n0 + b) * w.Ci * w.Hi * w.Wi, w.Ci, w.Hi, w.Wi, w.ph, w.pw, w.Hp, w.Wp,
                         xn + b * w.img());
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
    }
  }
}

}  // namespace

bool winograd_applies(const Conv2dGeom& g, ConvPass pass) {
  return pass != ConvPass::BackwardWeight && g.groups == 1 && g.R == 3 && g.S == 3 && g.stride_h == 1 &&
         g.stride_w == 1 && g.pad_h <= 2 && g.pad_w <= 2 && g.P > 0 && g.Q > 0;
}

size_t winograd_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  return workspace(pass == ConvPass::Forward ? fwd_wino(g) : data_wino(g), threads);
}

void winograd_forward(const Conv2dGeom& g, const float* x, const float* w, const float* b, float* y, void* ws) {
  run(fwd_wino(g), x, w, false, b, y, false, ws);
}

void winograd_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                            void* ws) {
  run(data_wino(g), dy, w, true, nullptr, dx, accumulate, ws);
}

}  // namespace et::cpu
