// Element-wise activations: relu (saves only the > 0 mask of its output) and inverted dropout
// (saves nothing: the mask is recomputed from a counter-based hash of the step seed).
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

class ReluOp final : public Op {
 public:
  const char* type() const override { return "relu"; }
  OpClass op_class() const override { return OpClass::Elementwise; }
  std::vector<SaveSpec> saves() const override { return {{-1, SaveKind::Mask}}; }
  bool grad_in_place(int, const Backend&) const override { return true; }
  OutputZeros output_zeros() const override { return OutputZeros::Many; }
  bool output_nonnegative(bool) const override { return true; }
  FusedStage fusion_stage() const override { return fused_stage(FusedKind::Relu); }

  // y = max(x, 0)
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    ctx.backend().relu_forward(ctx.input(0), y, ctx.output_mask());
  }
  // dx = dy * [y > 0]
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted) ctx.backend().relu_backward(ctx.grad_output(), ctx.saved_mask(0), dx.t, dx.accumulate);
  }
};

class DropoutOp final : public Op {
 public:
  explicit DropoutOp(float p) : p_(p) {}
  const char* type() const override { return "dropout"; }
  OpClass op_class() const override { return OpClass::Elementwise; }
  bool draws_random() const override { return p_ > 0.f; }
  OutputZeros output_zeros() const override { return p_ > 0.f ? OutputZeros::Many : OutputZeros::AsInput0; }
  bool output_nonnegative(bool in) const override { return in; }
  OpAttributes attributes() const override {
    OpAttributes a;
    a.p = p_;
    return a;
  }
  FusedStage fusion_stage() const override {
    FusedStage s = fused_stage(FusedKind::Dropout);
    s.p = p_;
    return s;
  }

  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    if (ctx.training() && p_ > 0.f)
      ctx.backend().dropout_forward(ctx.input(0), p_, ctx.dropout_seed(), y);
    else
      ctx.backend().copy(ctx.input(0), y);
  }
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    if (!dx.wanted) return;
    if (p_ > 0.f)
      ctx.backend().dropout_backward(ctx.grad_output(), p_, ctx.dropout_seed(), dx.t, dx.accumulate);
    else
      ctx.backend().accumulate_grad(ctx.grad_output(), dx.t, dx.accumulate);
  }

 private:
  float p_;
};

}  // namespace

int relu(Graph& g, int x, const std::string& name) {
  const Shape s = g.value(x).shape;
  return g.add_node(name, std::make_unique<ReluOp>(), {x}, activation(name, s));
}

int dropout(Graph& g, int x, const std::string& name, float p) {
  if (!(p >= 0.f && p < 1.f)) user_error("layer ", name, ": dropout probability must be in [0, 1), got ", p);
  const Shape s = g.value(x).shape;
  return g.add_node(name, std::make_unique<DropoutOp>(p), {x}, activation(name, s));
}

}  // namespace et
