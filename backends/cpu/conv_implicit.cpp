// Implicit-GEMM conv over channels-last padded copies (see conv_implicit.h).
//
// Forward and backward data are the same "correlation" (Corr): an input [N][Ci][Hi][Wi] read
// through an R x S window at stride (sh, sw) after zero padding (ph, pw), Co output channels on an
// Ho x Wo map, with packed weights A [Co, (t,c)] (backward data: w transposed and flipped). Chunks
// of nb images are independent GEMMs (columns = the chunk's output positions); threads take whole
// chunks, and a column's result never depends on the chunk it is in, so any schedule gives the same
// bits. The weight gradient splits the columns (t,c) of dw between the threads; every thread walks
// all chunks in order, so each dw element is summed in an order fixed by the geometry.
// Workspace: carved in the same order as sized by the *_layout functions; nothing is allocated.
#include "backends/cpu/conv_implicit.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/gemm.h"
#include "memory/stored_reader.h"

namespace et::cpu {

namespace {

constexpr int64_t KC = 256;          // GEMM depth block, as gemm.cpp
constexpr int64_t kFwdCols = 512;    // positions per forward chunk: B panel KC x 512 = 512 KiB (L2)
constexpr int64_t kWgradPos = 1024;  // positions per weight-gradient chunk (the GEMM's depth)
constexpr int64_t kWgradNC = 1024, kWgradMC = 96;
constexpr int kMaxMR = 16, kMaxNR = 32;  // bounds over the tiles of sgemm_tile(), for sizing

float* align64(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
struct Carve {  // bump allocator over the workspace, 64-byte aligned pieces
  float* p;
  float* take(int64_t n) { float* r = align64(p); p = r + n; return r; }
  int64_t* take_i64(int64_t n) { return reinterpret_cast<int64_t*>(take(2 * n)); }
};

struct Corr {
  int64_t N, Ci, Hi, Wi, ph, pw, sh, sw, R, S;  // input, padding, stride, window
  int64_t Co, Ho, Wo;                            // output
  int64_t Hp, Wp;                                // padded channels-last image [Hp][Wp][Ci]
  int64_t toff[kMaxTaps];                        // tap (r,s) -> (r*Wp + s)*Ci
  int64_t RS() const { return R * S; }
  int64_t PQ() const { return Ho * Wo; }
  int64_t depth() const { return R * S * Ci; }
  int64_t img() const { return Hp * Wp * Ci; }
};

Corr make_corr(int64_t N, int64_t Ci, int64_t Hi, int64_t Wi, int64_t ph, int64_t pw, int64_t sh, int64_t sw,
               int64_t R, int64_t S, int64_t Co, int64_t Ho, int64_t Wo) {
  Corr k{N, Ci, Hi, Wi, ph, pw, sh, sw, R, S, Co, Ho, Wo, (Ho - 1) * sh + R, (Wo - 1) * sw + S, {}};
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < S; ++s) k.toff[r * S + s] = (r * k.Wp + s) * Ci;
  return k;
}
Corr fwd_corr(const Conv2dGeom& g) {
  return make_corr(g.N, g.C, g.H, g.W, g.pad_h, g.pad_w, g.stride_h, g.stride_w, g.R, g.S, g.K, g.P, g.Q);
}
// dx = correlation of dy padded by R-1-pad with the flipped kernel (stride 1).
Corr data_corr(const Conv2dGeom& g) {
  return make_corr(g.N, g.K, g.P, g.Q, g.R - 1 - g.pad_h, g.S - 1 - g.pad_w, 1, 1, g.R, g.S, g.C, g.H, g.W);
}

void to_channels_last(const Corr& k, const float* src, float* dst) {
  cpu::to_channels_last(src, k.Ci, k.Hi, k.Wi, k.ph, k.pw, k.Hp, k.Wp, dst);
}

// base[j] for the chunk's output positions j = (b, p, q): offset of the window's top-left element.
void position_bases(const Corr& k, int64_t nb, int64_t* base) {
  for (int64_t b = 0, j = 0; b < nb; ++b)
    for (int64_t p = 0; p < k.Ho; ++p)
      for (int64_t q = 0; q < k.Wo; ++q) base[j++] = b * k.img() + (p * k.sh * k.Wp + q * k.sw) * k.Ci;
}

#if defined(__AVX__)
// dst[k*ldd + i] = s[base[i] + k] for i, k < 8 (8 positions x 8 channels -> 8 depth rows).
inline void transpose8(const float* s, const int64_t* base, float* dst, int64_t ldd) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + base[i]);
  transpose8_rows(r, dst, ldd);
}
#endif

