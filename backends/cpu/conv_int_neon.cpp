// NEON dot-product tiles of the integer convolutions (conv_int_tiles.h): sdot, four s8 x s8
// products into each of 4 int32 lanes, on the codes as they are (no offsets). Compiled with
// -march=armv8.2-a+dotprod on aarch64 (CMakeLists.txt); used only where the CPU reports
// asimddp (igemm_supported).
#include "backends/cpu/conv_int_tiles.h"

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

namespace et::cpu {
namespace {

struct Neon {
  static constexpr int L = 4, kConvNV = 2;  // 8 x 2 accumulators of 32 registers
  static constexpr bool kUnsigned = false;
  using V = int32x4_t;
  static V zero() { return vdupq_n_s32(0); }
  static V load(const uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }
  static V load_i32(const int32_t* p) { return vld1q_s32(p); }
  static void store(int32_t* p, V v) { vst1q_s32(p, v); }
  static V add(V a, V b) { return vaddq_s32(a, b); }
  static V dot(V acc, V x, int32_t w) {
    return vdotq_s32(acc, vreinterpretq_s8_s32(x), vreinterpretq_s8_s32(vdupq_n_s32(w)));
  }
};

#include "backends/cpu/conv_int_tile_impl.h"

const IntTileKernels kTiles = make_tiles<Neon, true>();

}  // namespace

const IntTileKernels* int_tiles_neon() { return &kTiles; }

}  // namespace et::cpu

#else
const et::cpu::IntTileKernels* et::cpu::int_tiles_neon() { return nullptr; }
#endif
