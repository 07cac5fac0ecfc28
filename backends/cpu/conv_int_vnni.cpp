// AVX-512 VNNI tiles of the integer convolutions (conv_int_tiles.h): vpdpbusd, four u8 x s8
// products into each of 16 int32 lanes. Compiled with -mavx512f -mavx512bw -mavx512vnni on x86
// (CMakeLists.txt); used only where the CPU has them (igemm_supported).
#include "backends/cpu/conv_int_tiles.h"

#if defined(__x86_64__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace et::cpu {
namespace {

struct Vnni {
  static constexpr int L = 16, kConvNV = 3;  // 8 x 3 accumulators of 32
  static constexpr bool kUnsigned = true;
  using V = __m512i;
  static V zero() { return _mm512_setzero_si512(); }
  static V load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static V load_i32(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, V v) { _mm512_storeu_si512(p, v); }
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static V dot(V acc, V x, int32_t w) { return _mm512_dpbusd_epi32(acc, x, _mm512_set1_epi32(w)); }
};

#include "backends/cpu/conv_int_tile_impl.h"

const IntTileKernels kTiles = make_tiles<Vnni, true>();

}  // namespace

const IntTileKernels* int_tiles_vnni() { return &kTiles; }

}  // namespace et::cpu

#else
const et::cpu::IntTileKernels* et::cpu::int_tiles_vnni() { return nullptr; }
#endif
