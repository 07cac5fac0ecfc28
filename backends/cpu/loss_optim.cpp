// Softmax cross-entropy, the SGD step and the divergence guard's finiteness check on CPU.
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

// One parallel region for all the tensors (a region per tensor costs more than the scan of small
// ones, and much more when another job holds a core); nowait: no barrier between tensors.
bool CpuBackend::all_finite(const std::vector<Tensor>& tensors) {
  int64_t bad = 0;
#pragma omp parallel reduction(+ : bad)
  for (const Tensor& t : tensors) {
    const float* x = t.f32();
    const int64_t n = t.numel();
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; ++i) bad += !(std::fabs(x[i]) <= FLT_MAX);
  }
  return bad == 0;
}

// PyTorch's SGD: g = grad + wd * p; buf = first ? g : momentum * buf + g;
// p -= lr * (nesterov ? g + momentum * buf : buf). Counts the non-finite new p: NaN and +-inf fail
// |p| <= FLT_MAX (a compare the loop vectorises, unlike a branch).
bool CpuBackend::sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                          float weight_decay, bool nesterov, bool first_step) {
  float* p = param.f32();
  const float* gr = grad.f32();
  float* b = momentum_buf.f32();
  const int64_t n = param.numel();
  int64_t bad = 0;
#pragma omp parallel for simd schedule(static) reduction(+ : bad) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gr[i] + weight_decay * p[i];
    const float buf = momentum == 0.f ? g : (first_step ? g : momentum * b[i] + g);
    b[i] = buf;
    const float np = p[i] - lr * (nesterov ? g + momentum * buf : buf);
    p[i] = np;
    bad += !(std::fabs(np) <= FLT_MAX);
  }
  return bad == 0;
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace et
