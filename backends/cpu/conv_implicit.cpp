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

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/fused_elementwise.h"
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

// A correlation's output is computed in phases: each phase is a grid of output positions that
// read the same set of window taps. Forward, stride-1 data gradient and weight gradient have one
// phase (every tap, every position). The data gradient of a stride-(sh, sw) conv has sh * sw:
// dx[h][w] only receives dy[p] for taps r with h + pad - r divisible by sh, so the positions of
// one parity class (a, b) form a stride-1 correlation of dy with the sub-kernel of those taps
// (2x2, 2x1, 1x2 and 1x1 of a 3x3 kernel at stride 2), with no zero rows in between: none of the
// multiply-adds of the zero-upsampled dy is spent (the GEMM path's col2im, or direct kernels over
// the upsampled plane, spend 3 in 4 on zeros).
struct Phase {
  int64_t taps = 0;
  int64_t toff[kMaxTaps] = {};  // tap -> offset in the padded channels-last image
  int64_t wtap[kMaxTaps] = {};  // tap -> r*S + s of the weight tensor's window
  int64_t Ho = 0, Wo = 0;       // this phase's output grid
  int64_t row0 = 0, col0 = 0, ish = 1, isw = 1;  // position (i,j) reads from padded (row0 + i*ish, col0 + j*isw)
  int64_t oh0 = 0, ow0 = 0, osh = 1, osw = 1;    // and lands on output (oh0 + i*osh, ow0 + j*osw)
  int64_t apk_off = 0;          // its packed weights in the shared workspace
  int64_t PQ() const { return Ho * Wo; }
};
constexpr int kMaxPhases = 4;  // strides up to 2 in the data gradient

struct Corr {
  int64_t N, Ci, Hi, Wi, ph, pw;  // input [N][Ci][Hi][Wi], placed at (ph, pw) of the padded image
  int64_t Hp, Wp;                 // padded channels-last image [Hp][Wp][Ci]
  int64_t Co, Ho, Wo;             // output [N][Co][Ho][Wo]
  int64_t RS;                     // the weight tensor's window size
  bool flip;                      // weights w [Ci][Co][RS] (data gradient), else w [Co][Ci][RS]
  int nph;
  Phase phase[kMaxPhases];
  int64_t apk_n;                  // the packed weights of every phase
  int64_t PQ() const { return Ho * Wo; }
  int64_t img() const { return Hp * Wp * Ci; }
  int64_t max_depth() const {
    int64_t d = 0;
    for (int i = 0; i < nph; ++i) d = std::max(d, phase[i].taps * Ci);
    return d;
  }
  int64_t max_phase_PQ() const {
    int64_t m = 0;
    for (int i = 0; i < nph; ++i) m = std::max(m, phase[i].PQ());
    return m;
  }
};

// Each phase's packed weights: round_up(Co, MR) <= Co + kMaxMR rows of its depth, one after another.
void set_packed_offsets(Corr& k) {
  int64_t off = 0;
  for (int i = 0; i < k.nph; ++i) {
    Phase& f = k.phase[i];
    f.apk_off = off;
    off += (k.Co + kMaxMR) * f.taps * k.Ci;
  }
  k.apk_n = off;
}

// The forward correlation (also the weight gradient's geometry): one phase, every tap.
Corr fwd_corr(const Conv2dGeom& g) {
  Corr k{};
  k.N = g.N, k.Ci = g.C, k.Hi = g.H, k.Wi = g.W, k.ph = g.pad_h, k.pw = g.pad_w;
  k.Co = g.K, k.Ho = g.P, k.Wo = g.Q, k.RS = g.R * g.S, k.flip = false, k.nph = 1;
  k.Hp = (g.P - 1) * g.stride_h + g.R, k.Wp = (g.Q - 1) * g.stride_w + g.S;
  Phase& f = k.phase[0];
  f.taps = g.R * g.S, f.Ho = g.P, f.Wo = g.Q, f.ish = g.stride_h, f.isw = g.stride_w;
  for (int64_t r = 0; r < g.R; ++r)
    for (int64_t s = 0; s < g.S; ++s) f.toff[r * g.S + s] = (r * k.Wp + s) * k.Ci, f.wtap[r * g.S + s] = r * g.S + s;
  set_packed_offsets(k);
  return k;
}

