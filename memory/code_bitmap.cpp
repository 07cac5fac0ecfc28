#include "memory/code_bitmap.h"

#include <omp.h>

#include <algorithm>

#include "engine/check.h"
#include "memory/bitmap.h"
#include "quant/codes.h"

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__)
#define ET_CODES_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define ET_CODES_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define ET_CODES_NEON 1
#include <arm_neon.h>
#endif

namespace et::code_bitmap {
namespace {

inline bool bit(const uint64_t* bits, int64_t i) { return (bits[i >> 6] >> (i & 63)) & 1; }

inline void put_nibble(uint8_t* out, int64_t p, int8_t code) {
  const uint8_t v = quant::int4_nibble(code);
  uint8_t& b = out[p >> 1];
  b = (p & 1) ? uint8_t((b & 0x0F) | (v << 4)) : v;
}
inline uint8_t get_nibble(const uint8_t* in, int64_t p) { return (in[p >> 1] >> ((p & 1) * 4)) & 0x0F; }

// The reference, from nibble p on (the fast kernels finish their tails with it).
int64_t ref_pack_from(const uint64_t* bits, int64_t first, const int8_t* codes, int64_t count, uint8_t* out, int64_t p) {
  for (int64_t i = 0; i < count; ++i)
    if (bit(bits, first + i)) put_nibble(out, p++, codes[i]);
  return p;
}
void ref_pack(const uint64_t* bits, const int8_t* codes, int64_t count, uint8_t* out) {
  ref_pack_from(bits, 0, codes, count, out, 0);
}
void ref_unpack(const uint64_t* bits, int64_t first, const uint8_t* nibbles, int64_t p, int64_t count, bool is_signed,
                int8_t* out) {
  for (int64_t i = 0; i < count; ++i)
    out[i] = bit(bits, first + i) ? quant::int4_from_nibble(get_nibble(nibbles, p++), is_signed) : int8_t(0);
}

#if defined(ET_CODES_AVX512)
// Byte permutations: up one (byte i <- i - 1) and down one (byte i <- i + 1).
struct Shifts {
  alignas(64) uint8_t up[64], down[64];
  Shifts() {
    for (int i = 0; i < 64; ++i) up[i] = uint8_t(i == 0 ? 0 : i - 1), down[i] = uint8_t(i == 63 ? 63 : i + 1);
  }
};
const Shifts kShifts;

// 32 elements at a time: their bitmap bits, the kept codes compressed into the low bytes of a
// register (vpcompressb to a register: Zen 4 microcodes the memory form), shifted up one byte
// behind the pending nibble when the output position is odd, then paired into bytes.
void a512_pack(const uint64_t* bits, const int8_t* codes, int64_t count, uint8_t* out) {
  const __m512i up_one = _mm512_load_si512(kShifts.up);
  const __m512i lo4 = _mm512_set1_epi16(0x000F), hi4 = _mm512_set1_epi16(0x00F0);
  int64_t p = 0, i = 0;
  for (; i + 32 <= count; i += 32) {
    const uint32_t m = uint32_t(bits[i >> 6] >> (i & 63));
    if (!m) continue;
    const int k = __builtin_popcount(m);
    // (Masked and zeroing forms throughout: GCC 12 warns about the unmasked ones' undefined lanes.)
    __m512i v = _mm512_maskz_compress_epi8(m, _mm512_maskz_loadu_epi8(~0u, codes + i));
    const int odd = int(p & 1);
    if (odd) v = _mm512_mask_set1_epi8(_mm512_maskz_permutexvar_epi8(~0ull, up_one, v), 1, char(out[p >> 1] & 0x0F));
    // u16 lane (a | b << 8) -> byte (a & 15) | (b & 15) << 4
    const __m512i pairs = _mm512_or_si512(_mm512_and_si512(v, lo4), _mm512_and_si512(_mm512_srli_epi16(v, 4), hi4));
    const int nbytes = (k + odd + 1) >> 1;  // <= 17
    _mm256_mask_storeu_epi8(out + (p >> 1), __mmask32((1u << nbytes) - 1), _mm512_maskz_cvtepi16_epi8(~0u, pairs));
    p += k;
  }
  if (i < count) ref_pack_from(bits, i, codes + i, count - i, out, p);
}

// 32 elements at a time: the (up to 17) bytes holding their codes widened to one nibble per byte,
// shifted down one when the first code is a high nibble, sign-extended, and expanded to the set
// bits' positions (vpexpandb; zeros elsewhere).
void a512_unpack(const uint64_t* bits, int64_t first, const uint8_t* nibbles, int64_t p, int64_t count, bool is_signed,
                 int8_t* out) {
  const __m512i down_one = _mm512_load_si512(kShifts.down);
  const __m512i lo4 = _mm512_set1_epi16(0x000F), eight = _mm512_set1_epi8(8);
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const int64_t e = first + i, s = e & 63;
    uint64_t w = bits[e >> 6] >> s;
    if (s > 32) w |= bits[(e >> 6) + 1] << (64 - s);  // the 32 bits span two words
    const uint32_t m = uint32_t(w);
    if (!m) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_setzero_si256());
      continue;
    }
    const int k = __builtin_popcount(m), odd = int(p & 1);
    const int nbytes = (k + odd + 1) >> 1;
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(__mmask32((1u << nbytes) - 1), nibbles + (p >> 1)));
    __m512i v = _mm512_or_si512(_mm512_and_si512(b, lo4), _mm512_slli_epi16(_mm512_srli_epi16(b, 4), 8));
    if (odd) v = _mm512_maskz_permutexvar_epi8(~0ull, down_one, v);
    if (is_signed) v = _mm512_sub_epi8(_mm512_xor_si512(v, eight), eight);  // two's complement nibble
    _mm512_mask_storeu_epi8(out + i, ~0u, _mm512_maskz_expand_epi8(m, v));
    p += k;
  }
  if (i < count) ref_unpack(bits, first + i, nibbles, p, count - i, is_signed, out + i);
}
#endif

