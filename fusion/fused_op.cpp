// FusedStackOp: one node running a whole stack (BN, then ReLU / add / pooling / a last global pool) through the
// backend's fused kernels. It saves what the stack's layers saved minus what it can recompute
// from x in the backward: BN's input x and, when the stack ends in a ReLU, y's mask. Pool inputs
// and ReLU outputs inside the stack are neither saved nor kept. A stack without a BN (ReLU, then
// a pool whose windows do not overlap) saves nothing: its aux value, one bit per element of x,
// says where dx takes a gradient.
#include <memory>
#include <string>

#include "engine/executor.h"
#include "fusion/fusion.h"

namespace et {
namespace fusion {
namespace {

constexpr int kSideInput = 5;  // after x, gamma, beta, running_mean, running_var
// FusedStack::side_bn: the side input is the folded BN's x2, followed by its gamma, beta,
// running_mean and running_var; its mean and invstd are aux values 2 and 3.
constexpr int kSideGamma = 6, kSideBeta = 7, kSideRunningMean = 8, kSideRunningVar = 9;
constexpr int kSideMeanAux = 2, kSideInvstdAux = 3;

class FusedStackOp final : public Op {
 public:
  FusedStackOp(const FusedStack& s, std::vector<std::string> members, int sums_input, int dz_sums_aux,
               int y_bits_aux, int side_sums_input)
      : stack_(s),
        members_(std::move(members)),
        sums_input_(sums_input),
        side_sums_input_(side_sums_input),
        dz_sums_aux_(dz_sums_aux),
        y_bits_aux_(y_bits_aux) {
    for (const FusedStage& st : s.stages)
      has_pool_ |= st.kind == FusedKind::MaxPool || st.kind == FusedKind::AvgPool || st.kind == FusedKind::GlobalAvgPool;
  }
  const char* type() const override { return "fused_stack"; }
  // Headed by a BN: bitmap_int4 recomputes its input from the conv's codes as it does for a BN.
  OpClass op_class() const override { return stack_.headed_by_bn() ? OpClass::Normalize : OpClass::Pool; }
  std::vector<SaveSpec> saves() const override {
    if (!stack_.headed_by_bn()) return {};
    std::vector<SaveSpec> s{{0, SaveKind::Full}};
    if (stack_.saves_output_mask) s.push_back({-1, SaveKind::Mask});
    if (stack_.side_bn) s.push_back({kSideInput, SaveKind::Full});  // x2, as its BN saved it
    return s;
  }
  int side_save_index() const { return stack_.saves_output_mask ? 2 : 1; }
  size_t workspace_bytes(const Backend& b, int64_t batch) const override {
    return b.fused_workspace_bytes(stack_, batch);
  }
  OutputZeros output_zeros() const override { return nonnegative() ? OutputZeros::Many : OutputZeros::None; }
  bool output_nonnegative(bool) const override { return nonnegative(); }
  // x straight from an fp16 / bf16 stash: the kernels widen it plane by plane. A folded side BN's
  // x2 is read as f32 (the stash decodes it).
  DTypeSet reads_stored(int save_index, const Backend& b, int64_t) const override {
    return save_index == 0 && stack_.headed_by_bn() ? b.fused_backward_reads() : dtype_bit(DType::F32);
  }
  // Each tile reads its dy planes into scratch before it writes the same planes of dx; with a pool,
  // where the backend's backward reads each plane's dy before writing its dx (and the executor
  // shares only where dx and dy have one size).
  bool grad_in_place(int input, const Backend& b) const override {
    return input == 0 && (!has_pool_ || b.fused_pool_grad_in_place(stack_));
  }
  // The planes of y for the stack after this one, while each is in cache (where planes go one by one).
  bool can_write_plane_sums() const override { return takes_plane_sums(stack_) && y_sums_aux_ < 0; }
  void write_plane_sums(int aux_index) override {
    ET_CHECK(can_write_plane_sums(), "fused stack: plane sums asked for twice, or of small planes");
    y_sums_aux_ = aux_index;
  }
  // The second backward sweep handed on (FusedGrads::dx_coef): this stack, x's only reader, writes
  // the coefficients to input `coef_input`, which the stack before (`producer`) keeps as an aux.
  void hand_sweep_to(const FusedStack& producer, int coef_input) {
    producer_ = producer;
    dx_coef_input_ = coef_input;
  }
  void take_sweep_from(int coef_aux) { dy_coef_aux_ = coef_aux; }

  // memory.recompute_stack_outputs: y from the x this stack keeps for its own backward and the
  // batch statistics in its aux values (a BN -> ReLU stack; the backend says which it recomputes).
  bool output_recomputable(const Backend& b) const override { return b.fused_recomputes(stack_); }
  void recompute_output(OpContext& ctx, Tensor& y) const override {
    FusedTensors t = tensors(ctx);
    t.x = ctx.saved(0, reads_stored(0, ctx.backend(), ctx.batch()));
    ctx.backend().fused_recompute_output(stack_, t, y);
  }

