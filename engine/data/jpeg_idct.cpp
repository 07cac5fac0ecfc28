// libjpeg-turbo's "islow" inverse DCT (Loeffler-Ligtenberg-Moschytz, 13-bit fixed-point constants,
// CONST_BITS 13, PASS1_BITS 2), bit for bit. Two references:
//  - idct_islow_c: jidctint.c transcribed: dequantisation in int, 64-bit intermediates, an int
//    workspace, the result DESCALE(...) masked to 10 bits (RANGE_MASK) into jdmaster.c's
//    range-limit table (0..127 -> 128..255, 128..511 -> 255, 512..895 -> 0, 896..1023 -> 0..127),
//    so far out-of-range values wrap around. What libjpeg-turbo built without SIMD gives.
//  - idct_islow_x86_simd: the arithmetic of its SSE2 / AVX2 code (jsimd_idct_islow_sse2/_avx2),
//    which every x86-64 PIL runs: 16-bit lanes, so the dequantised coefficients, in0 +- in4 and
//    the odd part's z3 / z4 wrap at 16 bits, products are summed in 32 bits (pmaddwd), the pass 1
//    results saturate to 16 bits (packssdw) and the output saturates to -128..127 before +128
//    (packsswb, paddb); when rows 1..7 are all zero, pass 1 is dq << 2 in 16 bits. Measured against
//    PIL on randomly damaged files (bench/jpeg_exactness.py --damage): identical, with AVX2 and
//    with SSE2 forced; the C reference is identical to PIL with its SIMD off (JSIMD_FORCENONE).
// The two agree on every block of a valid JPEG; they differ only where corrupt data makes
// coefficients overflow. idct_islow, the decoder's, gives idct_islow_x86_simd's bytes, fast: a
// block of only DC is one value; a block whose dequantised coefficients are within +-1024 and
// whose pass 1 results are within +-16383 cannot wrap or saturate anywhere (and no int32 can
// overflow: bench/jpeg_idct_bound.py), so it runs in plain int32, column-parallel so that the
// compiler vectorises it; any other block takes the reference.
#include <algorithm>
#include <cstring>

#include "engine/data/jpeg_internal.h"

