// Integer GEMM (see igemm.h): packing, the three micro-kernels, the driver and the reference.
#include "backends/cpu/igemm.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ET_IGEMM_X86 1
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "engine/check.h"

namespace et::cpu {

namespace {

constexpr int MR = kIgemmMR, NR = kIgemmNR;
int64_t k4_of(int64_t K) { return (K + 3) / 4; }
uint8_t* align64(void* p) { return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }

// ---- micro-kernels: c[MR x NR] (+)= A panel x B panel - offset * colsum, full tile, row stride ldc.
using Ukernel = void (*)(int64_t k4, const uint8_t* a, const int8_t* b, const int32_t* colsum, int offset,
                         int32_t* c, int64_t ldc, bool accumulate);

void ukernel_scalar(int64_t k4, const uint8_t* a, const int8_t* b, const int32_t* colsum, int offset, int32_t* c,
                    int64_t ldc, bool accumulate) {
  int32_t acc[MR][NR] = {};
  for (int64_t k = 0; k < k4; ++k, a += MR * 4, b += NR * 4)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) {
        int32_t s = 0;
        for (int q = 0; q < 4; ++q) s += int32_t(a[r * 4 + q]) * int32_t(b[j * 4 + q]);
        acc[r][j] += s;
      }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const int32_t v = acc[r][j] - offset * colsum[j];
      c[r * ldc + j] = accumulate ? c[r * ldc + j] + v : v;
    }
}

#if ET_IGEMM_X86
__attribute__((target("avx2"))) void ukernel_avx2(int64_t k4, const uint8_t* a, const int8_t* b,
                                                   const int32_t* colsum, int offset, int32_t* c, int64_t ldc,
                                                   bool accumulate) {
  // 4 rows x 16 columns at a time (8 accumulators), four sweeps over k per 8 x 32 tile.
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r0 = 0; r0 < MR; r0 += 4)
    for (int j0 = 0; j0 < NR; j0 += 16) {
      __m256i acc[4][2];
      for (auto& row : acc) row[0] = row[1] = _mm256_setzero_si256();
      const uint8_t* ap = a + r0 * 4;
      const int8_t* bp = b + j0 * 4;
      for (int64_t k = 0; k < k4; ++k, ap += MR * 4, bp += NR * 4) {
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 32));
        for (int r = 0; r < 4; ++r) {
          int32_t word;
          std::memcpy(&word, ap + r * 4, 4);
          const __m256i av = _mm256_set1_epi32(word);
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(av, b0), ones));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(av, b1), ones));
        }
      }
      const __m256i off = _mm256_set1_epi32(offset);
      const __m256i corr0 = _mm256_mullo_epi32(off, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum + j0)));
      const __m256i corr1 =
          _mm256_mullo_epi32(off, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(colsum + j0 + 8)));
      for (int r = 0; r < 4; ++r) {
        int32_t* cp = c + (r0 + r) * ldc + j0;
        __m256i v0 = _mm256_sub_epi32(acc[r][0], corr0), v1 = _mm256_sub_epi32(acc[r][1], corr1);
        if (accumulate) {
          v0 = _mm256_add_epi32(v0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp)));
          v1 = _mm256_add_epi32(v1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 8)));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(cp), v0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(cp + 8), v1);
      }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void ukernel_vnni(int64_t k4, const uint8_t* a,
                                                                          const int8_t* b, const int32_t* colsum,
                                                                          int offset, int32_t* c, int64_t ldc,
                                                                          bool accumulate) {
  __m512i acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < k4; ++k, a += MR * 4, b += NR * 4) {
    const __m512i b0 = _mm512_loadu_si512(b);
    const __m512i b1 = _mm512_loadu_si512(b + 64);
    for (int r = 0; r < MR; ++r) {
      int32_t word;
      std::memcpy(&word, a + r * 4, 4);
      const __m512i av = _mm512_set1_epi32(word);
      acc0[r] = _mm512_dpbusd_epi32(acc0[r], av, b0);
      acc1[r] = _mm512_dpbusd_epi32(acc1[r], av, b1);
    }
  }
  const __m512i off = _mm512_set1_epi32(offset);
  const __m512i corr0 = _mm512_mullo_epi32(off, _mm512_loadu_si512(colsum));
  const __m512i corr1 = _mm512_mullo_epi32(off, _mm512_loadu_si512(colsum + 16));
  for (int r = 0; r < MR; ++r) {
    int32_t* cp = c + r * ldc;
    __m512i v0 = _mm512_sub_epi32(acc0[r], corr0), v1 = _mm512_sub_epi32(acc1[r], corr1);
    if (accumulate) {
      v0 = _mm512_add_epi32(v0, _mm512_loadu_si512(cp));
      v1 = _mm512_add_epi32(v1, _mm512_loadu_si512(cp + 16));
    }
    _mm512_storeu_si512(cp, v0);
    _mm512_storeu_si512(cp + 16, v1);
  }
}
#endif

