// Pooling on CUDA, the CPU's rules (backends/cpu/pool_planes.h): max windows where padding never
// wins and the gradient goes to the first maximum; averages with count_include_pad. Backward
// passes gather: each input element sums, in window order, what the windows covering it send it
// (the argmax found again from x), so nothing races and the sum's order is the CPU reference's.
// The max-pool backward reads x as the stash keeps it (cuda_stored_x.h), without a decode buffer.
#include <cfloat>

#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_pool_window.h"
#include "backends/cuda/cuda_stored_x.h"
#include "backends/cuda/index_math.h"

namespace et {

namespace {

using cuda::blocks_for;
using cuda::kThreads;

using cuda_pool::Geom;
using cuda_pool::geom_of;
using cuda_pool::plane_values;
using cuda_index::idiv;  // (backends/cuda/index_math.h: 32-bit divisions where they fit)
using cuda_index::imod;

__global__ void maxpool_forward_kernel(Geom g, int64_t total, const float* x, float* y) {
  ET_GRID_STRIDE(i, total) {
    const int64_t plane = idiv(i, g.P * g.Q), p = imod(idiv(i, g.Q), g.P), q = imod(i, g.Q);
    int64_t arg;
    y[i] = cuda_pool::max_at(g, plane_values(x, plane * g.H * g.W), p, q, &arg);
  }
}

// X: const float*, or cuda::StoredX (x as the stash keeps it: maxpool2d_backward_reads).
template <class X>
__global__ void maxpool_backward_kernel(Geom g, int64_t total, X x, const float* dy, float* dx, bool acc) {
  ET_GRID_STRIDE(i, total) {
    const int64_t plane = idiv(i, g.H * g.W), h = imod(idiv(i, g.W), g.H), w = imod(i, g.W);
    dx[i] = cuda_pool::max_gradient(g, plane_values(x, plane * g.H * g.W), dy + plane * g.P * g.Q, h, w,
                                    acc ? dx[i] : 0.f);
  }
}

__global__ void avgpool_forward_kernel(Geom g, int64_t total, const float* x, float* y) {
  ET_GRID_STRIDE(i, total) {
    const int64_t plane = idiv(i, g.P * g.Q), p = imod(idiv(i, g.Q), g.P), q = imod(i, g.Q);
    y[i] = cuda_pool::avg_at(g, plane_values(x, plane * g.H * g.W), p, q);
  }
}

__global__ void avgpool_backward_kernel(Geom g, int64_t total, const float* dy, float* dx, bool acc) {
  ET_GRID_STRIDE(i, total) {
    const int64_t plane = idiv(i, g.H * g.W), h = imod(idiv(i, g.W), g.H), w = imod(i, g.W);
    dx[i] = cuda_pool::avg_gradient(g, dy + plane * g.P * g.Q, h, w, acc ? dx[i] : 0.f);
  }
}

// One plane per warp: a warp-shuffle sum in float (the CPU sums a plane in float too).
__global__ void global_avg_forward_kernel(const float* x, int64_t planes, int64_t HW, float* y) {
  const int64_t plane = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (plane >= planes) return;
  const float s = cuda_pool::warp_plane_sum(plane_values(x, plane * HW), HW, lane);
  if (lane == 0) y[plane] = s / float(HW);
}

__global__ void global_avg_backward_kernel(const float* dy, int64_t total, int64_t HW, float* dx, bool acc) {
  ET_GRID_STRIDE(i, total) {
    const float v = dy[idiv(i, HW)] / float(HW);
    dx[i] = acc ? dx[i] + v : v;
  }
}

__global__ void subsample_pad_forward_kernel(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t K,
                                             int64_t P, int64_t Q, int64_t s, int64_t pad, float* y) {
  const int64_t total = N * K * P * Q;
  ET_GRID_STRIDE(i, total) {
    const int64_t n = idiv(i, K * P * Q), k = imod(idiv(i, P * Q), K), p = imod(idiv(i, Q), P), q = imod(i, Q);
    const int64_t c = k - pad;
    y[i] = c < 0 || c >= C ? 0.f : x[((n * C + c) * H + p * s) * W + q * s];
  }
}

__global__ void subsample_pad_backward_kernel(const float* dy, int64_t N, int64_t C, int64_t H, int64_t W, int64_t K,
                                              int64_t P, int64_t Q, int64_t s, int64_t pad, float* dx, bool acc) {
  const int64_t total = N * C * H * W;
  ET_GRID_STRIDE(i, total) {
    const int64_t n = idiv(i, C * H * W), c = imod(idiv(i, H * W), C), h = imod(idiv(i, W), H), w = imod(i, W);
    float v = acc ? dx[i] : 0.f;
    if (imod(h, s) == 0 && imod(w, s) == 0 && idiv(h, s) < P && idiv(w, s) < Q)
      v += dy[((n * K + c + pad) * P + idiv(h, s)) * Q + idiv(w, s)];
    dx[i] = v;
  }
}

}  // namespace

void CudaBackend::maxpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) {
  const int64_t total = g.N * g.C * g.P * g.Q;
  maxpool_forward_kernel<<<blocks_for(total), kThreads, 0, stream_>>>(geom_of(g), total, x.f32(), y.f32());
  cuda::launched("maxpool2d_forward");
}