#if defined(ET_CODES_AVX2) || defined(ET_CODES_NEON)
// Byte shuffles by an 8-bit mask m: compress (the bytes whose bit is set, in order, to the low
// bytes) and expand (the low bytes, in order, to the set bits' places; 0x80 gives 0 elsewhere).
struct ByteShuffles {
  alignas(16) uint8_t compress[256][8], expand[256][8];
  ByteShuffles() {
    for (int m = 0; m < 256; ++m) {
      int r = 0;
      for (int j = 0; j < 8; ++j) {
        compress[m][j] = 0x80;
        expand[m][j] = 0x80;
      }
      for (int j = 0; j < 8; ++j)
        if ((m >> j) & 1) {
          compress[m][r] = uint8_t(j);
          expand[m][j] = uint8_t(r++);
        }
    }
  }
};
const ByteShuffles kByteShuffles;

// 8 bits of the bitmap from element e on (they may span two words).
inline unsigned bits8(const uint64_t* bits, int64_t e) {
  const int64_t s = e & 63;
  uint64_t w = bits[e >> 6] >> s;
  if (s > 56) w |= bits[(e >> 6) + 1] << (64 - s);
  return unsigned(w & 0xFF);
}

// The AVX2 and NEON kernels: one driver each way, the byte work per ISA (Shuffles below).
// pack: 8 elements at a time, the kept codes compressed by a byte shuffle and appended to a
// staging buffer as bytes; then 32 staged codes at a time paired into 16 bytes of nibbles.
// Exactly (kept + 1) / 2 bytes are written, as the reference writes.
template <class Isa>
void shuffle_pack(const uint64_t* bits, const int8_t* codes, int64_t count, uint8_t* out) {
  alignas(32) uint8_t staged[kBlock + 48];
  int64_t k = 0, i = 0;
  for (; i + 8 <= count; i += 8) {
    const unsigned m = bits8(bits, i);
    if (!m) continue;
    Isa::compress8(codes + i, kByteShuffles.compress[m], staged + k);
    k += __builtin_popcount(m);
  }
  for (; i < count; ++i)
    if (bit(bits, i)) staged[k++] = uint8_t(codes[i]);
  staged[k] = 0;  // an odd count's last byte: a zero high nibble, as the reference leaves it
  const int64_t nbytes = (k + 1) / 2;
  int64_t j = 0;
  for (; j + 16 <= nbytes; j += 16) Isa::pair16(staged + 2 * j, out + j);
  for (; j < nbytes; ++j) out[j] = uint8_t((staged[2 * j] & 0x0F) | ((staged[2 * j + 1] & 0x0F) << 4));
}

