// Batch norm on CUDA: P blocks per channel reduce its N planes (double accumulators, as the CPU
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

// The reductions are split over P blocks per channel, each over a fixed run of images, so that
// a layer of 16 channels still fills the GPU (one block per channel left 116 of an H200's 132 SMs
// idle: BN was a third of a ResNet-20 step); the partials are summed in a fixed order
// (deterministic, no atomics). P: about 1024 blocks in all, at most one per image.
int64_t parts_for(int64_t N, int64_t C) {
  const int64_t p = (1024 + C - 1) / C;
  return p < 1 ? 1 : p > N ? N : p;
}

// Block (c, part): the sums of f(x) and g(x) over channel c of images [N * part / P, N * (part + 1) / P).
// Forward: x and x^2. Backward: dy and dy * (x - mean).
__global__ void bn_partials_kernel(const float* x, const float* dy, const float* mean, int64_t N, int64_t C,
                                   int64_t HW, int64_t P, double* partials) {
  const int64_t c = blockIdx.x, part = blockIdx.y;
  const int64_t n0 = N * part / P, n1 = N * (part + 1) / P, M = (n1 - n0) * HW;
  double a = 0, b = 0;
  if (dy) {
    const float mu = mean[c];
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const int64_t at = ((n0 + j / HW) * C + c) * HW + j % HW;
      a += dy[at];
      b += double(dy[at]) * double(x[at] - mu);
    }
  } else {
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const float v = x[((n0 + j / HW) * C + c) * HW + j % HW];
      a += v;
      b += double(v) * double(v);
    }
  }
  block_sum2(a, b);
  if (threadIdx.x == 0) {
    partials[(c * P + part) * 2] = a;
    partials[(c * P + part) * 2 + 1] = b;
  }
}

// Channel c's forward statistics, running statistics and coefficients (coef[c] = scale, coef[C + c] = shift).
__global__ void bn_train_coefficients_kernel(const double* partials, int64_t P, int64_t C, int64_t M,
                                             const float* gamma, const float* beta, float* running_mean,
                                             float* running_var, float momentum, float eps, float* mean,
                                             float* invstd, float* coef) {
  ET_GRID_STRIDE(c, C) {
    double s = 0, ss = 0;
    for (int64_t p = 0; p < P; ++p) s += partials[(c * P + p) * 2], ss += partials[(c * P + p) * 2 + 1];
    const double mu = s / double(M);
    const double var = fmax(0.0, ss / double(M) - mu * mu);
    const float m = float(mu), is = float(1.0 / sqrt(var + double(eps)));
    mean[c] = m;
    invstd[c] = is;
    if (running_mean) {
      const double unbiased = M > 1 ? var * double(M) / double(M - 1) : var;
      running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * m;
      running_var[c] = (1.f - momentum) * running_var[c] + momentum * float(unbiased);
    }
    const float scale = gamma[c] * is;
    coef[c] = scale;
    coef[C + c] = beta[c] - m * scale;
  }
}