namespace et::jpeg_detail {
namespace {

// FIX(x) = x * 2^13 rounded (jidctint.c).
constexpr int32_t F0298 = 2446, F0390 = 3196, F0541 = 4433, F0765 = 6270, F0899 = 7373, F1175 = 9633,
                  F1501 = 12299, F1847 = 15137, F1961 = 16069, F2053 = 16819, F2562 = 20995, F3072 = 25172;

// ---- jidctint.c ----

// libjpeg's LEFT_SHIFT: (JLONG)((unsigned long)(a) << b).
inline int64_t left_shift(int64_t a, int b) { return int64_t(uint64_t(a) << b); }
inline int64_t descale(int64_t x, int n) { return (x + (int64_t(1) << (n - 1))) >> n; }

// The range-limit table as a formula of the masked value.
inline uint8_t range_limit(int64_t descaled) {
  const int32_t w = int32_t((descaled + 128) & 1023);
  return uint8_t(w < 256 ? w : (w < 640 ? 255 : 0));
}

// One 1-D pass of jidctint.c on in(0..7), 64-bit; the raw outputs in natural order.
template <typename Load>
void islow_1d(Load in, int64_t out[8]) {
  int64_t z2 = in(2), z3 = in(6);
  int64_t z1 = (z2 + z3) * F0541;
  int64_t tmp2 = z1 + z3 * -F1847;
  int64_t tmp3 = z1 + z2 * F0765;
  z2 = in(0);
  z3 = in(4);
  int64_t tmp0 = left_shift(z2 + z3, 13);
  int64_t tmp1 = left_shift(z2 - z3, 13);
  const int64_t tmp10 = tmp0 + tmp3, tmp13 = tmp0 - tmp3, tmp11 = tmp1 + tmp2, tmp12 = tmp1 - tmp2;
  tmp0 = in(7);
  tmp1 = in(5);
  tmp2 = in(3);
  tmp3 = in(1);
  z1 = tmp0 + tmp3;
  z2 = tmp1 + tmp2;
  z3 = tmp0 + tmp2;
  int64_t z4 = tmp1 + tmp3;
  const int64_t z5 = (z3 + z4) * F1175;
  tmp0 *= F0298;
  tmp1 *= F2053;
  tmp2 *= F3072;
  tmp3 *= F1501;
  z1 *= -F0899;
  z2 *= -F2562;
  z3 *= -F1961;
  z4 *= -F0390;
  z3 += z5;
  z4 += z5;
  tmp0 += z1 + z3;
  tmp1 += z2 + z4;
  tmp2 += z2 + z3;
  tmp3 += z1 + z4;
  out[0] = tmp10 + tmp3;
  out[7] = tmp10 - tmp3;
  out[1] = tmp11 + tmp2;
  out[6] = tmp11 - tmp2;
  out[2] = tmp12 + tmp1;
  out[5] = tmp12 - tmp1;
  out[3] = tmp13 + tmp0;
  out[4] = tmp13 - tmp0;
}

// ---- the x86 SIMD code's arithmetic ----

inline int16_t wrap16(int32_t v) { return int16_t(uint16_t(uint32_t(v))); }
inline int16_t saturate16(int32_t v) { return int16_t(std::clamp(v, -32768, 32767)); }
inline int32_t add32(int32_t a, int32_t b) { return int32_t(uint32_t(a) + uint32_t(b)); }
inline int32_t sub32(int32_t a, int32_t b) { return int32_t(uint32_t(a) - uint32_t(b)); }
// pmaddwd: two exact 16 x 16-bit products, summed in 32 bits.
inline int32_t madd(int16_t a, int32_t ca, int16_t b, int32_t cb) { return add32(a * ca, b * cb); }

// One 1-D pass as the SIMD code computes it (its comments: "this implementation" folds z1, z2, z5
// into the constants); raw 32-bit outputs.
void simd_1d(const int16_t x[8], int32_t out[8]) {
  const int32_t tmp3 = madd(x[2], F0541 + F0765, x[6], F0541);
  const int32_t tmp2 = madd(x[2], F0541, x[6], F0541 - F1847);
  const int32_t tmp0 = int32_t(uint32_t(wrap16(x[0] + x[4])) << 13);
  const int32_t tmp1 = int32_t(uint32_t(wrap16(x[0] - x[4])) << 13);
  const int32_t t10 = add32(tmp0, tmp3), t13 = sub32(tmp0, tmp3), t11 = add32(tmp1, tmp2), t12 = sub32(tmp1, tmp2);
  const int16_t o7 = x[7], o5 = x[5], o3 = x[3], o1 = x[1];
  const int16_t z3 = wrap16(o7 + o3), z4 = wrap16(o5 + o1);
  const int32_t z3f = madd(z3, F1175 - F1961, z4, F1175), z4f = madd(z3, F1175, z4, F1175 - F0390);
  const int32_t p0 = add32(madd(o7, F0298 - F0899, o1, -F0899), z3f);
  const int32_t p3 = add32(madd(o7, -F0899, o1, F1501 - F0899), z4f);
  const int32_t p1 = add32(madd(o5, F2053 - F2562, o3, -F2562), z4f);
  const int32_t p2 = add32(madd(o5, -F2562, o3, F3072 - F2562), z3f);
  out[0] = add32(t10, p3);
  out[7] = sub32(t10, p3);
  out[1] = add32(t11, p2);
  out[6] = sub32(t11, p2);
  out[2] = add32(t12, p1);
  out[5] = sub32(t12, p1);
  out[3] = add32(t13, p0);
  out[4] = sub32(t13, p0);
}

inline int32_t simd_descale(int32_t x, int n) { return add32(x, 1 << (n - 1)) >> n; }

// The output stage both SIMD paths share: saturate to 16 bits, then to -128..127, then + 128.
inline uint8_t simd_output(int32_t descaled) { return uint8_t(std::clamp<int32_t>(saturate16(descaled), -128, 127) + 128); }

// ---- the fast path ----

// The int32 pass for 8 columns at once: in[r * 8 + c] is value r of column c; writes
// DESCALE(out, shift) to out[r * 8 + c]. Equal to both references when nothing wraps or saturates.
void islow_columns_int32(const int32_t* __restrict in, int32_t* __restrict out, int shift) {
  const int32_t round = 1 << (shift - 1);
  for (int c = 0; c < 8; ++c) {
    const int32_t z2 = in[16 + c], z3 = in[48 + c];
    const int32_t z1 = (z2 + z3) * F0541;
    const int32_t e2 = z1 + z3 * -F1847, e3 = z1 + z2 * F0765;
    const int32_t e0 = (in[c] + in[32 + c]) * 8192, e1 = (in[c] - in[32 + c]) * 8192;
    const int32_t t10 = e0 + e3, t13 = e0 - e3, t11 = e1 + e2, t12 = e1 - e2;
    const int32_t o0 = in[56 + c], o1 = in[40 + c], o2 = in[24 + c], o3 = in[8 + c];
    const int32_t z5 = (o0 + o1 + o2 + o3) * F1175;
    const int32_t y1 = (o0 + o3) * -F0899, y2 = (o1 + o2) * -F2562;
    const int32_t y3 = (o0 + o2) * -F1961 + z5, y4 = (o1 + o3) * -F0390 + z5;
    const int32_t p0 = o0 * F0298 + y1 + y3, p1 = o1 * F2053 + y2 + y4;
    const int32_t p2 = o2 * F3072 + y2 + y3, p3 = o3 * F1501 + y1 + y4;
    out[c] = (t10 + p3 + round) >> shift;
    out[56 + c] = (t10 - p3 + round) >> shift;
    out[8 + c] = (t11 + p2 + round) >> shift;
    out[48 + c] = (t11 - p2 + round) >> shift;
    out[16 + c] = (t12 + p1 + round) >> shift;
    out[40 + c] = (t12 - p1 + round) >> shift;
    out[24 + c] = (t13 + p0 + round) >> shift;
    out[32 + c] = (t13 - p0 + round) >> shift;
  }
}

void transpose8(const int32_t* __restrict in, int32_t* __restrict out) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) out[c * 8 + r] = in[r * 8 + c];
}

}  // namespace