  bool output_is_affine_relu(const Backend& b) const override { return b.fused_output_is_affine_relu(stack_); }
  void describe_output(OpContext& ctx, AffineReluSource& src, float* scale, float* shift) const override {
    FusedTensors t = tensors(ctx);
    ctx.backend().fused_affine_coefficients(stack_, t, scale, shift);
    src.x = ctx.saved(0, kStashDTypes);  // as stored: the reader decodes it
    src.scale = scale;
    src.shift = shift;
    src.run = ctx.backend().fused_affine_relu(stack_);
  }

  // Not where y's planes' sums feed the next stack: those need y.
  bool output_by_readers_in_forward(const Backend& b) const override {
    return output_is_affine_relu(b) && b.fused_forward_by_readers(stack_) && y_sums_aux_ < 0;
  }

  void forward(OpContext& ctx) override {
    FusedTensors t = tensors(ctx);
    if (ctx.training() && ctx.statistics_updated())  // updated once
      t.running_mean = t.running_var = t.side_running_mean = t.side_running_var = Tensor{};
    // The sums pass from producer to reader in the first training forward only (Value::forward_only).
    if (ctx.training() && !ctx.recomputing()) {
      if (sums_input_ >= 0) t.x_sums = ctx.input(sums_input_);
      if (side_sums_input_ >= 0) t.side_x_sums = ctx.input(side_sums_input_);
      if (y_sums_aux_ >= 0) t.y_sums = ctx.aux(y_sums_aux_);
    }
    if (AffineReluSource* src = ctx.output_source()) {  // the readers compute y from x as they read it
      float* k = ctx.output_coefficients();
      ctx.backend().fused_forward_statistics(stack_, t, ctx.training(), k, k + stack_.C, ctx.workspace());
      src->x = t.x;
      src->run = ctx.backend().fused_affine_relu(stack_);
      return;
    }
    t.y = ctx.output();
    MaskOut* mask = ctx.output_mask();
    if (y_bits_aux_ >= 0) {  // y's bitmap for the reader's sweep 1, where the stash does not take it
      Tensor bits = ctx.aux(y_bits_aux_);
      const bool own = ctx.training() && !mask;
      bits.f32()[0] = own ? 1.f : 0.f;
      if (own) {
        MaskOut m;
        m.bits = reinterpret_cast<uint64_t*>(bits.f32() + 2);
        return ctx.backend().fused_forward(stack_, t, true, &m, ctx.workspace());
      }
    }
    ctx.backend().fused_forward(stack_, t, ctx.training(), mask, ctx.workspace());
  }

  void backward(OpContext& ctx) override {
    FusedTensors t = tensors(ctx);
    FusedGrads g;
    g.dy = ctx.grad_output();
    if (!stack_.headed_by_bn()) {
      t.x = Tensor{};  // not kept: the pass bits say everything the backward needs
      const GradOut dx = ctx.grad_input(0);
      if (!dx.wanted) return;
      g.dx = dx.t;
      g.dx_accumulate = dx.accumulate;
      ctx.backend().fused_backward(stack_, t, g, ctx.workspace());
      return;
    }
    // Both ends ask the backend the same question, so either both use the coefficients or neither.
    if (dy_coef_aux_ >= 0 && ctx.backend().fused_reads_dy_affine(stack_)) g.dy_coef = ctx.aux(dy_coef_aux_);
    if (dx_coef_input_ >= 0 && ctx.backend().fused_reads_dy_affine(producer_)) g.dx_coef = ctx.input(dx_coef_input_);
    // The first sweep done by the reader's data gradient (FusedGrads::dz_sums); the flag is spent here.
    if (dz_sums_aux_ >= 0) {
      Tensor sums = ctx.aux(dz_sums_aux_);
      if (sums.f32()[0] == 1.f) {
        ET_CHECK(ctx.backend().fused_takes_dz_sums(stack_), "fused stack: a first sweep it cannot take");
        g.dz_sums = sums;
      }
      sums.f32()[0] = 0.f;
    }
    t.x = ctx.saved(0, reads_stored(0, ctx.backend(), ctx.batch()));
    // y computed by its readers from x (nothing kept): the last ReLU's mask is rebuilt from x as y was.
    const bool y_from_x = stack_.saves_output_mask && ctx.saved_computed_by_readers(1);
    const DType stored = ctx.saved(0, kStashDTypes).dtype;
    g.x_exact = y_from_x || stored == DType::F32;  // not an fp16 / bf16 copy
    g.x_lossless = g.x_exact || stored == DType::BitmapF32;
    // A stack with an Add ends at it or at the ReLU after it: never recomputed, so the side input is
    // not read; with a folded side BN it is x2, which that BN's backward reads.
    t.side = stack_.side_bn ? ctx.saved(side_save_index(), dtype_bit(DType::F32)) : Tensor{};
    if (stack_.saves_output_mask && !y_from_x) g.y_mask = ctx.saved_mask(1);
    if (y_bits_aux_ >= 0 && !g.y_mask.bits) {  // y's bitmap, where this forward wrote it ([0] = 1)
      const Tensor bits = ctx.aux(y_bits_aux_);
      if (bits.f32()[0] == 1.f) {
        g.y_mask.bits = reinterpret_cast<const uint64_t*>(bits.f32() + 2);
        g.y_mask.dense = Tensor{};
      }
    }
    const GradOut dx = ctx.grad_input(0), dgamma = ctx.grad_input(1), dbeta = ctx.grad_input(2);
    if (dx.wanted) g.dx = dx.t;
    g.dx_accumulate = dx.accumulate;
    if (dgamma.wanted) g.dgamma = dgamma.t;
    if (dbeta.wanted) g.dbeta = dbeta.t;
    g.params_accumulate = dgamma.accumulate;
    if (stack_.add_stage() >= 0) {
      const GradOut ds = ctx.grad_input(kSideInput);
      if (ds.wanted) g.dside = ds.t;
      g.dside_accumulate = ds.accumulate;
    }
    if (stack_.side_bn) {
      const GradOut sg = ctx.grad_input(kSideGamma), sb = ctx.grad_input(kSideBeta);
      if (sg.wanted) g.side_dgamma = sg.t;
      if (sb.wanted) g.side_dbeta = sb.t;
      g.side_params_accumulate = sg.accumulate;
    }
    ctx.backend().fused_backward(stack_, t, g, ctx.workspace());
  }