// One dimension of the data gradient's phases: output positions h = a + i*stride of [0, H) take
// the taps r = r0 + m*stride (m < taps) from dy rows p = i + off - m.
struct PhaseDim {
  int64_t r0, taps, off, count;
};
PhaseDim phase_dim(int64_t a, int64_t H, int64_t R, int64_t pad, int64_t stride) {
  PhaseDim d{};
  d.r0 = (a + pad) % stride;
  d.taps = d.r0 < R ? (R - d.r0 + stride - 1) / stride : 0;
  d.off = (a + pad - d.r0) / stride;
  d.count = a < H ? (H - a + stride - 1) / stride : 0;
  return d;
}

// dx = correlation of dy (Ci = K, Co = C) with the flipped kernel, phase by phase. dy sits at
// (top, left) of the padded image, so that every phase's window starts at row >= 0:
// window tap u = taps-1-m of position i reads dy row i + off - (taps-1) + u.
Corr data_corr(const Conv2dGeom& g) {
  Corr k{};
  k.N = g.N, k.Ci = g.K, k.Hi = g.P, k.Wi = g.Q, k.Co = g.C, k.Ho = g.H, k.Wo = g.W, k.RS = g.R * g.S, k.flip = true;
  PhaseDim rows[2], cols[2];
  for (int64_t a = 0; a < g.stride_h; ++a) rows[a] = phase_dim(a, g.H, g.R, g.pad_h, g.stride_h);
  for (int64_t b = 0; b < g.stride_w; ++b) cols[b] = phase_dim(b, g.W, g.S, g.pad_w, g.stride_w);
  int64_t top = 0, left = 0;
  for (int64_t a = 0; a < g.stride_h; ++a) top = std::max(top, rows[a].taps - 1 - rows[a].off);
  for (int64_t b = 0; b < g.stride_w; ++b) left = std::max(left, cols[b].taps - 1 - cols[b].off);
  k.ph = top, k.pw = left;
  // Rows read by phase a: up to (row0 + count - 1) + (taps - 1) = top + off + count - 1.
  k.Hp = top + g.P, k.Wp = left + g.Q;
  for (int64_t a = 0; a < g.stride_h; ++a) k.Hp = std::max(k.Hp, top + rows[a].off + rows[a].count);
  for (int64_t b = 0; b < g.stride_w; ++b) k.Wp = std::max(k.Wp, left + cols[b].off + cols[b].count);
  k.nph = int(g.stride_h * g.stride_w);
  for (int64_t a = 0; a < g.stride_h; ++a)
    for (int64_t b = 0; b < g.stride_w; ++b) {
      const PhaseDim& rd = rows[a];
      const PhaseDim& cd = cols[b];
      Phase& f = k.phase[a * g.stride_w + b];
      f.taps = rd.taps * cd.taps, f.Ho = rd.count, f.Wo = cd.count;
      f.row0 = top + rd.off - (rd.taps - 1), f.col0 = left + cd.off - (cd.taps - 1);
      f.oh0 = a, f.ow0 = b, f.osh = g.stride_h, f.osw = g.stride_w;
      for (int64_t u = 0; u < rd.taps; ++u)
        for (int64_t v = 0; v < cd.taps; ++v) {
          const int64_t t = u * cd.taps + v;
          const int64_t r = rd.r0 + (rd.taps - 1 - u) * g.stride_h, s = cd.r0 + (cd.taps - 1 - v) * g.stride_w;
          f.toff[t] = (u * k.Wp + v) * k.Ci;
          f.wtap[t] = r * g.S + s;
        }
    }
  set_packed_offsets(k);
  return k;
}

void to_channels_last(const Corr& k, const float* src, float* dst) {
  cpu::to_channels_last(src, k.Ci, k.Hi, k.Wi, k.ph, k.pw, k.Hp, k.Wp, dst);
}

