// batchnorm2d over N,H,W per channel. Inputs: x, gamma, beta, running_mean, running_var.
// Training: batch statistics (mean / invstd kept as aux for backward), running statistics updated;
// evaluation: running statistics. Saves x: BN backward needs x_hat for every element.
// Double mask (Liu et al., Dynamic Sparse Graph; memory.double_mask_bn, lossy: it changes the
// function): y = BN(x) where x != 0, else 0, so a sparse input gives an equally sparse output (and
// saved tensors downstream compress as well as x). The gradient is masked the same way.
// Frozen (finetune.bn = frozen): the running statistics normalise in training too and stay as they
// are, gamma and beta are fixed: an affine map per channel, whose backward saves nothing.
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

class BatchNormOp final : public Op {
 public:
  BatchNormOp(float momentum, float eps, bool double_mask, bool frozen)
      : momentum_(momentum), eps_(eps), double_mask_(double_mask), frozen_(frozen) {}
  const char* type() const override { return "batchnorm2d"; }
  OpClass op_class() const override { return OpClass::Normalize; }
  std::vector<SaveSpec> saves() const override {
    if (frozen_ && !double_mask_) return {};
    return {{0, SaveKind::Full}};
  }
  // The kernel reduces dy per channel first, then writes dx element by element.
  bool grad_in_place(int input, const Backend&) const override { return input == 0; }
  // Double-mask BN compares x with zero element-wise: it reads the decoded f32 values.
  DTypeSet reads_stored(int, const Backend& b, int64_t) const override {
    return double_mask_ ? dtype_bit(DType::F32) : b.batchnorm_backward_reads();
  }

  OpAttributes attributes() const override {
    OpAttributes a;
    a.eps = eps_;
    a.masked = double_mask_;
    return a;
  }

  FusedStage fusion_stage() const override {
    FusedStage s;
    if (double_mask_ || frozen_) return s;  // not a stage the fused kernels know
    s.kind = FusedKind::BatchNorm;
    s.eps = eps_;
    s.momentum = momentum_;
    return s;
  }

  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    Tensor rm = ctx.input(3), rv = ctx.input(4);
    if (ctx.training() && !frozen_) {
      if (ctx.statistics_updated()) rm = rv = Tensor{};  // by the first forward of this batch
      Tensor mean = ctx.aux(0), invstd = ctx.aux(1);
      ctx.backend().batchnorm_forward_train(ctx.input(0), ctx.input(1), ctx.input(2), rm, rv, momentum_, eps_, y, mean,
                                            invstd);
    } else {
      ctx.backend().batchnorm_forward_eval(ctx.input(0), ctx.input(1), ctx.input(2), rm, rv, eps_, y);
    }
    if (double_mask_) ctx.backend().zero_where_zero(ctx.input(0), y);
  }

  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0), dg = ctx.grad_input(1), db = ctx.grad_input(2);
    if (frozen_) {  // gamma and beta are frozen: only dx
      Tensor dy = ctx.grad_output();
      if (double_mask_) ctx.backend().zero_where_zero(ctx.saved(0), dy);
      if (dx.wanted) ctx.backend().batchnorm_backward_frozen(dy, ctx.input(1), ctx.input(4), eps_, dx.t, dx.accumulate);
      return;
    }
    Tensor dxt = dx.wanted ? dx.t : Tensor{};
    const Tensor x = ctx.saved(0, reads_stored(0, ctx.backend(), ctx.batch()));
    Tensor dy = ctx.grad_output();
    if (double_mask_) ctx.backend().zero_where_zero(x, dy);  // dy is this node's alone: masked in place
    ctx.backend().batchnorm_backward(dy, x, ctx.input(1), ctx.aux(0), ctx.aux(1), dxt,
                                     dx.accumulate, dg.t, db.t, dg.accumulate);
  }

 private:
  float momentum_, eps_;
  bool double_mask_, frozen_;
};

}  // namespace

int batchnorm2d(Graph& g, int x, const std::string& name, float momentum, float eps) {
  const Value& in = g.value(x);
  if (in.shape.ndim != 4) user_error("layer ", name, ": batchnorm2d needs an NCHW input, got ", in.shape.str());
  const int64_t c = in.shape[1];
  const Shape shape = in.shape;
  const int gamma = add_param(g, name + ".weight", Shape{c}, ParamInit::Ones, 0);
  const int beta = add_param(g, name + ".bias", Shape{c}, ParamInit::Zeros, 0);
  g.value(gamma).frozen = g.value(beta).frozen = g.build.frozen_bn;
  auto buffer = [&](const char* suffix, ParamInit init) {
    Value v;
    v.name = name + suffix;
    v.shape = Shape{c};
    v.kind = ValueKind::Buffer;
    v.init = init;
    return g.add_value(std::move(v));
  };
  const int rm = buffer(".running_mean", ParamInit::Zeros);
  const int rv = buffer(".running_var", ParamInit::Ones);
  Value mean, invstd;
  mean.name = name + ".batch_mean";
  mean.shape = Shape{c};
  invstd.name = name + ".batch_invstd";
  invstd.shape = Shape{c};
  return g.add_node(name, std::make_unique<BatchNormOp>(momentum, eps, g.build.double_mask_bn, g.build.frozen_bn), {x, gamma, beta, rm, rv},
                    activation(name, shape), {mean, invstd});
}

}  // namespace et
