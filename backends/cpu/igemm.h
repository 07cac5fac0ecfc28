// Integer GEMM for 4-bit training (docs/quant.md): C[M,N] (+)= A[M,K] x B[K,N] in int32, exact.
// Used by the linear layers (linear_int.cpp); the convs use their own tiles (conv_int_tiles.h).
//
// Operand contract (what makes every path exact and lets AVX2 use vpmaddubsw without saturation):
// A is stored as int8 and shifted to unsigned by `offset` while packing, B is int8, and
// (max A + offset) * max |B| <= 2048, so a pair of products stays below 2^15. The two cases:
//   A = 4-bit codes (INT4 weights -7..7 + 8, unsigned activations 0..15 + 0), |B| <= 64 (FP4
//       gradients as signed powers of two 2^e, e = 0..6, or 4-bit codes);
//   A = FP4 gradient codes + 64 (0..128), |B| <= 15 (4-bit codes).
// The FP4 x INT4 product of MF-BPROP is a shift; here it is an exact integer multiply.
// The offset is taken back out with the column sums of B: C = sum (A + o) B - o * sum_k B.
//
// Paths: AVX-512 VNNI (vpdpbusd: four u8 x s8 products into each int32 lane), AVX2 (vpmaddubsw
// pairs <= 2 * 15 * 64 < 2^15, then vpmaddwd), scalar. Chosen at run time from the CPU
// (`__builtin_cpu_supports`), so a portable build uses VNNI where the CPU has it; tests force each
// path. All paths give the same integers (integer sums do not depend on order), so results are
// also independent of the thread count.
//
// Packed layouts (micro-kernel tile MR x NR = 8 x 32): A in MR-row panels [K4][MR][4] (4
// consecutive k of a row form one int32 lane), B in NR-column panels [K4][NR][4]; K padded to a
// multiple of 4 with zeros. No allocation: scratch comes from the caller.
#pragma once
#include <cstddef>
#include <cstdint>

namespace et::cpu {

// NeonDot (aarch64 sdot) has conv tiles (conv_int_neon.cpp); the GEMM itself runs scalar there.
enum class IgemmIsa : uint8_t { Scalar, Avx2, Avx512Vnni, NeonDot };
const char* igemm_isa_name(IgemmIsa isa);
bool igemm_supported(IgemmIsa isa);
IgemmIsa igemm_isa();            // the path in use: the best supported unless forced
void igemm_force_isa(IgemmIsa);  // tests and benchmarks (must be supported)

constexpr int kIgemmMR = 8, kIgemmNR = 32;

// Element (m, k) of a strided A: a[(k / kg) * gs + m * rs + (k % kg) * cs]. kg splits the
// reduction into groups (images side by side: kg = P*Q, gs = image stride); kg = K for one group.
struct IgemmA {
  const int8_t* a = nullptr;
  int64_t M = 0, K = 0;
  int64_t rs = 0, cs = 1, kg = 0, gs = 0;
  int offset = 0;
};
// Element (k, j) of B: trans = false: b[(j / jg) * gs + k * ld + j % jg] (row-major, column
// groups: images side by side), trans = true: b[j * ld + k] (B stored as [N, K]).
struct IgemmB {
  const int8_t* b = nullptr;
  int64_t K = 0, N = 0;
  int64_t ld = 0, jg = 0, gs = 0;
  bool trans = false;
};

// A packed once (weights: once per call), reused by every B panel.
struct PackedA {
  const uint8_t* data = nullptr;
  int64_t M = 0, K4 = 0;
  int offset = 0;
};
size_t igemm_packed_a_bytes(int64_t M, int64_t K);
PackedA igemm_pack_a(const IgemmA& a, uint8_t* out);

// Per-call scratch of igemm (one B panel and its column sums), per thread.
size_t igemm_scratch_bytes(int64_t K);
// C[M,N] (+)= A x B, C row-major int32 with row stride ldc.
void igemm(const PackedA& a, const IgemmB& b, int32_t* c, int64_t ldc, bool accumulate, void* scratch);

// Plain triple loop on the unpacked operands (int64 sums): the reference every path is tested against.
void igemm_reference(const IgemmA& a, const IgemmB& b, int32_t* c, int64_t ldc, bool accumulate);

}  // namespace et::cpu
