// Portable tiles of the integer convolutions (conv_int_tiles.h): four int32 lanes in plain C,
// the path of machines without a vector dot product here and the one tests compare against.
#include "backends/cpu/conv_int_tiles.h"

namespace et::cpu {
namespace {

struct Scalar {
  static constexpr int L = 4, kConvNV = 1;
  static constexpr bool kUnsigned = true;  // mirrors x86: u8 x s8
  struct V {
    int32_t l[4];
  };
  static V zero() { return V{{0, 0, 0, 0}}; }
  static V load(const uint8_t* p) {
    V v;
    for (int j = 0; j < 4; ++j) v.l[j] = int32_t(p[4 * j]) | int32_t(p[4 * j + 1]) << 8 | int32_t(p[4 * j + 2]) << 16 |
                                         int32_t(uint32_t(p[4 * j + 3]) << 24);
    return v;
  }
  static V load_i32(const int32_t* p) { return V{{p[0], p[1], p[2], p[3]}}; }
  static void store(int32_t* p, V v) {
    for (int j = 0; j < 4; ++j) p[j] = v.l[j];
  }
  static V add(V a, V b) {
    for (int j = 0; j < 4; ++j) a.l[j] += b.l[j];
    return a;
  }
  // Lane j of x holds four unsigned bytes (little-endian), w four signed ones.
  static V dot(V acc, V x, int32_t w) {
    for (int j = 0; j < 4; ++j)
      for (int b = 0; b < 4; ++b)
        acc.l[j] += int32_t(uint8_t(uint32_t(x.l[j]) >> (8 * b))) * int32_t(int8_t(uint32_t(w) >> (8 * b)));
    return acc;
  }
};

#include "backends/cpu/conv_int_tile_impl.h"

const IntTileKernels kTiles = make_tiles<Scalar, false>();

}  // namespace

const IntTileKernels* int_tiles_scalar() { return &kTiles; }

}  // namespace et::cpu
