// SIMD kernels of the bitmap codec (docs/bitmap.md). Every kernel handles whole 64-element words
// and hands a partial last word to the scalar reference (detail::tail_*), so its output is the
// reference's bit for bit. All paths compiled for the build's target are exposed (a Zen 4 build
// has both AVX-512 and AVX2, so the tests run both).
#include <cstring>

#include "memory/bitmap.h"
#include "memory/bitmap_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ET_BITMAP_AVX512 1
#endif
#if defined(__AVX2__)
#define ET_BITMAP_AVX2 1
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#define ET_BITMAP_NEON 1
#endif

#if defined(ET_BITMAP_AVX512) || defined(ET_BITMAP_AVX2)
#include <immintrin.h>
#endif
#if defined(ET_BITMAP_NEON)
#include <arm_neon.h>
#endif

namespace et::bitmap {
namespace {

[[maybe_unused]] inline int popc(uint64_t w) { return __builtin_popcountll(w); }

// ======================================================================================= AVX-512
#if defined(ET_BITMAP_AVX512)

// Register compress + masked store (Zen 4's vcompressps with a memory destination is microcoded
// and several times slower; masked stores never fault or write past the end). Masked stores and
// loads with an empty mask are skipped: one aimed at a page not mapped or not yet faulted in (the
// end of the values, a fresh stash page) still costs a microcode assist of ~10-100x the access
// (Table 1's all-zero rows ran at 0.35 GB/s on one thread when the values ended at a mapping's end).
inline __mmask16 a512_mask(const float* x, __m512i tb) {
  const __m512i v = _mm512_and_si512(_mm512_loadu_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
  return _mm512_cmp_epu32_mask(v, tb, _MM_CMPINT_NLT);
}

inline uint64_t a512_word(const float* x, __m512i tb) {
  return uint64_t(a512_mask(x, tb)) | uint64_t(a512_mask(x + 16, tb)) << 16 |
         uint64_t(a512_mask(x + 32, tb)) << 32 | uint64_t(a512_mask(x + 48, tb)) << 48;
}

inline int64_t a512_store(void* values, int64_t p, __mmask16 m, __m512 v, ValueType t) {
  const __m512 c = _mm512_maskz_compress_ps(m, v);
  const int k = __builtin_popcount(m);
  const __mmask16 lo = __mmask16((1u << k) - 1);
  if (t == ValueType::F32) {
    _mm512_mask_storeu_ps(static_cast<float*>(values) + p, lo, c);
  } else {
    const __m256i h = _mm512_maskz_cvtps_ph(0xFFFF, c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(values) + p, lo, h);
  }
  return p + k;
}

int64_t a512_make_bits(const float* x, int64_t n, float thr, uint64_t* bits) {
  const __m512i tb = _mm512_set1_epi32(int(detail::threshold_bits(thr)));
  const int64_t full = n / 64;
  int64_t nnz = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = a512_word(x + w * 64, tb);
    bits[w] = word;
    nnz += popc(word);
  }
  if (n % 64) nnz += detail::tail_make_bits(x + full * 64, n % 64, thr, bits + full);
  return nnz;
}

void a512_pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t) {
  const int64_t full = n / 64;
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = bits[w];
    if (!word) continue;
    const float* xw = x + w * 64;
    for (int q = 0; q < 4; ++q) {
      const __mmask16 m = __mmask16(word >> (16 * q));
      if (m) p = a512_store(values, p, m, _mm512_loadu_ps(xw + 16 * q), t);
    }
  }
  if (n % 64) detail::tail_pack_values(x + full * 64, bits + full, n % 64, static_cast<char*>(values) + p * value_bytes(t), t);
}

int64_t a512_pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t) {
  const __m512i tb = _mm512_set1_epi32(int(detail::threshold_bits(thr)));
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF);
  const int64_t full = n / 64;
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    const float* xw = x + w * 64;
    uint64_t word = 0;
    for (int q = 0; q < 4; ++q) {
      const __m512 v = _mm512_loadu_ps(xw + 16 * q);
      const __mmask16 m = _mm512_cmp_epu32_mask(_mm512_and_si512(_mm512_castps_si512(v), absm), tb, _MM_CMPINT_NLT);
      word |= uint64_t(m) << (16 * q);
      if (m) p = a512_store(values, p, m, v, t);
    }
    bits[w] = word;
  }
  if (n % 64) p += detail::tail_pack(x + full * 64, n % 64, thr, bits + full, static_cast<char*>(values) + p * value_bytes(t), t);
  return p;
}

