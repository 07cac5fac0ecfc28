// The operands of the CUDA backend's integer products (cuda_quant.cu) as matrices read in place:
// every 4-bit conv and linear pass is C[M][N] = sum_k A(m, k) * B(k, n) over int8 codes (INT4
// -7..15, FP4 as +-2^(f-1), quant/codes.h), exact in int32, with A and B gathered from the
// tensors as the kernel loads its tiles (an implicit GEMM: no im2col buffer).
//
//   conv forward        A = w [K][C*R*S]           B = x by (c, r, s) x (n, p, q)   C -> y [N][K][P][Q]
//   conv data gradient  A = w by (c) x (k, r, s)   B = g by (k, r, s) x (n, h, w)   C -> dx [N][C][H][W]
//     (strided: one product per phase of (h, w), over the phase's taps alone: DataGradPhase)
//   conv weight grad.   A = g by (k) x (n, p, q)   B = x by (n, p, q) x (c, r, s)   C -> dw [K][C*R*S]
//   linear              row-major views (Dense)
//
// Host and device code (ET_HOST_DEVICE), C++14: the CPU tests check each pass's index mapping
// against the CPU backend's integer kernels without a GPU (tests/test_int_gemm_operands.cpp).
// Sizes fit int32 index arithmetic per image; image offsets are int64.
#pragma once
#include <cstdint>

#include "backends/cuda/index_math.h"
#include "quant/codes.h"

