// Pooling on CPU: runs of (n, c) planes per call, runs spread over threads. A run is one plane,
// or, where the windows tile each plane (pool_planes::pools_as_one_plane: VGG's 2x2 stride 2), up
// to kRunFloats of input as one tall plane: on the late stages' small planes a call per plane
// costs more than its work.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu/always_inline.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/pool_planes.h"
#include "memory/stored_reader.h"

namespace et {

namespace {
constexpr int64_t kRunFloats = 4096;
int64_t run_planes(const Conv2dGeom& g) {
  return pool_planes::pools_as_one_plane(pool_planes::of(g)) ? std::max<int64_t>(1, kRunFloats / (g.H * g.W)) : 1;
}
int64_t run_floats(const Conv2dGeom& g) { return (run_planes(g) * g.H * g.W + 15) / 16 * 16; }  // 64-byte multiples

// f(first plane, planes, the run's plane geometry) for every run, threads over runs.
template <class F>
void for_each_run(const Conv2dGeom& g, F f) {
  const int64_t planes = g.N * g.C, G = run_planes(g), runs = (planes + G - 1) / G;
  const pool_planes::Plane pg = pool_planes::of(g);
#pragma omp for schedule(static)
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t p0 = r * G, k = std::min(G, planes - p0);
    f(p0, k, k == 1 ? pg : pool_planes::stacked(pg, k));
  }
}
}  // namespace

// y [N,C,P,Q] = max over each R x S window of x [N,C,H,W] (padding never wins)
void CpuBackend::maxpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) {
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
#pragma omp parallel
  for_each_run(g, [&](int64_t p0, int64_t, const pool_planes::Plane& pg) {
    pool_planes::max_forward(pg, x.f32() + p0 * HW, y.f32() + p0 * PQ);
  });
}

namespace {
// pool(g, x, y) over every run, then the run's output planes' sums for the BN reading y
// (bn_rows::plane_sums, which Backend::plane_sums calls: the same bits), while they are in cache:
// the fused stack reading y takes its statistics from them instead of reading y once more.
template <class Pool>
void pool_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums, Pool pool) {
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q, C = g.C;
  ET_CHECK(sums.dim(0) == 2 && sums.dim(1) >= g.N && sums.dim(2) == C, "pooling: plane sums of ", y.shape.str(),
           " into ", sums.shape.str());
  float *s1 = sums.f32(), *s2 = s1 + sums.dim(1) * C;
#pragma omp parallel
  for_each_run(g, [&](int64_t p0, int64_t k, const pool_planes::Plane& pg) {
    float* yp = y.f32() + p0 * PQ;
    pool(pg, x.f32() + p0 * HW, yp);
    for (int64_t i = 0; i < k; ++i) bn_rows::plane_sums(yp + i * PQ, PQ, s1 + p0 + i, s2 + p0 + i);
  });
}
}  // namespace

void CpuBackend::maxpool2d_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums) {
  pool_forward_sums(g, x, y, sums, [](const pool_planes::Plane& pg, const float* xp, float* yp) {
    pool_planes::max_forward(pg, xp, yp);
  });
}

size_t CpuBackend::maxpool2d_workspace_bytes(const Conv2dGeom& g) const {
  return size_t(cpu_threads()) * size_t(run_floats(g)) * sizeof(float);
}

// x may be the stash's encoding: each thread decodes its runs (increasing under the static
// schedule) into its own slice of the workspace.
void CpuBackend::maxpool2d_backward(const Conv2dGeom& g, const Tensor& dy, const Tensor& x, Tensor& dx,
                                    bool accumulate, Workspace ws) {
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
  ET_CHECK(x.dtype == DType::F32 || ws.bytes >= maxpool2d_workspace_bytes(g), "maxpool2d backward: workspace");
#pragma omp parallel
  {
    StoredReader xr(x, static_cast<float*>(ws.data) + omp_get_thread_num() * run_floats(g), run_floats(g));
    for_each_run(g, [&](int64_t p0, int64_t k, const pool_planes::Plane& pg) {
      const float* xp = xr.read(p0 * HW, k * HW);
      float* dxp = dx.f32() + p0 * HW;
      pool_planes::max_backward(pg, xp, dy.f32() + p0 * PQ, dxp, accumulate);
    });
  }
}

