// Pooling: maxpool2d (saves its input; backward finds the first maximum again), avgpool2d
// (count_include_pad, saves nothing), global average pooling [N,C,H,W] -> [N,C], and the
// option-A shortcut of the CIFAR ResNets (strided subsampling, zero channels: a parameter-free pool).
#include <memory>

#include "layers/layers.h"

namespace et {
namespace {

FusedStage pool_stage(FusedKind kind, const Conv2dGeom& g) {
  FusedStage s;
  s.kind = kind;
  s.pool = PoolWindow{g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
  return s;
}

OpAttributes window_attributes(const Conv2dGeom& g) {
  OpAttributes a;
  a.window = g;
  return a;
}

// A windowed pool, which may also write the per-plane sums of its output for the fused BN stack
// reading it (Op::write_plane_sums), so that stack reads its x once.
class WindowPoolOp : public Op {
 public:
  explicit WindowPoolOp(const Conv2dGeom& g) : geom_(g) {}
  OpClass op_class() const override { return OpClass::Pool; }
  bool output_nonnegative(bool in) const override { return in; }
  OpAttributes attributes() const override { return window_attributes(geom_); }
  bool can_write_plane_sums() const override { return sums_aux_ < 0; }  // for one reader
  void write_plane_sums(int aux_index) override {
    ET_CHECK(sums_aux_ < 0, type(), ": plane sums asked for twice");
    sums_aux_ = aux_index;
  }

 protected:
  // The sums to write, or undefined: only the first training forward (a recompute comes after the
  // stack's forward has read them).
  Tensor sums(OpContext& ctx) const {
    return sums_aux_ >= 0 && ctx.training() && !ctx.recomputing() ? ctx.aux(sums_aux_) : Tensor{};
  }
  Conv2dGeom geom_;

 private:
  int sums_aux_ = -1;
};

class MaxPoolOp final : public WindowPoolOp {
 public:
  using WindowPoolOp::WindowPoolOp;
  const char* type() const override { return "maxpool2d"; }
  std::vector<SaveSpec> saves() const override { return {{0, SaveKind::Full}}; }
  OutputZeros output_zeros() const override { return OutputZeros::AsInput0; }
  // The backward finds each window's maximum again in x, decoding it from the stash plane by plane.
  DTypeSet reads_stored(int, const Backend& b, int64_t) const override { return b.maxpool2d_backward_reads(); }
  size_t workspace_bytes(const Backend& b, int64_t batch) const override {
    return b.maxpool2d_workspace_bytes(geom_.with_batch(batch));
  }
  FusedStage fusion_stage() const override { return pool_stage(FusedKind::MaxPool, geom_); }
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output(), s = sums(ctx);
    const Conv2dGeom g = geom_.with_batch(ctx.batch());
    if (s.defined()) return ctx.backend().maxpool2d_forward_sums(g, ctx.input(0), y, s);
    ctx.backend().maxpool2d_forward(g, ctx.input(0), y);
  }
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted)
      ctx.backend().maxpool2d_backward(geom_.with_batch(ctx.batch()), ctx.grad_output(),
                                       ctx.saved(0, ctx.backend().maxpool2d_backward_reads()), dx.t, dx.accumulate,
                                       ctx.workspace());
  }
};

class AvgPoolOp final : public WindowPoolOp {
 public:
  using WindowPoolOp::WindowPoolOp;
  const char* type() const override { return "avgpool2d"; }
  FusedStage fusion_stage() const override { return pool_stage(FusedKind::AvgPool, geom_); }
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output(), s = sums(ctx);
    const Conv2dGeom g = geom_.with_batch(ctx.batch());
    if (s.defined()) return ctx.backend().avgpool2d_forward_sums(g, ctx.input(0), y, s);
    ctx.backend().avgpool2d_forward(g, ctx.input(0), y);
  }
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted)
      ctx.backend().avgpool2d_backward(geom_.with_batch(ctx.batch()), ctx.grad_output(), dx.t, dx.accumulate);
  }
};