// unpack: the kept codes of the range widened to a byte each (16 nibble bytes at a time where they
// lie inside the range's bytes), sign-extended, then 8 elements at a time expanded to the set
// bits' places by a byte shuffle.
template <class Isa>
void shuffle_unpack(const uint64_t* bits, int64_t first, const uint8_t* nibbles, int64_t p, int64_t count,
                    bool is_signed, int8_t* out) {
  const int64_t k = bitmap::popcount_range(bits, first, count);
  alignas(32) int8_t wide[kBlock + 48];  // nibble p & ~1 at wide[0]
  const uint8_t* src = nibbles + (p >> 1);
  const int64_t nbytes = ((p & 1) + k + 1) / 2;  // the bytes holding nibbles [p & ~1, p + k)
  int64_t b = 0;
  for (; b + 16 <= nbytes; b += 16) Isa::widen16(src + b, is_signed, wide + 2 * b);
  for (; b < nbytes; ++b) {
    wide[2 * b] = quant::int4_from_nibble(src[b] & 0x0F, is_signed);
    wide[2 * b + 1] = quant::int4_from_nibble(src[b] >> 4, is_signed);
  }
  const int8_t* codes = wide + (p & 1);
  for (int j = 0; j < 8; ++j) wide[2 * nbytes + j] = 0;  // what the last shuffle may read past the codes
  int64_t r = 0, i = 0;
  for (; i + 8 <= count; i += 8) {
    const unsigned m = bits8(bits, first + i);
    Isa::expand8(codes + r, kByteShuffles.expand[m], out + i);
    r += __builtin_popcount(m);
  }
  for (; i < count; ++i) out[i] = bit(bits, first + i) ? codes[r++] : int8_t(0);
}
#endif

#if defined(ET_CODES_AVX2)
struct Avx2Shuffles {
  static void compress8(const int8_t* codes, const uint8_t* sel, uint8_t* out) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sel));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_shuffle_epi8(v, s));
  }
  static void expand8(const int8_t* codes, const uint8_t* sel, int8_t* out) {
    compress8(codes, sel, reinterpret_cast<uint8_t*>(out));  // the same shuffle, the other table
  }
  // u16 lane (a | b << 8) -> (a & 15) | (b & 15) << 4, then the low bytes of the 16 lanes in order.
  static void pair16(const uint8_t* staged, uint8_t* out) {
    const __m256i lo4 = _mm256_set1_epi16(0x000F), hi4 = _mm256_set1_epi16(0x00F0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(staged));
    const __m256i t = _mm256_or_si256(_mm256_and_si256(v, lo4), _mm256_and_si256(_mm256_srli_epi16(v, 4), hi4));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }
  static void widen16(const uint8_t* src, bool is_signed, int8_t* wide) {
    const __m128i lo4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
    if (is_signed) {  // two's complement nibbles
      lo = _mm_sub_epi8(_mm_xor_si128(lo, eight), eight);
      hi = _mm_sub_epi8(_mm_xor_si128(hi, eight), eight);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wide), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wide + 16), _mm_unpackhi_epi8(lo, hi));
  }
};
#endif

#if defined(ET_CODES_NEON)
// vtbl1: an index of 8 or more gives 0; de-interleaving loads / interleaving stores for the pairs.
struct NeonShuffles {
  static void compress8(const int8_t* codes, const uint8_t* sel, uint8_t* out) {
    vst1_u8(out, vtbl1_u8(vld1_u8(reinterpret_cast<const uint8_t*>(codes)), vld1_u8(sel)));
  }
  static void expand8(const int8_t* codes, const uint8_t* sel, int8_t* out) {
    compress8(codes, sel, reinterpret_cast<uint8_t*>(out));
  }
  static void pair16(const uint8_t* staged, uint8_t* out) {
    const uint8x16x2_t v = vld2q_u8(staged);  // even codes, odd codes
    vst1q_u8(out, vorrq_u8(vandq_u8(v.val[0], vdupq_n_u8(0x0F)), vshlq_n_u8(v.val[1], 4)));
  }
  static void widen16(const uint8_t* src, bool is_signed, int8_t* wide) {
    const uint8x16_t v = vld1q_u8(src), eight = vdupq_n_u8(8);
    uint8x16x2_t w;
    w.val[0] = vandq_u8(v, vdupq_n_u8(0x0F));
    w.val[1] = vshrq_n_u8(v, 4);
    if (is_signed)  // two's complement nibbles
      for (int h = 0; h < 2; ++h) w.val[h] = vsubq_u8(veorq_u8(w.val[h], eight), eight);
    vst2q_u8(reinterpret_cast<uint8_t*>(wide), w);
  }
};
#endif

