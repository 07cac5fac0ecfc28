// Blocked, packed SGEMM (the BLIS loop nest) with a register-tile micro-kernel over the 16-float
// vector of conv_simd.h. C is row-major, so vectors run along N: a micro-tile is MR rows x NV
// vectors of 16 columns; per k it loads NV vectors of packed B and broadcasts MR packed A values.
//
//   for jc in N step NC:                 B panel [KC x NC] packed into NR-column slivers [k][NR]
//     for pc in K step KC:               (k blocks in increasing order: fixed summation order)
//       for ic in M step MC:             A block [MC x KC] packed into MR-row slivers [k][MR]
//         for jr in NC step NR, ir in MC step MR: micro-kernel C[ir.., jr..] (+)= A sliver x B sliver
//
// Transposed operands are absorbed by the packing, so the micro-kernel sees one layout. Edges:
// partial row tiles run a kernel instantiated for exactly that many rows; partial column tiles
// run fewer vectors and the last one goes through a small stack buffer. Packed B is zero padded
// to whole vectors. Scratch (both packing buffers) is caller-provided and bounded by the block
// sizes; nothing is allocated.
//
// Tiles per ISA (accumulators + B vectors + broadcast must fit the register file):
//   AVX-512: 8 x 32 (16 zmm accumulators; Zen 4 issues one 512-bit FMA per cycle, 4-cycle latency)
//   AVX2:    6 x 16 (VNative = 2 ymm: 12 accumulators of 16 ymm)
//   NEON:    6 x 16 (VNative = 4 q: 24 accumulators of 32 q)
//   scalar:  4 x 16 (also what the tests force with conv_force_scalar, to check the portable path)
#include "backends/cpu/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "backends/cpu/always_inline.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_simd.h"

