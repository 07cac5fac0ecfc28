// Pooling of one (n, c) plane on CPU, shared by the pooling layers (pooling.cpp) and the fused
// stacks (fused.cpp), so fused and unfused pooling agree bit for bit. The *_reference functions
// are the definitions, one output at a time. The fast ones give the same bits: output columns
// whose window lies inside the row run as vectors over the columns, each lane taking the window's
// taps in the reference's order (the same compares, the same additions); border columns and the
// gradient scatter run the reference loops, the scatter in the reference's order.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <climits>

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

// One output of the max window at (p, q): its maximum (padding never wins) and, in *arg, the
// flat index of its first maximum (PyTorch's rule), -1 if the window lies outside the plane.
inline float max_at(const Plane& g, const float* x, int64_t p, int64_t q, int64_t* arg) {
  float m = -FLT_MAX;
  *arg = -1;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t h = p * g.stride_h - g.pad_h + r;
    if (h < 0 || h >= g.H) continue;
    for (int64_t s = 0; s < g.S; ++s) {
      const int64_t w = q * g.stride_w - g.pad_w + s;
      if (w >= 0 && w < g.W && x[h * g.W + w] > m) {
        m = x[h * g.W + w];
        *arg = h * g.W + w;
      }
    }
  }
  return m;
}

// One output of the average window at (p, q), count_include_pad = true (PyTorch's default).
inline float avg_at(const Plane& g, const float* x, int64_t p, int64_t q) {
  float s = 0.f;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t h = p * g.stride_h - g.pad_h + r;
    if (h < 0 || h >= g.H) continue;
    for (int64_t t = 0; t < g.S; ++t) {
      const int64_t w = q * g.stride_w - g.pad_w + t;
      if (w >= 0 && w < g.W) s += x[h * g.W + w];
    }
  }
  return s * (1.f / float(g.R * g.S));
}

// y [P,Q] = max over each window of x [H,W].
inline void max_forward_reference(const Plane& g, const float* x, float* y) {
  int64_t arg;
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) y[p * g.Q + q] = max_at(g, x, p, q, &arg);
}

// dx [H,W] += dy routed to the first maximum of each window of x.
inline void max_backward_reference(const Plane& g, const float* x, const float* dy, float* dx) {
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) {
      int64_t arg;
      max_at(g, x, p, q, &arg);
      if (arg >= 0) dx[arg] += dy[p * g.Q + q];
    }
}

inline void avg_forward_reference(const Plane& g, const float* x, float* y) {
  for (int64_t p = 0; p < g.P; ++p)
    for (int64_t q = 0; q < g.Q; ++q) y[p * g.Q + q] = avg_at(g, x, p, q);
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

// Output columns [lo, hi) whose whole window lies inside the row.
inline void interior_columns(const Plane& g, int64_t* lo, int64_t* hi) {
  *lo = std::min(g.Q, (g.pad_w + g.stride_w - 1) / g.stride_w);
  const int64_t last = g.W - 1 + g.pad_w - (g.S - 1);  // largest q * stride_w that fits
  *hi = last < 0 ? *lo : std::max(*lo, std::min(g.Q, last / g.stride_w + 1));
}

constexpr int64_t kMaxFastColumns = 1024;  // wider rows take the reference loops

inline void max_forward(const Plane& g, const float* x, float* y) {
  int64_t lo, hi;
  interior_columns(g, &lo, &hi);
  if (g.Q > kMaxFastColumns) return max_forward_reference(g, x, y);
  const int64_t sw = g.stride_w;
  for (int64_t p = 0; p < g.P; ++p) {
    float* yr = y + p * g.Q;
    int64_t arg;
    for (int64_t q = 0; q < lo; ++q) yr[q] = max_at(g, x, p, q, &arg);
    for (int64_t q = hi; q < g.Q; ++q) yr[q] = max_at(g, x, p, q, &arg);
    for (int64_t q = lo; q < hi; ++q) yr[q] = -FLT_MAX;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t h = p * g.stride_h - g.pad_h + r;
      if (h < 0 || h >= g.H) continue;
      for (int64_t s = 0; s < g.S; ++s) {
        const float* xr = x + h * g.W - g.pad_w + s;
        if (sw == 1) {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) yr[q] = xr[q] > yr[q] ? xr[q] : yr[q];
        } else {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) yr[q] = xr[q * sw] > yr[q] ? xr[q * sw] : yr[q];
        }
      }
    }
  }
}

inline void max_backward(const Plane& g, const float* x, const float* dy, float* dx) {
  int64_t lo, hi;
  interior_columns(g, &lo, &hi);
  if (g.Q > kMaxFastColumns || g.H * g.W > INT32_MAX) return max_backward_reference(g, x, dy, dx);
  alignas(64) float m[kMaxFastColumns];
  alignas(64) int32_t arg[kMaxFastColumns];
  const int64_t sw = g.stride_w;
  for (int64_t p = 0; p < g.P; ++p) {
    for (int64_t q = lo; q < hi; ++q) {
      m[q] = -FLT_MAX;
      arg[q] = -1;
    }
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t h = p * g.stride_h - g.pad_h + r;
      if (h < 0 || h >= g.H) continue;
      for (int64_t s = 0; s < g.S; ++s) {
        const int64_t base = h * g.W - g.pad_w + s;
        const float* xr = x + base;
        if (sw == 1) {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) {
            const bool gt = xr[q] > m[q];
            m[q] = gt ? xr[q] : m[q];
            arg[q] = gt ? int32_t(base + q) : arg[q];
          }
        } else {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) {
            const float v = xr[q * sw];
            const bool gt = v > m[q];
            m[q] = gt ? v : m[q];
            arg[q] = gt ? int32_t(base + q * sw) : arg[q];
          }
        }
      }
    }
    const float* dyr = dy + p * g.Q;
    for (int64_t q = 0; q < g.Q; ++q) {  // the scatter, in the reference's order
      int64_t a;
      if (q >= lo && q < hi)
        a = arg[q];
      else
        max_at(g, x, p, q, &a);
      if (a >= 0) dx[a] += dyr[q];
    }
  }
}

inline void avg_forward(const Plane& g, const float* x, float* y) {
  int64_t lo, hi;
  interior_columns(g, &lo, &hi);
  if (g.Q > kMaxFastColumns) return avg_forward_reference(g, x, y);
  const float inv = 1.f / float(g.R * g.S);
  const int64_t sw = g.stride_w;
  alignas(64) float acc[kMaxFastColumns];
  for (int64_t p = 0; p < g.P; ++p) {
    float* yr = y + p * g.Q;
    for (int64_t q = 0; q < lo; ++q) yr[q] = avg_at(g, x, p, q);
    for (int64_t q = hi; q < g.Q; ++q) yr[q] = avg_at(g, x, p, q);
    for (int64_t q = lo; q < hi; ++q) acc[q] = 0.f;
    for (int64_t r = 0; r < g.R; ++r) {
      const int64_t h = p * g.stride_h - g.pad_h + r;
      if (h < 0 || h >= g.H) continue;
      for (int64_t t = 0; t < g.S; ++t) {
        const float* xr = x + h * g.W - g.pad_w + t;
        if (sw == 1) {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) acc[q] += xr[q];
        } else {
#pragma omp simd
          for (int64_t q = lo; q < hi; ++q) acc[q] += xr[q * sw];
        }
      }
    }
    for (int64_t q = lo; q < hi; ++q) yr[q] = acc[q] * inv;
  }
}

}  // namespace pool_planes
}  // namespace et
