// A pooling window on CUDA, the CPU's rules (backends/cpu/pool_planes.h): a max window's first
// maximum, padding never winning (a -FLT_MAX start, a strict >), an average window's mean with
// padding counted, a plane's sum for the global average, and which output windows cover an input
// row. Shared by the pooling layers (cuda_pooling.cu) and the fused stacks ending in a pool
// (cuda_batchnorm.cu, cuda_relu_pool.cu), so both compute the same bits. Device code, C++14.
#pragma once
#include <cfloat>
#include <cstdint>

#include "backends/backend.h"  // Conv2dGeom
#include "backends/cuda/index_math.h"

namespace et {
namespace cuda_pool {

struct Geom {
  int64_t C, H, W, P, Q, R, S, sh, sw, ph, pw;
};
inline Geom geom_of(const Conv2dGeom& g) {
  return Geom{g.C, g.H, g.W, g.P, g.Q, g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
}

// The values of the plane starting at element `base` of x, for max_at. X: const float*, or
// cuda::StoredX (cuda_stored_x.h: x as the stash keeps it).
template <class X>
struct PlaneValues {
  X x;
  int64_t base;
  __device__ __forceinline__ float operator()(int64_t i) const { return x[base + i]; }
};
template <class X>
__device__ __forceinline__ PlaneValues<X> plane_values(const X& x, int64_t base) {
  return PlaneValues<X>{x, base};
}

// Window (p, q)'s first maximum of value(h * W + w) over its elements inside the plane, and where
// (*arg; -1 where none is greater than -FLT_MAX).
template <class Value>
__device__ __forceinline__ float max_at(const Geom& g, const Value& value, int64_t p, int64_t q, int64_t* arg) {
  float m = -FLT_MAX;
  *arg = -1;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t h = p * g.sh - g.ph + r;
    if (h < 0 || h >= g.H) continue;
    for (int64_t s = 0; s < g.S; ++s) {
      const int64_t w = q * g.sw - g.pw + s;
      if (w < 0 || w >= g.W) continue;
      const float v = value(h * g.W + w);
      if (v > m) {
        m = v;
        *arg = h * g.W + w;
      }
    }
  }
  return m;
}

// Window (p, q)'s average of value(h * W + w) over its elements inside the plane, padding counted
// (count_include_pad): their sum in window order, times 1 / (R * S).
template <class Value>
__device__ __forceinline__ float avg_at(const Geom& g, const Value& value, int64_t p, int64_t q) {
  float s = 0.f;
  for (int64_t r = 0; r < g.R; ++r) {
    const int64_t h = p * g.sh - g.ph + r;
    if (h < 0 || h >= g.H) continue;
    for (int64_t t = 0; t < g.S; ++t) {
      const int64_t w = q * g.sw - g.pw + t;
      if (w >= 0 && w < g.W) s += value(h * g.W + w);
    }
  }
  return s * (1.f / float(g.R * g.S));
}

// A plane's sum of value(i), i in [0, HW), by one warp: lane l adds elements l, l + 32, ... in
// order, then the lanes' sums meet in a shuffle tree; lane 0 gets the plane's. The global average
// pool's order, for the layer (cuda_pooling.cu) and a fused stack ending in one (cuda_batchnorm.cu):
// both divide it by HW, so both give the same bits. Every lane of the warp calls it.
template <class Value>
__device__ __forceinline__ float warp_plane_sum(const Value& value, int64_t HW, int lane) {
  float s = 0.f;
  for (int64_t i = lane; i < HW; i += 32) s += value(i);
  for (int o = 16; o > 0; o /= 2) s += __shfl_down_sync(0xFFFFFFFFu, s, o);
  return s;
}

// The output windows covering input row h: p in [*lo, *hi).
__device__ __forceinline__ void covering(int64_t h, int64_t pad, int64_t R, int64_t stride, int64_t P, int64_t* lo,
                                         int64_t* hi) {
  const int64_t top = h + pad - R + 1;  // p * stride >= top
  *lo = top <= 0 ? 0 : cuda_index::idiv(top + stride - 1, stride);
  const int64_t last = cuda_index::idiv(h + pad, stride);
  *hi = last + 1 < P ? last + 1 : P;
}

// Input element (h, w)'s gradient from the max windows covering it: the sum, in window order, of
// the dy (dyp: the plane's) of those whose first maximum it is.
template <class Value>
__device__ __forceinline__ float max_gradient(const Geom& g, const Value& value, const float* dyp, int64_t h,
                                              int64_t w, float start) {
  int64_t p0, p1, q0, q1;
  covering(h, g.ph, g.R, g.sh, g.P, &p0, &p1);
  covering(w, g.pw, g.S, g.sw, g.Q, &q0, &q1);
  float v = start;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t q = q0; q < q1; ++q) {
      int64_t arg;
      max_at(g, value, p, q, &arg);
      if (arg == h * g.W + w) v += dyp[p * g.Q + q];
    }
  return v;
}

// Input element (h, w)'s gradient from the average windows covering it (padding counted): start
// plus, in window order, each window's dy (dyp: the plane's) times 1 / (R * S).
__device__ __forceinline__ float avg_gradient(const Geom& g, const float* dyp, int64_t h, int64_t w, float start) {
  const float inv = 1.f / float(g.R * g.S);
  int64_t p0, p1, q0, q1;
  covering(h, g.ph, g.R, g.sh, g.P, &p0, &p1);
  covering(w, g.pw, g.S, g.sw, g.Q, &q0, &q1);
  float v = start;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t q = q0; q < q1; ++q) v += dyp[p * g.Q + q] * inv;
  return v;
}

}  // namespace cuda_pool
}  // namespace et