namespace et::cpu {

namespace {

#if defined(__AVX512F__)
constexpr int kMR = 8, kNV = 2;
#elif defined(__AVX2__) || defined(__ARM_NEON)
constexpr int kMR = 6, kNV = 1;
#else
constexpr int kMR = 4, kNV = 1;
#endif
constexpr int kScalarMR = 4, kScalarNV = 1;

// Block sizes. KC: depth of one packed block (A sliver 8 KiB and B sliver 32 KiB at KC = 256);
// MC: rows of the packed A block (96 KiB); NC: columns of the packed B panel (1 MiB, L2 sized;
// 512..1536 measured within noise).
// MC is a multiple of every MR above, NC of every NR.
constexpr int64_t KC = 256, MC = 96, NC = 1024;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
float* align64(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }

// Scratch for one tile configuration: packed A block + packed B panel + alignment slack.
size_t scratch_for(int64_t M, int64_t N, int64_t K, int MR, int NR) {
  const int64_t kc = std::min(K, KC), mc = round_up(std::min(M, MC), MR), nc = round_up(std::min(N, NC), NR);
  return size_t(mc * kc + kc * nc + 32);
}

// C row (ncols <= 16*NV_ valid columns) = alpha * acc + beta * C; beta == 0 never reads C.
// CT: the tile is of C^T, so "row" i is column i of C and its elements are ldc apart.
template <class V, int NV_, bool CT>
inline void store_row(const V* acc, float* c, int64_t ldc, int64_t ncols, float alpha, float beta) {
  if (!CT && ncols == 16 * NV_) {
    const V va = V::set1(alpha), vb = V::set1(beta);
    for (int v = 0; v < NV_; ++v) {
      V r = V::zero();
      r.fma(va, acc[v]);
      if (beta != 0.f) r.fma(vb, V::load(c + 16 * v));
      r.store(c + 16 * v);
    }
    return;
  }
  alignas(64) float t[16 * NV_];
  for (int v = 0; v < NV_; ++v) acc[v].store(t + 16 * v);
  const int64_t step = CT ? ldc : 1;
  for (int64_t j = 0; j < ncols; ++j) {
    const float r = alpha * t[j];
    float& cj = c[j * step];
    cj = beta != 0.f ? std::fma(beta, cj, r) : r;
  }
}

// acc += one step of k: the A sliver's M_ values times the B sliver's NV_ vectors; a and b move on.
template <class V, int MR, int NR, int M_, int NV_>
ET_ALWAYS_INLINE inline void accumulate_step(const float*& a, const float*& b, V (&acc)[M_][NV_]) {
  V bv[NV_];
  for (int v = 0; v < NV_; ++v) bv[v] = V::load(b + 16 * v);
  fma_broadcast_rows<MR>(a, bv, acc);
  a += MR;
  b += NR;
}

// tile [M_][16 NV_] = A sliver [kc][MR] x B sliver [kc][NR] for M_ rows and NV_ vectors, kc >= 1.
// Where vectors are narrow (NEON, AVX2) the block leaves the loop through memory, out of line:
// inside the micro-kernel, beside a path around the loop (kc = 0) and store_row's branches, GCC 12
// for aarch64 kept it in memory as well as in registers and stored all 24 accumulators on every
// step of k (12 stp per 24 fmla).
template <class V, int MR, int NR, int M_, int NV_>
ET_NOINLINE void accumulate_block(int64_t kc, const float* a, const float* b, float* tile) {
  V acc[M_][NV_];
  for (int i = 0; i < M_; ++i)
    for (int v = 0; v < NV_; ++v) acc[i][v] = V::zero();
  int64_t k = 0;
  do accumulate_step<V, MR, NR>(a, b, acc);
  while (++k < kc);
  for (int i = 0; i < M_; ++i)
    for (int v = 0; v < NV_; ++v) acc[i][v].store(tile + (i * NV_ + v) * 16);
}

// C[M_ rows, ncols] (+)= A sliver [kc][MR] x B sliver [kc][NR], using M_ <= MR rows and NV_ vectors.
template <class V, int MR, int NR, int M_, int NV_, bool CT>
void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int64_t ncols, float alpha,
                  float beta) {
  V acc[M_][NV_];
  if constexpr (kNarrowVectors && !std::is_same_v<V, VScalar>) {
    alignas(64) float tile[M_ * NV_ * 16];
    if (kc > 0) accumulate_block<V, MR, NR, M_, NV_>(kc, a, b, tile);
    else std::fill(tile, tile + M_ * NV_ * 16, 0.f);
    for (int i = 0; i < M_; ++i)
      for (int v = 0; v < NV_; ++v) acc[i][v] = V::load(tile + (i * NV_ + v) * 16);
  } else {
    for (int i = 0; i < M_; ++i)
      for (int v = 0; v < NV_; ++v) acc[i][v] = V::zero();
    for (int64_t k = 0; k < kc; ++k) accumulate_step<V, MR, NR>(a, b, acc);
  }
  for (int i = 0; i < M_; ++i) store_row<V, NV_, CT>(acc[i], c + (CT ? i : i * ldc), ldc, ncols, alpha, beta);
}

using Kernel = void (*)(int64_t, const float*, const float*, float*, int64_t, int64_t, float, float);

// kernels[m-1][nv-1]: the micro-kernel for m rows and nv vectors (CT: storing into C^T).
template <class V, int MR, int NV, bool CT>
struct KernelTable {
  Kernel k[MR][NV];
  KernelTable() { fill<1>(); }
  template <int M_>
  void fill() {
    fill_nv<M_, 1>();
    if constexpr (M_ < MR) fill<M_ + 1>();
  }
  template <int M_, int NV_>
  void fill_nv() {
    k[M_ - 1][NV_ - 1] = &micro_kernel<V, MR, 16 * NV, M_, NV_, CT>;
    if constexpr (NV_ < NV) fill_nv<M_, NV_ + 1>();
  }
};

// A rows [ic, ic+mc) x k [pc, pc+kc) -> MR-row slivers dst + ir*kc, each [kc][MR] (rows past mc unused).
template <int MR>
void pack_a(bool trans, const float* A, int64_t lda, int64_t ic, int64_t mc, int64_t pc, int64_t kc, float* dst) {
  for (int64_t ir = 0; ir < mc; ir += MR) {
    const int64_t mr = std::min<int64_t>(MR, mc - ir);
    float* d = dst + ir * kc;
    if (!trans) {  // A(i,k) = A[i*lda + k]: read rows, write strided
      const int64_t k8 = kc / 8 * 8, i8 = mr / 8 * 8;  // rows [0, i8) x k [0, k8) by 8x8 transposes
      for (int64_t i = 0; i < i8; i += 8)
        for (int64_t k = 0; k < k8; k += 8) transpose8x8(A + (ic + ir + i) * lda + pc + k, lda, d + k * MR + i, MR);
      for (int64_t i = 0; i < mr; ++i) {
        const float* s = A + (ic + ir + i) * lda + pc;
        for (int64_t k = i < i8 ? k8 : 0; k < kc; ++k) d[k * MR + i] = s[k];
      }
    } else {  // A(i,k) = A[k*lda + i]: rows of the sliver are contiguous in A
      for (int64_t k = 0; k < kc; ++k) {
        const float* s = A + (pc + k) * lda + ic + ir;
        for (int64_t i = 0; i < mr; ++i) d[k * MR + i] = s[i];
      }
    }
  }
}

// B k [pc, pc+kc) x columns [jc, jc+nc) -> NR-column slivers dst + jr*kc, each [kc][NR]; columns
// past nc up to the next multiple of 16 are zero (the kernel loads whole vectors).
template <int NR>
void pack_b(bool trans, const float* B, int64_t ldb, int64_t pc, int64_t kc, int64_t jc, int64_t nc, float* dst) {
  for (int64_t jr = 0; jr < nc; jr += NR) {
    const int64_t n = std::min<int64_t>(NR, nc - jr), nz = std::min<int64_t>(NR, (n + 15) / 16 * 16);
    float* d = dst + jr * kc;
    if (!trans) {  // B(k,j) = B[k*ldb + j]
      for (int64_t k = 0; k < kc; ++k) {
        std::memcpy(d + k * NR, B + (pc + k) * ldb + jc + jr, sizeof(float) * size_t(n));
        for (int64_t j = n; j < nz; ++j) d[k * NR + j] = 0.f;
      }
    } else {  // B(k,j) = B[j*ldb + k]: a transpose, read along k
      const int64_t j8 = n / 8 * 8, k8 = kc / 8 * 8;
      for (int64_t j = 0; j < j8; j += 8)
        for (int64_t k = 0; k < k8; k += 8) transpose8x8(B + (jc + jr + j) * ldb + pc + k, ldb, d + k * NR + j, NR);
      for (int64_t j = 0; j < n; ++j) {
        const float* s = B + (jc + jr + j) * ldb + pc;
        for (int64_t k = j < j8 ? k8 : 0; k < kc; ++k) d[k * NR + j] = s[k];
      }
      if (nz > n)
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t j = n; j < nz; ++j) d[k * NR + j] = 0.f;
    }
  }
}

