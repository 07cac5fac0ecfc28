// The 4-bit steps conv2d and linear share (docs/quant.md): operands to codes in the node's planned
// buffers (OpContext::quant_operand), scales computed once per step and kept for the backward.
#pragma once
#include "engine/executor.h"

namespace et::qops {

// x / w -> INT4 codes with a fresh SAWB scale (X / W). A non-finite value throws NonFiniteError
// naming the layer and the step (the trainer's divergence guard catches it).
Tensor quantize_input(OpContext& ctx, const Tensor& x);
Tensor quantize_weight(OpContext& ctx, const Tensor& w);
// FNT: w -> INT4 codes (W) exactly as quantize_weight, dequantised into WF for the float kernels.
Tensor dequantized_weight(OpContext& ctx, const Tensor& w);
// The codes of a slot dequantised into its f32 slot (X -> XF, W -> WF, G -> GF).
Tensor dequantized(OpContext& ctx, QuantSlot codes, QuantSlot f32, float scale);
// alpha of dL/dy for FP4 (LUQ: max|dy| / 2^(levels-1)); non-finite dy throws NonFiniteError naming
// the layer and the step (training diverged), never a silent NaN run.
float grad_alpha(OpContext& ctx, const Tensor& dy);
// dy -> FP4 codes in G for SMP sample `sample`, carrying `scale` (alpha, or alpha / smp for the
// averaged weight gradient: the codes are the same, only their unit changes).
Tensor quantize_grad(OpContext& ctx, const Tensor& dy, float alpha, int sample);

}  // namespace et::qops
