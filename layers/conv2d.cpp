// conv2d: y = x * w (+ b). x [N,C,H,W], w [K,C/groups,R,S], b [K], y [N,K,P,Q].
// Saves x for the weight gradient, which reads it as the stash stores it where the backend can.
// Forward operands and the output gradient pass through the precision policy (the quantization
// point for 4-bit training).
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

class Conv2dOp final : public Op {
 public:
  explicit Conv2dOp(const Conv2dGeom& g) : geom_(g) {}
  const char* type() const override { return "conv2d"; }
  OpClass op_class() const override { return OpClass::Compute; }
  std::vector<SaveSpec> saves() const override { return {{0, SaveKind::Full}}; }
  // The weight-gradient kernel may decode x from the stash's encoding image by image.
  DTypeSet reads_stored(int, const Backend& b, int64_t batch) const override {
    return b.conv2d_weight_reads(geom_.with_batch(batch));
  }
  size_t workspace_bytes(const Backend& b, int64_t batch) const override {
    const Conv2dGeom g = geom_.with_batch(batch);
    size_t ws = 0;
    for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
      ws = std::max(ws, b.conv2d_workspace_bytes(g, p));
    return ws;
  }

  // y [N,K,P,Q] = conv(x [N,C,H,W], w [K,C/g,R,S]) + b [K]
  void forward(OpContext& ctx) override {
    const Conv2dGeom g = geom_.with_batch(ctx.batch());
    const Tensor x = ctx.precision().apply(ctx.node(), Operand::Input, ctx.input(0));
    const Tensor w = ctx.precision().apply(ctx.node(), Operand::Weight, ctx.input(1));
    const Tensor b = ctx.has_input(2) ? ctx.input(2) : Tensor{};
    Tensor y = ctx.output();
    ctx.backend().conv2d_forward(g, x, w, b, y, ctx.workspace());
  }

  // dx = conv_transpose(dy, w); dw = corr(x, dy); db = sum(dy)
  void backward(OpContext& ctx) override {
    const Conv2dGeom g = geom_.with_batch(ctx.batch());
    const Tensor dy = ctx.precision().apply(ctx.node(), Operand::OutputGrad, ctx.grad_output());
    const Tensor w = ctx.precision().apply(ctx.node(), Operand::Weight, ctx.input(1));
    const DTypeSet reads =
        ctx.precision().identity() ? ctx.backend().conv2d_weight_reads(g) : dtype_bit(DType::F32);
    const Tensor x = ctx.precision().apply(ctx.node(), Operand::Input, ctx.saved(0, reads));
    GradOut dw = ctx.grad_input(1);
    GradOut db = ctx.has_input(2) ? ctx.grad_input(2) : GradOut{};
    ctx.backend().conv2d_backward_weight(g, x, dy, dw.t, db.t, dw.accumulate, ctx.workspace());
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted) ctx.backend().conv2d_backward_data(g, dy, w, dx.t, dx.accumulate, ctx.workspace());
  }

 private:
  Conv2dGeom geom_;
};

}  // namespace

int conv2d(Graph& gr, int x, const std::string& name, const Conv2dOptions& o) {
  const Value& in = gr.value(x);
  if (in.shape.ndim != 4) user_error("layer ", name, ": conv2d needs an NCHW input, got ", in.shape.str());
  Conv2dGeom g;
  g.N = in.shape[0]; g.C = in.shape[1]; g.H = in.shape[2]; g.W = in.shape[3];
  g.K = o.out_channels; g.R = g.S = o.kernel;
  g.stride_h = g.stride_w = o.stride;
  g.pad_h = g.pad_w = o.padding;
  g.groups = o.groups;
  if (o.groups < 1 || g.C % o.groups != 0 || o.out_channels % o.groups != 0 || o.out_channels < 1)
    user_error("layer ", name, ": channels in ", g.C, " / out ", o.out_channels, " not divisible by groups ", o.groups);
  if (o.kernel < 1 || o.stride < 1 || o.padding < 0)
    user_error("layer ", name, ": invalid kernel ", o.kernel, " / stride ", o.stride, " / padding ", o.padding);
  g.infer_output();
  if (g.P < 1 || g.Q < 1) user_error("layer ", name, ": input ", in.shape.str(), " too small for kernel ", o.kernel);

  const int64_t fan_in = (g.C / g.groups) * g.R * g.S;
  const int64_t fan_out = (g.K / g.groups) * g.R * g.S;
  std::vector<int> inputs = {x, add_param(gr, name + ".weight", Shape{g.K, g.C / g.groups, g.R, g.S},
                                          ParamInit::KaimingNormalFanOut, fan_out)};
  if (o.bias) inputs.push_back(add_param(gr, name + ".bias", Shape{g.K}, ParamInit::UniformFanIn, fan_in));
  return gr.add_node(name, std::make_unique<Conv2dOp>(g), inputs, activation(name, Shape{g.N, g.K, g.P, g.Q}));
}

}  // namespace et
