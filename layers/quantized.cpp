#include "layers/quantized.h"

#include <chrono>

#include "quant/scales.h"

namespace et::qops {

namespace {
// Adds the time of its scope to the executor's quantizing time (timing on only).
class QuantizeTimer {
 public:
  explicit QuantizeTimer(OpContext& ctx) : ctx_(ctx), t0_(ctx.timing() ? Clock::now() : Clock::time_point{}) {}
  ~QuantizeTimer() {
    if (ctx_.timing()) ctx_.add_quantize_seconds(std::chrono::duration<double>(Clock::now() - t0_).count());
  }

 private:
  using Clock = std::chrono::steady_clock;
  OpContext& ctx_;
  Clock::time_point t0_;
};

Tensor quantize_int4(OpContext& ctx, const Tensor& t, QuantSlot slot, NonFiniteOperand what) {
  QuantizeTimer timer(ctx);
  Backend& be = ctx.backend();
  Tensor q = ctx.quant_operand(slot);
  const bool is_unsigned = q.dtype == DType::U4;
  if (be.quant_scales_in_memory()) {  // q.scale_at is the slot's float: written, then read, there
    be.int4_scale_to(t, is_unsigned, ctx.quant_scale(slot == QuantSlot::X ? ScaleSlot::X : ScaleSlot::W),
                     ctx.quant_flag(), ctx.nonfinite_code(what));
    be.quantize_int4(t, q);
    return q;
  }
  const TensorStats s = be.tensor_stats(t);
  if (!s.finite) throw NonFiniteError(ctx.nonfinite_message(what), ctx.node().name);
  q.scale = quant::sawb_scale(s, t.numel(), is_unsigned);
  ctx.set_quant_scale(slot, q.scale);
  be.quantize_int4(t, q);
  return q;
}
}  // namespace

Tensor quantize_input(OpContext& ctx, const Tensor& x) {
  return quantize_int4(ctx, x, QuantSlot::X, NonFiniteOperand::Input);
}
Tensor quantize_weight(OpContext& ctx, const Tensor& w) {
  return quantize_int4(ctx, w, QuantSlot::W, NonFiniteOperand::Weight);
}

Tensor dequantized(OpContext& ctx, QuantSlot codes, QuantSlot f32, QuantScale scale) {
  QuantizeTimer timer(ctx);
  Tensor q = ctx.quant_operand(codes);
  set_scale(q, scale);
  Tensor y = ctx.quant_operand(f32);
  ctx.backend().dequantize(q, y);
  return y;
}

Tensor dequantized_weight(OpContext& ctx, const Tensor& w) {
  return dequantized(ctx, QuantSlot::W, QuantSlot::WF, scale_of(quantize_weight(ctx, w)));
}

QuantScale grad_alpha(OpContext& ctx, const Tensor& dy) {
  QuantizeTimer timer(ctx);
  Backend& be = ctx.backend();
  if (be.quant_scales_in_memory()) {
    float* at = ctx.quant_scale(ScaleSlot::G);
    be.fp4_alpha_to(dy, ctx.quant()->levels, at, ctx.quant_flag(), ctx.nonfinite_code(NonFiniteOperand::OutputGradient));
    return {0.f, at};
  }
  const TensorStats s = be.tensor_max_abs(dy);
  if (!s.finite) throw NonFiniteError(ctx.nonfinite_message(NonFiniteOperand::OutputGradient), ctx.node().name);
  return {quant::fp4_alpha(s.max_abs, ctx.quant()->levels), nullptr};
}

QuantScale per_sample(OpContext& ctx, QuantScale alpha, int smp) {
  if (smp == 1) return alpha;  // (x / 1 is x)
  if (!alpha.at) return {alpha.value / float(smp), nullptr};
  float* at = ctx.quant_scale(ScaleSlot::GSample);
  ctx.backend().divide_scale_to(alpha.at, smp, at);
  return {0.f, at};
}

Tensor quantize_grad(OpContext& ctx, const Tensor& dy, QuantScale alpha, int sample) {
  QuantizeTimer timer(ctx);
  const LayerQuant& q = *ctx.quant();
  Tensor g = ctx.quant_operand(QuantSlot::G);
  set_scale(g, alpha);
  const Fp4Rounding mode = q.backward == BackwardQuant::LuqFp4 ? Fp4Rounding::Stochastic : Fp4Rounding::Nearest;
  ctx.backend().quantize_fp4(dy, q.levels, mode, ctx.quant_draw(sample), g);
  return g;
}

}  // namespace et::qops
