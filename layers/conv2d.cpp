// conv2d: y = x * w (+ b). x [N,C,H,W], w [K,C/groups,R,S], b [K], y [N,K,P,Q].
// Saves x for the weight gradient, which reads it as the stash stores it where the backend can.
// 4-bit training (docs/quant.md, per node OpContext::quant()): INT4 forward on codes (the node
// keeps x's codes instead of x: its X buffer, or the bitmap_int4 stash), FP4 output gradients,
// integer products where the backend has them. A recompute reruns the product on the kept codes.
// FNT: only the weights as INT4, dequantised for the float kernels.
#include <memory>

#include "engine/affine_relu.h"
#include "layers/layers.h"
#include "layers/quantized.h"

namespace et {
namespace {

class Conv2dOp final : public Op {
 public:
  explicit Conv2dOp(const Conv2dGeom& g) : geom_(g) {}
  const char* type() const override { return "conv2d"; }
  OpClass op_class() const override { return OpClass::Compute; }
  std::vector<SaveSpec> saves() const override { return {{0, SaveKind::Full}}; }
  // x is read by the weight gradient only: a frozen layer (finetune.trainable) does not keep it.
  bool save_needed(const SaveSpec&, const std::vector<uint8_t>& wants) const override { return wants[1] != 0; }
  // The weight-gradient kernel may decode x from the stash's encoding image by image.
  DTypeSet reads_stored(int, const Backend& b, int64_t batch) const override {
    return b.conv2d_weight_reads(geom_.with_batch(batch));
  }
  // x may be a fused stack's output that the kernel computes as it stages x (not 4-bit: the
  // executor does not offer it to quantized nodes).
  DTypeSet forward_reads(int input, const Backend& b, int64_t batch) const override {
    return input == 0 ? b.conv2d_forward_reads(geom_.with_batch(batch)) : dtype_bit(DType::F32);
  }
  size_t workspace_bytes(const Backend& b, int64_t batch) const override {
    return max_over_passes(batch, [&](const Conv2dGeom& g, ConvPass p) { return b.conv2d_workspace_bytes(g, p); });
  }
  size_t quant_workspace_bytes(const Backend& b, int64_t batch) const override {
    return max_over_passes(batch, [&](const Conv2dGeom& g, ConvPass p) { return b.conv2d_q_workspace_bytes(g, p); });
  }
  bool int_kernels() const override { return geom_.groups == 1; }
  OpAttributes attributes() const override {
    OpAttributes a;
    a.window = geom_;
    return a;
  }

  // The fused BN stack after this conv takes its statistics from sums written here (op.h).
  bool can_write_plane_sums() const override { return sums_aux_ < 0; }  // for one reader
  void write_plane_sums(int aux_index) override {
    ET_CHECK(sums_aux_ < 0, "conv2d: plane sums asked for twice");
    sums_aux_ = aux_index;
  }

  // The first backward sweep of the fused stack before it, in the data gradient (op.h), where the
  // backend's kernel for it has the epilogue (Backend::conv2d_backward_data_dz_sums; on the CPU the
  // stride-1 direct kernels, the channels-last strided one, Winograd and the GEMM path, not the
  // implicit GEMM's phases); elsewhere the stack sweeps itself.
  bool can_take_dz_sums() const override { return geom_.groups == 1 && sweep1_.mean_input < 0; }
  void take_dz_sums(const TakenSweep1& sweep) override {
    ET_CHECK(can_take_dz_sums() && sweep.mean_input >= 2 && sweep.sums_input > sweep.mean_input,
             "conv2d: a first sweep it cannot take");
    sweep1_ = sweep;
  }

  // y [N,K,P,Q] = conv(x [N,C,H,W], w [K,C/g,R,S]) + b [K]
  void forward(OpContext& ctx) override {
    const Conv2dGeom g = geom_.with_batch(ctx.batch());
    const Tensor b = has_bias(ctx) ? ctx.input(2) : Tensor{};
    Tensor y = ctx.output();
    const LayerQuant* q = ctx.quant();
    // Only the first training forward: a recompute comes after the stack's forward has read them.
    Tensor sums = sums_aux_ >= 0 && ctx.training() && !ctx.recomputing() ? ctx.aux(sums_aux_) : Tensor{};
    if (!q || (!q->int4_forward && !q->int4_weights_only)) {
      if (sums.defined())
        return ctx.backend().conv2d_forward_sums(g, ctx.input(0), ctx.input(1), b, y, sums, ctx.workspace());
      return ctx.backend().conv2d_forward(g, ctx.input(0), ctx.input(1), b, y, ctx.workspace());
    }
    forward_quantized(ctx, g, b, y, *q, sums);
  }

