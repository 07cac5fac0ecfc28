// SGEMM through Eigen's blocked kernel (AVX-512 / AVX2 / NEON by compile target).
#include "backends/cpu/gemm.h"

#include <Eigen/Core>

namespace et::cpu {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ColMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
using Stride = Eigen::OuterStride<>;

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  Eigen::Map<RowMat, 0, Stride> c(C, M, N, Stride(ldc));
  if (beta == 0.f)
    c.setZero();
  else if (beta != 1.f)
    c *= beta;
  // A stored row-major [M,K] is the column-major [K,M] transposed, and vice versa.
  auto run = [&](const auto& a, const auto& b) { c.noalias() += alpha * (a * b); };
  Eigen::Map<const RowMat, 0, Stride> a_n(A, M, K, Stride(lda));
  Eigen::Map<const ColMat, 0, Stride> a_t(A, M, K, Stride(lda));
  Eigen::Map<const RowMat, 0, Stride> b_n(B, K, N, Stride(ldb));
  Eigen::Map<const ColMat, 0, Stride> b_t(B, K, N, Stride(ldb));
  if (!trans_a && !trans_b) run(a_n, b_n);
  else if (!trans_a && trans_b) run(a_n, b_t);
  else if (trans_a && !trans_b) run(a_t, b_n);
  else run(a_t, b_t);
}

}  // namespace et::cpu