void CpuBackend::avgpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) {
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
#pragma omp parallel
  for_each_run(g, [&](int64_t p0, int64_t, const pool_planes::Plane& pg) {
    pool_planes::avg_forward(pg, x.f32() + p0 * HW, y.f32() + p0 * PQ);
  });
}

void CpuBackend::avgpool2d_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums) {
  pool_forward_sums(g, x, y, sums, [](const pool_planes::Plane& pg, const float* xp, float* yp) {
    pool_planes::avg_forward(pg, xp, yp);
  });
}

void CpuBackend::avgpool2d_backward(const Conv2dGeom& g, const Tensor& dy, Tensor& dx, bool accumulate) {
  const int64_t HW = g.H * g.W, PQ = g.P * g.Q;
#pragma omp parallel
  for_each_run(g, [&](int64_t p0, int64_t k, const pool_planes::Plane& pg) {
    float* dxp = dx.f32() + p0 * HW;
    if (!accumulate) std::memset(dxp, 0, sizeof(float) * size_t(k * HW));
    pool_planes::avg_backward(pg, dy.f32() + p0 * PQ, dxp);
  });
}

namespace pool_planes {
ET_NOINLINE float plane_mean(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s / float(n);
}

ET_NOINLINE void plane_mean_backward(float dy, int64_t n, float* dx, bool accumulate) {
  const float v = dy / float(n);
  if (accumulate) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] += v;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] = v;
  }
}
}  // namespace pool_planes

// y [N,C] = mean over H,W of x [N,C,H,W]
void CpuBackend::global_avgpool_forward(const Tensor& x, Tensor& y) {
  const int64_t planes = x.dim(0) * x.dim(1), HW = x.dim(2) * x.dim(3);
#pragma omp parallel for schedule(static)
  for (int64_t pl = 0; pl < planes; ++pl) y.f32()[pl] = pool_planes::plane_mean(x.f32() + pl * HW, HW);
}

void CpuBackend::global_avgpool_backward(const Tensor& dy, Tensor& dx, bool accumulate) {
  const int64_t planes = dx.dim(0) * dx.dim(1), HW = dx.dim(2) * dx.dim(3);
#pragma omp parallel for schedule(static)
  for (int64_t pl = 0; pl < planes; ++pl)
    pool_planes::plane_mean_backward(dy.f32()[pl], HW, dx.f32() + pl * HW, accumulate);
}

// Option-A shortcut: plane (n, k) of y is zero or the strided subsample of plane (n, k - pad) of x.
void CpuBackend::subsample_pad_forward(const Tensor& x, int64_t s, int64_t pad, Tensor& y) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t K = y.dim(1), P = y.dim(2), Q = y.dim(3);
#pragma omp parallel for schedule(static)
  for (int64_t pl = 0; pl < N * K; ++pl) {
    const int64_t n = pl / K, c = pl % K - pad;
    float* yp = y.f32() + pl * P * Q;
    if (c < 0 || c >= C) {
      std::memset(yp, 0, sizeof(float) * size_t(P * Q));
      continue;
    }
    const float* xp = x.f32() + (n * C + c) * H * W;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) yp[p * Q + q] = xp[p * s * W + q * s];
  }
}

void CpuBackend::subsample_pad_backward(const Tensor& dy, int64_t s, int64_t pad, Tensor& dx, bool accumulate) {
  const int64_t N = dx.dim(0), C = dx.dim(1), H = dx.dim(2), W = dx.dim(3);
  const int64_t K = dy.dim(1), P = dy.dim(2), Q = dy.dim(3);
#pragma omp parallel for schedule(static)
  for (int64_t pl = 0; pl < N * C; ++pl) {
    const int64_t n = pl / C, c = pl % C;
    float* dxp = dx.f32() + pl * H * W;
    if (!accumulate) std::memset(dxp, 0, sizeof(float) * size_t(H * W));
    const float* dyp = dy.f32() + (n * K + c + pad) * P * Q;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) dxp[p * s * W + q * s] += dyp[p * Q + q];
  }
}

}  // namespace et
