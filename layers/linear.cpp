// linear: y [N,O] = x [N,I] w[O,I]^T + b [O]. Saves x for the weight gradient.
#include <memory>

#include "layers/layers.h"
#include "layers/quantized.h"

namespace et {
namespace {

class LinearOp final : public Op {
 public:
  LinearOp(int64_t in, int64_t out) : in_(in), out_(out) {}
  const char* type() const override { return "linear"; }
  OpClass op_class() const override { return OpClass::Compute; }
  std::vector<SaveSpec> saves() const override { return {{0, SaveKind::Full}}; }
  // x is read by the weight gradient only: a frozen layer (finetune.trainable) does not keep it.
  bool save_needed(const SaveSpec&, const std::vector<uint8_t>& wants) const override { return wants[1] != 0; }

  size_t quant_workspace_bytes(const Backend& b, int64_t batch) const override {
    return b.linear_q_workspace_bytes(batch, in_, out_);
  }
  bool int_kernels() const override { return true; }

  void forward(OpContext& ctx) override {
    const Tensor b = ctx.has_input(2) ? ctx.input(2) : Tensor{};
    Tensor y = ctx.output();
    const LayerQuant* q = ctx.quant();
    if (q && q->int4_weights_only)  // FNT: f32 input, dequantised INT4 weights
      return ctx.backend().linear_forward(ctx.input(0), qops::dequantized_weight(ctx, ctx.input(1)), b, y);
    if (!q || !q->int4_forward) return ctx.backend().linear_forward(ctx.input(0), ctx.input(1), b, y);
    const Tensor xq = qops::quantize_input(ctx, ctx.input(0));
    const Tensor wq = qops::quantize_weight(ctx, ctx.input(1));
    ctx.backend().linear_forward_q(xq, wq, b, y, ctx.workspace());
  }

  // dx [N,I] = dy w; dw [O,I] = dy^T x; db = sum_n dy
  void backward(OpContext& ctx) override {
    GradOut dw = ctx.grad_input(1);
    GradOut db = ctx.has_input(2) ? ctx.grad_input(2) : GradOut{};
    GradOut dx = ctx.grad_input(0);
    Backend& be = ctx.backend();
    const Tensor dy = ctx.grad_output();
    const LayerQuant* q = ctx.quant();
    if (!q || q->int4_weights_only) {  // FP32 (FNT: the data gradient reads the forward's weights)
      if (dw.wanted) be.linear_backward_weight(ctx.saved(0), dy, dw.t, db.t, dw.accumulate);
      const Tensor w = q ? ctx.quant_operand(QuantSlot::WF) : ctx.input(1);
      if (dx.wanted) be.linear_backward_data(dy, w, dx.t, dx.accumulate);
      return;
    }
    auto x_f32 = [&] {
      return q->int4_forward ? qops::dequantized(ctx, QuantSlot::X, QuantSlot::XF, qops::scale_of(ctx.quant_operand(QuantSlot::X)))
                             : ctx.saved(0);
    };
    auto w_f32 = [&] {
      return q->int4_forward ? qops::dequantized(ctx, QuantSlot::W, QuantSlot::WF, qops::scale_of(ctx.quant_operand(QuantSlot::W)))
                             : ctx.input(1);
    };
    if (q->backward == BackwardQuant::Fp32) {
      if (dw.wanted) be.linear_backward_weight(x_f32(), dy, dw.t, db.t, dw.accumulate);
      if (dx.wanted) be.linear_backward_data(dy, w_f32(), dx.t, dx.accumulate);
      return;
    }
    const qops::QuantScale alpha = qops::grad_alpha(ctx, dy);
    const int smp = q->smp;
    if (q->int4_forward) {
      const Tensor xq = ctx.input_codes(), wq = ctx.quant_operand(QuantSlot::W);
      Tensor gq = qops::quantize_grad(ctx, dy, alpha, 0);
      if (dx.wanted) be.linear_backward_data_q(gq, wq, dx.t, dx.accumulate, ctx.workspace());
      if (!dw.wanted) return;
      const qops::QuantScale unit = qops::per_sample(ctx, alpha, smp);
      for (int s = 0; s < smp; ++s) {
        if (s > 0) gq = qops::quantize_grad(ctx, dy, alpha, s);
        qops::set_scale(gq, unit);
        be.linear_backward_weight_q(xq, gq, dw.t, db.t, dw.accumulate || s > 0, ctx.workspace());
      }
      return;
    }
    qops::quantize_grad(ctx, dy, alpha, 0);
    if (dx.wanted) be.linear_backward_data(qops::dequantized(ctx, QuantSlot::G, QuantSlot::GF, alpha), w_f32(), dx.t,
                                           dx.accumulate);
    if (!dw.wanted) return;  // frozen: x was not kept
    const Tensor x = x_f32();
    const qops::QuantScale unit = qops::per_sample(ctx, alpha, smp);
    for (int s = 0; s < smp; ++s) {
      if (s > 0) qops::quantize_grad(ctx, dy, alpha, s);
      be.linear_backward_weight(x, qops::dequantized(ctx, QuantSlot::G, QuantSlot::GF, unit), dw.t, db.t,
                                dw.accumulate || s > 0);
    }
  }

 private:
  int64_t in_ = 0, out_ = 0;
};

}  // namespace

int linear(Graph& g, int x, const std::string& name, int64_t out_features, bool bias) {
  const Value& in = g.value(x);
  if (in.shape.ndim != 2) user_error("layer ", name, ": linear needs an [N, F] input (flatten first), got ", in.shape.str());
  if (out_features < 1) user_error("layer ", name, ": out_features must be positive, got ", out_features);
  const int64_t n = in.shape[0], f = in.shape[1];
  std::vector<int> inputs = {x, add_param(g, name + ".weight", Shape{out_features, f}, ParamInit::UniformFanIn, f)};
  if (bias) inputs.push_back(add_param(g, name + ".bias", Shape{out_features}, ParamInit::UniformFanIn, f));
  return g.add_node(name, std::make_unique<LinearOp>(f, out_features), inputs, activation(name, Shape{n, out_features}));
}

}  // namespace et
