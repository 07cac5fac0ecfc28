// Residual add (y = a + b; both inputs receive dy) and flatten ([N, ...] -> [N, F], a copy).
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

class AddOp final : public Op {
 public:
  const char* type() const override { return "add"; }
  OpClass op_class() const override { return OpClass::Elementwise; }
  bool grad_in_place(int, const Backend&) const override { return true; }  // dx = dy: sharing makes the copy free
  FusedStage fusion_stage() const override { return fused_stage(FusedKind::Add); }
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    ctx.backend().add_forward(ctx.input(0), ctx.input(1), y);
  }
  void backward(OpContext& ctx) override {
    for (int i = 0; i < 2; ++i) {
      GradOut d = ctx.grad_input(i);
      if (d.wanted) ctx.backend().accumulate_grad(ctx.grad_output(), d.t, d.accumulate);
    }
  }
};

class FlattenOp final : public Op {
 public:
  const char* type() const override { return "flatten"; }
  OpClass op_class() const override { return OpClass::Reshape; }
  OutputZeros output_zeros() const override { return OutputZeros::AsInput0; }
  bool output_nonnegative(bool in) const override { return in; }
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    ctx.backend().copy(ctx.input(0).reshaped(y.shape), y);
  }
  void backward(OpContext& ctx) override {
    GradOut d = ctx.grad_input(0);
    if (d.wanted) ctx.backend().accumulate_grad(ctx.grad_output().reshaped(d.t.shape), d.t, d.accumulate);
  }
};

}  // namespace

int add(Graph& g, int a, int b, const std::string& name) {
  const Shape sa = g.value(a).shape, sb = g.value(b).shape;
  if (sa != sb) user_error("layer ", name, ": add of different shapes ", sa.str(), " and ", sb.str());
  return g.add_node(name, std::make_unique<AddOp>(), {a, b}, activation(name, sa));
}

int flatten(Graph& g, int x, const std::string& name) {
  const Shape s = g.value(x).shape;
  const int64_t n = s[0];
  return g.add_node(name, std::make_unique<FlattenOp>(), {x}, activation(name, Shape{n, s.numel() / n}));
}

}  // namespace et
