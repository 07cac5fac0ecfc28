// Planning pass for 4-bit training (docs/quant.md): the operand buffers of each quantized conv /
// linear node, planned by lifetime like any other buffer, so a quantized step allocates nothing.
//
//   X  INT4 codes of the input (1 byte each): forward -> backward. With an INT4 forward this is
//      what the node keeps for its weight gradient instead of the f32 input (plan_saves drops
//      that save): 4x less than a dense fp32 stash entry, and exactly the operand the integer
//      weight-gradient kernel reads. Under bitmap_int4 the stash keeps the codes instead (packed,
//      executor_codes.cpp) and X lives through the forward only.
//   W  INT4 codes of the weight: forward -> backward (the data gradient's operand).
//   G  FP4 codes of the output gradient: the node's backward only.
//   XF / WF / GF  f32 dequantised copies, only where a float kernel consumes a quantized operand:
//      depthwise convs (no integer kernel), an FP32 backward after an INT4 forward, an FP4
//      backward after an FP32 forward.
// FNT (int4_weights_only): W and WF only, forward -> backward: the float forward and the data
// gradient read WF; the input is saved in f32 as without quantization. Both span the backward so
// a recompute (checkpoint_every) may write them again.
#include "engine/executor.h"
#include "engine/executor_plan_state.h"
#include "quant/policy.h"