void idct_islow_c(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride) {
  int32_t ws[64];  // libjpeg's int workspace
  for (int c = 0; c < 8; ++c) {
    auto in = [&](int r) -> int64_t { return int32_t(coef[r * 8 + c]) * int32_t(quant[r * 8 + c]); };
    bool ac_zero = true;
    for (int r = 1; r < 8; ++r) ac_zero = ac_zero && coef[r * 8 + c] == 0;
    if (ac_zero) {  // column shortcut, as in libjpeg
      const int32_t dc = int32_t(left_shift(in(0), 2));
      for (int r = 0; r < 8; ++r) ws[r * 8 + c] = dc;
      continue;
    }
    int64_t o[8];
    islow_1d(in, o);
    for (int r = 0; r < 8; ++r) ws[r * 8 + c] = int32_t(descale(o[r], 11));
  }
  for (int r = 0; r < 8; ++r) {
    const int32_t* w = ws + r * 8;
    uint8_t* row = out + size_t(r) * stride;
    if (!w[1] && !w[2] && !w[3] && !w[4] && !w[5] && !w[6] && !w[7]) {  // row shortcut
      std::memset(row, range_limit(descale(w[0], 5)), 8);
      continue;
    }
    int64_t o[8];
    islow_1d([&](int k) -> int64_t { return w[k]; }, o);
    for (int k = 0; k < 8; ++k) row[k] = range_limit(descale(o[k], 18));
  }
}

void idct_islow_x86_simd(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride) {
  int16_t ws[64];
  bool rows_zero = true;  // rows 1..7 of every column
  for (int i = 8; i < 64; ++i) rows_zero = rows_zero && coef[i] == 0;
  for (int c = 0; c < 8; ++c) {
    int16_t x[8];
    for (int r = 0; r < 8; ++r) x[r] = wrap16(int32_t(coef[r * 8 + c]) * quant[r * 8 + c]);  // pmullw
    if (rows_zero) {
      for (int r = 0; r < 8; ++r) ws[r * 8 + c] = wrap16(x[0] * 4);  // psllw
      continue;
    }
    int32_t o[8];
    simd_1d(x, o);
    for (int r = 0; r < 8; ++r) ws[r * 8 + c] = saturate16(simd_descale(o[r], 11));
  }
  for (int r = 0; r < 8; ++r) {
    int32_t o[8];
    simd_1d(ws + r * 8, o);
    for (int k = 0; k < 8; ++k) out[size_t(r) * stride + size_t(k)] = simd_output(simd_descale(o[k], 18));
  }
}

void idct_islow(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride) {
  int32_t dq[64];
  int32_t lo = 0, hi = 0, ac = 0;
  for (int i = 0; i < 64; ++i) {
    dq[i] = int32_t(coef[i]) * int32_t(quant[i]);
    lo = std::min(lo, dq[i]);
    hi = std::max(hi, dq[i]);
    ac |= i ? coef[i] : 0;
  }
  if (ac == 0) {  // only DC: pass 1 gives dq << 2 in column 0, pass 2 one value for all
    const int32_t v = wrap16(wrap16(dq[0]) * 4);
    const uint8_t value = simd_output((v + 16) >> 5);
    for (int r = 0; r < 8; ++r) std::memset(out + size_t(r) * stride, value, 8);
    return;
  }
  int32_t ws[64], wt[64], res[64];
  if (lo >= -1024 && hi <= 1024) {
    islow_columns_int32(dq, ws, 11);
    int32_t wlo = 0, whi = 0;
    for (int i = 0; i < 64; ++i) {
      wlo = std::min(wlo, ws[i]);
      whi = std::max(whi, ws[i]);
    }
    if (wlo >= -16383 && whi <= 16383) {  // pass 2's 16-bit sums cannot wrap
      transpose8(ws, wt);
      islow_columns_int32(wt, res, 18);  // res[k * 8 + r]: row r, column k
      for (int r = 0; r < 8; ++r) {
        uint8_t* row = out + size_t(r) * stride;
        for (int k = 0; k < 8; ++k) row[k] = uint8_t(std::clamp(res[k * 8 + r], -128, 127) + 128);
      }
      return;
    }
  }
  idct_islow_x86_simd(coef, quant, out, stride);
}

}  // namespace et::jpeg_detail
