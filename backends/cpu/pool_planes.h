// Pooling of one (n, c) plane on CPU, shared by the pooling layers (pooling.cpp) and the fused
// stacks (fused.cpp): the same loops in both, so fused and unfused pooling agree bit for bit
// (the max is order-free; the sums run in the same order).
#pragma once
#include <cfloat>
#include <cstdint>

#include "backends/backend.h"

namespace et {
namespace pool_planes {

struct Plane {
  int64_t H = 0, W = 0, P = 0, Q = 0;  // input and output plane
  int64_t R = 1, S = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
};
inline Plane of(const Conv2dGeom& g) { return {g.H, g.W, g.P, g.Q, g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w}; }
inline Plane of(const FusedStage& s) {
  return {s.H, s.W, s.P, s.Q, s.pool.R, s.pool.S, s.pool.stride_h, s.pool.stride_w, s.pool.pad_h, s.pool.pad_w};
}

// y [P,Q] = max over each window of x [H,W] (padding never wins).
inline void max_forward(const Plane& g, const float* x, float* y) {
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      float m = -FLT_MAX;
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t h = p * g.stride_h - g.pad_h + r;
        if (h < 0 || h >= g.H) continue;
        for (int64_t s = 0; s < g.S; ++s) {
          const int64_t w = q * g.stride_w - g.pad_w + s;
          if (w >= 0 && w < g.W && x[h * g.W + w] > m) m = x[h * g.W + w];
        }
      }
      y[p * g.Q + q] = m;
    }
}

// dx [H,W] += dy routed to the first maximum of each window of x (PyTorch's rule).
inline void max_backward(const Plane& g, const float* x, const float* dy, float* dx) {
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      float m = -FLT_MAX;
      int64_t arg = -1;
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t h = p * g.stride_h - g.pad_h + r;
        if (h < 0 || h >= g.H) continue;
        for (int64_t s = 0; s < g.S; ++s) {
          const int64_t w = q * g.stride_w - g.pad_w + s;
          if (w >= 0 && w < g.W && x[h * g.W + w] > m) {
            m = x[h * g.W + w];
            arg = h * g.W + w;
          }
        }
      }
      if (arg >= 0) dx[arg] += dy[p * g.Q + q];
    }
}

// count_include_pad = true (PyTorch's default).
inline void avg_forward(const Plane& g, const float* x, float* y) {
  const float inv = 1.f / float(g.R * g.S);
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      float s = 0.f;
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t h = p * g.stride_h - g.pad_h + r;
        if (h < 0 || h >= g.H) continue;
        for (int64_t t = 0; t < g.S; ++t) {
          const int64_t w = q * g.stride_w - g.pad_w + t;
          if (w >= 0 && w < g.W) s += x[h * g.W + w];
        }
      }
      y[p * g.Q + q] = s * inv;
    }
}

inline void avg_backward(const Plane& g, const float* dy, float* dx) {
  const float inv = 1.f / float(g.R * g.S);
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      const float v = dy[p * g.Q + q] * inv;
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t h = p * g.stride_h - g.pad_h + r;
        if (h < 0 || h >= g.H) continue;
        for (int64_t t = 0; t < g.S; ++t) {
          const int64_t w = q * g.stride_w - g.pad_w + t;
          if (w >= 0 && w < g.W) dx[h * g.W + w] += v;
        }
      }
    }
}

}  // namespace pool_planes
}  // namespace et