// base[j] for the chunk's positions j = (b, i, jj) of phase f: offset of the window's top-left element.
void position_bases(const Corr& k, const Phase& f, int64_t nb, int64_t* base) {
  for (int64_t b = 0, j = 0; b < nb; ++b)
    for (int64_t i = 0; i < f.Ho; ++i)
      for (int64_t q = 0; q < f.Wo; ++q)
        base[j++] = b * k.img() + ((f.row0 + i * f.ish) * k.Wp + f.col0 + q * f.isw) * k.Ci;
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
void pack_im2col(const Corr& k, const int64_t* toff, const float* xn, const int64_t* base, int64_t cols, int64_t pc,
                 int64_t kc, int NR, float* dst) {
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
          transpose8(xn + toff[t] + c, bj + j8, d + kk * NR + j8, NR);
        }
#endif
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t t = (pc + kk) / k.Ci, c = (pc + kk) % k.Ci;
      const float* s = xn + toff[t] + c;
      float* dk = d + kk * NR;
      for (int64_t j = j8; j < n; ++j) dk[j] = s[bj[j]];
      for (int64_t j = n; j < nz; ++j) dk[j] = 0.f;
    }
  }
}

// One phase's weights as MR-row slivers over its depth: sliver o/MR, [taps * Ci][MR]; rows >= Co
// are zero. Forward: A(o, t*Ci + c) = w[o][c][wtap[t]]. Flip (backward data, Ci = K, Co = C):
// A(o, t*K + k) = w[k][o][wtap[t]] (wtap runs the window backwards). Full slivers take loops with
// a constant trip count (unrolled, no per-element branch): this runs once per call over the whole
// weight tensor, a tenth of a 2x2 layer's time at batch 32 otherwise.
template <int MR>
void pack_weights_full(const Corr& k, const Phase& f, const float* w, int64_t o0, float* dst) {
  const int64_t RS = k.RS, Ci = k.Ci;
  if (k.flip) {
    for (int64_t c = 0; c < Ci; ++c) {
      const float* blk = w + (c * k.Co + o0) * RS;  // [MR][RS], contiguous
      for (int64_t t = 0; t < f.taps; ++t) {
        float* d = dst + (t * Ci + c) * MR;
        for (int i = 0; i < MR; ++i) d[i] = blk[i * RS + f.wtap[t]];
      }
    }
  } else {
    for (int64_t c = 0; c < Ci; ++c)
      for (int64_t t = 0; t < f.taps; ++t) {
        const float* s = w + (o0 * Ci + c) * RS + f.wtap[t];
        float* d = dst + (t * Ci + c) * MR;
        for (int i = 0; i < MR; ++i) d[i] = s[i * Ci * RS];
      }
  }
}

void pack_weights_sliver(const Corr& k, const Phase& f, const float* w, int MR, int64_t sl, float* dst) {
  const int64_t RS = k.RS, o0 = sl * MR;
  if (o0 + MR <= k.Co && MR == 8) return pack_weights_full<8>(k, f, w, o0, dst);
  if (o0 + MR <= k.Co && MR == 4) return pack_weights_full<4>(k, f, w, o0, dst);
  for (int64_t c = 0; c < k.Ci; ++c)
    for (int64_t t = 0; t < f.taps; ++t) {
      float* d = dst + (t * k.Ci + c) * MR;
      for (int i = 0; i < MR; ++i) {
        const int64_t o = o0 + i;
        d[i] = o >= k.Co ? 0.f : k.flip ? w[(c * k.Co + o) * RS + f.wtap[t]] : w[(o * k.Ci + c) * RS + f.wtap[t]];
      }
    }
}

struct CorrLayout {
  int64_t nb, cols, parts, xn_n, base_n, bp_n, out_n, per_thread;
};

// Tasks are (chunk, part of the output channels). Normally one part and at least one chunk per
// thread; when the whole batch has few positions (2x2 maps at batch 32: 128), chunks that small
// would stream the whole packed weight matrix for a handful of columns, so there is one chunk and
// the threads split the output channels instead (each packs the same im2col panel). Chunks are
// sized by the largest phase (a phase is one GEMM).
CorrLayout corr_layout(const Corr& k, int threads) {
  CorrLayout l;
  const int64_t PQ = std::max<int64_t>(1, k.max_phase_PQ()), depth = std::max<int64_t>(1, k.max_depth());
  const bool few = k.N * PQ < threads * kFwdCols / 2;
  l.parts = few ? threads : 1;
  l.nb = few ? k.N : std::max<int64_t>(1, std::min(kFwdCols / PQ, (k.N + threads - 1) / threads));
  l.cols = l.nb * PQ;
  l.xn_n = l.nb * k.img();
  l.base_n = 2 * l.cols;
  l.bp_n = std::min(KC, depth) * (l.cols + kMaxNR);
  l.out_n = k.Co * l.cols;
  l.per_thread = l.xn_n + l.base_n + l.bp_n + l.out_n + 64;
  return l;
}