  // dx = conv_transpose(dy, w); dw = corr(x, dy); db = sum(dy)
  void backward(OpContext& ctx) override {
    const Conv2dGeom g = geom_.with_batch(ctx.batch());
    // The first sweep's flag (take_dz_sums): its buffer lives in the backward only, so it is
    // written here on every path, 1 where data_gradient_with_dz_sums takes the sweep.
    if (sweep1_.sums_input >= 0) ctx.input(sweep1_.sums_input).f32()[0] = 0.f;
    GradOut dw = ctx.grad_input(1);
    GradOut db = has_bias(ctx) ? ctx.grad_input(2) : GradOut{};
    GradOut dx = ctx.grad_input(0);
    Backend& be = ctx.backend();
    const Workspace ws = ctx.workspace();
    const LayerQuant* q = ctx.quant();
    if (!q || q->int4_weights_only) {  // FP32 (FNT: the data gradient reads the forward's weights)
      const Tensor dy = ctx.grad_output();
      if (dw.wanted) be.conv2d_backward_weight(g, ctx.saved(0, be.conv2d_weight_reads(g)), dy, dw.t, db.t, dw.accumulate, ws);
      const Tensor w = q ? ctx.quant_operand(QuantSlot::WF) : ctx.input(1);
      if (dx.wanted && !(!q && dw.wanted && data_gradient_with_dz_sums(ctx, g, dy, w, dx)))
        be.conv2d_backward_data(g, dy, w, dx.t, dx.accumulate, ws);
      return;
    }
    // The forward operands as the float kernels read them: f32 (FP32 forward) or dequantised codes.
    auto x_f32 = [&] {
      return q->int4_forward ? qops::dequantized(ctx, QuantSlot::X, QuantSlot::XF, qops::scale_of(ctx.quant_operand(QuantSlot::X)))
                             : ctx.saved(0, be.conv2d_weight_reads(g));
    };
    auto w_f32 = [&] {
      return q->int4_forward ? qops::dequantized(ctx, QuantSlot::W, QuantSlot::WF, qops::scale_of(ctx.quant_operand(QuantSlot::W)))
                             : ctx.input(1);
    };
    const Tensor dy = ctx.grad_output();
    if (q->backward == BackwardQuant::Fp32) {  // INT4 forward, FP32 backward (straight-through)
      if (dw.wanted) be.conv2d_backward_weight(g, x_f32(), dy, dw.t, db.t, dw.accumulate, ws);
      if (dx.wanted) be.conv2d_backward_data(g, dy, w_f32(), dx.t, dx.accumulate, ws);
      return;
    }
    // FP4 dL/dy: sample 0 feeds the data gradient; the weight and bias gradients average the SMP
    // samples (each sample's codes carry alpha / smp).
    const qops::QuantScale alpha = qops::grad_alpha(ctx, dy);
    const int smp = q->smp;
    if (q->int4_forward && int_kernels()) {
      const Tensor xq = ctx.input_codes(), wq = ctx.quant_operand(QuantSlot::W);
      Tensor gq = qops::quantize_grad(ctx, dy, alpha, 0);
      if (dx.wanted) be.conv2d_backward_data_q(g, gq, wq, dx.t, dx.accumulate, ws);
      if (!dw.wanted) return;
      const qops::QuantScale unit = qops::per_sample(ctx, alpha, smp);
      for (int s = 0; s < smp; ++s) {
        if (s > 0) gq = qops::quantize_grad(ctx, dy, alpha, s);
        qops::set_scale(gq, unit);
        be.conv2d_backward_weight_q(g, xq, gq, dw.t, db.t, dw.accumulate || s > 0, ws);
      }
      return;
    }
    // No integer kernel here (FP32 forward, or depthwise): the float kernels on dequantised codes.
    qops::quantize_grad(ctx, dy, alpha, 0);
    if (dx.wanted) {
      const Tensor gf = qops::dequantized(ctx, QuantSlot::G, QuantSlot::GF, alpha);
      be.conv2d_backward_data(g, gf, w_f32(), dx.t, dx.accumulate, ws);
    }
    if (!dw.wanted) return;  // frozen: x was not kept
    const Tensor x = x_f32();
    const qops::QuantScale unit = qops::per_sample(ctx, alpha, smp);
    for (int s = 0; s < smp; ++s) {
      if (s > 0) qops::quantize_grad(ctx, dy, alpha, s);
      const Tensor gf = qops::dequantized(ctx, QuantSlot::G, QuantSlot::GF, unit);
      be.conv2d_backward_weight(g, x, gf, dw.t, db.t, dw.accumulate || s > 0, ws);
    }
  }

 private:
  // The bias is input 2 unless that is the first of take_dz_sums's inputs.
  bool has_bias(const OpContext& ctx) const { return ctx.has_input(2) && sweep1_.mean_input != 2; }

