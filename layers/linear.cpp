// linear: y [N,O] = x [N,I] w[O,I]^T + b [O]. Saves x for the weight gradient.
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

class LinearOp final : public Op {
 public:
  const char* type() const override { return "linear"; }
  OpClass op_class() const override { return OpClass::Compute; }
  std::vector<SaveSpec> saves() const override { return {{0, SaveKind::Full}}; }

  void forward(OpContext& ctx) override {
    const Tensor x = ctx.precision().apply(ctx.node(), Operand::Input, ctx.input(0));
    const Tensor w = ctx.precision().apply(ctx.node(), Operand::Weight, ctx.input(1));
    const Tensor b = ctx.has_input(2) ? ctx.input(2) : Tensor{};
    Tensor y = ctx.output();
    ctx.backend().linear_forward(x, w, b, y);
  }

  // dx [N,I] = dy w; dw [O,I] = dy^T x; db = sum_n dy
  void backward(OpContext& ctx) override {
    const Tensor dy = ctx.precision().apply(ctx.node(), Operand::OutputGrad, ctx.grad_output());
    const Tensor w = ctx.precision().apply(ctx.node(), Operand::Weight, ctx.input(1));
    const Tensor x = ctx.precision().apply(ctx.node(), Operand::Input, ctx.saved(0));
    GradOut dw = ctx.grad_input(1);
    GradOut db = ctx.has_input(2) ? ctx.grad_input(2) : GradOut{};
    ctx.backend().linear_backward_weight(x, dy, dw.t, db.t, dw.accumulate);
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted) ctx.backend().linear_backward_data(dy, w, dx.t, dx.accumulate);
  }
};

}  // namespace

int linear(Graph& g, int x, const std::string& name, int64_t out_features, bool bias) {
  const Value& in = g.value(x);
  if (in.shape.ndim != 2) user_error("layer ", name, ": linear needs an [N, F] input (flatten first), got ", in.shape.str());
  if (out_features < 1) user_error("layer ", name, ": out_features must be positive, got ", out_features);
  const int64_t n = in.shape[0], f = in.shape[1];
  std::vector<int> inputs = {x, add_param(g, name + ".weight", Shape{out_features, f}, ParamInit::UniformFanIn, f)};
  if (bias) inputs.push_back(add_param(g, name + ".bias", Shape{out_features}, ParamInit::UniformFanIn, f));
  return g.add_node(name, std::make_unique<LinearOp>(), inputs, activation(name, Shape{n, out_features}));
}

}  // namespace et