// Im2col B panel, depth rows [pc, pc+kc) (row t*Ci + c) x columns j < cols, as NR-column slivers
// [kc][NR] of xn[base[j] + toff[t] + c]; columns past cols up to a multiple of 16 are zero.
void pack_im2col(const Corr& k, const float* xn, const int64_t* base, int64_t cols, int64_t pc, int64_t kc, int NR,
                 float* dst) {
  for (int64_t jr = 0; jr < cols; jr += NR) {
    const int64_t n = std::min<int64_t>(NR, cols - jr), nz = round_up(n, 16);
    const int64_t* bj = base + jr;
    float* d = dst + jr * kc;
    int64_t j8 = 0;
#if defined(__AVX__)
    if (k.Ci % 8 == 0 && pc % 8 == 0 && kc % 8 == 0)  // runs of 8 channels never straddle a tap
      for (; j8 + 8 <= n; j8 += 8)
        for (int64_t kk = 0; kk < kc; kk += 8) {
          const int64_t t = (pc + kk) / k.Ci, c = (pc + kk) % k.Ci;
          transpose8(xn + k.toff[t] + c, bj + j8, d + kk * NR + j8, NR);
        }
#endif
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t t = (pc + kk) / k.Ci, c = (pc + kk) % k.Ci;
      const float* s = xn + k.toff[t] + c;
      float* dk = d + kk * NR;
      for (int64_t j = j8; j < n; ++j) dk[j] = s[bj[j]];
      for (int64_t j = n; j < nz; ++j) dk[j] = 0.f;
    }
  }
}

// Weights as MR-row slivers over the whole depth: sliver o/MR, [depth][MR]; rows >= Co are zero.
// Forward: A(o, t*Ci + c) = w[o][c][t]. Flip (backward data, Ci = K, Co = C): A(o, t*K + k) = w[k][o][RS-1-t].
// Full slivers take loops with a constant trip count (unrolled, no per-element branch): this runs
// once per call over the whole weight tensor, a tenth of a 2x2 layer's time at batch 32 otherwise.
template <int MR>
void pack_weights_full(const Corr& k, const float* w, bool flip, int64_t o0, float* dst) {
  const int64_t RS = k.RS(), Ci = k.Ci;
  if (flip) {
    for (int64_t c = 0; c < Ci; ++c) {
      const float* blk = w + (c * k.Co + o0) * RS;  // [MR][RS], contiguous
      for (int64_t t = 0; t < RS; ++t) {
        float* d = dst + ((RS - 1 - t) * Ci + c) * MR;
        for (int i = 0; i < MR; ++i) d[i] = blk[i * RS + t];
      }
    }
  } else {
    for (int64_t c = 0; c < Ci; ++c)
      for (int64_t t = 0; t < RS; ++t) {
        const float* s = w + (o0 * Ci + c) * RS + t;
        float* d = dst + (t * Ci + c) * MR;
        for (int i = 0; i < MR; ++i) d[i] = s[i * Ci * RS];
      }
  }
}

void pack_weights_sliver(const Corr& k, const float* w, bool flip, int MR, int64_t sl, float* dst) {
  const int64_t RS = k.RS(), o0 = sl * MR;
  if (o0 + MR <= k.Co && MR == 8) return pack_weights_full<8>(k, w, flip, o0, dst);
  if (o0 + MR <= k.Co && MR == 4) return pack_weights_full<4>(k, w, flip, o0, dst);
  for (int64_t c = 0; c < k.Ci; ++c)
    for (int64_t t = 0; t < RS; ++t) {
      float* d = dst + (t * k.Ci + c) * MR;
      for (int i = 0; i < MR; ++i) {
        const int64_t o = o0 + i;
        d[i] = o >= k.Co ? 0.f : flip ? w[(c * k.Co + o) * RS + (RS - 1 - t)] : w[(o * k.Ci + c) * RS + t];
      }
    }
}

struct CorrLayout {
  int64_t nb, cols, parts, apk_n, xn_n, base_n, bp_n, out_n, per_thread;
};

