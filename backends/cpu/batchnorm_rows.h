// The per-channel and per-row pieces of batchnorm2d on CPU, shared by the layer kernels
// (batchnorm.cpp) and the fused stacks (fused.cpp). Both call these same out-of-line functions, so
// the reduction order and the rounding of every element are the same: fused and unfused results
// are bit-identical by construction, not by luck of the compiler.
#pragma once
#include <cstdint>

#include "engine/tensor.h"

namespace et {
namespace bn_rows {

// Channel c of x [N,C,HW] (f32): mean[c], invstd[c] from the batch, running statistics updated
// when defined (PyTorch's momentum and unbiased variance). Each plane sums in float, planes add in
// double, n in order.
void channel_statistics(const float* x, int64_t N, int64_t C, int64_t HW, int64_t c, float momentum, float eps,
                        Tensor& running_mean, Tensor& running_var, Tensor& mean, Tensor& invstd);

// out[i] = x[i] * scale + shift (BN apply; scale, shift per channel).
void apply(const float* x, float scale, float shift, int64_t len, float* out);
// Training: scale = gamma * invstd, shift = beta - mean * scale; eval: from the running statistics.
void train_coefficients(float gamma, float beta, float mean, float invstd, float* scale, float* shift);
void eval_coefficients(float gamma, float beta, float running_mean, float running_var, float eps, float* scale,
                       float* shift);

// Backward reductions of one row: *a = sum dy, *b = sum dy * (x - mu), in float.
void grad_sums(const float* dy, const float* x, float mu, int64_t len, float* a, float* b);

// From a channel's reductions (summed in double over its rows): dbeta, dgamma and the three
// coefficients of dx = a * dy + b * x + c0.
struct GradCoefficients {
  float dbeta, dgamma, a, b, c0;
};
GradCoefficients grad_coefficients(double sum_dy, double sum_dy_xmu, float gamma, float mu, float invstd, int64_t M);
// out (+)= a * dy + b * x + c0
void grad_apply(const float* dy, const float* x, const GradCoefficients& k, int64_t len, float* out, bool accumulate);

}  // namespace bn_rows
}  // namespace et
