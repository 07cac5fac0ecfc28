// Single-threaded SGEMM on row-major matrices: C[M,N] = alpha * op(A) op(B) + beta * C.
// Callers parallelise over independent problems (images, thread-private partial sums).
#pragma once
#include <cstdint>

namespace et::cpu {

// op(A) is [M,K]: A stored [M,K] (lda) or, if trans_a, [K,M]. op(B) is [K,N]: B stored [K,N] or [N,K].
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace et::cpu
