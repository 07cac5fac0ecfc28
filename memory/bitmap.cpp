// Bitmap codec: scalar reference, FP16 conversion, and the threaded dispatch (docs/bitmap.md).
// SIMD kernels are in bitmap_simd.cpp.
#include "memory/bitmap.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "engine/check.h"
#include "memory/bitmap_kernels.h"

namespace et::bitmap {

// ---------------------------------------------------------------------------------- FP16

uint16_t f32_to_f16(float x) {
  // Round to nearest even on the bit pattern (after F. Giesen's float_to_half_fast3_rtne).
  uint32_t u = detail::fbits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7FFFFFFFu;
  uint16_t h;
  if (u > 0x7F800000u) {
    h = uint16_t(0x7E00u | ((u >> 13) & 0x3FFu));  // NaN: quiet, top 10 payload bits (as vcvtps2ph)
  } else if (u >= 0x47800000u) {
    h = 0x7C00u;  // >= 65536 and inf (65520 .. 65536 round up to inf below)
  } else if (u < 0x38800000u) {
    // Result is a half denormal (or zero): let an FP32 add do the rounding. x + 0.5 has its low
    // mantissa bits equal to x / 2^-24 rounded to nearest even. Inputs are < 2^-14, far from FTZ.
    float f;
    std::memcpy(&f, &u, 4);
    f += 0.5f;
    h = uint16_t(detail::fbits(f) - 0x3F000000u);
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += 0xC8000FFFu + mant_odd;  // rebias exponent (127 -> 15), add rounding bias
    h = uint16_t(u >> 13);        // a carry into the exponent is the correct rounding (to inf too)
  }
  return uint16_t(h | sign);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t u;
  if (e == 0x1F) {
    u = sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u);  // inf, or NaN made quiet
  } else if (e == 0) {
    if (m == 0) {
      u = sign;
    } else {  // denormal half: m * 2^-24, exact in FP32
      int shift = 0;
      uint32_t mm = m;
      while (!(mm & 0x400u)) {
        mm <<= 1;
        ++shift;
      }
      u = sign | (uint32_t(113 - shift) << 23) | ((mm & 0x3FFu) << 13);
    }
  } else {
    u = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------------ scalar reference

namespace {

inline void store_value(void* values, int64_t j, float v, ValueType t) {
  if (t == ValueType::F32)
    static_cast<float*>(values)[j] = v;
  else
    static_cast<uint16_t*>(values)[j] = f32_to_f16(v);
}
inline float load_value(const void* values, int64_t j, ValueType t) {
  return t == ValueType::F32 ? static_cast<const float*>(values)[j]
                             : f16_to_f32(static_cast<const uint16_t*>(values)[j]);
}

int64_t ref_make_bits(const float* x, int64_t n, float thr, uint64_t* bits) {
  const uint32_t tb = detail::threshold_bits(thr);
  int64_t nnz = 0;
  for (int64_t w = 0; w < num_words(n); ++w) {
    uint64_t word = 0;
    for (int64_t j = 0; j < 64 && w * 64 + j < n; ++j)
      if (detail::keep(x[w * 64 + j], tb)) word |= uint64_t(1) << j;
    bits[w] = word;
    nnz += __builtin_popcountll(word);
  }
  return nnz;
}

void ref_pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t) {
  int64_t j = 0;
  for (int64_t i = 0; i < n; ++i)
    if ((bits[i >> 6] >> (i & 63)) & 1) store_value(values, j++, x[i], t);
}

// Algorithm 1 of the paper: one element at a time, bit and value together.
int64_t ref_pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t) {
  const uint32_t tb = detail::threshold_bits(thr);
  int64_t j = 0;
  for (int64_t w = 0; w < num_words(n); ++w) bits[w] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!detail::keep(x[i], tb)) continue;
    bits[i >> 6] |= uint64_t(1) << (i & 63);
    store_value(values, j++, x[i], t);
  }
  return j;
}

// Algorithm 2 of the paper.
void ref_unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out) {
  int64_t j = 0;
  for (int64_t i = 0; i < n; ++i) out[i] = ((bits[i >> 6] >> (i & 63)) & 1) ? load_value(values, j++, t) : 0.f;
}