// ct: C is stored transposed (the caller swapped the operands, see sgemm).
template <class V, int MR, int NV>
void gemm_blocked(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                  const float* B, int64_t ldb, float beta, float* C, int64_t ldc, bool ct, float* scratch) {
  constexpr int NR = 16 * NV;
  static const KernelTable<V, MR, NV, false> table_n;
  static const KernelTable<V, MR, NV, true> table_t;
  const auto& table = ct ? table_t.k : table_n.k;
  const int64_t kc_max = std::min(K, KC), mc_max = round_up(std::min(M, MC), MR);
  float* apack = align64(scratch);
  float* bpack = align64(apack + mc_max * kc_max);
  for (int64_t jc = 0; jc < N; jc += NC) {
    const int64_t nc = std::min(NC, N - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = std::min(KC, K - pc);
      const float beta_k = pc == 0 ? beta : 1.f;  // later k blocks add to the first's result
      pack_b<NR>(tb, B, ldb, pc, kc, jc, nc, bpack);
      for (int64_t ic = 0; ic < M; ic += MC) {
        const int64_t mc = std::min(MC, M - ic);
        pack_a<MR>(ta, A, lda, ic, mc, pc, kc, apack);
        auto tile = [&](int64_t ir, int64_t jr) {
          const int64_t ncols = std::min<int64_t>(NR, nc - jr), nv = (ncols + 15) / 16;
          const int64_t mr = std::min<int64_t>(MR, mc - ir);
          float* c = ct ? C + (jc + jr) * ldc + ic + ir : C + (ic + ir) * ldc + jc + jr;
          table[mr - 1][nv - 1](kc, apack + ir * kc, bpack + jr * kc, c, ldc, ncols, alpha, beta_k);
        };
        // Rows outer: the A sliver stays in L1 while B slivers stream from L2, and C is written
        // row by row (columns outer wrote 128-byte pieces of rows 4 KiB apart on 32x32 maps: 2x slower).
        for (int64_t ir = 0; ir < mc; ir += MR)
          for (int64_t jr = 0; jr < nc; jr += NR) tile(ir, jr);
      }
    }
  }
}

