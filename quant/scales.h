// Per-tensor scales of 4-bit training (docs/quant.md), from one statistics pass over the tensor.
// Backend neutral and C++14 (CUDA kernels include it).
//   INT4 forward (SAWB, Choi et al. 2018): clip = c1 sqrt(E[x^2]) - c2 E|x|, capped at max|x|
//     (a clip above the largest value only wastes grid points) and max|x| where the formula gives
//     nothing positive (a constant tensor); scale = clip / 7 (signed) or clip / 15 (unsigned).
//   FP4 backward (LUQ): alpha = max|g| / 2^(levels-1), so the top magnitude 2^(levels-1) alpha is
//     max|g| and nothing clips (an unbiased quantizer must not clip).
#pragma once
#include <cmath>
#include <cstdint>

#include "quant/codes.h"

namespace et {

struct TensorStats {
  double sum_sq = 0, sum_abs = 0;  // of the finite values
  float max_abs = 0;               // of the finite values
  bool finite = true;              // no inf / NaN anywhere
};

using quant::Fp4Rounding;  // quant/codes.h

namespace quant {

// The coefficients of the LUQ reference code for 4 bits.
constexpr double kSawbC1 = 12.1, kSawbC2 = 12.2;

// Scale of an INT4 operand; 1 for an all-zero tensor (every code is 0 then). Host and device
// (a GPU that keeps its scales in its memory computes them there: the same IEEE operations).
ET_HOST_DEVICE inline float sawb_scale(const TensorStats& s, int64_t n, bool is_unsigned) {
  if (n <= 0 || s.max_abs == 0.f) return 1.f;
  const double e2 = s.sum_sq / double(n), e1 = s.sum_abs / double(n);
#if defined(__CUDA_ARCH__)  // each operation rounded as the host's (no contraction into an FMA)
  double clip = __dsub_rn(__dmul_rn(kSawbC1, ::sqrt(e2)), __dmul_rn(kSawbC2, e1));
#else  // volatile: each product rounded, as GCC would otherwise contract one into an FMA for C++
  volatile double c1_sqrt = kSawbC1 * std::sqrt(e2), c2_e1 = kSawbC2 * e1;
  double clip = c1_sqrt - c2_e1;
#endif
  if (!(clip > 0.0) || clip > double(s.max_abs)) clip = double(s.max_abs);
  return float(clip / (is_unsigned ? kInt4UnsignedMax : kInt4SignedMax));
}

// FP4 alpha; 0 (all codes zero) for a gradient whose largest magnitude is below 1e-30, where
// 1 / alpha would leave the float range (such a gradient is zero for every practical purpose).
ET_HOST_DEVICE inline float fp4_alpha(float max_abs, int levels) {
  if (!(max_abs >= 1e-30f)) return 0.f;
#if defined(__CUDA_ARCH__)
  return ::ldexpf(max_abs, -(levels - 1));
#else
  return std::ldexp(max_abs, -(levels - 1));
#endif
}

}  // namespace quant
}  // namespace et
