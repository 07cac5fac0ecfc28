// Planning passes of memory.stash = bitmap_int4 (docs/quant.md, "The bitmap_int4 stash"), part of
// the saves pass of Executor::plan():
//
// plan_code_saves: a layer with an INT4 forward and a 4-bit backward multiplies its input's INT4
//   codes again in its weight gradient. Under bitmap_int4 (and auto) the stash keeps those codes
//   (memory/code_bitmap.h: the input's bitmap, which is also a ReLU's mask, plus 4 bits per
//   non-zero) instead of the node's X buffer keeping one byte per element until the backward:
//   the codes are pushed after the forward that computes them, X lives through that forward only.
// plan_code_segments: the dense BN inputs (conv outputs) are not kept at all. Each is computed
//   again just before its BN's backward by its conv's forward from what the backward keeps anyway:
//   the input codes (stashed, or X where the layer keeps it) and the W codes (integer kernels, so
//   bit for bit the first forward's result), or, for an FP32 conv on the graph input (the stem),
//   that input. One recompute segment [conv, BN] each, run by Executor::recompute like
//   memory.checkpoint_every's.
#include <algorithm>

#include "engine/executor.h"
#include "engine/executor_plan_state.h"

namespace et {

void Executor::plan_code_saves(PlanState& st) {
  st.codes.assign(size_t(st.nv), 0);
  st.code_pusher.assign(size_t(st.nv), -1);
  codes_in_stash_.assign(size_t(st.nn), 0);
  // Layers whose backward reads their input's codes as integers (their X), and the values that
  // can be kept as those codes: activations no other layer saves in f32.
  std::vector<uint8_t> reader(size_t(st.nn), 0), eligible(size_t(st.nv), 0);
  for (int n = 0; n < st.nn; ++n) {
    const LayerQuant& q = quant_[size_t(n)];
    const Node& node = graph_.node(n);
    reader[size_t(n)] = needs_backward_[size_t(n)] && q.int4_forward && q.backward != BackwardQuant::Fp32 &&
                        node.op->int_kernels();
    const int x = node.inputs[0];
    if (reader[size_t(n)] && graph_.value(x).kind == ValueKind::Activation && !st.full[size_t(x)])
      eligible[size_t(x)] = 1;
  }
  const StashFormat global = stash_options_.format;
  // A backend whose codec has no code bitmap keeps the codes in X, as dense_fp32 does (the CPU's
  // and CUDA's codecs have one).
  const bool encodes = backend_.stash_codec().encodes_codes();
  auto no_code_bitmap = [&](const std::string& key) {
    user_error("config key '", key, "' = \"bitmap_int4\": the ", backend_.name(),
               " backend has no INT4 code bitmap yet; choose another stash format");
  };
  if (global == StashFormat::BitmapI4 && !encodes) no_code_bitmap("memory.stash");
  // auto takes the codes unless checkpoint_every recomputes segments its own way.
  const bool all = global == StashFormat::BitmapI4 ||
                   (global == StashFormat::Auto && stash_options_.checkpoint_every == 0 && encodes);
  for (int id = 0; id < st.nv; ++id) st.codes[size_t(id)] = all && eligible[size_t(id)];
  if (global == StashFormat::BitmapI4 && std::count(st.codes.begin(), st.codes.end(), 1) == 0)
    user_error("config key 'memory.stash' = \"bitmap_int4\": it keeps the INT4 input codes of layers with an INT4 "
               "forward and a 4-bit backward, and no layer of this model that runs a backward has both (set "
               "quant.forward = int4 and quant.backward = luq_fp4, train more than finetune.trainable does, or "
               "choose another stash format)");
  for (const auto& [layer, f] : stash_options_.layers) {
    const int id = graph_.find_value(layer);
    if (id < 0) continue;  // stash_formats names it
    if (f == StashFormat::BitmapI4 && !encodes) no_code_bitmap("memory.layers." + layer);
    if (f == StashFormat::BitmapI4 && !eligible[size_t(id)])
      user_error("config key 'memory.layers.", layer, "' = \"bitmap_int4\": the output of this layer is not the input "
                 "of a layer with an INT4 forward and a 4-bit backward (quant.forward = int4, quant.backward = "
                 "luq_fp4), or another layer saves it in f32");
    st.codes[size_t(id)] = f == StashFormat::BitmapI4;
  }
  const bool any = std::count(st.codes.begin(), st.codes.end(), 1) > 0;
  if (any && stash_options_.checkpoint_every > 0)
    user_error("config key 'memory.checkpoint_every' = ", stash_options_.checkpoint_every,
               ": not with memory.stash = bitmap_int4, which recomputes the BN inputs from the INT4 codes itself; "
               "use 0");
  for (int n = 0; n < st.nn; ++n) {
    const int x = graph_.node(n).inputs[0];
    if (!reader[size_t(n)] || !st.codes[size_t(x)]) continue;
    codes_in_stash_[size_t(n)] = 1;
    st.add_saver(x, n, true);
    if (st.code_pusher[size_t(x)] < 0) st.code_pusher[size_t(x)] = n;
  }
}

void Executor::plan_code_segments(PlanState& st) {
  segments_.clear();
  st.seg_of.assign(size_t(st.nn), -1);
  reruns_.assign(size_t(st.nn), 0);
  int taken_to = -1;  // segments do not overlap
  for (int c = 0; c < st.nn; ++c) {
    const Node& node = graph_.node(c);
    const int v = node.output;
    if (node.op->op_class() != OpClass::Compute || c <= taken_to || graph_.value(v).kind != ValueKind::Activation ||
        st.first_saver[size_t(v)] <= c)  // not saved (or saved by the conv itself)
      continue;
    // Kept as a quantized reader's input codes (plan_code_saves): the stash holds those, pushed by
    // that reader's forward; a conv straight after a conv (no BN between) is no BN input to rebuild.
    if (st.codes[size_t(v)]) continue;
    // From the input codes kept for the backward (OpContext::input_codes) and W, or an FP32 forward
    // on the graph input; weights and bias are parameters, and aux values of an earlier node (a
    // fused stack's mean and sums, which the conv's backward takes: Op::take_dz_sums) outlive the
    // recompute.
    const bool int4 = quant_[size_t(c)].int4_forward;
    bool recomputable = int4 ? node.op->int_kernels() : graph_.value(node.inputs[0]).kind == ValueKind::Input;
    for (size_t i = 1; i < node.inputs.size(); ++i) {
      const ValueKind k = graph_.value(node.inputs[i]).kind;
      recomputable &= k == ValueKind::Param || k == ValueKind::Aux;
    }
    // Only values BN saves (its input, read by its backward).
    for (int k : graph_.value(v).consumers)
      for (const SaveSpec& sp : save_specs_[size_t(k)])
        if (sp.input >= 0 && graph_.node(k).inputs[size_t(sp.input)] == v)
          recomputable &= graph_.node(k).op->op_class() == OpClass::Normalize;
    if (!recomputable) continue;
    Segment s{c, st.last_saver[size_t(v)], {v}, {v}, {}};
    taken_to = s.end;
    reruns_[size_t(c)] = 1;
    for (int n = s.begin; n <= s.end; ++n) st.seg_of[size_t(n)] = int(segments_.size());
    segments_.push_back(std::move(s));
  }
}

}  // namespace et