IgemmIsa best_isa() {
#if ET_IGEMM_X86
  if (igemm_supported(IgemmIsa::Avx512Vnni)) return IgemmIsa::Avx512Vnni;
  if (igemm_supported(IgemmIsa::Avx2)) return IgemmIsa::Avx2;
#endif
  if (igemm_supported(IgemmIsa::NeonDot)) return IgemmIsa::NeonDot;
  return IgemmIsa::Scalar;
}
IgemmIsa g_isa = best_isa();

Ukernel ukernel_for(IgemmIsa isa) {
#if ET_IGEMM_X86
  if (isa == IgemmIsa::Avx512Vnni) return ukernel_vnni;
  if (isa == IgemmIsa::Avx2) return ukernel_avx2;
#endif
  return ukernel_scalar;
}

// ---- B panel packing: columns [j0, j0 + nr) into [K4][NR][4], zero padded; colsum[NR] of the panel.
int8_t b_at(const IgemmB& b, int64_t k, int64_t j) {
  if (b.trans) return b.b[j * b.ld + k];
  return b.b[(j / b.jg) * b.gs + k * b.ld + j % b.jg];
}

void pack_b_panel(const IgemmB& b, int64_t j0, int64_t nr, int8_t* out, int32_t* colsum) {
  const int64_t K4 = k4_of(b.K), kfull = b.K / 4;
  std::memset(colsum, 0, sizeof(int32_t) * NR);
  if (nr < NR || b.K % 4) std::memset(out, 0, size_t(K4) * NR * 4);
  if (b.trans) {
    // Four consecutive k of column j are four consecutive bytes of row j: one word each.
    for (int64_t j = 0; j < nr; ++j) {
      const int8_t* row = b.b + (j0 + j) * b.ld;
      int32_t s = 0;
      for (int64_t k = 0; k < b.K; ++k) s += row[k];
      colsum[j] = s;
      for (int64_t k = 0; k < kfull; ++k) std::memcpy(out + (k * NR + j) * 4, row + k * 4, 4);
      for (int64_t k = kfull * 4; k < b.K; ++k) out[(kfull * NR + j) * 4 + (k - kfull * 4)] = row[k];
    }
    return;
  }
  // Row-major: interleave four rows byte by byte. Whole 16-column runs inside one column group
  // use SSE2 unpacks (SSSE3 for the column sums: not in a portable x86-64 build, which goes element
  // by element); the rest goes element by element.
  int64_t j = 0;
#if ET_IGEMM_X86 && defined(__SSSE3__)
  for (; j + 16 <= nr && (j0 + j) / b.jg == (j0 + j + 15) / b.jg; j += 16) {
    const int64_t jj = j0 + j;
    const int8_t* base = b.b + (jj / b.jg) * b.gs + jj % b.jg;
    __m128i s0 = _mm_setzero_si128(), s1 = s0, s2 = s0, s3 = s0;  // column sums, 4 columns each
    const __m128i ones8 = _mm_set1_epi8(1), ones16 = _mm_set1_epi16(1);
    for (int64_t k = 0; k < kfull; ++k) {
      const int8_t* p = base + k * 4 * b.ld;
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + b.ld));
      const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * b.ld));
      const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * b.ld));
      const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
      const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
      const __m128i w0 = _mm_unpacklo_epi16(lo01, lo23), w1 = _mm_unpackhi_epi16(lo01, lo23);
      const __m128i w2 = _mm_unpacklo_epi16(hi01, hi23), w3 = _mm_unpackhi_epi16(hi01, hi23);
      int8_t* o = out + (k * NR + j) * 4;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), w0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), w1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 32), w2);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 48), w3);
      // maddubs(1, w) sums byte pairs (no saturation: |b| <= 64), madd(., 1) the pairs of pairs.
      s0 = _mm_add_epi32(s0, _mm_madd_epi16(_mm_maddubs_epi16(ones8, w0), ones16));
      s1 = _mm_add_epi32(s1, _mm_madd_epi16(_mm_maddubs_epi16(ones8, w1), ones16));
      s2 = _mm_add_epi32(s2, _mm_madd_epi16(_mm_maddubs_epi16(ones8, w2), ones16));
      s3 = _mm_add_epi32(s3, _mm_madd_epi16(_mm_maddubs_epi16(ones8, w3), ones16));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(colsum + j), s0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(colsum + j + 4), s1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(colsum + j + 8), s2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(colsum + j + 12), s3);
    for (int64_t k = kfull * 4; k < b.K; ++k)
      for (int64_t q = 0; q < 16; ++q) {
        const int8_t v = base[k * b.ld + q];
        out[(kfull * NR + j + q) * 4 + (k - kfull * 4)] = v;
        colsum[j + q] += v;
      }
  }
