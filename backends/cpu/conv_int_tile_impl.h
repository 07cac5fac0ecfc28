// The tile loops of conv_int_tiles.h, generic over an instruction set `I`:
//   I::L lanes; I::V a vector of L int32 lanes; I::load(p): 4L bytes; I::dot(acc, v, word).
// Included only by the per-ISA files, inside an anonymous namespace there, so each compiles
// it with its own target flags and nothing with those flags leaks into other files.
// Deliberately includes no library header.

template <class I, int NV, int MK>
void conv_tile(const et::cpu::ConvTileArgs& a) {
  typename I::V acc[MK][NV];
  for (int m = 0; m < MK; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = I::zero();
  for (int64_t t = 0; t < a.taps; ++t) {
    const uint8_t* s = a.src + a.toff[t];
    const int32_t* w = a.w + t * a.c4s * a.wld;
    for (int64_t c = 0; c < a.c4s; ++c, s += a.plane, w += a.wld) {
      typename I::V x[NV];
      for (int v = 0; v < NV; ++v) x[v] = I::load(s + v * I::L * 4);
      for (int m = 0; m < MK; ++m) {
        const int32_t word = w[m];
        for (int v = 0; v < NV; ++v) acc[m][v] = I::dot(acc[m][v], x[v], word);
      }
    }
  }
  for (int m = 0; m < MK; ++m)
    for (int v = 0; v < NV; ++v) I::store(a.out + m * a.ldo + v * I::L, acc[m][v]);
}

template <class I, int NV, int MK>
void wgrad_tile(const et::cpu::WgradTileArgs& a) {
  typename I::V acc[MK][NV];
  for (int m = 0; m < MK; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = I::zero();
  for (int64_t i = 0; i < a.imgs; ++i)
    for (int64_t p = 0; p < a.rows; ++p) {
      const uint8_t* x = a.x + i * a.x_img + p * a.x_row;
      const int32_t* g = a.g + i * a.g_img + p * a.g_row;
      for (int64_t q = 0; q < a.q4s; ++q, x += a.x_q4, g += a.g_q4) {
        typename I::V xv[NV];
        for (int v = 0; v < NV; ++v) xv[v] = I::load(x + v * a.x_v);
        for (int m = 0; m < MK; ++m) {
          const int32_t word = g[m];
          for (int v = 0; v < NV; ++v) acc[m][v] = I::dot(acc[m][v], xv[v], word);
        }
      }
    }
  for (int m = 0; m < MK; ++m)
    for (int v = 0; v < NV; ++v) {
      int32_t* o = a.out + m * a.ldo + v * I::L;
      I::store(o, I::add(I::load_i32(o), acc[m][v]));
    }
}

// Wide: the instruction set has registers for 16-24 accumulators (AVX-512: 32 vectors).
template <class I, bool Wide>
et::cpu::IntTileKernels make_tiles() {
  et::cpu::IntTileKernels k;
  k.lanes = I::L;
  k.unsigned_staged = I::kUnsigned;
  k.conv_nv = I::kConvNV;
  k.conv_mk = 8;
  k.conv = conv_tile<I, I::kConvNV, 8>;
  k.wgrad_1x8 = wgrad_tile<I, 1, 8>;
  k.wgrad_2x8 = Wide ? wgrad_tile<I, 2, 8> : nullptr;
  return k;
}