namespace et {
namespace int_gemm {

using cuda_index::idiv;  // 32-bit divisions where the operands fit (index_math.h)
using cuda_index::imod;

// The geometry the conv operands need (Conv2dGeom's fields, no backend header).
struct ConvShape {
  int C, H, W, K, R, S, P, Q, stride_h, stride_w, pad_h, pad_w;
  ET_HOST_DEVICE int taps() const { return R * S; }
};
// From a Conv2dGeom (a template: this header does not include the backend's).
template <class Geom>
ConvShape conv_shape_of(const Geom& g) {
  return ConvShape{int(g.C), int(g.H), int(g.W), int(g.K), int(g.R), int(g.S),
                   int(g.P), int(g.Q), int(g.stride_h), int(g.stride_w), int(g.pad_h), int(g.pad_w)};
}

// Each view splits an element's index into what its row gives and what its column gives (row(),
// col(): a Pos each), so that a kernel decomposes its block's rows of A and columns of B once, and
// the running k index once per tile for all its threads; get() then costs an add, the bounds and
// one load. at(r, c) = get(row(r), col(c)) is the plain form.
// Pos: an offset into the tensor and a position (h, w) the bounds apply to (views without bounds
// leave them 0).
struct Pos {
  int64_t off;
  int h, w;
};

// A row-major view: at(r, c) = p[r * ld_r + c * ld_c].
struct Dense {
  const int8_t* p;
  int64_t ld_r, ld_c;
  ET_HOST_DEVICE Pos row(int64_t r) const { return Pos{r * ld_r, 0, 0}; }
  ET_HOST_DEVICE Pos col(int64_t c) const { return Pos{c * ld_c, 0, 0}; }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const { return p[r.off + c.off]; }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// Forward B: row (c, r, s), column (n, p, q) -> x[n][c][h][w] at (h, w) = (p * stride - pad + r,
// q * stride - pad + s), 0 outside the plane (the padding). The column's offset points at (h, w)
// of its window's corner, which may lie outside the plane; the sum is inside when (h, w) is.
struct ConvInputByTaps {
  const int8_t* x;
  ConvShape s;
  ET_HOST_DEVICE Pos row(int64_t i) const {
    const int RS = s.taps(), c = int(idiv(i, RS)), t = int(imod(i, RS)), r = t / s.S, u = t % s.S;
    return Pos{(int64_t(c) * s.H + r) * s.W + u, r, u};
  }
  ET_HOST_DEVICE Pos col(int64_t j) const {
    const int PQ = s.P * s.Q;
    const int64_t n = idiv(j, PQ);
    const int pq = int(imod(j, PQ)), h = pq / s.Q * s.stride_h - s.pad_h, w = pq % s.Q * s.stride_w - s.pad_w;
    return Pos{n * s.C * s.H * s.W + int64_t(h) * s.W + w, h, w};
  }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const {
    const int h = r.h + c.h, w = r.w + c.w;
    if (h < 0 || h >= s.H || w < 0 || w >= s.W) return 0;
    return x[r.off + c.off];
  }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// Weight-gradient B: row (n, p, q), column (c, r, s) -> the same x element as above.
struct ConvInputByPositions {
  ConvInputByTaps x;
  ET_HOST_DEVICE Pos row(int64_t r) const { return x.col(r); }
  ET_HOST_DEVICE Pos col(int64_t c) const { return x.row(c); }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const { return x.get(c, r); }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// Data-gradient A: row c, column (k, r, s) -> w[k][c][r][s].
struct WeightsByInputChannel {
  const int8_t* w;
  ConvShape s;
  ET_HOST_DEVICE Pos row(int64_t c) const { return Pos{c * s.taps(), 0, 0}; }
  ET_HOST_DEVICE Pos col(int64_t j) const {
    const int RS = s.taps();
    return Pos{idiv(j, RS) * s.C * RS + imod(j, RS), 0, 0};
  }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const { return w[r.off + c.off]; }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// Data-gradient B: row (k, r, s), column (n, h, w) -> g[n][k][p][q] for the output (p, q) whose
// window puts tap (r, s) on (h, w): p * stride = h + pad - r; 0 where no output does.
// The row holds (r, s), the column (h + pad, w + pad).
struct GradByTaps {
  const int8_t* g;
  ConvShape s;
  ET_HOST_DEVICE Pos row(int64_t i) const {
    const int RS = s.taps(), k = int(idiv(i, RS)), t = int(imod(i, RS));
    return Pos{int64_t(k) * s.P * s.Q, t / s.S, t % s.S};
  }
  ET_HOST_DEVICE Pos col(int64_t j) const {
    const int HW = s.H * s.W;
    const int64_t n = idiv(j, HW);
    const int hw = int(imod(j, HW));
    return Pos{n * s.K * s.P * s.Q, hw / s.W + s.pad_h, hw % s.W + s.pad_w};
  }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const {
    int ph = c.h - r.h, pw = c.w - r.w;
    if (ph < 0 || pw < 0) return 0;
    if (s.stride_h != 1 || s.stride_w != 1) {
      if (ph % s.stride_h != 0 || pw % s.stride_w != 0) return 0;
      ph /= s.stride_h;
      pw /= s.stride_w;
    }
    if (ph >= s.P || pw >= s.Q) return 0;
    return g[r.off + c.off + int64_t(ph) * s.Q + pw];
  }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// The strided data gradient by phase (a sub-pixel decomposition). At stride > 1 only the taps r
// with r = h + pad (mod stride) reach input row h, so GradByTaps' product multiplies zeros for the
// others: 3/4 of its work for a 3 x 3 conv at stride 2, all of it for a 1 x 1 conv's skipped
// positions. The input positions split into stride_h x stride_w phases (a, b) = ((h + pad_h) mod
// stride_h, (w + pad_w) mod stride_w); each phase is a product of its own, over its taps alone
// (r = a + i * stride_h, s = b + j * stride_w), its columns the phase's positions. Each dx element
// is in one phase and gets the same exact integer sum as from GradByTaps.
struct DataGradPhase {
  int a, b;            // the phase, and its first taps
  int taps_h, taps_w;  // its taps: r = a + i * stride_h, i < taps_h (0: none; its dx is 0)
  int h0, w0;          // its first input row and column
  int rows, cols;      // its input positions: h = h0 + u * stride_h, u < rows; w likewise
  int base_h, base_w;  // the output row (column) that tap a (b) of row h0 (column w0) reads
  ET_HOST_DEVICE int taps() const { return taps_h * taps_w; }
  ET_HOST_DEVICE int positions() const { return rows * cols; }
};
ET_HOST_DEVICE inline DataGradPhase data_grad_phase(const ConvShape& s, int a, int b) {
  DataGradPhase p;
  p.a = a, p.b = b;
  p.taps_h = a < s.R ? (s.R - a + s.stride_h - 1) / s.stride_h : 0;
  p.taps_w = b < s.S ? (s.S - b + s.stride_w - 1) / s.stride_w : 0;
  p.h0 = ((a - s.pad_h) % s.stride_h + s.stride_h) % s.stride_h;  // h0 + pad_h = a (mod stride_h)
  p.w0 = ((b - s.pad_w) % s.stride_w + s.stride_w) % s.stride_w;
  p.rows = p.h0 < s.H ? (s.H - p.h0 + s.stride_h - 1) / s.stride_h : 0;
  p.cols = p.w0 < s.W ? (s.W - p.w0 + s.stride_w - 1) / s.stride_w : 0;
  p.base_h = (p.h0 + s.pad_h - a) / s.stride_h;  // exact, and >= 0
  p.base_w = (p.w0 + s.pad_w - b) / s.stride_w;
  return p;
}

// Phase data-gradient A: row c, column (k, i, j) -> w[k][c][a + i * stride_h][b + j * stride_w].
struct WeightsByPhaseTaps {
  const int8_t* w;
  ConvShape s;
  DataGradPhase ph;
  ET_HOST_DEVICE Pos row(int64_t c) const { return Pos{c * s.taps(), 0, 0}; }
  ET_HOST_DEVICE Pos col(int64_t j) const {
    const int T = ph.taps(), t = int(imod(j, T)), r = ph.a + t / ph.taps_w * s.stride_h,
              u = ph.b + t % ph.taps_w * s.stride_w;
    return Pos{idiv(j, T) * s.C * s.taps() + r * s.S + u, 0, 0};
  }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const { return w[r.off + c.off]; }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// Phase data-gradient B: row (k, i, j), column (n, u, v) (input position (h0 + u * stride_h,
// w0 + v * stride_w)) -> g[n][k][base_h + u - i][base_w + v - j]: the output that tap
// (a + i * stride_h, b + j * stride_w) of that position's window reads; 0 outside the output.
// The row holds (i, j), the column (base_h + u, base_w + v): no division in get().
struct GradByPhaseTaps {
  const int8_t* g;
  ConvShape s;
  DataGradPhase ph;
  ET_HOST_DEVICE Pos row(int64_t i) const {
    const int T = ph.taps(), t = int(imod(i, T));
    return Pos{idiv(i, T) * s.P * s.Q, t / ph.taps_w, t % ph.taps_w};
  }
  ET_HOST_DEVICE Pos col(int64_t j) const {
    const int n_pos = ph.positions(), uv = int(imod(j, n_pos));
    return Pos{idiv(j, n_pos) * s.K * s.P * s.Q, ph.base_h + uv / ph.cols, ph.base_w + uv % ph.cols};
  }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const {
    const int p = c.h - r.h, q = c.w - r.w;
    if (p < 0 || q < 0 || p >= s.P || q >= s.Q) return 0;
    return g[r.off + c.off + int64_t(p) * s.Q + q];
  }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// Where a phase's C[c][(n, u, v)] goes: dx[n][c][h0 + u * stride_h][w0 + v * stride_w].
struct PhaseOut {
  int64_t channels;
  ConvShape s;
  DataGradPhase ph;
  ET_HOST_DEVICE int64_t at(int64_t m, int64_t n) const {
    const int n_pos = ph.positions(), uv = int(imod(n, n_pos));
    const int h = ph.h0 + uv / ph.cols * s.stride_h, w = ph.w0 + uv % ph.cols * s.stride_w;
    return ((idiv(n, n_pos) * channels + m) * s.H + h) * s.W + w;
  }
};

// Weight-gradient A: row k, column (n, p, q) -> g[n][k][p][q].
struct GradByPositions {
  const int8_t* g;
  ConvShape s;
  ET_HOST_DEVICE Pos row(int64_t k) const { return Pos{k * s.P * s.Q, 0, 0}; }
  ET_HOST_DEVICE Pos col(int64_t j) const {
    const int PQ = s.P * s.Q;
    return Pos{idiv(j, PQ) * s.K * PQ + imod(j, PQ), 0, 0};
  }
  ET_HOST_DEVICE int get(const Pos& r, const Pos& c) const { return g[r.off + c.off]; }
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return get(row(r), col(c)); }
};

// The order a warp gathers an operand's tile in (cuda_quant.cu's int_gemm_kernel): along k (lanes
// on consecutive k of a few rows of A or columns of B) where consecutive k are adjacent in memory
// and consecutive rows (columns) are not; across them otherwise. A GPU serves a warp's loads by
// 32-byte sectors: the other order makes each lane's byte a sector of its own.
struct GatherOrder {
  bool a_along_k, b_along_k;
};
// A's k is its column, B's its row.
inline bool along_k_as_a(const Dense& a) { return a.ld_c == 1 && a.ld_r != 1; }
inline bool along_k_as_b(const Dense& b) { return b.ld_r == 1 && b.ld_c != 1; }
inline bool along_k_as_b(const ConvInputByTaps&) { return false; }     // columns: x along q
inline bool along_k_as_b(const ConvInputByPositions&) { return true; } // k: x along q
inline bool along_k_as_a(const WeightsByInputChannel&) { return false; }  // rows: R*S codes apart
inline bool along_k_as_b(const GradByTaps&) { return false; }          // columns: g along w
inline bool along_k_as_a(const WeightsByPhaseTaps&) { return false; }
inline bool along_k_as_b(const GradByPhaseTaps&) { return false; }
inline bool along_k_as_a(const GradByPositions&) { return true; }      // k: g along q

// Where C[m][n] goes in the output tensor.
// Forward: m = k, n = (img, p, q) -> y[img][k][p][q]; data gradient: m = c, n = (img, h, w).
struct PlanesOut {
  int64_t channels, plane;  // channels of the output tensor, positions per plane
  ET_HOST_DEVICE int64_t at(int64_t m, int64_t n) const { return (idiv(n, plane) * channels + m) * plane + imod(n, plane); }
};
// Row-major C (the weight gradient, linear layers): m * ld + n.
struct RowsOut {
  int64_t ld;
  ET_HOST_DEVICE int64_t at(int64_t m, int64_t n) const { return m * ld + n; }
};

}  // namespace int_gemm
}  // namespace et