DTypeSet CudaBackend::maxpool2d_backward_reads() const { return kStashDTypes; }

void CudaBackend::maxpool2d_backward(const Conv2dGeom& g, const Tensor& dy, const Tensor& x, Tensor& dx,
                                     bool accumulate, Workspace) {
  const int64_t total = g.N * g.C * g.H * g.W;
  cuda::with_stored_x(x, *codec_, "maxpool2d_backward", [&](auto xs) {
    maxpool_backward_kernel<<<blocks_for(total), kThreads, 0, stream_>>>(geom_of(g), total, xs, dy.f32(), dx.f32(),
                                                                         accumulate);
  });
  cuda::launched("maxpool2d_backward");
}

void CudaBackend::avgpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) {
  const int64_t total = g.N * g.C * g.P * g.Q;
  avgpool_forward_kernel<<<blocks_for(total), kThreads, 0, stream_>>>(geom_of(g), total, x.f32(), y.f32());
  cuda::launched("avgpool2d_forward");
}

void CudaBackend::avgpool2d_backward(const Conv2dGeom& g, const Tensor& dy, Tensor& dx, bool accumulate) {
  const int64_t total = g.N * g.C * g.H * g.W;
  avgpool_backward_kernel<<<blocks_for(total), kThreads, 0, stream_>>>(geom_of(g), total, dy.f32(), dx.f32(),
                                                                       accumulate);
  cuda::launched("avgpool2d_backward");
}

void CudaBackend::global_avgpool_forward(const Tensor& x, Tensor& y) {
  const int64_t planes = x.dim(0) * x.dim(1), HW = x.dim(2) * x.dim(3);
  global_avg_forward_kernel<<<unsigned((planes * 32 + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(
      x.f32(), planes, HW, y.f32());
  cuda::launched("global_avgpool_forward");
}

void CudaBackend::global_avgpool_backward(const Tensor& dy, Tensor& dx, bool accumulate) {
  const int64_t HW = dx.dim(2) * dx.dim(3);
  global_avg_backward_kernel<<<blocks_for(dx.numel()), kThreads, 0, stream_>>>(dy.f32(), dx.numel(), HW, dx.f32(),
                                                                               accumulate);
  cuda::launched("global_avgpool_backward");
}

void CudaBackend::subsample_pad_forward(const Tensor& x, int64_t stride, int64_t pad, Tensor& y) {
  subsample_pad_forward_kernel<<<blocks_for(y.numel()), kThreads, 0, stream_>>>(
      x.f32(), x.dim(0), x.dim(1), x.dim(2), x.dim(3), y.dim(1), y.dim(2), y.dim(3), stride, pad, y.f32());
  cuda::launched("subsample_pad_forward");
}

void CudaBackend::subsample_pad_backward(const Tensor& dy, int64_t stride, int64_t pad, Tensor& dx, bool accumulate) {
  subsample_pad_backward_kernel<<<blocks_for(dx.numel()), kThreads, 0, stream_>>>(
      dy.f32(), dx.dim(0), dx.dim(1), dx.dim(2), dx.dim(3), dy.dim(1), dy.dim(2), dy.dim(3), stride, pad, dx.f32(),
      accumulate);
  cuda::launched("subsample_pad_backward");
}

}  // namespace et