// Tasks are (chunk, part of the output channels). Normally one part and at least one chunk per
// thread; when the whole batch has few positions (2x2 maps at batch 32: 128), chunks that small
// would stream the whole packed weight matrix for a handful of columns, so there is one chunk and
// the threads split the output channels instead (each packs the same im2col panel).
CorrLayout corr_layout(const Corr& k, int threads) {
  CorrLayout l;
  const bool few = k.N * k.PQ() < threads * kFwdCols / 2;
  l.parts = few ? threads : 1;
  l.nb = few ? k.N : std::max<int64_t>(1, std::min(kFwdCols / k.PQ(), (k.N + threads - 1) / threads));
  l.cols = l.nb * k.PQ();
  l.apk_n = (k.Co + kMaxMR) * k.depth();  // >= round_up(Co, MR) rows for any tile
  l.xn_n = l.nb * k.img();
  l.base_n = 2 * l.cols;
  l.bp_n = std::min(KC, k.depth()) * (l.cols + kMaxNR);
  l.out_n = k.Co * l.cols;
  l.per_thread = l.xn_n + l.base_n + l.bp_n + l.out_n + 64;
  return l;
}

size_t corr_workspace(const Corr& k, int threads) {
  const CorrLayout l = corr_layout(k, threads);
  return size_t(l.apk_n + 16 + threads * l.per_thread) * sizeof(float);
}

// out [N][Co][Ho][Wo] (+)= correlation of in [N][Ci][Hi][Wi] (+ bias).
void run_corr(const Corr& k, const float* in, const float* w, bool flip, const float* bias, float* out,
              bool accumulate, void* ws) {
  const GemmTile tile = sgemm_tile();
  const int MR = tile.mr;
  const int threads = omp_get_max_threads();
  const CorrLayout l = corr_layout(k, threads);
  const int64_t depth = k.depth(), PQ = k.PQ(), slivers = (k.Co + MR - 1) / MR;
  const int64_t chunks = (k.N + l.nb - 1) / l.nb;
  Carve shared{static_cast<float*>(ws)};
  float* apk = shared.take(l.apk_n);
  float* thread_base = shared.p;
#pragma omp parallel num_threads(threads)
  {
    Carve cv{thread_base + omp_get_thread_num() * l.per_thread};
    float* xn = cv.take(l.xn_n);
    int64_t* base = cv.take_i64(l.cols);
    float* bp = cv.take(l.bp_n);
    float* ob = cv.take(l.out_n);
    std::memset(xn, 0, sizeof(float) * size_t(l.xn_n));  // padding stays zero; interiors are overwritten
#pragma omp for schedule(static)
    for (int64_t s = 0; s < slivers; ++s) pack_weights_sliver(k, w, flip, MR, s, apk + s * MR * depth);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < chunks * l.parts; ++task) {
      const int64_t ch = task / l.parts, part = task % l.parts;
      const int64_t o0 = std::min(k.Co, slivers * part / l.parts * MR), o1 = std::min(k.Co, slivers * (part + 1) / l.parts * MR);
      const int64_t n0 = ch * l.nb, nb = std::min(l.nb, k.N - n0), cols = nb * PQ;
      if (o1 <= o0) continue;
      for (int64_t b = 0; b < nb; ++b) to_channels_last(k, in + (n0 + b) * k.Ci * k.Hi * k.Wi, xn + b * k.img());
      position_bases(k, nb, base);
      for (int64_t pc = 0; pc < depth; pc += KC) {
        const int64_t kc = std::min(KC, depth - pc);
        pack_im2col(k, xn, base, cols, pc, kc, tile.nr, bp);
        sgemm_packed(o1 - o0, cols, kc, apk + o0 * depth + pc * MR, MR * depth, bp, pc > 0, ob + o0 * cols, cols);
      }
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t o = o0; o < o1; ++o) {
          const float* src = ob + o * cols + b * PQ;
          float* dst = out + ((n0 + b) * k.Co + o) * PQ;
          const float bo = bias ? bias[o] : 0.f;
          if (accumulate)
            for (int64_t j = 0; j < PQ; ++j) dst[j] += src[j] + bo;
          else
            for (int64_t j = 0; j < PQ; ++j) dst[j] = src[j] + bo;
        }
    }
  }
}

// ---------------------------------------------------------------- weight gradient
// dwt [K, (t,c)] = sum over positions j of dy[K, j] x im2col(x)[j, (t,c)]; the GEMM's depth is
// the positions of a chunk. Thread t owns columns [c0, c1) of dwt (whole NR slivers).

struct WgradLayout {
  int64_t nb, pos, xn_n, dyn_n, base_n, ap_n, bp_n, dwt_n, x_n, per_thread;
};