// Sized for the planned batch and for any smaller one (the executor runs a partial last batch in
// the same workspace): a batch of few positions takes the one-chunk layout, whose chunk grows with
// the batch up to the threshold, so the largest such batch is sized too.
size_t corr_workspace(const Corr& k, int threads) {
  const int64_t PQ = std::max<int64_t>(1, k.max_phase_PQ());
  const int64_t few_max = (threads * kFwdCols / 2 - 1) / PQ;  // largest N with N * PQ below the threshold
  int64_t per_thread = 0;
  Corr part = k;
  for (int64_t n : {k.N, std::min(k.N, few_max)}) {
    if (n < 1) continue;
    part.N = n;
    per_thread = std::max(per_thread, corr_layout(part, threads).per_thread);
  }
  return size_t(k.apk_n + 16 + threads * per_thread) * sizeof(float);
}

// Output channels [o0, o1) of images [n0, n0+nb) at phase f's positions (+)= ob + bias; a phase
// without taps (a 1x1 stride-2 conv's odd rows and columns) gets zeros (ob == nullptr).
void scatter_phase(const Corr& k, const Phase& f, const float* ob, int64_t cols, int64_t n0, int64_t nb, int64_t o0,
                   int64_t o1, const float* bias, bool accumulate, float* out) {
  const int64_t fPQ = f.PQ(), PQ = k.PQ();
  const bool dense = f.osh == 1 && f.osw == 1 && fPQ == PQ;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t o = o0; o < o1; ++o) {
      const float* src = ob ? ob + o * cols + b * fPQ : nullptr;
      float* dst = out + ((n0 + b) * k.Co + o) * PQ;
      const float bo = bias ? bias[o] : 0.f;
      if (dense) {
        if (accumulate)
          for (int64_t j = 0; j < PQ; ++j) dst[j] += src[j] + bo;
        else
          for (int64_t j = 0; j < PQ; ++j) dst[j] = src[j] + bo;
        continue;
      }
      for (int64_t i = 0; i < f.Ho; ++i) {
        float* d = dst + (f.oh0 + i * f.osh) * k.Wo + f.ow0;
        const float* sr = src ? src + i * f.Wo : nullptr;
        for (int64_t j = 0; j < f.Wo; ++j) {
          const float v = (sr ? sr[j] : 0.f) + bo;
          d[j * f.osw] = accumulate ? d[j * f.osw] + v : v;
        }
      }
    }
}

