// Index arithmetic of the CUDA element kernels in 32 bits where the operands fit: a 64-bit
// division is a long software routine on a GPU, a 32-bit one a few instructions, and BN's and the
// fused stacks' kernels divide once or twice an element. The same quotient and remainder either
// way (operands >= 0 below 2^32; anything else takes the 64-bit form). Host and device, C++14: the
// CPU tests check them at the edges (tests/test_int_gemm_operands.cpp).
#pragma once
#include <cstdint>

#include "quant/codes.h"  // ET_HOST_DEVICE

namespace et {
namespace cuda_index {

ET_HOST_DEVICE inline int64_t idiv(int64_t a, int64_t b) {
  return ((a | b) >> 32) == 0 ? int64_t(uint32_t(a) / uint32_t(b)) : a / b;
}
ET_HOST_DEVICE inline int64_t imod(int64_t a, int64_t b) {
  return ((a | b) >> 32) == 0 ? int64_t(uint32_t(a) % uint32_t(b)) : a % b;
}

}  // namespace cuda_index
}  // namespace et
