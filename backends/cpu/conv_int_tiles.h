// Register tiles of the integer convolutions (conv_int.cpp): the innermost loops, one set per
// instruction set, each compiled in its own file with that set's flags (conv_int_vnni.cpp,
// conv_int_avx2.cpp, conv_int_scalar.cpp) from the one template in conv_int_tile_impl.h.
//
// A "dot4" multiplies four bytes of a staged operand by four signed bytes of a word and adds the
// sum to an int32 lane (vpdpbusd; vpmaddubsw + vpmaddwd; sdot; plain C). On x86 the staged bytes
// are unsigned and obey the contract of igemm.h (<= 128 against |b| <= 64, product pairs
// < 2^15); on NEON both are signed codes. Every path computes the same integers and no sum
// depends on order or thread count.
//
// Both tiles read their vector operand straight from a staging buffer (no im2col, no packing)
// and broadcast the other operand one 32-bit word at a time:
//   conv tile  (forward, data gradient): lanes = output positions, words = weights
//     out[m][j] = sum_{t < taps, c4 < c4s} dot4(src[c4 * plane + toff[t] + 4 j], w[(t * c4s + c4) * wld + m])
//   wgrad tile (weight gradient): lanes = input channels, words = output gradients (4 positions)
//     out[m][j] += sum_{i, p, q4} dot4(x[i * x_img + p * x_row + q4 * x_q4 + x_v * (j / L) + 4 (j % L)],
//                                      g[i * g_img + p * g_row + q4 * g_q4 + m])
// for m < MK (output channels) and j < NV * lanes.
#pragma once
#include <cstdint>

namespace et::cpu {

struct ConvTileArgs {
  const uint8_t* src;   // staged operand at the tile's first position
  int64_t plane;        // bytes between groups of four channels
  const int64_t* toff;  // byte offset of each tap
  int64_t taps, c4s;
  const int32_t* w;     // weight words of the tile's first output channel
  int64_t wld;          // words between (tap, channel group) rows of w
  int32_t* out;         // out[m * ldo + j]
  int64_t ldo;
};

struct WgradTileArgs {
  const uint8_t* x;  // staged input at the tile's first channel; strides in bytes
  int64_t x_img, x_row, x_q4, x_v;  // x_v: from one vector of channels to the next
  const int32_t* g;  // staged gradient words at the tile's first output channel; strides in words
  int64_t g_img, g_row, g_q4;
  int64_t imgs, rows, q4s;
  int32_t* out;  // out[m * ldo + j] += ...
  int64_t ldo;
};

using ConvTileFn = void (*)(const ConvTileArgs&);
using WgradTileFn = void (*)(const WgradTileArgs&);

struct IntTileKernels {
  int lanes;  // int32 lanes per vector
  // x86 multiplies u8 by s8: the staged side carries offsets (codes + 8, FP4 + 64) that the
  // drivers take back out. NEON sdot multiplies s8 by s8: the codes as they are.
  bool unsigned_staged;
  int conv_nv, conv_mk;
  ConvTileFn conv;
  WgradTileFn wgrad_1x8, wgrad_2x8;  // NV x MK; 2x8 only where there are registers for it
};

// nullptr where the file was not compiled for this machine's architecture.
const IntTileKernels* int_tiles_vnni();
const IntTileKernels* int_tiles_avx2();
const IntTileKernels* int_tiles_neon();
const IntTileKernels* int_tiles_scalar();

}  // namespace et::cpu
