// Softmax cross-entropy with optional label smoothing: loss [1] = mean_n CE(softmax(logits_n), target_n).
// Saves the logits; the backward recomputes the softmax. Backward starts here with dL/dloss = 1.
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

class SoftmaxXentOp final : public Op {
 public:
  explicit SoftmaxXentOp(float smoothing) : smoothing_(smoothing) {}
  const char* type() const override { return "softmax_cross_entropy"; }
  OpClass op_class() const override { return OpClass::Loss; }
  std::vector<SaveSpec> saves() const override { return {{0, SaveKind::Full}}; }
  void forward(OpContext& ctx) override {
    Tensor loss = ctx.output();
    ctx.backend().softmax_xent_forward(ctx.input(0), ctx.input(1), smoothing_, loss);
  }
  void backward(OpContext& ctx) override {
    GradOut d = ctx.grad_input(0);
    if (d.wanted) ctx.backend().softmax_xent_backward(ctx.saved(0), ctx.input(1), smoothing_, 1.f, d.t, d.accumulate);
  }

 private:
  float smoothing_;
};

}  // namespace

int softmax_cross_entropy(Graph& g, int logits, int labels, const std::string& name, float label_smoothing) {
  const Shape s = g.value(logits).shape;
  if (s.ndim != 2) user_error("layer ", name, ": cross-entropy needs [N, classes] logits, got ", s.str());
  if (!(label_smoothing >= 0.f && label_smoothing < 1.f))
    user_error("layer ", name, ": label smoothing must be in [0, 1), got ", label_smoothing);
  Value loss;
  loss.name = name;
  loss.shape = Shape{1};
  g.loss = g.add_node(name, std::make_unique<SoftmaxXentOp>(label_smoothing), {logits, labels}, loss);
  g.logits = logits;
  return g.loss;
}

}  // namespace et
