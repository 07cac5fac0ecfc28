// fp16 to fp32 on the device, as memory/bitmap.cpp's f16_to_f32 on the host (bit for bit: the
// stash's fp16 values read back by the codec and by kernels that read stored values). C++14.
#pragma once
#include <cstdint>

namespace et {
namespace cuda {

__device__ __forceinline__ float from_f16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t u;
  if (e == 0x1F) {
    u = sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u);
  } else if (e != 0) {
    u = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {  // a half denormal: m * 2^-24, exact in FP32 (normalised by the leading zeros)
    const int shift = __clz(m) - 21;  // places until bit 10 is set
    u = sign | (uint32_t(113 - shift) << 23) | (((m << shift) & 0x3FFu) << 13);
  }
  return __uint_as_float(u);
}

}  // namespace cuda
}  // namespace et
