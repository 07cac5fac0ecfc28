// BitTrain sparse bitmap codec (docs/bitmap.md): a tensor of n floats is stored as
//   bits:   ceil(n / 64) uint64 words; bit (i % 64) of word (i / 64) set <=> element i is kept;
//           bits past n in the last word are zero;
//   values: the kept elements in order, FP32 (bit-exact) or FP16 (IEEE half, round to nearest even).
// Which elements are kept: x != 0 (both +0.0 and -0.0 count as zero, so -0.0 comes back as +0.0),
// and, with activation pruning (threshold t > 0), |x| >= t. NaN is always kept (FP32: payload
// bit-exact; FP16: quiet NaN, payload truncated to 10 bits); infinities and denormals are kept
// (FP32: bit-exact; FP16: denormal floats round to +-0 but their bit stays set).
// Comparisons are done on the integer bits, so the result does not depend on FTZ / DAZ modes.
//
// The bitmap is directly a ReLU backward mask (MaskView::bits) when x is a ReLU output and t = 0.
//
// Paths, chosen at compile time: AVX-512 (F + BW + VL; vcompressps / vexpandps in registers and
// masked loads / stores), AVX2 (+ F16C for FP16; mask-indexed shuffle tables), NEON (lookup table
// of lane indices), scalar. No heap allocation. Large tensors are split over OpenMP threads at
// 64-element boundaries; each thread's value offset is the popcount of the bitmap before its part,
// so the output is identical to the scalar reference whatever the thread count.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace et {
namespace bitmap {

enum class ValueType : uint8_t { F32 = 0, F16 = 1 };

inline constexpr int value_bytes(ValueType t) { return t == ValueType::F16 ? 2 : 4; }
inline constexpr int64_t num_words(int64_t n) { return (n + 63) / 64; }
// Exact storage: 8 * ceil(n / 64) bytes of bitmap + nnz values. (The paper's formula n / 8 + 4 nnz
// differs only when n is not a multiple of 64.)
inline constexpr size_t bitmap_bytes(int64_t n, int64_t nnz, ValueType t) {
  return size_t(num_words(n)) * 8 + size_t(nnz) * size_t(value_bytes(t));
}

// The keep rule as one unsigned compare: x is kept iff (bits(x) & 0x7FFFFFFF) >= this value
// (t = 0: every non-zero; t > 0: |x| >= t; NaN always). For kernels that build the bitmap themselves.
inline uint32_t keep_threshold_bits(float prune_threshold) {
  uint32_t u = 1;
  if (prune_threshold > 0.f) std::memcpy(&u, &prune_threshold, 4);
  return u;
}

// Number of elements that pack() keeps (see above). threshold >= 0; 0 = lossless.
int64_t count_nonzero(const float* x, int64_t n, float prune_threshold = 0.f);
// Number of set bits among the first n bits (= number of stored values).
int64_t popcount(const uint64_t* bits, int64_t n);
// Number of set bits among bits [begin, begin + count) (any begin).
int64_t popcount_range(const uint64_t* bits, int64_t begin, int64_t count);

// Clears every set bit after the first `keep` among the first n (a bitmap whose values or codes
// had room for only `keep` of them: the stash's fixed layout); returns the set bits it had.
int64_t keep_first(uint64_t* bits, int64_t n, int64_t keep);

// Writes the bitmap of x (num_words(n) words) and returns the number of kept elements.
int64_t make_bits(const float* x, int64_t n, float prune_threshold, uint64_t* bits);
// Writes the values selected by an existing bitmap (popcount(bits, n) values of type t).
// Elements whose bit is set are stored as they are (no threshold is applied here).
void pack_values(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t);
// make_bits + pack_values in one call: returns nnz. `values` needs room for nnz values; size it
// with count_nonzero() first (the output is written exactly, nothing past nnz values is touched).
int64_t pack(const float* x, int64_t n, float prune_threshold, uint64_t* bits, void* values,
             ValueType t = ValueType::F32);
// out[i] = bit i set ? next value (converted to FP32) : +0.0f.
void unpack(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out);
// Elements [begin, begin + count) of an encoded tensor, on the calling thread (for kernels that
// decode small pieces as they read them): `value_index` is the number of set bits before `begin`
// (popcount(bits, begin)); returns the index after the range. Any begin (not only multiples of 64).
int64_t unpack_range(const uint64_t* bits, const void* values, ValueType t, int64_t begin, int64_t count,
                     int64_t value_index, float* out);

// Which SIMD path the dispatching functions use: "avx512", "avx2", "neon" or "scalar".
const char* simd_path();

// IEEE half conversions (scalar; round to nearest even, overflow to inf, NaN -> quiet NaN with the
// top 10 payload bits). Match F16C's vcvtps2ph / vcvtph2ps bit for bit.
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);

// Single-threaded implementations, one per path compiled into this build, for tests and
// benchmarks. `ref` is the scalar reference (Algorithms 1 and 2 of the paper, one element at a
// time); the others are nullptr-free only when compiled (check the `available` flag).
struct Impl {
  const char* name;
  bool available;
  int64_t (*make_bits)(const float* x, int64_t n, float prune_threshold, uint64_t* bits);
  void (*pack_values)(const float* x, const uint64_t* bits, int64_t n, void* values, ValueType t);
  // One pass: bits and values together (returns nnz).
  int64_t (*pack)(const float* x, int64_t n, float prune_threshold, uint64_t* bits, void* values, ValueType t);
  void (*unpack)(const uint64_t* bits, const void* values, int64_t n, ValueType t, float* out);
};
const Impl& scalar_impl();
const Impl& avx2_impl();
const Impl& avx512_impl();
const Impl& neon_impl();
const Impl& best_impl();  // what the dispatching functions run on each thread's part

// Threading: tensors below this many elements run on one thread; above, on up to `threads`
// OpenMP threads (0 = omp_get_max_threads()). set_threads is for benchmarks and tests.
constexpr int64_t kParallelMinElements = 1 << 18;
void set_threads(int threads);
int threads();

}  // namespace bitmap
}  // namespace et
