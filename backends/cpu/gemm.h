// Single-threaded SGEMM on row-major matrices: C[M,N] = alpha * op(A) op(B) + beta * C.
// Callers parallelise over independent problems (images, thread-private partial sums, or
// disjoint row slices of C).
//
// Our own blocked, packed GEMM (gemm.cpp): no heap allocation ever. The packing buffers come
// from caller-provided scratch whose size, sgemm_scratch_floats(M, N, K), is bounded by the
// block sizes (not by the problem), so the executor's planned workspaces and a fixed buffer in
// CpuBackend cover every call. Results are deterministic: each C element is summed over k in
// increasing order in blocks of KC, the same order whatever the caller's threading.
#pragma once
#include <cstddef>
#include <cstdint>

namespace et::cpu {

// Floats of scratch sgemm needs for this problem size; never more than sgemm_scratch_floats_max().
size_t sgemm_scratch_floats(int64_t M, int64_t N, int64_t K);
size_t sgemm_scratch_floats_max();

// op(A) is [M,K]: A stored [M,K] (lda) or, if trans_a, [K,M]. op(B) is [K,N]: B stored [K,N] or [N,K].
// beta == 0 never reads C (it may hold garbage). scratch: sgemm_scratch_floats(M, N, K) floats, any
// alignment (it is aligned inside).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc, float* scratch);

// Naive triple loop (float accumulation, k in order): the reference the tests and the blocked
// kernel's scalar configuration are checked against.
void sgemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Building blocks for callers that pack their own operands (conv_implicit.cpp packs im2col
// slivers straight from the activations). sgemm_tile(): the active register tile (the scalar one
// under conv_force_scalar). Packed formats, as sgemm's: A in MR-row slivers [kc][MR], B in NR-column
// slivers [kc][NR] with columns past the matrix zero up to the next multiple of 16.
struct GemmTile { int mr, nr; };
GemmTile sgemm_tile();
// C[mc, nc] = A x B (+ C when accumulate): A sliver i (rows i*MR..) at a + i*a_stride, B sliver j
// (columns j*NR..) at b + j*NR*kc. Rows past mc / columns past nc are not stored.
void sgemm_packed(int64_t mc, int64_t nc, int64_t kc, const float* a, int64_t a_stride, const float* b,
                  bool accumulate, float* c, int64_t ldc);

}  // namespace et::cpu
