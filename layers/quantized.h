// The 4-bit steps conv2d and linear share (docs/quant.md): operands to codes in the node's planned
// buffers (OpContext::quant_operand), scales computed once per step and kept for the backward.
// Scales are values the host computed from statistics read back, or, where the backend keeps them
// in its memory (Backend::quant_scales_in_memory: a recordable step), floats there that its
// kernels write and read: QuantScale carries either, as the code tensors do (Tensor::scale_at).
#pragma once
#include "engine/executor.h"

namespace et::qops {

struct QuantScale {
  float value = 1.f;
  const float* at = nullptr;  // in the backend's memory; then `value` is unused
};
inline QuantScale scale_of(const Tensor& codes) { return {codes.scale, codes.scale_at}; }
inline void set_scale(Tensor& codes, QuantScale s) {
  codes.scale = s.value;
  codes.scale_at = s.at;
}

// x / w -> INT4 codes with a fresh SAWB scale (X / W). A non-finite value throws NonFiniteError
// naming the layer and the step (the trainer's divergence guard catches it); with the scales in
// the backend's memory it is flagged there, and Executor::check_quant_finite throws the same error.
Tensor quantize_input(OpContext& ctx, const Tensor& x);
Tensor quantize_weight(OpContext& ctx, const Tensor& w);
// FNT: w -> INT4 codes (W) exactly as quantize_weight, dequantised into WF for the float kernels.
Tensor dequantized_weight(OpContext& ctx, const Tensor& w);
// The codes of a slot dequantised into its f32 slot (X -> XF, W -> WF, G -> GF).
Tensor dequantized(OpContext& ctx, QuantSlot codes, QuantSlot f32, QuantScale scale);
// alpha of dL/dy for FP4 (LUQ: max|dy| / 2^(levels-1)); non-finite dy throws NonFiniteError naming
// the layer and the step (training diverged), never a silent NaN run (or flags it, as above).
QuantScale grad_alpha(OpContext& ctx, const Tensor& dy);
// alpha / smp: the unit of each SMP sample's codes in the averaged weight gradient.
QuantScale per_sample(OpContext& ctx, QuantScale alpha, int smp);
// dy -> FP4 codes in G for SMP sample `sample`, carrying alpha (callers set alpha / smp for the
// averaged weight gradient: the codes are the same, only their unit changes).
Tensor quantize_grad(OpContext& ctx, const Tensor& dy, QuantScale alpha, int sample);

}  // namespace et::qops
