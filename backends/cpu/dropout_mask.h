// Inverted dropout's mask on CPU, shared by the dropout layer (elementwise.cpp) and the fused
// stacks' dropout stage (fused_common.h), so both keep the same elements and scale them alike.
#pragma once
#include <cstdint>

namespace et {
namespace dropout_mask {

// Counter-based uniform in [0,1): a pure function of (seed, i), so the backward recomputes the
// forward's mask and any split of the elements (threads, planes, bands) gives the same mask.
// The CUDA backend has the same function (cuda_elementwise.cu).
inline float uniform(uint64_t seed, uint64_t i) {
  uint64_t x = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(x >> 40) * (1.0f / 16777216.0f);
}

// Elements [first, first + n) of a tensor: o[i] = in[i] / (1 - p) where kept, else +0 (in place allowed).
inline void forward(float p, uint64_t seed, int64_t first, const float* in, int64_t n, float* o) {
  const float scale = 1.f / (1.f - p);
  for (int64_t i = 0; i < n; ++i) o[i] = uniform(seed, uint64_t(first + i)) >= p ? in[i] * scale : 0.f;
}

// The gradient over the same elements, in place: g[i] = g[i] / (1 - p) where kept, else +0.
inline void backward(float p, uint64_t seed, int64_t first, float* g, int64_t n) {
  const float scale = 1.f / (1.f - p);
  for (int64_t i = 0; i < n; ++i) g[i] = uniform(seed, uint64_t(first + i)) >= p ? g[i] * scale : 0.f;
}

}  // namespace dropout_mask
}  // namespace et