class GlobalAvgPoolOp final : public Op {
 public:
  const char* type() const override { return "global_avgpool"; }
  OpClass op_class() const override { return OpClass::Pool; }
  bool output_nonnegative(bool in) const override { return in; }
  FusedStage fusion_stage() const override { return fused_stage(FusedKind::GlobalAvgPool); }
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    ctx.backend().global_avgpool_forward(ctx.input(0), y);
  }
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted) ctx.backend().global_avgpool_backward(ctx.grad_output(), dx.t, dx.accumulate);
  }
};

Conv2dGeom pool_geom(const Graph& gr, int x, const std::string& name, int64_t k, int64_t s, int64_t p) {
  const Value& in = gr.value(x);
  if (in.shape.ndim != 4) user_error("layer ", name, ": pooling needs an NCHW input, got ", in.shape.str());
  if (k < 1 || s < 1 || p < 0 || 2 * p > k)
    user_error("layer ", name, ": invalid pooling kernel ", k, " / stride ", s, " / padding ", p);
  Conv2dGeom g;
  g.N = in.shape[0]; g.C = g.K = in.shape[1]; g.H = in.shape[2]; g.W = in.shape[3];
  g.R = g.S = k;
  g.stride_h = g.stride_w = s;
  g.pad_h = g.pad_w = p;
  g.infer_output();
  if (g.P < 1 || g.Q < 1) user_error("layer ", name, ": input ", in.shape.str(), " too small for pooling ", k);
  return g;
}

class SubsamplePadOp final : public Op {
 public:
  SubsamplePadOp(int64_t stride, int64_t pad) : stride_(stride), pad_(pad) {}
  const char* type() const override { return "subsample_pad"; }
  OpClass op_class() const override { return OpClass::Pool; }
  bool output_nonnegative(bool in) const override { return in; }
  OpAttributes attributes() const override {
    OpAttributes a;
    a.stride = stride_;
    a.pad_channels = pad_;
    return a;
  }
  void forward(OpContext& ctx) override {
    Tensor y = ctx.output();
    ctx.backend().subsample_pad_forward(ctx.input(0), stride_, pad_, y);
  }
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    if (dx.wanted) ctx.backend().subsample_pad_backward(ctx.grad_output(), stride_, pad_, dx.t, dx.accumulate);
  }

 private:
  int64_t stride_, pad_;
};

}  // namespace

int maxpool2d(Graph& gr, int x, const std::string& name, int64_t kernel, int64_t stride, int64_t padding) {
  const Conv2dGeom g = pool_geom(gr, x, name, kernel, stride, padding);
  return gr.add_node(name, std::make_unique<MaxPoolOp>(g), {x}, activation(name, Shape{g.N, g.C, g.P, g.Q}));
}

int avgpool2d(Graph& gr, int x, const std::string& name, int64_t kernel, int64_t stride, int64_t padding) {
  const Conv2dGeom g = pool_geom(gr, x, name, kernel, stride, padding);
  return gr.add_node(name, std::make_unique<AvgPoolOp>(g), {x}, activation(name, Shape{g.N, g.C, g.P, g.Q}));
}

int global_avgpool(Graph& gr, int x, const std::string& name) {
  const Value& in = gr.value(x);
  if (in.shape.ndim != 4) user_error("layer ", name, ": global pooling needs an NCHW input, got ", in.shape.str());
  return gr.add_node(name, std::make_unique<GlobalAvgPoolOp>(), {x}, activation(name, Shape{in.shape[0], in.shape[1]}));
}

int subsample_pad(Graph& gr, int x, const std::string& name, int64_t out_channels, int64_t stride) {
  const Value& in = gr.value(x);
  if (in.shape.ndim != 4) user_error("layer ", name, ": the option-A shortcut needs an NCHW input, got ", in.shape.str());
  const int64_t C = in.shape[1];
  if (out_channels < C || stride < 1)
    user_error("layer ", name, ": the option-A shortcut cannot map ", C, " channels to ", out_channels, " at stride ",
               stride);
  const int64_t P = (in.shape[2] + stride - 1) / stride, Q = (in.shape[3] + stride - 1) / stride;
  return gr.add_node(name, std::make_unique<SubsamplePadOp>(stride, (out_channels - C) / 2), {x},
                     activation(name, Shape{in.shape[0], out_channels, P, Q}));
}

}  // namespace et