 private:
  FusedTensors tensors(OpContext& ctx) const {
    FusedTensors t;
    t.x = ctx.input(0);
    if (!stack_.headed_by_bn()) {
      t.pass = ctx.aux(0);
      return t;
    }
    t.gamma = ctx.input(1);
    t.beta = ctx.input(2);
    t.running_mean = ctx.input(3);
    t.running_var = ctx.input(4);
    if (stack_.add_stage() >= 0) t.side = ctx.input(kSideInput);
    t.mean = ctx.aux(0);
    t.invstd = ctx.aux(1);
    if (stack_.side_bn) {
      t.side_gamma = ctx.input(kSideGamma);
      t.side_beta = ctx.input(kSideBeta);
      t.side_running_mean = ctx.input(kSideRunningMean);
      t.side_running_var = ctx.input(kSideRunningVar);
      t.side_mean = ctx.aux(kSideMeanAux);
      t.side_invstd = ctx.aux(kSideInvstdAux);
    }
    t.seed = ctx.seed();  // the dropout member's (fusion::apply gives the node its seed index)
    return t;
  }
  bool nonnegative() const {
    bool nonneg = false;
    for (const FusedStage& st : stack_.stages)
      nonneg = st.kind == FusedKind::Relu ||
               (nonneg && (st.kind == FusedKind::MaxPool || st.kind == FusedKind::AvgPool ||
                           st.kind == FusedKind::Dropout || st.kind == FusedKind::GlobalAvgPool));
    return nonneg;
  }

  FusedStack stack_;
  std::vector<std::string> members_;
  bool has_pool_ = false;
  int sums_input_ = -1;  // the input holding x's plane sums, written by x's producer
  int side_sums_input_ = -1;  // the same for x2 (FusedStack::side_bn)
  int dz_sums_aux_ = -1;  // the aux value y's reader writes dz's plane sums to (FusedGrads::dz_sums)
  int y_bits_aux_ = -1;   // the aux value this forward writes y's bitmap to for it (y_bits_floats)
  int y_sums_aux_ = -1;  // the aux value to write y's plane sums to
  FusedStack producer_;     // hand_sweep_to
  int dx_coef_input_ = -1;  // the input to write the handed-on sweep's coefficients to
  int dy_coef_aux_ = -1;    // the aux value they come in
};

}  // namespace

void hand_sweep_on(Op& producer, Op& reader, const FusedStack& producer_stack, int coef_aux, int coef_input) {
  ET_CHECK(std::string(producer.type()) == "fused_stack" && std::string(reader.type()) == "fused_stack",
           "fusion: a sweep handed on between ", producer.type(), " and ", reader.type());
  static_cast<FusedStackOp&>(producer).take_sweep_from(coef_aux);
  static_cast<FusedStackOp&>(reader).hand_sweep_to(producer_stack, coef_input);
}

bool takes_plane_sums(const FusedStack& s) { return s.headed_by_bn() && !s.small_planes() && !s.channel_slabs; }

std::unique_ptr<Op> make_fused_op(const FusedStack& s, std::vector<std::string> members, int sums_input,
                                  int dz_sums_aux, int y_bits_aux, int side_sums_input) {
  return std::make_unique<FusedStackOp>(s, std::move(members), sums_input, dz_sums_aux, y_bits_aux, side_sums_input);
}

}  // namespace fusion
}  // namespace et
