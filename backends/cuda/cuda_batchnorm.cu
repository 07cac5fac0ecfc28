// Batch norm on CUDA: one block per channel reduces its N planes (double accumulators, as the CPU
// does, in another order: results agree to rounding), then applies the CPU's coefficients
// (backends/cpu/batchnorm.cpp: train / eval scale and shift, the backward's a * dy + b * x + c0).
#include "backends/cuda/cuda_backend_impl.h"

namespace et {

namespace {

constexpr int kBnThreads = 256;

// Block-wide sums of two doubles; every thread gets them.
__device__ void block_sum2(double& a, double& b) {
  __shared__ double sa[kBnThreads], sb[kBnThreads];
  sa[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int s = kBnThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      sa[threadIdx.x] += sa[threadIdx.x + s];
      sb[threadIdx.x] += sb[threadIdx.x + s];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
  __syncthreads();
}

// Channel blockIdx.x: statistics, running statistics, y = x * scale + shift.
__global__ void bn_train_kernel(const float* x, int64_t N, int64_t C, int64_t HW, const float* gamma, const float* beta,
                                float* running_mean, float* running_var, float momentum, float eps, float* y,
                                float* mean, float* invstd) {
  const int64_t c = blockIdx.x, M = N * HW;
  double s = 0, ss = 0;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const float v = x[(j / HW * C + c) * HW + j % HW];
    s += v;
    ss += double(v) * double(v);
  }
  block_sum2(s, ss);
  const double mu = s / double(M);
  const double var = fmax(0.0, ss / double(M) - mu * mu);
  const float m = float(mu), is = float(1.0 / sqrt(var + double(eps)));
  if (threadIdx.x == 0) {
    mean[c] = m;
    invstd[c] = is;
    if (running_mean) {
      const double unbiased = M > 1 ? var * double(M) / double(M - 1) : var;
      running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * m;
      running_var[c] = (1.f - momentum) * running_var[c] + momentum * float(unbiased);
    }
  }
  const float scale = gamma[c] * is, shift = beta[c] - m * scale;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t at = (j / HW * C + c) * HW + j % HW;
    y[at] = x[at] * scale + shift;
  }
}

__global__ void bn_eval_kernel(const float* x, int64_t n_total, int64_t C, int64_t HW, const float* gamma,
                               const float* beta, const float* rm, const float* rv, float eps, float* y) {
  ET_GRID_STRIDE(i, n_total) {
    const int64_t c = i / HW % C;
    const float scale = gamma[c] / sqrtf(rv[c] + eps), shift = beta[c] - rm[c] * scale;
    y[i] = x[i] * scale + shift;
  }
}

__global__ void bn_frozen_backward_kernel(const float* dy, int64_t n_total, int64_t C, int64_t HW, const float* gamma,
                                          const float* rv, float eps, float* dx, bool acc) {
  ET_GRID_STRIDE(i, n_total) {
    const int64_t c = i / HW % C;
    const float v = dy[i] * (gamma[c] / sqrtf(rv[c] + eps));
    dx[i] = acc ? dx[i] + v : v;
  }
}

// Channel blockIdx.x: sum dy and sum dy * (x - mean), then dgamma, dbeta and dx.
__global__ void bn_backward_kernel(const float* dy, const float* x, int64_t N, int64_t C, int64_t HW,
                                   const float* gamma, const float* mean, const float* invstd, float* dx, bool acc_dx,
                                   float* dgamma, float* dbeta, bool acc_params) {
  const int64_t c = blockIdx.x, M = N * HW;
  const float mu = mean[c], is = invstd[c];
  double sdy = 0, sdyx = 0;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t at = (j / HW * C + c) * HW + j % HW;
    sdy += dy[at];
    sdyx += double(dy[at]) * double(x[at] - mu);
  }
  block_sum2(sdy, sdyx);
  const float db = float(sdy), dg = float(sdyx) * is;
  const float g = gamma[c] * is / float(M), coef = dg * is;
  const float a = g * float(M), b = -g * coef, c0 = -g * db + g * mu * coef;
  if (threadIdx.x == 0) {
    if (dbeta) dbeta[c] = acc_params ? dbeta[c] + db : db;
    if (dgamma) dgamma[c] = acc_params ? dgamma[c] + dg : dg;
  }
  if (!dx) return;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t at = (j / HW * C + c) * HW + j % HW;
    const float v = a * dy[at] + b * x[at] + c0;
    dx[at] = acc_dx ? dx[at] + v : v;
  }
}

float* opt(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

}  // namespace

void CudaBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                          Tensor& running_mean, Tensor& running_var, float momentum, float eps,
                                          Tensor& y, Tensor& mean, Tensor& invstd) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  bn_train_kernel<<<unsigned(C), kBnThreads>>>(x.f32(), N, C, HW, gamma.f32(), beta.f32(), opt(running_mean),
                                               opt(running_var), momentum, eps, y.f32(), mean.f32(), invstd.f32());
  cuda::launched("batchnorm_forward_train");
}

void CudaBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y) {
  const int64_t C = x.dim(1), HW = x.dim(2) * x.dim(3);
  bn_eval_kernel<<<cuda::blocks_for(x.numel()), cuda::kThreads>>>(x.f32(), x.numel(), C, HW, gamma.f32(), beta.f32(),
                                                                  running_mean.f32(), running_var.f32(), eps, y.f32());
  cuda::launched("batchnorm_forward_eval");
}

void CudaBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                     const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma,
                                     Tensor& dbeta, bool accumulate_params) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
  bn_backward_kernel<<<unsigned(C), kBnThreads>>>(dy.f32(), x.f32(), N, C, HW, gamma.f32(), mean.f32(), invstd.f32(),
                                                  opt(dx), accumulate_dx, opt(dgamma), opt(dbeta), accumulate_params);
  cuda::launched("batchnorm_backward");
}

void CudaBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var, float eps,
                                            Tensor& dx, bool accumulate) {
  const int64_t C = dy.dim(1), HW = dy.dim(2) * dy.dim(3);
  bn_frozen_backward_kernel<<<cuda::blocks_for(dy.numel()), cuda::kThreads>>>(
      dy.f32(), dy.numel(), C, HW, gamma.f32(), running_var.f32(), eps, dx.f32(), accumulate);
  cuda::launched("batchnorm_backward_frozen");
}

}  // namespace et