void a512_unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out) {
  const int64_t full = n / 64;
  int64_t p = 0;
  const float* v32 = static_cast<const float*>(values);
  const uint16_t* v16 = static_cast<const uint16_t*>(values);
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = bits[w];
    float* ow = out + w * 64;
    for (int q = 0; q < 4; ++q) {
      const __mmask16 m = __mmask16(word >> (16 * q));
      const int k = __builtin_popcount(m);
      if (!m) {
        _mm512_storeu_ps(ow + 16 * q, _mm512_setzero_ps());
      } else if (t == ValueType::F32) {
        // vexpandps from memory reads only the k values it needs (and is fast on Zen 4, unlike
        // vcompressps to memory).
        _mm512_storeu_ps(ow + 16 * q, _mm512_maskz_expandloadu_ps(m, v32 + p));
      } else {
        const __m512 v = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_maskz_loadu_epi16(__mmask16((1u << k) - 1), v16 + p));
        _mm512_storeu_ps(ow + 16 * q, _mm512_maskz_expand_ps(m, v));
      }
      p += k;
    }
  }
  if (n % 64) detail::tail_unpack(bits + full, static_cast<const char*>(values) + p * value_bytes(t), n % 64, t, out + full * 64);
}

#endif  // ET_BITMAP_AVX512

// ========================================================================================== AVX2
#if defined(ET_BITMAP_AVX2)

// compress: lane j of the result = source lane of the j-th set bit of the 8-bit mask.
// expand: lane j = rank of bit j among the set bits (lanes with a clear bit are zeroed after).
struct ShuffleTables {
  alignas(32) int32_t compress[256][8];
  alignas(32) int32_t expand[256][8];
  alignas(32) int32_t lanes[256][8];  // -1 where bit set (blend mask)
  ShuffleTables() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int j = 0; j < 8; ++j) {
        compress[m][j] = 0;
        expand[m][j] = 0;
        lanes[m][j] = (m >> j) & 1 ? -1 : 0;
      }
      for (int j = 0; j < 8; ++j)
        if ((m >> j) & 1) {
          compress[m][k] = j;
          expand[m][j] = k;
          ++k;
        }
    }
  }
};
const ShuffleTables& shuffle_tables() {
  static const ShuffleTables t;
  return t;
}

inline uint32_t a2_mask(const float* x, __m256i tbm1) {
  const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), _mm256_set1_epi32(0x7FFFFFFF));
  // both sides are in [0, 2^31): a signed compare is the unsigned one. keep <=> v > tb - 1.
  return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, tbm1))));
}

inline uint64_t a2_word(const float* x, __m256i tbm1) {
  uint64_t w = 0;
  for (int q = 0; q < 8; ++q) w |= uint64_t(a2_mask(x + 8 * q, tbm1)) << (8 * q);
  return w;
}

// Compresses the 64 elements of one word into `dst` (room for 64 + 8 values): full-width stores.
inline int a2_compress_word(const float* x, uint64_t word, float* dst) {
  const ShuffleTables& T = shuffle_tables();
  int p = 0;
  for (int q = 0; q < 8; ++q) {
    const uint32_t m = uint32_t(word >> (8 * q)) & 0xFFu;
    const __m256i idx = _mm256_load_si256(reinterpret_cast<const __m256i*>(T.compress[m]));
    _mm256_storeu_ps(dst + p, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 8 * q), idx));
    p += __builtin_popcount(m);
  }
  return p;
}

inline void a2_store_values(void* values, int64_t p, const float* src, int k, ValueType t) {
  if (t == ValueType::F32) {
    std::memcpy(static_cast<float*>(values) + p, src, size_t(k) * 4);
  } else {
    uint16_t* h = static_cast<uint16_t*>(values) + p;
    int i = 0;
#if defined(__F16C__)
    alignas(16) uint16_t tmp[8];
    for (; i + 8 <= k; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < k) {
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      std::memcpy(h + i, tmp, size_t(k - i) * 2);
    }
#else
    for (; i < k; ++i) h[i] = f32_to_f16(src[i]);
#endif
  }
}

int64_t a2_make_bits(const float* x, int64_t n, float thr, uint64_t* bits) {
  const __m256i tbm1 = _mm256_set1_epi32(int(detail::threshold_bits(thr) - 1));
  const int64_t full = n / 64;
  int64_t nnz = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = a2_word(x + w * 64, tbm1);
    bits[w] = word;
    nnz += popc(word);
  }
  if (n % 64) nnz += detail::tail_make_bits(x + full * 64, n % 64, thr, bits + full);
  return nnz;
}

