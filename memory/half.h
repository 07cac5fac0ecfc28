// Array conversions between f32 and the 16-bit formats the stash stores: IEEE half (round to
// nearest even; F16C when the target has it, the bit-exact scalar conversion otherwise) and
// bfloat16 (round to nearest even on the upper 16 bits; NaN stays NaN).
#pragma once
#include <cstdint>

namespace et {

void f32_to_f16(const float* x, int64_t n, uint16_t* out);
void f16_to_f32(const uint16_t* x, int64_t n, float* out);
void f32_to_bf16(const float* x, int64_t n, uint16_t* out);
void bf16_to_f32(const uint16_t* x, int64_t n, float* out);

}  // namespace et
