// 4-bit code tables and the counter-based RNG of stochastic rounding (docs/quant.md). Backend
// neutral and C++14, so CUDA kernels can include it.
//
// INT4 (forward operands, round to nearest, per-tensor scale s):
//   signed   codes -7..7   value = code * s   (weights; activations that can be negative)
//   unsigned codes 0..15   value = code * s   (activations non-negative by construction)
// FP4 [1,3,0] (neural gradients, per-tensor alpha): sign + 3-bit exponent field f;
//   f = 0 is zero, f = 1..levels is the magnitude 2^(f-1) * alpha (levels <= 7: strict FP4).
// In the kernels' layout every code takes one byte (int8): INT4 codes as their value, an FP4 code
// as the signed power of two +-2^(f-1) it stands for, so an FP4 x INT4 product is an exact integer
// product (a shift: MF-BPROP). Packed, two codes share a byte (low nibble first): INT4 signed as
// two's-complement nibbles, unsigned as is, FP4 as sign << 3 | f.
#pragma once
#include <cstdint>
#include <cstring>

// Functions both the CPU quantizers and the CUDA kernels call (the same bits on both backends).
#if defined(__CUDACC__)
#define ET_HOST_DEVICE __host__ __device__
#else
#define ET_HOST_DEVICE
#endif

namespace et {
namespace quant {

constexpr int kInt4SignedMax = 7;     // -7..7 (the symmetric grid: -8 is never produced)
constexpr int kInt4UnsignedMax = 15;  // 0..15
constexpr int kFp4MaxLevels = 7;      // magnitudes 2^0 .. 2^6 (times alpha)

// FP4 field <-> kernel byte (+-2^(f-1), 0 for f = 0).
ET_HOST_DEVICE inline int8_t fp4_value(int sign, int field) {
  return field == 0 ? int8_t(0) : int8_t(sign ? -(1 << (field - 1)) : (1 << (field - 1)));
}
inline uint8_t fp4_nibble(int8_t value) {
  if (value == 0) return 0;
  const int mag = value < 0 ? -value : value;
  int f = 1;
  while ((1 << (f - 1)) < mag) ++f;
  return uint8_t((value < 0 ? 8 : 0) | f);
}
inline int8_t fp4_from_nibble(uint8_t n) { return fp4_value((n >> 3) & 1, n & 7); }

// INT4 nibbles: signed values as two's complement in 4 bits.
inline uint8_t int4_nibble(int8_t v) { return uint8_t(v) & 0xF; }
inline int8_t int4_from_nibble(uint8_t n, bool is_signed) {
  return is_signed ? int8_t(int8_t(n << 4) >> 4) : int8_t(n);
}

// Counter-based random bits: a key from (seed, step, layer, sample) and the element index give 32
// bits, the same on every backend and for any thread split, so runs reproduce and resume exactly.
ET_HOST_DEVICE inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
ET_HOST_DEVICE inline uint32_t fmix32(uint32_t h) {  // murmur3 finaliser: a bijection with full avalanche
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
struct RngKey {
  uint32_t k0 = 0, k1 = 0;
};
ET_HOST_DEVICE inline RngKey rng_key(uint64_t layer_seed, int sample) {
  const uint64_t k = mix64(layer_seed ^ mix64(0x4C55510000000000ull + uint64_t(sample)));
  return RngKey{uint32_t(k), uint32_t(k >> 32)};
}
// Two rounds over the index: distinct indices give distinct, well mixed words within one key.
ET_HOST_DEVICE inline uint32_t rng_bits(RngKey key, uint32_t index) { return fmix32(fmix32(index ^ key.k0) + key.k1); }

ET_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// FP4 rounding of neural gradients: LUQ's unbiased stochastic one, or round to nearest (the
// paper's diverging ablation).
enum class Fp4Rounding : uint8_t { Stochastic, Nearest };

// The FP4 field (0: zero, f = 1..levels: magnitude 2^(f-1)) of a = |g| / alpha, with the 32 random
// bits rnd of the element (stochastic rounding). Between powers of two 2^e <= a < 2^(e+1) it rounds
// up with probability (a - 2^e) / 2^e, so E[value] = a; below 1 (alpha) to 1 with probability a
// (LUQ's unbiased underflow); at or above 2^(levels-1) it is the top level (alpha = max|g| / 2^(levels-1),
// so only max|g| itself gets there). The mantissa against 23 of the random bits: exact.
ET_HOST_DEVICE inline int fp4_field(float a, int levels, Fp4Rounding mode, uint32_t rnd) {
  if (a >= 1.f) {
    const uint32_t b = float_bits(a);
    const int e = int(b >> 23) - 127;
    if (e >= levels - 1) return levels;
    const uint32_t mant = b & 0x7FFFFFu;  // (a - 2^e) / 2^e in units of 2^-23
    const bool up = mode == Fp4Rounding::Stochastic ? (rnd >> 9) < mant : mant >= 0x400000u;
    return e + 1 + int(up);
  }
  // float(rnd >> 8) * 2^-24: a uniform in [0, 1) on 24 bits, exact
  const bool up = mode == Fp4Rounding::Stochastic ? float(rnd >> 8) * (1.f / 16777216.f) < a : a >= 0.5f;
  return int(up);
}

}  // namespace quant
}  // namespace et
