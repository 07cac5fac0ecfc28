// CPU quantizers of 4-bit training (docs/quant.md): tensor statistics for the SAWB scale and the
// FP4 alpha, INT4 round-to-nearest, FP4 LUQ (stochastic underflow + logarithmic stochastic
// rounding) and its round-to-nearest ablation, dequantisation. Each has an AVX-512 path, AVX2 and
// NEON ones (session 35: without them a LUQ step on an AVX2 host spent half its time quantizing)
// and a scalar one that the tests force (quant_force_scalar) and compare bit for bit.
#pragma once
#include <cstdint>

#include "backends/backend.h"
#include "quant/codes.h"

namespace et::cpu {

void quant_force_scalar(bool on);

// Statistics over x[0, n): the sums run in 16 double lanes over 8 fixed parts of the tensor,
// combined in order, so the result does not depend on the thread count.
// moments = false: only max_abs and finite (the sums stay 0), a cheaper pass.
TensorStats tensor_stats(const float* x, int64_t n, bool moments = true);
// q = clamp(round_half_even(x * inv_scale), lo, hi)
void quantize_int4(const float* x, int64_t n, float inv_scale, int lo, int hi, int8_t* q);
// FP4 code bytes of g (see quant/codes.h). a = |g| * inv_alpha; a >= 2^(levels-1) gives the top
// magnitude; stochastic: up with probability (a - 2^e) / 2^e between powers of two, 1 with
// probability a below 1 (unbiased); nearest: the ablation (biased).
void quantize_fp4(const float* g, int64_t n, float inv_alpha, int levels, Fp4Rounding mode, quant::RngKey key,
                  int8_t* q);
void dequantize(const int8_t* q, int64_t n, float scale, float* y);
// Sum of the codes (the bias gradient of a quantized delta, in units of its scale).
int64_t sum_codes(const int8_t* q, int64_t n);

}  // namespace et::cpu
