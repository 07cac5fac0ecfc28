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

Tensor quantize_int4(OpContext& ctx, const Tensor& t, QuantSlot slot, const char* what) {
  QuantizeTimer timer(ctx);
  const TensorStats s = ctx.backend().tensor_stats(t);
  if (!s.finite)
    throw NonFiniteError(fmt("layer '", ctx.node().name, "': non-finite ", what, " at training step ", ctx.step(),
                             " (INT4 forward): the training diverged"),
                         ctx.node().name);
  Tensor q = ctx.quant_operand(slot);
  q.scale = quant::sawb_scale(s, t.numel(), q.dtype == DType::U4);
  ctx.set_quant_scale(slot, q.scale);
  ctx.backend().quantize_int4(t, q);
  return q;
}
}  // namespace

Tensor quantize_input(OpContext& ctx, const Tensor& x) { return quantize_int4(ctx, x, QuantSlot::X, "input"); }
Tensor quantize_weight(OpContext& ctx, const Tensor& w) { return quantize_int4(ctx, w, QuantSlot::W, "weight"); }

Tensor dequantized(OpContext& ctx, QuantSlot codes, QuantSlot f32, float scale) {
  QuantizeTimer timer(ctx);
  Tensor q = ctx.quant_operand(codes);
  q.scale = scale;
  Tensor y = ctx.quant_operand(f32);
  ctx.backend().dequantize(q, y);
  return y;
}

Tensor dequantized_weight(OpContext& ctx, const Tensor& w) {
  return dequantized(ctx, QuantSlot::W, QuantSlot::WF, quantize_weight(ctx, w).scale);
}

float grad_alpha(OpContext& ctx, const Tensor& dy) {
  QuantizeTimer timer(ctx);
  const TensorStats s = ctx.backend().tensor_max_abs(dy);
  if (!s.finite)
    throw NonFiniteError(fmt("layer '", ctx.node().name, "': non-finite output gradient at training step ", ctx.step(),
                             " (quant.backward = ", backward_quant_name(ctx.quant()->backward),
                             "): the training diverged; lower train.lr"),
                         ctx.node().name);
  return quant::fp4_alpha(s.max_abs, ctx.quant()->levels);
}

Tensor quantize_grad(OpContext& ctx, const Tensor& dy, float alpha, int sample) {
  QuantizeTimer timer(ctx);
  const LayerQuant& q = *ctx.quant();
  Tensor g = ctx.quant_operand(QuantSlot::G);
  g.scale = alpha;
  const Fp4Rounding mode = q.backward == BackwardQuant::LuqFp4 ? Fp4Rounding::Stochastic : Fp4Rounding::Nearest;
  ctx.backend().quantize_fp4(dy, q.levels, mode, ctx.quant_rng(sample), g);
  return g;
}

}  // namespace et::qops