WgradLayout wgrad_layout(const Corr& k) {
  WgradLayout l;
  l.nb = std::clamp<int64_t>(kWgradPos / k.PQ(), 1, k.N);
  l.pos = l.nb * k.PQ();
  l.xn_n = l.nb * k.img();
  l.dyn_n = l.pos * k.Co;
  l.base_n = 2 * l.pos;
  l.ap_n = (std::min(kWgradMC, k.Co) + kMaxMR) * std::min(KC, l.pos);
  l.bp_n = std::min(KC, l.pos) * (std::min(kWgradNC, k.depth()) + kMaxNR);
  l.dwt_n = k.Co * k.depth();
  l.x_n = k.Ci * k.Hi * k.Wi;  // one image of a stashed x, decoded (StoredReader)
  l.per_thread = l.xn_n + l.dyn_n + l.base_n + l.ap_n + l.bp_n + l.x_n + 96;
  return l;
}

// B panel: depth rows = positions [pc, pc+kc), columns [jc, jc+nc) of (t,c); NR-column slivers.
void pack_im2col_rows(const Corr& k, const float* xn, const int64_t* base, int64_t pc, int64_t kc, int64_t jc,
                      int64_t nc, int NR, float* dst) {
  for (int64_t jr = 0; jr < nc; jr += NR) {
    const int64_t n = std::min<int64_t>(NR, nc - jr), nz = round_up(n, 16);
    float* d = dst + jr * kc;
    for (int64_t kk = 0; kk < kc; ++kk) {
      const float* src = xn + base[pc + kk];
      float* dk = d + kk * NR;
      for (int64_t f = 0; f < n;) {  // runs of channels within one tap
        const int64_t col = jc + jr + f, t = col / k.Ci, c = col % k.Ci, run = std::min(n - f, k.Ci - c);
        std::memcpy(dk + f, src + k.toff[t] + c, sizeof(float) * size_t(run));
        f += run;
      }
      for (int64_t j = n; j < nz; ++j) dk[j] = 0.f;
    }
  }
}

// A block: rows [ic, ic+mc) of dy x positions [pc, pc+kc), from dyn [pos][Co]; MR-row slivers [kc][MR].
void pack_dy(const float* dyn, int64_t Co, int64_t ic, int64_t mc, int64_t pc, int64_t kc, int MR, float* dst) {
  for (int64_t ir = 0; ir < mc; ir += MR) {
    const int64_t mr = std::min<int64_t>(MR, mc - ir);
    float* d = dst + ir * kc;
    for (int64_t kk = 0; kk < kc; ++kk)
      std::memcpy(d + kk * MR, dyn + (pc + kk) * Co + ic + ir, sizeof(float) * size_t(mr));
  }
}

}  // namespace

void to_channels_last(const float* src, int64_t Ci, int64_t Hi, int64_t Wi, int64_t ph, int64_t pw, int64_t Hp,
                      int64_t Wp, float* dst) {
  const int64_t h1 = std::min(Hi, Hp - ph), w1 = std::min(Wi, Wp - pw), HW = Hi * Wi;
  const int64_t c8 = Ci / 8 * 8, w8 = w1 / 8 * 8;  // [0, c8) x [0, w8) of each row in 8x8 blocks
  for (int64_t h = 0; h < h1; ++h) {
    float* drow = dst + ((h + ph) * Wp + pw) * Ci;
    const float* srow = src + h * Wi;
    for (int64_t c = 0; c < c8; c += 8)
      for (int64_t w = 0; w < w8; w += 8) transpose8x8(srow + c * HW + w, HW, drow + w * Ci + c, Ci);
    for (int64_t w = 0; w < w1; ++w)
      for (int64_t c = w < w8 ? c8 : 0; c < Ci; ++c) drow[w * Ci + c] = srow[c * HW + w];
  }
}

bool implicit_applies(const Conv2dGeom& g, ConvPass pass) {
  if (g.groups != 1 || g.R * g.S > kMaxTaps || g.P <= 0 || g.Q <= 0) return false;
  if (pass == ConvPass::BackwardData)
    return g.stride_h == 1 && g.stride_w == 1 && g.pad_h <= g.R - 1 && g.pad_w <= g.S - 1;
  return true;
}

size_t implicit_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  if (pass == ConvPass::Forward) return corr_workspace(fwd_corr(g), threads);
  if (pass == ConvPass::BackwardData) return corr_workspace(data_corr(g), threads);
  const WgradLayout l = wgrad_layout(fwd_corr(g));
  return size_t(l.dwt_n + 16 + threads * l.per_thread) * sizeof(float);
}

