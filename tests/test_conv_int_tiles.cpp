// The register tiles of the integer convolutions (backends/cpu/conv_int_tiles.h): every
// instruction set's tile equals a plain evaluation of the tile's definition. Staged bytes are
// 0..127, the same value whether a path reads them as unsigned (x86) or signed (NEON sdot).
// Needs nothing but the tiles, so it also runs in an aarch64 cross build under qemu.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "backends/cpu/conv_int_tiles.h"
#include "backends/cpu/igemm.h"

using namespace et::cpu;

namespace {

uint32_t lcg(uint32_t& s) { return s = s * 1664525u + 1013904223u; }

struct Path {
  const char* name;
  const IntTileKernels* k;
};
std::vector<Path> paths() {
  std::vector<Path> out;
  const std::pair<const char*, std::pair<const IntTileKernels*, IgemmIsa>> all[] = {
      {"scalar", {int_tiles_scalar(), IgemmIsa::Scalar}},
      {"avx2", {int_tiles_avx2(), IgemmIsa::Avx2}},
      {"avx512vnni", {int_tiles_vnni(), IgemmIsa::Avx512Vnni}},
      {"neon-dot", {int_tiles_neon(), IgemmIsa::NeonDot}}};
  for (const auto& [name, p] : all)
    if (p.first && igemm_supported(p.second)) out.push_back({name, p.first});
  return out;
}

int32_t dot4(const uint8_t* x, int32_t w) {
  int32_t s = 0;
  for (int b = 0; b < 4; ++b) s += int32_t(x[b]) * int32_t(int8_t(uint32_t(w) >> (8 * b)));
  return s;
}

}  // namespace

TEST_CASE("integer conv tiles: every path equals the tile's definition", "[quant][conv]") {
  uint32_t seed = 11;
  std::vector<uint8_t> src(1 << 16);
  for (auto& b : src) b = uint8_t((lcg(seed) >> 9) & 127);
  std::vector<int32_t> words(4096);
  for (auto& w : words) {
    uint8_t b[4];
    for (auto& x : b) x = uint8_t(int8_t(int((lcg(seed) >> 9) % 129) - 64));
    w = int32_t(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24);
  }
  for (const Path& path : paths()) {
    INFO(path.name);
    const IntTileKernels& k = *path.k;
    {  // conv tile: out[m][j] = sum_{t, c} dot4(src[c * plane + toff[t] + 4 j], w[(t * c4s + c) * wld + m])
      const int64_t toff[3] = {0, 68, 1000}, taps = 3, c4s = 5, plane = 4096, wld = 11;
      const int64_t mk = k.conv_mk, width = k.conv_nv * k.lanes, ldo = width + 3;
      std::vector<int32_t> out(size_t(mk * ldo), -1);
      const uint8_t* s0 = src.data() + 12;
      const int32_t* w0 = words.data() + 3;
      k.conv(ConvTileArgs{s0, plane, toff, taps, c4s, w0, wld, out.data(), ldo});
      bool ok = true;
      for (int64_t m = 0; m < mk; ++m)
        for (int64_t j = 0; j < width; ++j) {
          int32_t ref = 0;
          for (int64_t t = 0; t < taps; ++t)
            for (int64_t c = 0; c < c4s; ++c) ref += dot4(s0 + c * plane + toff[t] + 4 * j, w0[(t * c4s + c) * wld + m]);
          ok &= out[size_t(m * ldo + j)] == ref;
        }
      CHECK(ok);
    }
    // wgrad tiles: out[m][j] += sum_{i, p, q} dot4(x[i x_img + p x_row + q x_q4 + x_v (j / L) + 4 (j % L)],
    //                                              g[i g_img + p g_row + q g_q4 + m])
    for (const auto& [fn, nv] : {std::pair<WgradTileFn, int>{k.wgrad_1x8, 1}, {k.wgrad_2x8, 2}}) {
      if (!fn) continue;
      const int64_t mk = 8, width = nv * k.lanes, ldo = width + 1;
      const uint8_t* x0 = src.data() + 5;
      const int32_t* g0 = words.data() + 3;
      const WgradTileArgs base{x0, 3000, 300, 200, 70, g0, 100, 20, 3, 2, 3, 5, nullptr, ldo};
      std::vector<int32_t> out(size_t(mk * ldo));
      for (size_t i = 0; i < out.size(); ++i) out[i] = int32_t(i) - 40;  // the tile accumulates
      const std::vector<int32_t> before = out;
      WgradTileArgs a = base;
      a.out = out.data();
      fn(a);
      bool ok = true;
      for (int64_t m = 0; m < mk; ++m)
        for (int64_t j = 0; j < width; ++j) {
          int32_t ref = before[size_t(m * ldo + j)];
          for (int64_t i = 0; i < a.imgs; ++i)
            for (int64_t p = 0; p < a.rows; ++p)
              for (int64_t q = 0; q < a.q4s; ++q)
                ref += dot4(x0 + i * a.x_img + p * a.x_row + q * a.x_q4 + a.x_v * (j / k.lanes) + 4 * (j % k.lanes),
                            g0[i * a.g_img + p * a.g_row + q * a.g_q4 + m]);
          ok &= out[size_t(m * ldo + j)] == ref;
        }
      CHECK(ok);
    }
  }
}