void a2_pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t) {
  const int64_t full = n / 64;
  alignas(32) float buf[64 + 8];
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    if (!bits[w]) continue;
    const int k = a2_compress_word(x + w * 64, bits[w], buf);
    a2_store_values(values, p, buf, k, t);
    p += k;
  }
  if (n % 64) detail::tail_pack_values(x + full * 64, bits + full, n % 64, static_cast<char*>(values) + p * value_bytes(t), t);
}

int64_t a2_pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t) {
  const __m256i tbm1 = _mm256_set1_epi32(int(detail::threshold_bits(thr) - 1));
  const int64_t full = n / 64;
  alignas(32) float buf[64 + 8];
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = a2_word(x + w * 64, tbm1);
    bits[w] = word;
    if (!word) continue;
    const int k = a2_compress_word(x + w * 64, word, buf);
    a2_store_values(values, p, buf, k, t);
    p += k;
  }
  if (n % 64) p += detail::tail_pack(x + full * 64, n % 64, thr, bits + full, static_cast<char*>(values) + p * value_bytes(t), t);
  return p;
}

void a2_unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out) {
  const ShuffleTables& T = shuffle_tables();
  const int64_t full = n / 64;
  alignas(32) float buf[64 + 8];
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = bits[w];
    const int k = popc(word);
    // This word's values, converted to FP32, into a local buffer (full-width loads from it).
    if (t == ValueType::F32) {
      std::memcpy(buf, static_cast<const float*>(values) + p, size_t(k) * 4);
    } else {
      const uint16_t* h = static_cast<const uint16_t*>(values) + p;
      int i = 0;
#if defined(__F16C__)
      for (; i + 8 <= k; i += 8) _mm256_store_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
      for (; i < k; ++i) buf[i] = f16_to_f32(h[i]);
    }
    int r = 0;
    float* ow = out + w * 64;
    for (int q = 0; q < 8; ++q) {
      const uint32_t m = uint32_t(word >> (8 * q)) & 0xFFu;
      const __m256 v = _mm256_permutevar8x32_ps(_mm256_loadu_ps(buf + r),
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(T.expand[m])));
      _mm256_storeu_ps(ow + 8 * q, _mm256_and_ps(v, _mm256_load_ps(reinterpret_cast<const float*>(T.lanes[m]))));
      r += __builtin_popcount(m);
    }
    p += k;
  }
  if (n % 64) detail::tail_unpack(bits + full, static_cast<const char*>(values) + p * value_bytes(t), n % 64, t, out + full * 64);
}

#endif  // ET_BITMAP_AVX2

// ========================================================================================== NEON
#if defined(ET_BITMAP_NEON)

// Byte-shuffle tables for vqtbl1q_u8 over 4 float lanes; index 0xFF gives 0 (used by expand).
struct NeonTables {
  uint8_t compress[16][16];
  uint8_t expand[16][16];
  NeonTables() {
    for (int m = 0; m < 16; ++m) {
      int k = 0;
      for (int j = 0; j < 16; ++j) compress[m][j] = expand[m][j] = 0xFF;
      for (int j = 0; j < 4; ++j)
        if ((m >> j) & 1) {
          for (int b = 0; b < 4; ++b) {
            compress[m][4 * k + b] = uint8_t(4 * j + b);
            expand[m][4 * j + b] = uint8_t(4 * k + b);
          }
          ++k;
        }
    }
  }
};
const NeonTables& neon_tables() {
  static const NeonTables t;
  return t;
}

inline uint32_t ne_mask(const float* x, uint32x4_t tb) {
  static const uint32_t kBit[4] = {1, 2, 4, 8};
  const uint32x4_t v = vandq_u32(vld1q_u32(reinterpret_cast<const uint32_t*>(x)), vdupq_n_u32(0x7FFFFFFFu));
  return vaddvq_u32(vandq_u32(vcgeq_u32(v, tb), vld1q_u32(kBit)));
}

inline uint64_t ne_word(const float* x, uint32x4_t tb) {
  uint64_t w = 0;
  for (int q = 0; q < 16; ++q) w |= uint64_t(ne_mask(x + 4 * q, tb)) << (4 * q);
  return w;
}

inline int ne_compress_word(const float* x, uint64_t word, float* dst) {
  const NeonTables& T = neon_tables();
  int p = 0;
  for (int q = 0; q < 16; ++q) {
    const uint32_t m = uint32_t(word >> (4 * q)) & 0xFu;
    const uint8x16_t v = vld1q_u8(reinterpret_cast<const uint8_t*>(x + 4 * q));
    vst1q_u8(reinterpret_cast<uint8_t*>(dst + p), vqtbl1q_u8(v, vld1q_u8(T.compress[m])));
    p += __builtin_popcount(m);
  }
  return p;
}