#endif
  for (; j < nr; ++j) {
    int32_t s = 0;
    for (int64_t k = 0; k < b.K; ++k) {
      const int8_t v = b_at(b, k, j0 + j);
      out[((k / 4) * NR + j) * 4 + k % 4] = v;
      s += v;
    }
    colsum[j] = s;
  }
}

}  // namespace

const char* igemm_isa_name(IgemmIsa isa) {
  switch (isa) {
    case IgemmIsa::Scalar: return "scalar";
    case IgemmIsa::Avx2: return "avx2";
    case IgemmIsa::Avx512Vnni: return "avx512vnni";
    case IgemmIsa::NeonDot: return "neon-dot";
  }
  return "?";
}

bool igemm_supported(IgemmIsa isa) {
  switch (isa) {
    case IgemmIsa::Scalar: return true;
#if defined(__aarch64__) && defined(__linux__) && defined(HWCAP_ASIMDDP)
    case IgemmIsa::NeonDot: return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
#if ET_IGEMM_X86
    case IgemmIsa::Avx2: return __builtin_cpu_supports("avx2");
    case IgemmIsa::Avx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
#endif
    default: return false;
  }
}

IgemmIsa igemm_isa() { return g_isa; }
void igemm_force_isa(IgemmIsa isa) {
  ET_CHECK(igemm_supported(isa), "igemm path ", igemm_isa_name(isa), " not supported by this CPU");
  g_isa = isa;
}

size_t igemm_packed_a_bytes(int64_t M, int64_t K) {
  return size_t((M + MR - 1) / MR) * size_t(k4_of(K)) * MR * 4 + 64;
}

PackedA igemm_pack_a(const IgemmA& a, uint8_t* out_raw) {
  ET_CHECK(a.kg > 0 && a.offset >= 0 && a.offset <= 64);
  uint8_t* out = align64(out_raw);
  const int64_t K4 = k4_of(a.K), panels = (a.M + MR - 1) / MR;
  std::memset(out, 0, size_t(panels) * size_t(K4) * MR * 4);
  const uint8_t off = uint8_t(a.offset);
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* dst = out + p * K4 * MR * 4;
    for (int64_t r = 0; r < MR && p * MR + r < a.M; ++r) {
      const int64_t m = p * MR + r;
      for (int64_t k = 0; k < a.K; ++k) {
        const int8_t v = a.a[(k / a.kg) * a.gs + m * a.rs + (k % a.kg) * a.cs];
        dst[((k / 4) * MR + r) * 4 + k % 4] = uint8_t(v + off);
      }
    }
  }
  return PackedA{out, a.M, K4, a.offset};
}

size_t igemm_scratch_bytes(int64_t K) { return size_t(k4_of(K)) * NR * 4 + NR * sizeof(int32_t) + 128; }

void igemm(const PackedA& a, const IgemmB& b, int32_t* c, int64_t ldc, bool accumulate, void* scratch) {
  ET_CHECK(k4_of(b.K) == a.K4, "igemm: A has ", a.K4 * 4, " reduction columns, B ", b.K);
  ET_CHECK(b.trans || b.jg > 0);
  const Ukernel kernel = ukernel_for(g_isa);
  int8_t* panel = reinterpret_cast<int8_t*>(align64(scratch));
  int32_t* colsum = reinterpret_cast<int32_t*>(panel + a.K4 * NR * 4);
  alignas(64) int32_t tile[MR * NR];
  for (int64_t j0 = 0; j0 < b.N; j0 += NR) {
    const int64_t nr = std::min<int64_t>(NR, b.N - j0);
    pack_b_panel(b, j0, nr, panel, colsum);
    for (int64_t i0 = 0; i0 < a.M; i0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, a.M - i0);
      const uint8_t* ap = a.data + (i0 / MR) * a.K4 * MR * 4;
      if (mr == MR && nr == NR) {
        kernel(a.K4, ap, panel, colsum, a.offset, c + i0 * ldc + j0, ldc, accumulate);
        continue;
      }
      kernel(a.K4, ap, panel, colsum, a.offset, tile, NR, false);
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t j = 0; j < nr; ++j) {
          int32_t& dst = c[(i0 + r) * ldc + j0 + j];
          dst = accumulate ? dst + tile[r * NR + j] : tile[r * NR + j];
        }
    }
  }
}

void igemm_reference(const IgemmA& a, const IgemmB& b, int32_t* c, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t j = 0; j < b.N; ++j) {
      int64_t s = 0;
      for (int64_t k = 0; k < a.K; ++k)
        s += int64_t(a.a[(k / a.kg) * a.gs + m * a.rs + (k % a.kg) * a.cs]) * int64_t(b_at(b, k, j));
      int32_t& dst = c[m * ldc + j];
      dst = int32_t(accumulate ? dst + s : s);
    }
}

}  // namespace et::cpu