namespace et {

std::vector<Executor::PlannedBuffer> Executor::plan_quant_operands(const PlanState& st) {
  qbufs_.assign(size_t(st.nn), {});
  quant_owner_.clear();
  quant_workspace_ = 0;
  std::vector<PlannedBuffer> out;
  for (int n = 0; n < st.nn; ++n) {
    const LayerQuant& q = quant_[size_t(n)];
    if (!q.on()) continue;
    const Node& node = graph_.node(n);
    const bool bwd = needs_backward_[size_t(n)] != 0;
    const bool ints = node.op->int_kernels();
    const int fwd_t = n, bwd_t = bwd ? st.bwd_t[size_t(n)] : n;
    const int64_t nx = graph_.value(node.inputs[0]).shape.numel(), nw = graph_.value(node.inputs[1]).shape.numel();
    const int64_t ny = graph_.value(node.output).shape.numel();
    auto add = [&](QuantSlot s, int64_t bytes, int first, int last) {
      PlannedBuffer b;
      b.request = BufferRequest{Arena::align_up(size_t(bytes)), first, last};
      b.value = s == QuantSlot::W || s == QuantSlot::WF ? node.inputs[1] : node.inputs[0];
      b.role = PlannedBuffer::Role::Extra;
      out.push_back(b);
      quant_owner_.emplace_back(n, s);
    };
    if (q.int4_weights_only) {
      add(QuantSlot::W, nw, fwd_t, bwd_t);
      add(QuantSlot::WF, nw * 4, fwd_t, bwd_t);
      continue;
    }
    const bool float_fwd = q.int4_forward && !ints;  // dequantised operands in the forward
    const bool float_bwd = bwd && q.int4_forward && (q.backward == BackwardQuant::Fp32 || !ints);
    if (q.int4_forward) {
      add(QuantSlot::X, nx, fwd_t, codes_in_stash_[size_t(n)] ? fwd_t : bwd_t);
      add(QuantSlot::W, nw, fwd_t, bwd_t);
    }
    if (float_fwd || float_bwd) {
      add(QuantSlot::XF, nx * 4, float_fwd ? fwd_t : bwd_t, float_bwd ? bwd_t : fwd_t);
      add(QuantSlot::WF, nw * 4, float_fwd ? fwd_t : bwd_t, float_bwd ? bwd_t : fwd_t);
    }
    if (bwd && q.backward != BackwardQuant::Fp32) {
      add(QuantSlot::G, ny, bwd_t, bwd_t);
      if (!q.int4_forward || !ints) add(QuantSlot::GF, ny * 4, bwd_t, bwd_t);
    }
    if (ints && q.int4_forward) quant_workspace_ = std::max(quant_workspace_, node.op->quant_workspace_bytes(backend_, st.max_batch));
  }
  return out;
}

void Executor::bind_quant_operands(const PlanState& st, size_t first_extra) {
  for (size_t i = 0; i < quant_owner_.size(); ++i) {
    const auto [n, s] = quant_owner_[i];
    const Node& node = graph_.node(n);
    const LayerQuant& q = quant_[size_t(n)];
    const bool weight = s == QuantSlot::W || s == QuantSlot::WF;
    const int value = s == QuantSlot::G || s == QuantSlot::GF ? node.output : weight ? node.inputs[1] : node.inputs[0];
    DType t = DType::F32;
    if (s == QuantSlot::X) t = q.input_unsigned ? DType::U4 : DType::I4;
    if (s == QuantSlot::W) t = DType::I4;
    if (s == QuantSlot::G) t = DType::F4;
    qbufs_[size_t(n)][size_t(s)] =
        Tensor::contiguous(arena_.at(st.buffers[first_extra + i].offset), graph_.value(value).shape, t);
  }
  report_.quant_operands = 0;
  for (size_t i = first_extra; i < st.buffers.size(); ++i) report_.quant_operands += st.buffers[i].request.bytes;
  // Scales in the backend's memory: the code operands point at their node's floats from the start.
  if (quant_owner_.empty() || !backend_.quant_scales_in_memory() || plan_only_) return;
  quant_scales_.reserve(size_t(st.nn * kScaleSlots + 1) * 4, "the 4-bit scales", backend_.memory());
  auto* at = static_cast<float*>(quant_scales_.at(0));
  for (int n = 0; n < st.nn; ++n) {
    std::array<Tensor, kQuantSlots>& b = qbufs_[size_t(n)];
    b[size_t(QuantSlot::X)].scale_at = at + n * kScaleSlots + int(ScaleSlot::X);
    b[size_t(QuantSlot::W)].scale_at = at + n * kScaleSlots + int(ScaleSlot::W);
    b[size_t(QuantSlot::G)].scale_at = at + n * kScaleSlots + int(ScaleSlot::G);
  }
}

float* OpContext::quant_scale(ScaleSlot s) const {
  ET_CHECK(ex_.quant_scales_.size() > 0, "node ", node_.name, ": the backend keeps no 4-bit scales in its memory");
  return static_cast<float*>(ex_.quant_scales_.at(size_t(node_id_ * kScaleSlots + int(s)) * 4));
}

Tensor Executor::quant_flag_word() const {
  if (quant_scales_.size() == 0) return Tensor{};
  return Tensor::contiguous(quant_scales_.at(size_t(graph_.num_nodes() * kScaleSlots) * 4), Shape{1}, DType::F32,
                            backend_.device());
}

uint32_t* OpContext::quant_flag() const {
  const Tensor word = ex_.quant_flag_word();
  ET_CHECK(word.defined(), "node ", node_.name, ": the backend keeps no 4-bit scales in its memory");
  return static_cast<uint32_t*>(word.data);
}

namespace {
std::string nonfinite_text(const Node& node, NonFiniteOperand what, int64_t step, const LayerQuant& q) {
  if (what == NonFiniteOperand::OutputGradient)
    return fmt("layer '", node.name, "': non-finite output gradient at training step ", step,
               " (quant.backward = ", backward_quant_name(q.backward), "): the training diverged; lower train.lr");
  return fmt("layer '", node.name, "': non-finite ", what == NonFiniteOperand::Input ? "input" : "weight",
             " at training step ", step, " (INT4 forward): the training diverged");
}
}  // namespace

std::string OpContext::nonfinite_message(NonFiniteOperand what) const {
  return nonfinite_text(node_, what, ex_.step_, ex_.quant_[size_t(node_id_)]);
}

void Executor::check_quant_finite() {
  Tensor word = quant_flag_word();
  if (!word.defined()) return;
  uint32_t code = 0;
  backend_.copy_to_host(word, &code);
  if (code == 0) return;
  backend_.fill(word, 0.f);  // reported once
  const int node = int(code / 4) - 1;
  ET_CHECK(node >= 0 && node < graph_.num_nodes() && code % 4 < 3, "4-bit non-finite flag ", code);
  const Node& n = graph_.node(node);
  const NonFiniteOperand operand = NonFiniteOperand(code % 4);
  throw NonFiniteError(nonfinite_text(n, operand, step_, quant_[size_t(node)]), n.name,
                       operand != NonFiniteOperand::OutputGradient);
}

Tensor OpContext::input_codes() const {
  return ex_.codes_in_stash_[size_t(node_id_)] ? ex_.stash_.get_stored(node_.inputs[0]) : quant_operand(QuantSlot::X);
}

Tensor OpContext::quant_operand(QuantSlot s) const {
  const Tensor& t = ex_.qbufs_[size_t(node_id_)][size_t(s)];
  ET_CHECK(t.defined(), "node ", node_.name, " has no planned quant operand ", int(s));
  const bool batched = s != QuantSlot::W && s != QuantSlot::WF;
  return batched ? t.with_batch(ex_.batch_) : t;
}

}  // namespace et