// y = x * scale + shift, every element in parallel.
__global__ void bn_apply_kernel(const float* x, int64_t n_total, int64_t C, int64_t HW, const float* coef, float* y) {
  ET_GRID_STRIDE(i, n_total) {
    const int64_t c = i / HW % C;
    y[i] = x[i] * coef[c] + coef[C + c];
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

// Channel c's dgamma, dbeta and its dx coefficients: dx = a * dy + b * x + c0 (coef[c], [C + c], [2C + c]).
__global__ void bn_backward_coefficients_kernel(const double* partials, int64_t P, int64_t C, int64_t M,
                                                const float* gamma, const float* mean, const float* invstd,
                                                float* dgamma, float* dbeta, bool acc_params, float* coef) {
  ET_GRID_STRIDE(c, C) {
    double sdy = 0, sdyx = 0;
    for (int64_t p = 0; p < P; ++p) sdy += partials[(c * P + p) * 2], sdyx += partials[(c * P + p) * 2 + 1];
    const float mu = mean[c], is = invstd[c];
    const float db = float(sdy), dg = float(sdyx) * is;
    const float g = gamma[c] * is / float(M), k = dg * is;
    coef[c] = g * float(M);
    coef[C + c] = -g * k;
    coef[2 * C + c] = -g * db + g * mu * k;
    if (dbeta) dbeta[c] = acc_params ? dbeta[c] + db : db;
    if (dgamma) dgamma[c] = acc_params ? dgamma[c] + dg : dg;
  }
}

__global__ void bn_backward_apply_kernel(const float* dy, const float* x, int64_t n_total, int64_t C, int64_t HW,
                                         const float* coef, float* dx, bool acc) {
  ET_GRID_STRIDE(i, n_total) {
    const int64_t c = i / HW % C;
    const float v = coef[c] * dy[i] + coef[C + c] * x[i] + coef[2 * C + c];
    dx[i] = acc ? dx[i] + v : v;
  }
}

float* opt(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }

}  // namespace

double* CudaBackend::bn_scratch(int64_t doubles) {
  if (doubles > bn_scratch_capacity_) {
    cudaFree(bn_scratch_);
    bn_scratch_ = nullptr;
    cuda::check(cudaMalloc(reinterpret_cast<void**>(&bn_scratch_), size_t(doubles) * 8), "cudaMalloc");
    bn_scratch_capacity_ = doubles;
  }
  return bn_scratch_;
}

void CudaBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                          Tensor& running_mean, Tensor& running_var, float momentum, float eps,
                                          Tensor& y, Tensor& mean, Tensor& invstd) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), P = parts_for(N, C);
  double* partials = bn_scratch(C * P * 2 + 2 * C);  // then the coefficients, 2C floats in C doubles' room
  float* coef = reinterpret_cast<float*>(partials + C * P * 2);
  bn_partials_kernel<<<dim3(unsigned(C), unsigned(P)), kBnThreads, 0, stream_>>>(x.f32(), nullptr, nullptr, N, C, HW, P,
                                                                                 partials);
  cuda::launched("batchnorm_forward_train (sums)");
  bn_train_coefficients_kernel<<<cuda::blocks_for(C), cuda::kThreads, 0, stream_>>>(
      partials, P, C, N * HW, gamma.f32(), beta.f32(), opt(running_mean), opt(running_var), momentum, eps, mean.f32(),
      invstd.f32(), coef);
  cuda::launched("batchnorm_forward_train (coefficients)");
  bn_apply_kernel<<<cuda::blocks_for(x.numel()), cuda::kThreads, 0, stream_>>>(x.f32(), x.numel(), C, HW, coef,
                                                                               y.f32());
  cuda::launched("batchnorm_forward_train (apply)");
}

void CudaBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y) {
  const int64_t C = x.dim(1), HW = x.dim(2) * x.dim(3);
  bn_eval_kernel<<<cuda::blocks_for(x.numel()), cuda::kThreads, 0, stream_>>>(
      x.f32(), x.numel(), C, HW, gamma.f32(), beta.f32(), running_mean.f32(), running_var.f32(), eps, y.f32());
  cuda::launched("batchnorm_forward_eval");
}

void CudaBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                     const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma,
                                     Tensor& dbeta, bool accumulate_params) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), P = parts_for(N, C);
  double* partials = bn_scratch(C * P * 2 + 2 * C);  // then the coefficients, 3C floats in 2C doubles' room
  float* coef = reinterpret_cast<float*>(partials + C * P * 2);
  bn_partials_kernel<<<dim3(unsigned(C), unsigned(P)), kBnThreads, 0, stream_>>>(x.f32(), dy.f32(), mean.f32(), N, C,
                                                                                 HW, P, partials);
  cuda::launched("batchnorm_backward (sums)");
  bn_backward_coefficients_kernel<<<cuda::blocks_for(C), cuda::kThreads, 0, stream_>>>(
      partials, P, C, N * HW, gamma.f32(), mean.f32(), invstd.f32(), opt(dgamma), opt(dbeta), accumulate_params, coef);
  cuda::launched("batchnorm_backward (coefficients)");
  if (!dx.defined()) return;
  bn_backward_apply_kernel<<<cuda::blocks_for(x.numel()), cuda::kThreads, 0, stream_>>>(
      dy.f32(), x.f32(), x.numel(), C, HW, coef, dx.f32(), accumulate_dx);
  cuda::launched("batchnorm_backward (apply)");
}

void CudaBackend::batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var, float eps,
                                            Tensor& dx, bool accumulate) {
  const int64_t C = dy.dim(1), HW = dy.dim(2) * dy.dim(3);
  bn_frozen_backward_kernel<<<cuda::blocks_for(dy.numel()), cuda::kThreads, 0, stream_>>>(
      dy.f32(), dy.numel(), C, HW, gamma.f32(), running_var.f32(), eps, dx.f32(), accumulate);
  cuda::launched("batchnorm_backward_frozen");
}

}  // namespace et
