// libjpeg's "islow" inverse DCT (jidctint.c: Loeffler-Ligtenberg-Moschytz with 13-bit fixed
// point constants, CONST_BITS 13, PASS1_BITS 2), bit for bit, overflow included:
//  - dequantisation multiplies the 16-bit coefficient by the 16-bit multiplier in int;
//  - intermediates are JLONG (64 bits), the workspace between the passes is int (32 bits);
//  - the output is DESCALE(...) masked to 10 bits (RANGE_MASK) and looked up in libjpeg's
//    range-limit table (jdmaster.c prepare_range_limit_table): 0..127 -> 128..255, 128..511 ->
//    255, 512..895 -> 0, 896..1023 -> 0..127. So a value far out of range wraps, as in libjpeg.
// idct_islow_reference transcribes that. idct_islow gives the same bytes faster: a block of
// only DC is one value; a block whose dequantised coefficients are all within +-1024 cannot
// overflow 32 bits anywhere (bench/jpeg_idct_bound.py: below 1174) and runs in int32, written
// column-parallel so that the compiler vectorises it; any other block takes the reference.
#include <algorithm>
#include <cstring>

#include "engine/data/jpeg_internal.h"

namespace et::jpeg_detail {
namespace {

// FIX(x) = x * 2^13 rounded (jidctint.c).
constexpr int32_t F0298 = 2446, F0390 = 3196, F0541 = 4433, F0765 = 6270, F0899 = 7373, F1175 = 9633,
                  F1501 = 12299, F1847 = 15137, F1961 = 16069, F2053 = 16819, F2562 = 20995, F3072 = 25172;

// The range-limit table as a formula of the masked value (see the top of the file).
inline uint8_t range_limit(int64_t descaled) {
  const int32_t w = int32_t((descaled + 128) & 1023);
  return uint8_t(w < 256 ? w : (w < 640 ? 255 : 0));
}

// libjpeg's LEFT_SHIFT: (JLONG)((unsigned long)(a) << b).
inline int64_t left_shift(int64_t a, int b) { return int64_t(uint64_t(a) << b); }

inline int64_t descale(int64_t x, int n) { return (x + (int64_t(1) << (n - 1))) >> n; }

// One 1-D pass of jidctint.c on 8 values (in[0..7] at in_step apart) with 64-bit intermediates;
// the raw (not yet descaled) outputs in natural order.
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

// The same pass in int32 for 8 columns at once: in[r * 8 + c] is value r of column c; writes
// DESCALE(out, shift) to out[r * 8 + c]. Exact when nothing overflows 32 bits.
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

void transpose8(const int32_t* in, int32_t* out) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) out[c * 8 + r] = in[r * 8 + c];
}

}  // namespace

void idct_islow_reference(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride) {
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

void idct_islow(const int16_t* coef, const int16_t* quant, uint8_t* out, size_t stride) {
  int32_t dq[64];
  int32_t lo = 0, hi = 0, ac = 0;
  for (int i = 0; i < 64; ++i) {
    dq[i] = int32_t(coef[i]) * int32_t(quant[i]);
    lo = std::min(lo, dq[i]);
    hi = std::max(hi, dq[i]);
    ac |= i ? coef[i] : 0;
  }
  if (ac == 0) {  // every column and row takes libjpeg's shortcut: one value
    const int32_t dc = int32_t(left_shift(dq[0], 2));
    const uint8_t v = range_limit(descale(dc, 5));
    for (int r = 0; r < 8; ++r) std::memset(out + size_t(r) * stride, v, 8);
    return;
  }
  if (lo < -1024 || hi > 1024) {
    idct_islow_reference(coef, quant, out, stride);
    return;
  }
  int32_t ws[64], wt[64], res[64];
  islow_columns_int32(dq, ws, 11);
  transpose8(ws, wt);
  islow_columns_int32(wt, res, 18);  // res[k * 8 + r]: row r, column k
  for (int r = 0; r < 8; ++r) {
    uint8_t* row = out + size_t(r) * stride;
    for (int k = 0; k < 8; ++k) row[k] = range_limit(res[k * 8 + r]);
  }
}

}  // namespace et::jpeg_detail
