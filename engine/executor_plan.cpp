// Executor::plan(): before the first step, decides where every buffer of a training step lives.
// A time line orders forward (node n at time n), recomputed segments and backward; each buffer's
// lifetime on it goes to the planner (memory/planner.h), which packs them into one arena.
//
// plan() runs named passes in order over one PlanState (what they share):
//   needs-backward -> saves (codes, segments) and stash formats -> recomputed outputs -> decode buffers
//   -> time line -> layout (executor_layout.cpp)
//   -> page release (also executor_layout.cpp).
// A pass that needs more arena buffers planned by lifetime (e.g. per-op operand buffers) runs
// after the time line, hands its PlannedBuffers (role Extra) to plan_layout and, after it, finds
// their arena offsets in PlanState::buffers.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cstdint>

#include "engine/executor.h"
#include "engine/executor_plan_state.h"
#include "memory/planner.h"

namespace et {

void Executor::plan() {
  PlanState st;
  st.nv = graph_.num_values();
  st.nn = graph_.num_nodes();
  st.max_batch = graph_.batch_size();
  ET_CHECK(st.max_batch > 0, "graph batch size not set");
  params_.clear();  // the trained ones: frozen parameters get no gradient and no optimizer state
  for (int p : graph_.params())
    if (!graph_.value(p).frozen) params_.push_back(p);

  quant_ = resolve_quant(graph_, quant_options_);
  plan_needs_backward();
  plan_saves(st);
  plan_recomputed_outputs(st);
  plan_forward_by_readers(st);
  plan_decode_buffers(st);
  plan_time_line(st);
  const std::vector<PlannedBuffer> quant_buffers = plan_quant_operands(st);
  plan_layout(st, quant_buffers);
  bind_quant_operands(st, st.buffers.size() - quant_buffers.size());
  plan_page_release(st);

  report_.recompute_segments = int(segments_.size());
  report_.recompute_nodes = int(std::count(reruns_.begin(), reruns_.end(), 1));
  stash_.configure(std::move(st.saved), st.nv, stash_options_.prune_threshold, stash_options_.release_pages,
                   backend_.memory(), backend_.stash_codec(), stash_options_.first_room, !plan_only_);
  report_.stash_region = stash_.region_bytes();
  stash_.set_recomputer([this](int id, Tensor& out) {
    const int p = graph_.value(id).producer;
    OpContext ctx(*this, p);
    graph_.node(p).op->recompute_output(ctx, out);
  });
  batch_ = st.max_batch;  // views have the full batch until a forward says otherwise
  param_grads_.clear();
  sgd_slots_.clear();
  for (int p : params_) {
    param_grads_.push_back(grads_[size_t(p)]);
    sgd_slots_.push_back(SgdSlot{data_[size_t(p)], grads_[size_t(p)], opt_slot(p, 0)});
  }
}

// Which nodes need a backward: those whose output depends on a trained parameter (or on a value
// that needs a gradient). Values in node order, so one pass suffices. Below the lowest trained
// layer nothing runs backward: the frozen bottom of a fine-tuned network costs forward time only.
void Executor::plan_needs_backward() {
  const int nn = graph_.num_nodes();
  needs_backward_.assign(size_t(nn), 0);
  for (int p : graph_.params()) graph_.value(p).needs_grad = !graph_.value(p).frozen;
  for (int n = 0; n < nn; ++n) {
    const Node& node = graph_.node(n);
    bool any = false;
    for (int in : node.inputs) any |= graph_.value(in).needs_grad;
    graph_.value(node.output).needs_grad = any;
    needs_backward_[size_t(n)] = any;
  }
}

// Saved values: the first saving consumer pushes (its backward is the last reader and pops),
// the last saving consumer's backward is the first reader. Also plans bitmap_int4's codes (pushed
// by the layer that computes them, executor_codes.cpp), the recompute segments and each saved
// value's stash format.
void Executor::plan_saves(PlanState& st) {
  const int nv = st.nv, nn = st.nn;
  save_specs_.assign(size_t(nn), {});
  for (int n = 0; n < nn; ++n) {
    // A node without backward saves nothing; one with, what its wanted gradients read.
    const Node& node = graph_.node(n);
    if (!needs_backward_[size_t(n)]) continue;
    std::vector<uint8_t> wanted;
    for (int in : node.inputs) wanted.push_back(graph_.value(in).needs_grad);
    save_specs_[size_t(n)] = node.op->saves();
    auto& specs = save_specs_[size_t(n)];
    specs.erase(std::remove_if(specs.begin(), specs.end(), [&](const SaveSpec& s) { return !node.op->save_needed(s, wanted); }),
                specs.end());
    // A conv / linear with an INT4 forward keeps its input's codes instead (plan_quant_operands).
    if (quant_[size_t(n)].int4_forward)
      specs.erase(std::remove_if(specs.begin(), specs.end(), [](const SaveSpec& s) { return s.input == 0; }),
                  specs.end());
  }

  st.first_saver.assign(size_t(nv), -1);
  st.last_saver.assign(size_t(nv), -1);
  st.full.assign(size_t(nv), 0);
  st.mask_read.assign(size_t(nv), 0);
  for (int n = 0; n < nn; ++n)
    for (const SaveSpec& sp : save_specs_[size_t(n)]) {
      const Node& node = graph_.node(n);
      const int id = sp.input < 0 ? node.output : node.inputs[size_t(sp.input)];
      st.add_saver(id, n, sp.kind == SaveKind::Full);
      st.mask_read[size_t(id)] |= sp.kind == SaveKind::Mask;
    }
  plan_code_saves(st);
  if (std::count(st.codes.begin(), st.codes.end(), 1) > 0)
    plan_code_segments(st);
  else
    plan_segments(st.first_saver, &st.seg_of);
  st.recomputed.assign(size_t(nv), 0);
  st.rewritten.assign(size_t(nv), 0);
  for (const Segment& s : segments_)
    for (int id : s.outputs) st.rewritten[size_t(id)] = 1;
  for (const Segment& s : segments_) {
    for (int id : s.inside) st.recomputed[size_t(id)] = 1;
    // What the segment reads from before itself must survive until its recompute: saved in full.
    for (int id : s.external)
      for (int c : graph_.value(id).consumers)
        if (c >= s.begin && c <= s.end && reruns_[size_t(c)]) st.add_saver(id, c, true);
  }

  const std::vector<StashFormat> format = stash_formats(st);
  push_after_.assign(size_t(nn), {});
  push_after_recompute_.assign(size_t(nn), {});
  pop_after_.assign(size_t(nn), {});
  st.saved.clear();
  st.saved_index.assign(size_t(nv), -1);
  for (int id = 0; id < nv; ++id) {
    if (st.first_saver[size_t(id)] < 0) continue;
    const Value& v = graph_.value(id);
    SavedValue sv;
    sv.value = id;
    sv.numel = v.shape.numel();
    sv.full = st.full[size_t(id)] != 0;
    sv.mask_read = st.mask_read[size_t(id)] != 0;
    // Inputs live for the whole step anyway: keep them in place.
    sv.format = v.kind == ValueKind::Input ? StashFormat::DenseF32 : format[size_t(id)];
    st.saved_index[size_t(id)] = int(st.saved.size());
    st.saved.push_back(sv);
    report_.stash_dense_bytes += size_t(sv.numel) * dtype_size(v.dtype);
    // After the first saver's forward, or, for codes, the forward that computes them.
    const int pusher = st.code_pusher[size_t(id)] >= 0 ? st.code_pusher[size_t(id)] : st.first_saver[size_t(id)];
    (st.recomputed[size_t(id)] ? push_after_recompute_ : push_after_)[size_t(pusher)].push_back(id);
  }
  // A node's own output goes first: the stash's top is where its forward may write the output's
  // bitmap and values as it computes them (Stash::mask_target; a fused stack also pushes its input).
  for (int n = 0; n < nn; ++n) {
    std::vector<int>& p = push_after_[size_t(n)];
    const auto own = std::find(p.begin(), p.end(), graph_.node(n).output);
    if (own != p.end()) std::rotate(p.begin(), own, own + 1);
  }
  // Pops after the first saver's backward (the last reader's), the latest pushed first: recomputed
  // values (pushed in backward), then forward pushes in reverse.
  for (int n = 0; n < nn; ++n)
    for (auto it = push_after_recompute_[size_t(n)].rbegin(); it != push_after_recompute_[size_t(n)].rend(); ++it)
      pop_after_[size_t(st.first_saver[size_t(*it)])].push_back(*it);
  for (int n = nn - 1; n >= 0; --n)
    for (auto it = push_after_[size_t(n)].rbegin(); it != push_after_[size_t(n)].rend(); ++it)
      pop_after_[size_t(st.first_saver[size_t(*it)])].push_back(*it);
}

// The stash format of every value (used for saved ones). A global bitmap format applies where
// zeros come by construction (ReLU / dropout outputs and max-pools of them). Other saved values
// (conv outputs: BN inputs) keep the dense format of the same precision: a bitmap of a tensor
// without zeros is 1/32 larger and costs a pack and unpack. auto keeps those as zero-copy fp32
// (what its per-tensor choice would pick, without the count). bitmap_int4 applies to the values
// plan_code_saves chose, as do auto's codes; its other values take bitmap_fp32's exact formats.
// Per-layer overrides apply as given.
std::vector<StashFormat> Executor::stash_formats(const PlanState& st) const {
  const std::vector<int>& first_saver = st.first_saver;
  const int nv = graph_.num_values(), nn = graph_.num_nodes();
  std::vector<uint8_t> sparse(size_t(nv), 0);
  for (int n = 0; n < nn; ++n) {
    const Node& node = graph_.node(n);
    const OutputZeros z = node.op->output_zeros();
    sparse[size_t(node.output)] = z == OutputZeros::Many || (z == OutputZeros::AsInput0 && sparse[size_t(node.inputs[0])]);
  }
  auto global_format = [&](int id) {
    if (st.codes[size_t(id)]) return StashFormat::BitmapI4;
    switch (stash_options_.format) {
      case StashFormat::BitmapI4: return sparse[size_t(id)] ? StashFormat::BitmapF32 : StashFormat::DenseF32;
      case StashFormat::BitmapF32:
      case StashFormat::Auto: return sparse[size_t(id)] ? stash_options_.format : StashFormat::DenseF32;
      case StashFormat::BitmapF16: return sparse[size_t(id)] ? StashFormat::BitmapF16 : StashFormat::DenseF16;
      default: return stash_options_.format;
    }
  };
  std::vector<StashFormat> format(static_cast<size_t>(nv));
  for (int id = 0; id < nv; ++id) format[size_t(id)] = global_format(id);
  for (const auto& [layer, f] : stash_options_.layers) {
    const int id = graph_.find_value(layer);
    if (id < 0 || graph_.value(id).producer < 0)
      user_error("config key 'memory.layers.", layer, "': no layer of that name in the model");
    if (first_saver[size_t(id)] < 0)
      user_error("config key 'memory.layers.", layer, "': nothing saves the output of this layer for backward");
    format[size_t(id)] = f;
  }
  return format;
}

// memory.recompute_stack_outputs: a value saved in full whose producer can recompute it from its own
// saves (Op::output_recomputable: a fused BN -> ReLU stack from its input x) is not kept. Its first
// reader's backward has the producer write it into the value's decode buffer, which lives from
// there to the producer's backward (plan_decode_buffers); the producer's saves are popped after
// its own backward, so they outlive every later reader's. Where the producer describes it as
// relu(x * scale[c] + shift[c]) of x as stored (Op::output_is_affine_relu) and every reader takes
// DType::AffineRelu (the conv weight gradients), there is no buffer: each reader computes the
// pieces it reads (memory/stored_reader.h on the host, a GPU's kernels from x and the coefficients
// in its memory). Not with recompute segments, which choose what is
// kept themselves, and not from a value that is itself recomputed.
void Executor::plan_recomputed_outputs(PlanState& st) {
  affine_sources_.assign(size_t(st.nv), AffineReluSource{});
  affine_coefficients_.assign(size_t(st.nv), nullptr);
  if (!stash_options_.recompute_stack_outputs || !segments_.empty()) return;
  // ET_AFFINE_RELU_READS=0: every reader gets y recomputed into a buffer (A/B measurements, tests).
  const char* env = std::getenv("ET_AFFINE_RELU_READS");
  const bool readers_compute = !(env && !std::strcmp(env, "0"));
  for (SavedValue& sv : st.saved) {
    const Value& v = graph_.value(sv.value);
    if (!sv.full || v.kind != ValueKind::Activation || v.producer < 0 || st.codes[size_t(sv.value)]) continue;
    const int p = v.producer;
    if (!graph_.node(p).op->output_recomputable(backend_)) continue;
    const int x = graph_.node(p).inputs[0];
    bool keeps_x = false;
    for (const SaveSpec& sp : save_specs_[size_t(p)]) keeps_x |= sp.input == 0 && sp.kind == SaveKind::Full;
    const int xi = st.saved_index[size_t(x)];
    if (!keeps_x || xi < 0 || st.saved[size_t(xi)].recomputed) continue;
    sv.recomputed = true;
    // Readers may compute it from x as stored, where every encoding of x is one StoredReader reads.
    sv.affine_relu = readers_compute && graph_.node(p).op->output_is_affine_relu(backend_) &&
                     (stash_format_dtypes(st.saved[size_t(xi)].format) & ~kStashDTypes) == 0;
  }
  // The coefficients ([2, C] floats a value) in one allocation of the backend's memory.
  size_t floats = 0;
  for (const SavedValue& sv : st.saved)
    if (sv.affine_relu) floats += size_t(2 * graph_.value(sv.value).shape[1]);
  if (floats == 0 || plan_only_) return;
  affine_room_.reserve(floats * sizeof(float), "the fused stacks' output coefficients", backend_.memory());
  auto* at = static_cast<float*>(affine_room_.at(0));
  for (const SavedValue& sv : st.saved)
    if (sv.affine_relu) {
      affine_coefficients_[size_t(sv.value)] = at;
      at += 2 * graph_.value(sv.value).shape[1];
    }
}

// The same values in forward: where the producer can leave its output to its readers in forward too
// (Op::output_by_readers_in_forward) and every reader's forward takes DType::AffineRelu (a conv
// that computes it as it stages its input: cpu::ConvInput), the output has no buffer at all: the producer's
// forward computes its coefficients only (OpContext::output_source), and its readers get a tensor
// of dtype AffineRelu. Not for quantized readers, which quantize x itself; ET_FORWARD_BY_READERS=0
// turns it off (A/B measurements).
void Executor::plan_forward_by_readers(PlanState& st) {
  by_readers_.assign(size_t(st.nv), 0);
  st.read_through.assign(size_t(st.nv), -1);
  const char* env = std::getenv("ET_FORWARD_BY_READERS");
  if (env && !std::strcmp(env, "0")) return;
  for (const SavedValue& sv : st.saved) {
    const int id = sv.value;
    const Value& v = graph_.value(id);
    if (!sv.affine_relu || id == graph_.logits || id == graph_.loss || v.consumers.empty()) continue;
    if (!graph_.node(v.producer).op->output_by_readers_in_forward(backend_)) continue;
    bool all = true;
    for (int c : v.consumers) {
      const Node& reader = graph_.node(c);
      all = all && !quant_[size_t(c)].on();
      for (size_t i = 0; i < reader.inputs.size(); ++i)
        if (reader.inputs[i] == id)
          all = all && dtype_in(DType::AffineRelu, reader.op->forward_reads(int(i), backend_, st.max_batch));
    }
    if (!all) continue;
    by_readers_[size_t(id)] = 1;
    // The readers read the producer's input: its forward buffer lives until the last of them (a
    // packed stash would otherwise let it die at the producer, and a reader's output take its place).
    int& until = st.read_through[size_t(graph_.node(v.producer).inputs[0])];
    for (int c : v.consumers) until = std::max(until, c);
    float* k = affine_coefficients_[size_t(id)];
    affine_sources_[size_t(id)].scale = k;
    affine_sources_[size_t(id)].shift = k + v.shape[1];
  }
}

// Decode buffers: only for values some reader needs as f32 (a recomputed segment always does).
// A reader may take the stored encoding (Op::reads_stored); a compressed save every reader takes
// as stored gets no buffer.
void Executor::plan_decode_buffers(PlanState& st) {
  std::vector<uint8_t> needs_decode(size_t(st.nv), 0);
  const DTypeSet mask_reads = stash_mask_dtypes();
  std::vector<DTypeSet> stored(size_t(st.nv), 0);
  st.decode_from.assign(size_t(st.nv), -1);
  st.decode_until.assign(size_t(st.nv), -1);
  for (const SavedValue& sv : st.saved)
    stored[size_t(sv.value)] = sv.affine_relu ? dtype_bit(DType::AffineRelu)
                               : sv.recomputed ? dtype_bit(DType::F32)
                                               : stash_format_dtypes(sv.format);
  for (int n = 0; n < st.nn; ++n) {
    const Node& node = graph_.node(n);
    const auto& specs = save_specs_[size_t(n)];
    for (size_t i = 0; i < specs.size(); ++i) {
      const int id = specs[i].input < 0 ? node.output : node.inputs[size_t(specs[i].input)];
      // A producer's mask of an output its readers compute: its backward rebuilds it from its input.
      if (specs[i].input < 0 && specs[i].kind == SaveKind::Mask && st.saved_of(id) && st.saved_of(id)->affine_relu)
        continue;
      // A mask reads the bitmap, or the f32 values (a dense 16-bit copy decodes for it).
      const DTypeSet reads = specs[i].kind == SaveKind::Mask ? mask_reads
                                                             : node.op->reads_stored(int(i), backend_, st.max_batch);
      if ((stored[size_t(id)] & ~reads) != 0) {
        needs_decode[size_t(id)] = 1;
        int &from = st.decode_from[size_t(id)], &until = st.decode_until[size_t(id)];
        from = std::max(from, n);
        until = until < 0 ? n : std::min(until, n);
      }
    }
  }
  // A segment decodes its external inputs when it reruns (activation_buffers adds that time).
  for (const Segment& s : segments_)
    for (int id : s.external) needs_decode[size_t(id)] = 1;

  // Zero-copy saves (dense_fp32) are the forward buffer itself; mask-only saves are never decoded.
  st.needs_unpack.assign(size_t(st.nv), 0);
  for (const SavedValue& sv : st.saved) {
    const ValueKind kind = graph_.value(sv.value).kind;
    if (sv.recomputed) {  // written there by its producer for the first reader, unless all compute it
      st.needs_unpack[size_t(sv.value)] = !sv.affine_relu || needs_decode[size_t(sv.value)];
      st.decode_from[size_t(sv.value)] = st.decode_until[size_t(sv.value)] = -1;  // every reader gets it
      continue;
    }
    if (!sv.full || sv.format == StashFormat::DenseF32 || (kind != ValueKind::Activation && kind != ValueKind::Aux))
      continue;
    st.needs_unpack[size_t(sv.value)] = needs_decode[size_t(sv.value)];  // else read as stored
  }
}

// Time line. Forward of node n at n; backward in reverse, each recomputed segment's forward
// just before the backward of its last node.
void Executor::plan_time_line(PlanState& st) {
  const int nn = st.nn;
  st.bwd_t.assign(size_t(nn), 0);
  st.rec_t.assign(size_t(nn), -1);
  segment_ending_at_.assign(size_t(nn), -1);
  for (size_t i = 0; i < segments_.size(); ++i) segment_ending_at_[size_t(segments_[i].end)] = int(i);
  int t = nn;
  for (int n = nn - 1; n >= 0; --n) {
    if (const int s = segment_ending_at_[size_t(n)]; s >= 0)
      for (int k = segments_[size_t(s)].begin; k <= n; ++k) st.rec_t[size_t(k)] = t++;
    st.bwd_t[size_t(n)] = t++;
  }
  st.t_end = t;
}

// Segments of checkpoint_every = m compute ops: each starts at every m-th compute op (conv /
// linear) and runs until the next segment; the loss and what follows stay outside. A segment is
// kept only if it recomputes something the stash would otherwise hold. Where the m-th op follows
// another compute op, a segment starting there would keep that op's output from the forward (a
// fused stack after a shortcut conv: conv2, the shortcut's conv and BN, then the stack reading
// both; unfused, BN sits between conv2 and the shortcut), so the segment starts at whichever of
// the two keeps fewer bytes, the earlier one on a tie; where the earlier op starts a segment
// itself, that segment runs on. (ResNet: conv2's output or the stack's before it, the same size;
// MobileNet-V2: the narrow projection conv's output rather than the expanded input it reads.)
std::vector<std::pair<int, int>> Executor::candidate_segments(const Graph& g, int m) {
  std::vector<std::pair<int, int>> all;
  if (m <= 0) return all;
  // Bytes of the activations produced before node b and read at or after it.
  auto kept_by_start_at = [&](int b) {
    size_t bytes = 0;
    for (int id = 0; id < g.num_values(); ++id) {
      const Value& v = g.value(id);
      if (v.kind != ValueKind::Activation || v.producer < 0 || v.producer >= b) continue;
      if (std::any_of(v.consumers.begin(), v.consumers.end(), [&](int c) { return c >= b; }))
        bytes += size_t(v.shape.numel()) * dtype_size(v.dtype);
    }
    return bytes;
  };
  int computes = 0;
  for (int n = 0; n < g.num_nodes(); ++n) {
    const OpClass c = g.node(n).op->op_class();
    if (c == OpClass::Loss) break;
    if (c == OpClass::Compute && computes++ % m == 0) {
      const bool after_compute = n > 0 && g.node(n - 1).op->op_class() == OpClass::Compute;
      if (all.empty() || !after_compute) {
        all.emplace_back(n, n);
      } else if (all.back().first < n - 1) {
        if (kept_by_start_at(n - 1) <= kept_by_start_at(n)) {
          all.back().second = n - 2;
          all.emplace_back(n - 1, n);
        } else {
          all.emplace_back(n, n);
        }
      }
    }
    if (!all.empty()) all.back().second = n;
  }
  return all;
}

void Executor::plan_segments(const std::vector<int>& first_saver, std::vector<int>* seg_of) {
  const int nn = graph_.num_nodes(), m = stash_options_.checkpoint_every;
  segments_.clear();
  seg_of->assign(size_t(nn), -1);
  if (m <= 0) return;
  const std::vector<std::pair<int, int>> candidates = candidate_segments(graph_, m);
  int computes = 0;
  for (int n = 0; n < nn; ++n) computes += graph_.node(n).op->op_class() == OpClass::Compute;
  if (computes < m)
    user_error("config key 'memory.checkpoint_every' = ", m, ": the model has only ", computes,
               " conv / linear layers, so no segment would be recomputed");
  const std::vector<uint8_t>& chosen = stash_options_.segments;
  ET_CHECK(chosen.empty() || chosen.size() == candidates.size(), "segment flags ", chosen.size(), " for ",
           candidates.size(), " candidate segments");
  std::vector<Segment> all;
  for (size_t i = 0; i < candidates.size(); ++i)
    if (chosen.empty() || chosen[i]) all.push_back(Segment{candidates[i].first, candidates[i].second, {}, {}, {}});
  reruns_.assign(size_t(nn), 0);
  for (Segment& s : all) {
    // Only what backward reads again is recomputed: the saved values produced and used inside the
    // segment (conv outputs read by BN backward) and, walking back, what they are computed from.
    // Outputs read after the segment are kept from the forward, so the BN / ReLU / add after the
    // last saved value do not run again.
    bool saves_recomputed = false;
    for (int n = s.end; n >= s.begin; --n) {
      const int id = graph_.node(n).output;
      const Value& v = graph_.value(id);
      if (v.kind != ValueKind::Activation) continue;
      bool inside = id != graph_.logits && id != graph_.loss && !v.consumers.empty();
      for (int c : v.consumers) inside &= c >= s.begin && c <= s.end;
      if (inside) s.inside.push_back(id);
      bool needed = inside && first_saver[size_t(id)] >= 0;
      saves_recomputed |= needed;
      for (int c : v.consumers) needed |= c <= s.end && reruns_[size_t(c)] != 0;  // an input of a rerun
      reruns_[size_t(n)] = needed;
    }
    if (!saves_recomputed) {
      for (int n = s.begin; n <= s.end; ++n) reruns_[size_t(n)] = 0;
      continue;
    }
    for (int n = s.begin; n <= s.end; ++n)
      if (reruns_[size_t(n)]) s.outputs.push_back(graph_.node(n).output);
    for (int n = s.begin; n <= s.end; ++n)
      if (reruns_[size_t(n)])
        for (int in : graph_.node(n).inputs) {
          const Value& v = graph_.value(in);
          if (v.kind == ValueKind::Activation && v.producer < s.begin &&
              std::find(s.external.begin(), s.external.end(), in) == s.external.end())
            s.external.push_back(in);
        }
    for (int n = s.begin; n <= s.end; ++n) (*seg_of)[size_t(n)] = int(segments_.size());
    segments_.push_back(std::move(s));
  }
}

std::vector<Executor::StashEvent> Executor::stash_schedule() const {
  std::vector<StashEvent> out;
  const int nn = graph_.num_nodes();
  for (int n = 0; n < nn; ++n)
    for (int id : push_after_[size_t(n)]) out.push_back({true, id});
  for (int n = nn - 1; n >= 0; --n) {
    if (const int s = segment_ending_at_[size_t(n)]; s >= 0)
      for (int k = segments_[size_t(s)].begin; k <= n; ++k)
        for (int id : push_after_recompute_[size_t(k)]) out.push_back({true, id});
    for (int id : pop_after_[size_t(n)]) out.push_back({false, id});
  }
  return out;
}

}  // namespace et
