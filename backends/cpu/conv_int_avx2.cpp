// AVX2 tiles of the integer convolutions (conv_int_tiles.h): vpmaddubsw (u8 x s8 pairs into
// int16, below saturation by the operand contract) then vpmaddwd with ones into 8 int32 lanes.
// Compiled with -mavx2 on x86 (CMakeLists.txt); used only where the CPU has AVX2.
#include "backends/cpu/conv_int_tiles.h"

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>

namespace et::cpu {
namespace {

struct Avx2 {
  static constexpr int L = 8, kConvNV = 1;  // 8 accumulators of 16 registers
  static constexpr bool kUnsigned = true;
  using V = __m256i;
  static V zero() { return _mm256_setzero_si256(); }
  static V load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V load_i32(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(int32_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static V dot(V acc, V x, int32_t w) {
    const V pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi32(w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};

#include "backends/cpu/conv_int_tile_impl.h"

const IntTileKernels kTiles = make_tiles<Avx2, false>();

}  // namespace

const IntTileKernels* int_tiles_avx2() { return &kTiles; }

}  // namespace et::cpu

#else
const et::cpu::IntTileKernels* et::cpu::int_tiles_avx2() { return nullptr; }
#endif