// Narrow C (few columns, many rows): vectors along N would be mostly empty, so compute
// C^T = op(B)^T op(A)^T instead (vectors along M) and store the tiles transposed.
bool use_transposed(int64_t M, int64_t N) { return N < 16 * kNV && M >= 2 * N; }

}  // namespace

size_t sgemm_scratch_floats(int64_t M, int64_t N, int64_t K) {
  const size_t n = std::max(scratch_for(M, N, K, kMR, 16 * kNV), scratch_for(M, N, K, kScalarMR, 16 * kScalarNV));
  const size_t t = std::max(scratch_for(N, M, K, kMR, 16 * kNV), scratch_for(N, M, K, kScalarMR, 16 * kScalarNV));
  return std::max(n, t);
}

size_t sgemm_scratch_floats_max() { return sgemm_scratch_floats(MC, NC, KC); }

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc, float* scratch) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta * C
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta != 0.f ? beta * C[i * ldc + j] : 0.f;
    return;
  }
  auto run = [&](auto blocked) {
    if (use_transposed(M, N))  // op(A') = op(B)^T: B read with the opposite transpose flag
      blocked(!trans_b, !trans_a, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc, true, scratch);
    else
      blocked(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, false, scratch);
  };
  if (scalar_forced()) run(gemm_blocked<VScalar, kScalarMR, kScalarNV>);
  else run(gemm_blocked<VNative, kMR, kNV>);
}

GemmTile sgemm_tile() { return scalar_forced() ? GemmTile{kScalarMR, 16 * kScalarNV} : GemmTile{kMR, 16 * kNV}; }

namespace {
template <class V, int MR, int NV>
void packed_rows_cols(int64_t mc, int64_t nc, int64_t kc, const float* a, int64_t a_stride, const float* b,
                      bool accumulate, float* c, int64_t ldc) {
  constexpr int NR = 16 * NV;
  static const KernelTable<V, MR, NV, false> table;
  for (int64_t ir = 0; ir < mc; ir += MR) {  // rows outer, as gemm_blocked (A sliver stays in L1)
    const int64_t mr = std::min<int64_t>(MR, mc - ir);
    for (int64_t jr = 0; jr < nc; jr += NR) {
      const int64_t ncols = std::min<int64_t>(NR, nc - jr), nv = (ncols + 15) / 16;
      table.k[mr - 1][nv - 1](kc, a + ir / MR * a_stride, b + jr * kc, c + ir * ldc + jr, ldc, ncols, 1.f,
                              accumulate ? 1.f : 0.f);
    }
  }
}
}  // namespace

void sgemm_packed(int64_t mc, int64_t nc, int64_t kc, const float* a, int64_t a_stride, const float* b,
                  bool accumulate, float* c, int64_t ldc) {
  if (scalar_forced()) packed_rows_cols<VScalar, kScalarMR, kScalarNV>(mc, nc, kc, a, a_stride, b, accumulate, c, ldc);
  else packed_rows_cols<VNative, kMR, kNV>(mc, nc, kc, a, a_stride, b, accumulate, c, ldc);
}

void sgemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                     int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k)
        s += (trans_a ? A[k * lda + i] : A[i * lda + k]) * (trans_b ? B[j * ldb + k] : B[k * ldb + j]);
      float& c = C[i * ldc + j];
      c = beta != 0.f ? alpha * s + beta * c : alpha * s;
    }
}

}  // namespace et::cpu
