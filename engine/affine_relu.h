// AffineReluSource: a value the stash does not keep because its readers compute it from another
// saved value as they read it (DType::AffineRelu, memory.recompute_stack_outputs): a fused
// BN -> ReLU stack's output y = relu(x * scale[c] + shift[c]), read back by the weight gradient of
// the conv after the stack. Each reader (memory/stored_reader.h) decodes a piece of x and applies
// the producer's own arithmetic to it, in cache: no pass over y, no buffer of y's size.
#pragma once
#include <cstdint>

#include "engine/tensor.h"

namespace et {

// Elements [begin, begin + count) (flat index) of y = relu(x * scale[c] + shift[c]), c = i / plane %
// channels, with the arithmetic of the producer's forward plane by plane (so the bits are its
// output's): x and y point at element `begin`. In place (x == y) allowed. One call per piece, so
// small planes cost no call each.
using AffineReluRun = void (*)(const float* x, const float* scale, const float* shift, int64_t channels,
                               int64_t plane, int64_t begin, int64_t count, float* y);

struct AffineReluSource {
  Tensor x;                      // the source, as the stash keeps it (kStashDTypes), shape [N, C, H, W]
  const float* scale = nullptr;  // [C]
  const float* shift = nullptr;  // [C]
  AffineReluRun run = nullptr;
};

// A tensor of y's shape whose values are `src`'s (src must outlive it).
inline Tensor affine_relu_tensor(const AffineReluSource& src) {
  Tensor t = Tensor::contiguous(const_cast<AffineReluSource*>(&src), src.x.shape, DType::AffineRelu);
  return t;
}

}  // namespace et