std::atomic<int> g_threads{0};

int threads_for(int64_t n) {
  if (n < kParallelMinElements) return 1;
  const int t = g_threads.load(std::memory_order_relaxed);
  return std::max(1, t > 0 ? t : omp_get_max_threads());
}

// Part `i` of `parts` of the words [0, words).
inline void split(int64_t words, int parts, int i, int64_t* w0, int64_t* w1) {
  *w0 = words * i / parts;
  *w1 = words * (i + 1) / parts;
}

inline void* advance(void* values, int64_t k, ValueType t) {
  return static_cast<char*>(values) + k * value_bytes(t);
}
inline const void* advance(const void* values, int64_t k, ValueType t) {
  return static_cast<const char*>(values) + k * value_bytes(t);
}

}  // namespace

namespace detail {
// Partial last word (n % 64 elements) of a SIMD kernel: done by the reference.
int64_t tail_make_bits(const float* x, int64_t n, float thr, uint64_t* bits) { return ref_make_bits(x, n, thr, bits); }
void tail_pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t) {
  ref_pack_values(x, bits, n, values, t);
}
int64_t tail_pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t) {
  return ref_pack(x, n, thr, bits, values, t);
}
void tail_unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out) {
  ref_unpack(bits, values, n, t, out);
}
}  // namespace detail

const Impl& scalar_impl() {
  static const Impl impl{"scalar", true, ref_make_bits, ref_pack_values, ref_pack, ref_unpack};
  return impl;
}

const Impl& best_impl() {
  if (avx512_impl().available) return avx512_impl();
  if (avx2_impl().available) return avx2_impl();
  if (neon_impl().available) return neon_impl();
  return scalar_impl();
}

const char* simd_path() { return best_impl().name; }

void set_threads(int t) { g_threads.store(std::max(0, t), std::memory_order_relaxed); }
int threads() { return threads_for(kParallelMinElements); }

// ----------------------------------------------------------------------------- dispatch

static void check_threshold(float thr) {
  ET_CHECK(thr >= 0.f, "bitmap prune threshold must be >= 0 and not NaN, got ", thr);
}

int64_t unpack_range(const uint64_t* bits, const void* values, ValueType t, int64_t begin, int64_t count,
                     int64_t value_index, float* out) {
  // Up to the next word boundary one element at a time, then the SIMD kernel on whole words.
  const int64_t head = std::min(count, (64 - begin % 64) % 64);
  for (int64_t i = 0; i < head; ++i) {
    const int64_t e = begin + i;
    out[i] = ((bits[e >> 6] >> (e & 63)) & 1) ? load_value(values, value_index++, t) : 0.f;
  }
  const int64_t rest = count - head;
  if (rest <= 0) return value_index;
  const uint64_t* w = bits + (begin + head) / 64;
  best_impl().unpack(w, advance(values, value_index, t), rest, t, out + head);
  return value_index + popcount(w, rest);
}

int64_t popcount_range(const uint64_t* bits, int64_t begin, int64_t count) {
  if (count <= 0) return 0;
  const int64_t head = std::min(count, (64 - begin % 64) % 64);  // up to the next word boundary
  const int64_t c = head ? __builtin_popcountll((bits[begin / 64] >> (begin % 64)) & ((uint64_t(1) << head) - 1)) : 0;
  return c + popcount(bits + (begin + head) / 64, count - head);
}

int64_t popcount(const uint64_t* bits, int64_t n) {
  const int64_t full = n / 64;
  int64_t c = 0;
  for (int64_t w = 0; w < full; ++w) c += __builtin_popcountll(bits[w]);
  if (n % 64) c += __builtin_popcountll(bits[full] & ((uint64_t(1) << (n % 64)) - 1));
  return c;
}

