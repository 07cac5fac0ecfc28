// Softmax cross-entropy and the SGD step on CPU.
#include <cfloat>
#include <cmath>

#include "backends/cpu/cpu_backend.h"

namespace et {

// loss = mean_n [ -sum_k t_nk log softmax(z_n)_k ],  t = (1 - s) onehot(label) + s / K
void CpuBackend::softmax_xent_forward(const Tensor& logits, const Tensor& labels, float smoothing, Tensor& loss) {
  const int64_t N = logits.dim(0), K = logits.dim(1);
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    const float* z = logits.f32() + n * K;
    const int32_t y = labels.i32()[n];
    ET_CHECK(y >= 0 && y < K, "label ", y, " outside 0..", K - 1);
    float m = -FLT_MAX;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, z[k]);
    double se = 0, sum_z = 0;
    for (int64_t k = 0; k < K; ++k) {
      se += std::exp(double(z[k] - m));
      sum_z += z[k];
    }
    const double lse = double(m) + std::log(se);
    total += (1.0 - smoothing) * (lse - z[y]) + smoothing * (lse - sum_z / double(K));
  }
  loss.f32()[0] = float(total / double(N));
}

void CpuBackend::softmax_xent_backward(const Tensor& logits, const Tensor& labels, float smoothing, float dloss,
                                       Tensor& dlogits, bool accumulate) {
  const int64_t N = logits.dim(0), K = logits.dim(1);
  const float scale = dloss / float(N);
  for (int64_t n = 0; n < N; ++n) {
    const float* z = logits.f32() + n * K;
    float* d = dlogits.f32() + n * K;
    const int32_t y = labels.i32()[n];
    float m = -FLT_MAX;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, z[k]);
    double se = 0;
    for (int64_t k = 0; k < K; ++k) se += std::exp(double(z[k] - m));
    for (int64_t k = 0; k < K; ++k) {
      const float p = float(std::exp(double(z[k] - m)) / se);
      const float t = (k == y ? 1.f - smoothing : 0.f) + smoothing / float(K);
      const float v = (p - t) * scale;
      d[k] = accumulate ? d[k] + v : v;
    }
  }
}

// PyTorch's SGD: g = grad + wd * p; buf = first ? g : momentum * buf + g;
// p -= lr * (nesterov ? g + momentum * buf : buf)
void CpuBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                          float weight_decay, bool nesterov, bool first_step) {
  float* p = param.f32();
  const float* gr = grad.f32();
  float* b = momentum_buf.f32();
  const int64_t n = param.numel();
#pragma omp parallel for simd schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gr[i] + weight_decay * p[i];
    const float buf = momentum == 0.f ? g : (first_step ? g : momentum * b[i] + g);
    b[i] = buf;
    p[i] -= lr * (nesterov ? g + momentum * buf : buf);
  }
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace et
