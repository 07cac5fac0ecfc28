// The operands of the CUDA backend's integer products (cuda_quant.cu) as matrices read in place:
// every 4-bit conv and linear pass is C[M][N] = sum_k A(m, k) * B(k, n) over int8 codes (INT4
// -7..15, FP4 as +-2^(f-1), quant/codes.h), exact in int32, with A and B gathered from the
// tensors as the kernel loads its tiles (an implicit GEMM: no im2col buffer).
//
//   conv forward        A = w [K][C*R*S]           B = x by (c, r, s) x (n, p, q)   C -> y [N][K][P][Q]
//   conv data gradient  A = w by (c) x (k, r, s)   B = g by (k, r, s) x (n, h, w)   C -> dx [N][C][H][W]
//   conv weight grad.   A = g by (k) x (n, p, q)   B = x by (n, p, q) x (c, r, s)   C -> dw [K][C*R*S]
//   linear              row-major views (Dense)
//
// Host and device code (ET_HOST_DEVICE), C++14: the CPU tests check each pass's index mapping
// against the CPU backend's integer kernels without a GPU (tests/test_int_gemm_operands.cpp).
// Sizes fit int32 index arithmetic per image; image offsets are int64.
#pragma once
#include <cstdint>

#include "quant/codes.h"

namespace et {
namespace int_gemm {

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

// A row-major view: at(r, c) = p[r * ld_r + c * ld_c].
struct Dense {
  const int8_t* p;
  int64_t ld_r, ld_c;
  ET_HOST_DEVICE int at(int64_t r, int64_t c) const { return p[r * ld_r + c * ld_c]; }
};

// x[n][c][h][w] at input position (h, w), 0 outside the plane (the padding).
ET_HOST_DEVICE inline int input_at(const int8_t* x, const ConvShape& s, int64_t n, int c, int h, int w) {
  if (h < 0 || h >= s.H || w < 0 || w >= s.W) return 0;
  return x[((n * s.C + c) * s.H + h) * int64_t(s.W) + w];
}

// Forward B: row (c, r, s), column (n, p, q) -> x at (p * stride - pad + r, q * stride - pad + s).
struct ConvInputByTaps {
  const int8_t* x;
  ConvShape s;
  ET_HOST_DEVICE int at(int64_t row, int64_t col) const {
    const int RS = s.taps(), PQ = s.P * s.Q;
    const int c = int(row / RS), t = int(row % RS);
    const int64_t n = col / PQ;
    const int pq = int(col % PQ), p = pq / s.Q, q = pq % s.Q;
    return input_at(x, s, n, c, p * s.stride_h - s.pad_h + t / s.S, q * s.stride_w - s.pad_w + t % s.S);
  }
};

// Weight-gradient B: row (n, p, q), column (c, r, s) -> the same x element as above.
struct ConvInputByPositions {
  ConvInputByTaps x;
  ET_HOST_DEVICE int at(int64_t row, int64_t col) const { return x.at(col, row); }
};

// Data-gradient A: row c, column (k, r, s) -> w[k][c][r][s].
struct WeightsByInputChannel {
  const int8_t* w;
  ConvShape s;
  ET_HOST_DEVICE int at(int64_t c, int64_t col) const {
    const int RS = s.taps();
    const int64_t k = col / RS, t = col % RS;
    return w[(k * s.C + c) * RS + t];
  }
};

// Data-gradient B: row (k, r, s), column (n, h, w) -> g[n][k][p][q] for the output (p, q) whose
// window puts tap (r, s) on (h, w): p * stride = h + pad - r; 0 where no output does.
struct GradByTaps {
  const int8_t* g;
  ConvShape s;
  ET_HOST_DEVICE int at(int64_t row, int64_t col) const {
    const int RS = s.taps(), HW = s.H * s.W;
    const int k = int(row / RS), t = int(row % RS);
    const int64_t n = col / HW;
    const int hw = int(col % HW), h = hw / s.W, w = hw % s.W;
    const int ph = h + s.pad_h - t / s.S, pw = w + s.pad_w - t % s.S;
    if (ph < 0 || pw < 0 || ph % s.stride_h != 0 || pw % s.stride_w != 0) return 0;
    const int p = ph / s.stride_h, q = pw / s.stride_w;
    if (p >= s.P || q >= s.Q) return 0;
    return g[((n * s.K + k) * s.P + p) * int64_t(s.Q) + q];
  }
};

// Weight-gradient A: row k, column (n, p, q) -> g[n][k][p][q].
struct GradByPositions {
  const int8_t* g;
  ConvShape s;
  ET_HOST_DEVICE int at(int64_t k, int64_t col) const {
    const int PQ = s.P * s.Q;
    const int64_t n = col / PQ;
    return g[(n * s.K + k) * PQ + col % PQ];
  }
};

// Where C[m][n] goes in the output tensor.
// Forward: m = k, n = (img, p, q) -> y[img][k][p][q]; data gradient: m = c, n = (img, h, w).
struct PlanesOut {
  int64_t channels, plane;  // channels of the output tensor, positions per plane
  ET_HOST_DEVICE int64_t at(int64_t m, int64_t n) const { return (n / plane * channels + m) * plane + n % plane; }
};
// Row-major C (the weight gradient, linear layers): m * ld + n.
struct RowsOut {
  int64_t ld;
  ET_HOST_DEVICE int64_t at(int64_t m, int64_t n) const { return m * ld + n; }
};

}  // namespace int_gemm
}  // namespace et
