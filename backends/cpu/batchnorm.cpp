// batchnorm2d on CPU: channels spread over threads; each channel's reduction runs in one thread in
// a fixed order (double accumulators), so results do not depend on scheduling.
#include <algorithm>
#include <cmath>

#include "backends/cpu/cpu_backend.h"
#include "memory/half.h"

namespace et {

// x, y [N,C,H,W]; mean, invstd, gamma, beta, running_* [C]
void CpuBackend::batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         Tensor& running_mean, Tensor& running_var, float momentum, float eps,
                                         Tensor& y, Tensor& mean, Tensor& invstd) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), M = N * HW;
  const float* xp = x.f32();
  float* yp = y.f32();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    double s = 0, ss = 0;
    for (int64_t n = 0; n < N; ++n) {
      const float* row = xp + (n * C + c) * HW;
      float s1 = 0.f, s2 = 0.f;
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t i = 0; i < HW; ++i) {
        s1 += row[i];
        s2 += row[i] * row[i];
      }
      s += s1;
      ss += s2;
    }
    const double mu = s / double(M);
    const double var = std::max(0.0, ss / double(M) - mu * mu);
    const float is = float(1.0 / std::sqrt(var + double(eps)));
    mean.f32()[c] = float(mu);
    invstd.f32()[c] = is;
    const double unbiased = M > 1 ? var * double(M) / double(M - 1) : var;
    if (running_mean.defined()) {
      running_mean.f32()[c] = (1.f - momentum) * running_mean.f32()[c] + momentum * float(mu);
      running_var.f32()[c] = (1.f - momentum) * running_var.f32()[c] + momentum * float(unbiased);
    }
    const float scale = gamma.f32()[c] * is, shift = beta.f32()[c] - float(mu) * scale;
    for (int64_t n = 0; n < N; ++n) {
      const float* row = xp + (n * C + c) * HW;
      float* out = yp + (n * C + c) * HW;
      for (int64_t i = 0; i < HW; ++i) out[i] = row[i] * scale + shift;
    }
  }
}

void CpuBackend::batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                        const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      const float scale = gamma.f32()[c] / std::sqrt(running_var.f32()[c] + eps);
      const float shift = beta.f32()[c] - running_mean.f32()[c] * scale;
      const float* row = x.f32() + (n * C + c) * HW;
      float* out = y.f32() + (n * C + c) * HW;
      for (int64_t i = 0; i < HW; ++i) out[i] = row[i] * scale + shift;
    }
}

// With x_hat = (x - mean) * invstd:
//   dbeta = sum dy, dgamma = sum dy * x_hat,
//   dx = gamma * invstd / M * (M * dy - dbeta - x_hat * dgamma)
namespace {
// x rows for the backward: f32 in place, or a 16-bit saved copy (dense_fp16 / dense_bf16 stash)
// widened chunk by chunk into a stack buffer, so BN reads the stash directly (no decode pass).
constexpr int64_t kRowChunk = 4096;
inline const float* x_chunk(const Tensor& x, int64_t offset, int64_t len, float* buf) {
  switch (x.dtype) {
    case DType::F32: return x.f32() + offset;
    case DType::F16: f16_to_f32(static_cast<const uint16_t*>(x.data) + offset, len, buf); return buf;
    case DType::BF16: bf16_to_f32(static_cast<const uint16_t*>(x.data) + offset, len, buf); return buf;
    default: ET_CHECK(false, "batchnorm backward: x dtype ", int(x.dtype));
  }
  return nullptr;
}
}  // namespace

void CpuBackend::batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                    const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma,
                                    Tensor& dbeta, bool accumulate_params) {
  const int64_t N = x.dim(0), C = x.dim(1), HW = x.dim(2) * x.dim(3), M = N * HW;
  const float* dyp = dy.f32();
  // f32 rows are read whole; 16-bit rows in chunks (a chunk as long as a CIFAR row keeps the
  // reduction order, hence the results, identical to reading the decoded f32 copy).
  const int64_t chunk = x.dtype == DType::F32 ? HW : std::min(HW, kRowChunk);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    alignas(64) float buf[kRowChunk];
    const float mu = mean.f32()[c], is = invstd.f32()[c];
    double sdy = 0, sdyx = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i0 = 0; i0 < HW; i0 += chunk) {
        const int64_t len = std::min(chunk, HW - i0), base = (n * C + c) * HW + i0;
        const float* xr = x_chunk(x, base, len, buf);
        const float* dr = dyp + base;
        float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
        for (int64_t i = 0; i < len; ++i) {
          a += dr[i];
          b += dr[i] * (xr[i] - mu);
        }
        sdy += a;
        sdyx += b;
      }
    const float db = float(sdy), dg = float(sdyx) * is;
    dbeta.f32()[c] = accumulate_params ? dbeta.f32()[c] + db : db;
    dgamma.f32()[c] = accumulate_params ? dgamma.f32()[c] + dg : dg;
    if (!dx.defined()) continue;
    const float k = gamma.f32()[c] * is / float(M);
    const float coef = dg * is;  // multiplies (x - mu)
    // dx = a * dy + b * x + c0, hoisted so the loop is one FMA chain
    const float a = k * float(M), b = -k * coef, c0 = -k * db + k * mu * coef;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i0 = 0; i0 < HW; i0 += chunk) {
        const int64_t len = std::min(chunk, HW - i0), base = (n * C + c) * HW + i0;
        const float* xr = x_chunk(x, base, len, buf);
        const float* dr = dyp + base;
        float* out = dx.f32() + base;
        if (accumulate_dx) {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) out[i] += a * dr[i] + b * xr[i] + c0;
        } else {
#pragma omp simd
          for (int64_t i = 0; i < len; ++i) out[i] = a * dr[i] + b * xr[i] + c0;
        }
      }
  }
}

}  // namespace et