// out [N][Co][Ho][Wo] (+)= correlation of in [N][Ci][Hi][Wi] (+ bias), phase by phase. After a
// task's phases have written its planes (images x output channels), still in this core's cache:
// their BN sums (sum1 / sum2, the forward) or the first sweep of the stack before (dz_sums, the
// data gradient).
void run_corr(const Corr& k, const float* in, const float* w, const float* bias, float* out, bool accumulate,
              void* ws, float* sum1 = nullptr, float* sum2 = nullptr, const DzSumsEpilogue* dz_sums = nullptr) {
  const GemmTile tile = sgemm_tile();
  const int MR = tile.mr;
  const int threads = omp_get_max_threads();
  const CorrLayout l = corr_layout(k, threads);
  const int64_t slivers = (k.Co + MR - 1) / MR;
  const int64_t chunks = (k.N + l.nb - 1) / l.nb;
  Carve shared{static_cast<float*>(ws)};
  float* apk = shared.take(k.apk_n);
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
    for (int64_t task = 0; task < k.nph * slivers; ++task) {
      const Phase& f = k.phase[task / slivers];
      const int64_t s = task % slivers;
      pack_weights_sliver(k, f, w, MR, s, apk + f.apk_off + s * MR * f.taps * k.Ci);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < chunks * l.parts; ++task) {
      const int64_t ch = task / l.parts, part = task % l.parts;
      const int64_t o0 = std::min(k.Co, slivers * part / l.parts * MR), o1 = std::min(k.Co, slivers * (part + 1) / l.parts * MR);
      const int64_t n0 = ch * l.nb, nb = std::min(l.nb, k.N - n0);
      if (o1 <= o0) continue;
      for (int64_t b = 0; b < nb; ++b) to_channels_last(k, in + (n0 + b) * k.Ci * k.Hi * k.Wi, xn + b * k.img());
      for (int pi = 0; pi < k.nph; ++pi) {
        const Phase& f = k.phase[pi];
        const int64_t cols = nb * f.PQ(), depth = f.taps * k.Ci;
        if (cols == 0) continue;
        if (depth == 0) {
          scatter_phase(k, f, nullptr, cols, n0, nb, o0, o1, bias, accumulate, out);
          continue;
        }
        position_bases(k, f, nb, base);
        const float* a = apk + f.apk_off;
        for (int64_t pc = 0; pc < depth; pc += KC) {
          const int64_t kc = std::min(KC, depth - pc);
          pack_im2col(k, f.toff, xn, base, cols, pc, kc, tile.nr, bp);
          sgemm_packed(o1 - o0, cols, kc, a + o0 * depth + pc * MR, MR * depth, bp, pc > 0, ob + o0 * cols, cols);
        }
        scatter_phase(k, f, ob, cols, n0, nb, o0, o1, bias, accumulate, out);
      }
      if (sum1)  // the forward's one phase has written the task's planes: their sums, in cache
        for (int64_t n = n0; n < n0 + nb; ++n)
          for (int64_t o = o0; o < o1; ++o)
            bn_rows::plane_sums(out + (n * k.Co + o) * k.PQ(), k.PQ(), sum1 + n * k.Co + o, sum2 + n * k.Co + o);
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
      if (dz_sums)  // every phase of the task's planes is written (added onto out where accumulate)
        for (int64_t n = n0; n < n0 + nb; ++n)
          fused_elementwise::dz_sums_planes(*dz_sums, n * k.Co + o0, n * k.Co + o1, k.Co, k.PQ(), out);
#endif
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
  l.bp_n = std::min(KC, l.pos) * (std::min(kWgradNC, k.max_depth()) + kMaxNR);
  l.dwt_n = k.Co * k.max_depth();
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
        std::memcpy(dk + f, src + k.phase[0].toff[t] + c, sizeof(float) * size_t(run));
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
                      int64_t Wp, float* dst, const AffineReluSource* stack) {
  const int64_t h1 = std::min(Hi, Hp - ph), w1 = std::min(Wi, Wp - pw), HW = Hi * Wi;
  const int64_t c8 = Ci / 8 * 8, w8 = w1 / 8 * 8;  // [0, c8) x [0, w8) of each row in 8x8 blocks
  const float *scale = stack ? stack->scale : nullptr, *shift = stack ? stack->shift : nullptr;
  for (int64_t h = 0; h < h1; ++h) {
    float* drow = dst + ((h + ph) * Wp + pw) * Ci;
    const float* srow = src + h * Wi;
    for (int64_t c = 0; c < c8; c += 8) {
      if (!stack) {
        for (int64_t w = 0; w < w8; w += 8) transpose8x8(srow + c * HW + w, HW, drow + w * Ci + c, Ci);
        continue;
      }
#if defined(ET_AFFINE_FMA) && defined(__AVX__) && defined(__FMA__)
      __m256 sc[8], sh[8];
      for (int i = 0; i < 8; ++i) sc[i] = _mm256_set1_ps(scale[c + i]), sh[i] = _mm256_set1_ps(shift[c + i]);
      const __m256 zero = _mm256_setzero_ps();
      for (int64_t w = 0; w < w8; w += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i)  // a max with +0 second: NaN and -0 give +0
          r[i] = _mm256_max_ps(_mm256_fmadd_ps(_mm256_loadu_ps(srow + (c + i) * HW + w), sc[i], sh[i]), zero);
        transpose8_rows(r, drow + w * Ci + c, Ci);
      }
#else
      for (int64_t w = 0; w < w8; ++w)
        for (int64_t i = 0; i < 8; ++i)
          drow[w * Ci + c + i] = bn_rows::affine_relu_one(srow[(c + i) * HW + w], scale[c + i], shift[c + i]);
#endif
    }
    for (int64_t w = 0; w < w1; ++w)
      for (int64_t c = w < w8 ? c8 : 0; c < Ci; ++c)
        drow[w * Ci + c] = stack ? bn_rows::affine_relu_one(srow[c * HW + w], scale[c], shift[c]) : srow[c * HW + w];
  }
}