void implicit_forward(const Conv2dGeom& g, const float* x, const float* w, const float* b, float* y, void* ws) {
  run_corr(fwd_corr(g), x, w, false, b, y, false, ws);
}

void implicit_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                            void* ws) {
  run_corr(data_corr(g), dy, w, true, nullptr, dx, accumulate, ws);
}

void implicit_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                              bool accumulate, void* ws) {
  const Corr k = fwd_corr(g);
  const WgradLayout l = wgrad_layout(k);
  const GemmTile tile = sgemm_tile();
  const int MR = tile.mr, NR = tile.nr;
  const int threads = omp_get_max_threads();
  const int64_t depth = k.depth(), PQ = k.PQ(), RS = k.RS(), K = k.Co, C = k.Ci;
  Carve shared{static_cast<float*>(ws)};
  float* dwt = shared.take(l.dwt_n);
  float* thread_base = shared.p;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Carve cv{thread_base + t * l.per_thread};
    float* xn = cv.take(l.xn_n);
    float* dyn = cv.take(l.dyn_n);
    int64_t* base = cv.take_i64(l.pos);
    float* ap = cv.take(l.ap_n);
    float* bp = cv.take(l.bp_n);
    StoredReader xr(x, cv.take(l.x_n), l.x_n);
    const int64_t units = (depth + NR - 1) / NR;
    const int64_t c0 = std::min(depth, units * t / nt * NR), c1 = std::min(depth, units * (t + 1) / nt * NR);
    if (c1 > c0) std::memset(xn, 0, sizeof(float) * size_t(l.xn_n));
    for (int64_t n0 = 0; n0 < k.N && c1 > c0; n0 += l.nb) {
      const int64_t nb = std::min(l.nb, k.N - n0), pos = nb * PQ;
      for (int64_t b = 0; b < nb; ++b) {
        to_channels_last(k, xr.read((n0 + b) * l.x_n, l.x_n), xn + b * k.img());
        const float* src = dy + (n0 + b) * K * PQ;
        float* d = dyn + b * PQ * K;
        const int64_t o8 = K / 8 * 8, j8 = PQ / 8 * 8;
        for (int64_t o = 0; o < o8; o += 8)
          for (int64_t j = 0; j < j8; j += 8) transpose8x8(src + o * PQ + j, PQ, d + j * K + o, K);
        for (int64_t j = 0; j < PQ; ++j)
          for (int64_t o = j < j8 ? o8 : 0; o < K; ++o) d[j * K + o] = src[o * PQ + j];
      }
      position_bases(k, nb, base);
      for (int64_t jc = c0; jc < c1; jc += kWgradNC) {
        const int64_t nc = std::min(kWgradNC, c1 - jc);
        for (int64_t pc = 0; pc < pos; pc += KC) {
          const int64_t kc = std::min(KC, pos - pc);
          const bool acc = n0 > 0 || pc > 0;
          pack_im2col_rows(k, xn, base, pc, kc, jc, nc, NR, bp);
          for (int64_t ic = 0; ic < K; ic += kWgradMC) {
            const int64_t mc = std::min(kWgradMC, K - ic);
            pack_dy(dyn, K, ic, mc, pc, kc, MR, ap);
            sgemm_packed(mc, nc, kc, ap, MR * kc, bp, acc, dwt + ic * depth + jc, depth);
          }
        }
      }
    }
    // dwt [K][(t,c)] -> dw [K][C][RS], this thread's columns.
    for (int64_t o = 0; o < K && c1 > c0; ++o)
      for (int64_t tap = c0 / C; tap <= (c1 - 1) / C; ++tap) {
        const int64_t ca = std::max(c0 - tap * C, int64_t(0)), cb = std::min(c1 - tap * C, C);
        const float* src = dwt + o * depth + tap * C;
        float* d = dw + o * C * RS + tap;
        if (accumulate)
          for (int64_t c = ca; c < cb; ++c) d[c * RS] += src[c];
        else
          for (int64_t c = ca; c < cb; ++c) d[c * RS] = src[c];
      }
    if (db) {
#pragma omp for schedule(static)
      for (int64_t o = 0; o < K; ++o) {
        float s = 0.f;
        for (int64_t n = 0; n < k.N; ++n)
          for (int64_t j = 0; j < PQ; ++j) s += dy[(n * K + o) * PQ + j];
        db[o] = accumulate ? db[o] + s : s;
      }
    }
  }
}

}  // namespace et::cpu