inline void ne_store_values(void* values, int64_t p, const float* src, int k, ValueType t) {
  if (t == ValueType::F32) {
    std::memcpy(static_cast<float*>(values) + p, src, size_t(k) * 4);
  } else {
    uint16_t* h = static_cast<uint16_t*>(values) + p;
    int i = 0;
    for (; i + 4 <= k; i += 4) vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i))));  // as F16C
    for (; i < k; ++i) h[i] = f32_to_f16(src[i]);
  }
}

int64_t ne_make_bits(const float* x, int64_t n, float thr, uint64_t* bits) {
  const uint32x4_t tb = vdupq_n_u32(detail::threshold_bits(thr));
  const int64_t full = n / 64;
  int64_t nnz = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = ne_word(x + w * 64, tb);
    bits[w] = word;
    nnz += popc(word);
  }
  if (n % 64) nnz += detail::tail_make_bits(x + full * 64, n % 64, thr, bits + full);
  return nnz;
}

void ne_pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t) {
  const int64_t full = n / 64;
  float buf[64 + 4];
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    if (!bits[w]) continue;
    const int k = ne_compress_word(x + w * 64, bits[w], buf);
    ne_store_values(values, p, buf, k, t);
    p += k;
  }
  if (n % 64) detail::tail_pack_values(x + full * 64, bits + full, n % 64, static_cast<char*>(values) + p * value_bytes(t), t);
}

int64_t ne_pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t) {
  const uint32x4_t tb = vdupq_n_u32(detail::threshold_bits(thr));
  const int64_t full = n / 64;
  float buf[64 + 4];
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = ne_word(x + w * 64, tb);
    bits[w] = word;
    if (!word) continue;
    const int k = ne_compress_word(x + w * 64, word, buf);
    ne_store_values(values, p, buf, k, t);
    p += k;
  }
  if (n % 64) p += detail::tail_pack(x + full * 64, n % 64, thr, bits + full, static_cast<char*>(values) + p * value_bytes(t), t);
  return p;
}

void ne_unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out) {
  const NeonTables& T = neon_tables();
  const int64_t full = n / 64;
  float buf[64 + 4];
  int64_t p = 0;
  for (int64_t w = 0; w < full; ++w) {
    const uint64_t word = bits[w];
    const int k = popc(word);
    if (t == ValueType::F32) {
      std::memcpy(buf, static_cast<const float*>(values) + p, size_t(k) * 4);
    } else {
      const uint16_t* h = static_cast<const uint16_t*>(values) + p;
      int i = 0;
      for (; i + 4 <= k; i += 4) vst1q_f32(buf + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
      for (; i < k; ++i) buf[i] = f16_to_f32(h[i]);
    }
    int r = 0;
    float* ow = out + w * 64;
    for (int q = 0; q < 16; ++q) {
      const uint32_t m = uint32_t(word >> (4 * q)) & 0xFu;
      const uint8x16_t v = vld1q_u8(reinterpret_cast<const uint8_t*>(buf + r));
      vst1q_u8(reinterpret_cast<uint8_t*>(ow + 4 * q), vqtbl1q_u8(v, vld1q_u8(T.expand[m])));
      r += __builtin_popcount(m);
    }
    p += k;
  }
  if (n % 64) detail::tail_unpack(bits + full, static_cast<const char*>(values) + p * value_bytes(t), n % 64, t, out + full * 64);
}

#endif  // ET_BITMAP_NEON

}  // namespace

const Impl& avx512_impl() {
#if defined(ET_BITMAP_AVX512)
  static const Impl impl{"avx512", true, a512_make_bits, a512_pack_values, a512_pack, a512_unpack};
#else
  static const Impl impl{"avx512", false, nullptr, nullptr, nullptr, nullptr};
#endif
  return impl;
}

const Impl& avx2_impl() {
#if defined(ET_BITMAP_AVX2)
  static const Impl impl{"avx2", true, a2_make_bits, a2_pack_values, a2_pack, a2_unpack};
#else
  static const Impl impl{"avx2", false, nullptr, nullptr, nullptr, nullptr};
#endif
  return impl;
}

const Impl& neon_impl() {
#if defined(ET_BITMAP_NEON)
  static const Impl impl{"neon", true, ne_make_bits, ne_pack_values, ne_pack, ne_unpack};
#else
  static const Impl impl{"neon", false, nullptr, nullptr, nullptr, nullptr};
#endif
  return impl;
}

}  // namespace et::bitmap