  // The data gradient with the first backward sweep of the stack before (take_dz_sums), onto dx
  // where it accumulates (this conv's backward comes after the other readers of its input's): where
  // x is kept (dw wanted), either as the stack's x (f32, in place) that readers compute x from
  // (the mask recomputed from it), or in f32 itself (the mask y > 0, the stack's x read where the
  // stash holds it in place), and the backend's kernel can; sets the flag the stack reads. False:
  // nothing done.
  bool data_gradient_with_dz_sums(OpContext& ctx, const Conv2dGeom& g, const Tensor& dy, const Tensor& w,
                                  GradOut& dx) {
    if (sweep1_.sums_input < 0) return false;
    DzSumsEpilogue e;
    if (ctx.saved_computed_by_readers(0)) {
      const Tensor x = ctx.saved(0, dtype_bit(DType::AffineRelu));
      ET_CHECK(x.dtype == DType::AffineRelu, "conv2d: input computed by its readers, not offered");
      const auto* src = static_cast<const AffineReluSource*>(x.data);
      if (src->x.dtype != DType::F32) return false;
      e.x = src->x.f32();
      e.scale = src->scale;
      e.shift = src->shift;
      e.mask = DzMask::FromX;
    } else {
      if (sweep1_.stack_x < 0) return false;
      const Tensor y = ctx.saved(0, ctx.backend().conv2d_weight_reads(g));  // as the weight gradient read it
      const Tensor x = ctx.held_in_place(sweep1_.stack_x);
      if (y.dtype != DType::F32 || !x.defined() || x.numel() != y.numel()) return false;
      e.x = x.f32();
      e.y = y.f32();
      e.mask = sweep1_.relu ? DzMask::FromY : DzMask::None;
      // y's bitmap where the stack's forward wrote it ([0] = 1): 1 bit an element read, not 32.
      if (sweep1_.relu && sweep1_.y_bits_input >= 0) {
        const Tensor bits = ctx.input(sweep1_.y_bits_input);
        if (bits.f32()[0] == 1.f) {
          ET_CHECK(bits.numel() >= y_bits_floats(g.N, g.C, g.H * g.W), "conv2d: y bits of ", bits.shape.str());
          e.bits = reinterpret_cast<const uint64_t*>(bits.f32() + 2);
          e.mask = DzMask::FromBits;
        }
      }
    }
    Tensor sums = ctx.input(sweep1_.sums_input);
    const int64_t max_n = (sums.numel() - 1) / (2 * g.C);
    ET_CHECK(sums.numel() == dz_sums_floats(max_n, g.C) && max_n >= g.N, "conv2d: dz sums of ", sums.shape.str());
    e.mean = ctx.input(sweep1_.mean_input).f32();
    e.sum1 = sums.f32() + 1;
    e.sum2 = e.sum1 + max_n * g.C;
    if (!ctx.backend().conv2d_backward_data_dz_sums(g, dy, w, dx.t, dx.accumulate, e, ctx.workspace())) return false;
    sums.f32()[0] = 1.f;
    return true;
  }

  // FNT (INT4 weights only) or INT4 forward; y's plane sums too where `sums` is defined, taken by
  // the kernel while y is in cache.
  void forward_quantized(OpContext& ctx, const Conv2dGeom& g, const Tensor& b, Tensor& y, const LayerQuant& q,
                         Tensor& sums) {
    Backend& be = ctx.backend();
    auto float_forward = [&](const Tensor& x, const Tensor& w) {
      if (sums.defined()) return be.conv2d_forward_sums(g, x, w, b, y, sums, ctx.workspace());
      be.conv2d_forward(g, x, w, b, y, ctx.workspace());
    };
    if (q.int4_weights_only)  // FNT: f32 input, dequantised INT4 weights
      return float_forward(ctx.input(0), qops::dequantized_weight(ctx, ctx.input(1)));
    // A recompute (no sums: the stack's forward has read them): the first forward's codes and
    // scales, so the integer product is the same.
    if (ctx.recomputing() && int_kernels())
      return be.conv2d_forward_q(g, ctx.input_codes(), ctx.quant_operand(QuantSlot::W), b, y, ctx.workspace());
    // INT4: codes with SAWB scales, an integer product; depthwise multiplies the dequantised codes.
    const Tensor xq = qops::quantize_input(ctx, ctx.input(0));
    const Tensor wq = qops::quantize_weight(ctx, ctx.input(1));
    if (int_kernels()) {
      if (sums.defined()) return be.conv2d_forward_q_sums(g, xq, wq, b, y, sums, ctx.workspace());
      return be.conv2d_forward_q(g, xq, wq, b, y, ctx.workspace());
    }
    float_forward(qops::dequantized(ctx, QuantSlot::X, QuantSlot::XF, qops::scale_of(xq)),
                  qops::dequantized(ctx, QuantSlot::W, QuantSlot::WF, qops::scale_of(wq)));
  }

  // The largest of bytes(g, pass) over forward, data gradient and weight gradient.
  template <class Bytes>
  size_t max_over_passes(int64_t batch, Bytes bytes) const {
    const Conv2dGeom g = geom_.with_batch(batch);
    size_t ws = 0;
    for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight}) ws = std::max(ws, bytes(g, p));
    return ws;
  }
  Conv2dGeom geom_;
  int sums_aux_ = -1;  // write_plane_sums
  TakenSweep1 sweep1_;  // take_dz_sums
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