void image_to_channels_last(StoredReader& xr, int64_t n, int64_t Ci, int64_t Hi, int64_t Wi, int64_t ph, int64_t pw,
                            int64_t Hp, int64_t Wp, float* dst) {
  const int64_t len = Ci * Hi * Wi;
  if (const AffineReluSource* stack = xr.affine_over_f32())
    return to_channels_last(stack->x.f32() + n * len, Ci, Hi, Wi, ph, pw, Hp, Wp, dst, stack);
  to_channels_last(xr.read(n * len, len), Ci, Hi, Wi, ph, pw, Hp, Wp, dst);
}

bool implicit_applies(const Conv2dGeom& g, ConvPass pass) {
  if (g.groups != 1 || g.R * g.S > kMaxTaps || g.P <= 0 || g.Q <= 0) return false;
  // Strided data gradients run as stride_h x stride_w phases (data_corr): strides up to 2.
  if (pass == ConvPass::BackwardData) return g.stride_h <= 2 && g.stride_w <= 2 && g.H > 0 && g.W > 0;
  return true;
}

size_t implicit_workspace(const Conv2dGeom& g, ConvPass pass, int threads) {
  if (pass == ConvPass::Forward) return corr_workspace(fwd_corr(g), threads);
  if (pass == ConvPass::BackwardData) return corr_workspace(data_corr(g), threads);
  const WgradLayout l = wgrad_layout(fwd_corr(g));
  return size_t(l.dwt_n + 16 + threads * l.per_thread) * sizeof(float);
}

void implicit_forward(const Conv2dGeom& g, const float* x, const float* w, const float* b, float* y, void* ws,
                      float* sum1, float* sum2) {
  run_corr(fwd_corr(g), x, w, b, y, false, ws, sum1, sum2);
}

void implicit_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                            void* ws, const DzSumsEpilogue* dz_sums) {
#if !defined(ET_ELEMENTWISE_IN_REGISTERS)
  ET_CHECK(!dz_sums, "implicit GEMM data gradient: dz sums in this build");
#endif
  run_corr(data_corr(g), dy, w, nullptr, dx, accumulate, ws, nullptr, nullptr, dz_sums);
}

void implicit_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                              bool accumulate, void* ws) {
  const Corr k = fwd_corr(g);
  const WgradLayout l = wgrad_layout(k);
  const GemmTile tile = sgemm_tile();
  const int MR = tile.mr, NR = tile.nr;
  const int threads = omp_get_max_threads();
  const int64_t depth = k.max_depth(), PQ = k.PQ(), RS = k.RS, K = k.Co, C = k.Ci;
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
        image_to_channels_last(xr, n0 + b, k.Ci, k.Hi, k.Wi, k.ph, k.pw, k.Hp, k.Wp, xn + b * k.img());
        const float* src = dy + (n0 + b) * K * PQ;
        float* d = dyn + b * PQ * K;
        const int64_t o8 = K / 8 * 8, j8 = PQ / 8 * 8;
        for (int64_t o = 0; o < o8; o += 8)
          for (int64_t j = 0; j < j8; j += 8) transpose8x8(src + o * PQ + j, PQ, d + j * K + o, K);
        for (int64_t j = 0; j < PQ; ++j)
          for (int64_t o = j < j8 ? o8 : 0; o < K; ++o) d[j * K + o] = src[o * PQ + j];
      }
      position_bases(k, k.phase[0], nb, base);
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