const Impl& best() { return fast_impl().available ? fast_impl() : reference_impl(); }

struct Layout {
  uint64_t* bits;
  int64_t* directory;
  uint8_t* nibbles;
};
Layout layout(const void* data, int64_t n) {
  uint64_t* bits = static_cast<uint64_t*>(const_cast<void*>(data));
  int64_t* dir = reinterpret_cast<int64_t*>(bits + bitmap::num_words(n));
  return Layout{bits, dir, reinterpret_cast<uint8_t*>(dir + num_blocks(n))};
}

}  // namespace

const Impl& reference_impl() {
  static const Impl impl{"reference", true, ref_pack, ref_unpack};
  return impl;
}

const Impl& fast_impl() {
#if defined(ET_CODES_AVX512)
  static const Impl impl{"avx512", true, a512_pack, a512_unpack};
#elif defined(ET_CODES_AVX2)
  static const Impl impl{"avx2", true, shuffle_pack<Avx2Shuffles>, shuffle_unpack<Avx2Shuffles>};
#elif defined(ET_CODES_NEON)
  static const Impl impl{"neon", true, shuffle_pack<NeonShuffles>, shuffle_unpack<NeonShuffles>};
#else
  static const Impl impl{"none", false, nullptr, nullptr};
#endif
  return impl;
}

size_t encoded_bytes(int64_t n, int64_t kept) {
  return size_t(bitmap::num_words(n)) * 8 + size_t(num_blocks(n)) * 8 + size_t(nibble_bytes(n, kept));
}

int64_t encode(const float* x, const int8_t* codes, int64_t n, float prune_threshold, void* out, int64_t capacity) {
  const int64_t room = capacity >= 0 && capacity < n ? nibble_bytes(n, capacity) : -1;  // -1: no limit
  const Layout l = layout(out, n);
  const int64_t blocks = num_blocks(n);
  const Impl& k = best();
  const int T = n >= bitmap::kParallelMinElements ? bitmap::threads() : 1;
  int64_t kept = 0;
  // One parallel region, each thread on its blocks: bitmaps and counts (in the directory), then the
  // directory's offsets, then the codes.
#pragma omp parallel num_threads(T) if (T > 1)
  {
    const int64_t p = omp_get_num_threads(), i = omp_get_thread_num();
    const int64_t b0 = blocks * i / p, b1 = blocks * (i + 1) / p;
    auto len = [&](int64_t b) { return std::min(kBlock, n - b * kBlock); };
    for (int64_t b = b0; b < b1; ++b)
      l.directory[b] = bitmap::make_bits(x + b * kBlock, len(b), prune_threshold, l.bits + b * (kBlock / 64));
#pragma omp barrier
#pragma omp single
    for (int64_t b = 0, offset = 0; b < blocks; ++b) {
      kept += l.directory[b];
      const int64_t count = l.directory[b];
      l.directory[b] = offset;
      offset += (count + 1) / 2;
      // Past the room: the block keeps the codes whose nibbles fit, the others' bits cleared.
      if (room >= 0 && offset > room)
        bitmap::keep_first(l.bits + b * (kBlock / 64), len(b), std::max<int64_t>(0, 2 * (room - l.directory[b])));
    }
    for (int64_t b = b0; b < b1; ++b)
      k.pack(l.bits + b * (kBlock / 64), codes + b * kBlock, len(b), l.nibbles + l.directory[b]);
  }
  return kept;
}

void decode(const void* data, int64_t n, bool is_signed, int64_t begin, int64_t count, int8_t* out) {
  ET_CHECK(begin >= 0 && count >= 0 && begin + count <= n, "codes [", begin, ", +", count, ") of ", n);
  const Layout l = layout(data, n);
  const Impl& k = best();
  for (int64_t e = begin, end = begin + count; e < end;) {
    const int64_t b = e / kBlock, stop = std::min(end, (b + 1) * kBlock);
    const int64_t nibble = bitmap::popcount_range(l.bits, b * kBlock, e - b * kBlock);
    k.unpack(l.bits, e, l.nibbles + l.directory[b], nibble, stop - e, is_signed, out + (e - begin));
    e = stop;
  }
}

}  // namespace et::code_bitmap