int64_t keep_first(uint64_t* bits, int64_t n, int64_t keep) {
  int64_t seen = 0;
  for (int64_t w = 0; w < num_words(n); ++w) {
    const int c = __builtin_popcountll(bits[w]);  // (bits past n are clear: the layout's rule)
    if (seen >= keep) {
      bits[w] = 0;
    } else if (seen + c > keep) {  // keep this word's lowest keep - seen bits
      uint64_t word = bits[w];
      for (int64_t drop = seen + c - keep; drop > 0; --drop) word &= ~(uint64_t(1) << (63 - __builtin_clzll(word)));
      bits[w] = word;
    }
    seen += c;
  }
  return seen;
}

int64_t count_nonzero(const float* x, int64_t n, float thr) {
  check_threshold(thr);
  const uint32_t tb = detail::threshold_bits(thr);
  const int T = threads_for(n);
  int64_t c = 0;
#pragma omp parallel for num_threads(T) reduction(+ : c) schedule(static) if (T > 1)
  for (int64_t i = 0; i < n; ++i) c += detail::keep(x[i], tb);
  return c;
}

int64_t make_bits(const float* x, int64_t n, float thr, uint64_t* bits) {
  check_threshold(thr);
  const Impl& k = best_impl();
  const int T = threads_for(n);
  if (T <= 1) return k.make_bits(x, n, thr, bits);
  int64_t nnz = 0;
#pragma omp parallel num_threads(T) reduction(+ : nnz)
  {
    int64_t w0, w1;
    split(num_words(n), omp_get_num_threads(), omp_get_thread_num(), &w0, &w1);
    const int64_t e0 = w0 * 64, e1 = std::min(n, w1 * 64);
    if (e1 > e0) nnz += k.make_bits(x + e0, e1 - e0, thr, bits + w0);
  }
  return nnz;
}

void pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t) {
  const Impl& k = best_impl();
  const int T = threads_for(n);
  if (T <= 1) return k.pack_values(x, bits, n, values, t);
#pragma omp parallel num_threads(T)
  {
    int64_t w0, w1;
    split(num_words(n), omp_get_num_threads(), omp_get_thread_num(), &w0, &w1);
    const int64_t e0 = w0 * 64, e1 = std::min(n, w1 * 64);
    if (e1 > e0) k.pack_values(x + e0, bits + w0, e1 - e0, advance(values, popcount(bits, e0), t), t);
  }
}

int64_t pack(const float* x, int64_t n, float thr, uint64_t* bits, void* values, ValueType t) {
  check_threshold(thr);
  const Impl& k = best_impl();
  const int T = threads_for(n);
  if (T <= 1) return k.pack(x, n, thr, bits, values, t);
  // Two passes: every thread writes the bitmap of its part and counts; after one barrier, each
  // thread knows its value offset (sum of the counts before it) and compresses its part.
  constexpr int kMaxThreads = 256;
  int64_t counts[kMaxThreads];
  int64_t nnz = 0;
#pragma omp parallel num_threads(std::min(T, kMaxThreads))
  {
    const int p = omp_get_num_threads(), i = omp_get_thread_num();
    int64_t w0, w1;
    split(num_words(n), p, i, &w0, &w1);
    const int64_t e0 = w0 * 64, e1 = std::min(n, w1 * 64);
    counts[i] = e1 > e0 ? k.make_bits(x + e0, e1 - e0, thr, bits + w0) : 0;
#pragma omp barrier
    int64_t off = 0;
    for (int j = 0; j < i; ++j) off += counts[j];
    if (e1 > e0) k.pack_values(x + e0, bits + w0, e1 - e0, advance(values, off, t), t);
    if (i == p - 1) nnz = off + counts[i];
  }
  return nnz;
}

void unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out) {
  const Impl& k = best_impl();
  const int T = threads_for(n);
  if (T <= 1) return k.unpack(bits, values, n, t, out);
#pragma omp parallel num_threads(T)
  {
    int64_t w0, w1;
    split(num_words(n), omp_get_num_threads(), omp_get_thread_num(), &w0, &w1);
    const int64_t e0 = w0 * 64, e1 = std::min(n, w1 * 64);
    if (e1 > e0) k.unpack(bits + w0, advance(values, popcount(bits, e0), t), e1 - e0, t, out + e0);
  }
}

}  // namespace et::bitmap
