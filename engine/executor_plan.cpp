// Executor::plan(): before the first step, decides where every buffer of a training step lives.
// A time line orders forward (node n at time n), recomputed segments and backward; each buffer's
// lifetime on it goes to the planner (memory/planner.h), which packs them into one arena.
#include <algorithm>
#include <cstdint>

#include "engine/executor.h"
#include "memory/planner.h"

namespace et {

void Executor::plan() {
  const int nv = graph_.num_values(), nn = graph_.num_nodes();
  const int64_t max_batch = graph_.batch_size();
  ET_CHECK(max_batch > 0, "graph batch size not set");

  // Which nodes need a backward: those whose output depends on a parameter (or on a value that needs
  // a gradient). Values in node order, so one pass suffices.
  needs_backward_.assign(size_t(nn), 0);
  for (int n = 0; n < nn; ++n) {
    const Node& node = graph_.node(n);
    bool any = false;
    for (int in : node.inputs) any |= graph_.value(in).needs_grad || graph_.value(in).kind == ValueKind::Param;
    graph_.value(node.output).needs_grad = any;
    needs_backward_[size_t(n)] = any;
  }
  for (int p : graph_.params()) graph_.value(p).needs_grad = true;

  save_specs_.assign(size_t(nn), {});
  for (int n = 0; n < nn; ++n) save_specs_[size_t(n)] = graph_.node(n).op->saves();

  // Saved values: the first saving consumer pushes (its backward is the last reader and pops),
  // the last saving consumer's backward is the first reader.
  std::vector<int> first_saver(size_t(nv), -1), last_saver(size_t(nv), -1);
  std::vector<uint8_t> full(size_t(nv), 0);
  auto add_saver = [&](int id, int n, bool is_full) {
    if (first_saver[size_t(id)] < 0 || n < first_saver[size_t(id)]) first_saver[size_t(id)] = n;
    last_saver[size_t(id)] = std::max(last_saver[size_t(id)], n);
    full[size_t(id)] |= is_full;
  };
  for (int n = 0; n < nn; ++n)
    for (const SaveSpec& sp : save_specs_[size_t(n)]) {
      const Node& node = graph_.node(n);
      add_saver(sp.input < 0 ? node.output : node.inputs[size_t(sp.input)], n, sp.kind == SaveKind::Full);
    }
  std::vector<int> seg_of;
  plan_segments(first_saver, &seg_of);
  std::vector<uint8_t> recomputed(size_t(nv), 0), rewritten(size_t(nv), 0);
  for (const Segment& s : segments_)
    for (int id : s.outputs) rewritten[size_t(id)] = 1;
  for (const Segment& s : segments_) {
    for (int id : s.inside) recomputed[size_t(id)] = 1;
    // What the segment reads from before itself must survive until its recompute: saved in full.
    for (int id : s.external)
      for (int c : graph_.value(id).consumers)
        if (c >= s.begin && c <= s.end && reruns_[size_t(c)]) add_saver(id, c, true);
  }

  // Time line. Forward of node n at n; backward in reverse, each recomputed segment's forward
  // just before the backward of its last node.
  std::vector<int> bwd_t(static_cast<size_t>(nn), 0), rec_t(static_cast<size_t>(nn), -1);
  segment_ending_at_.assign(size_t(nn), -1);
  for (size_t i = 0; i < segments_.size(); ++i) segment_ending_at_[size_t(segments_[i].end)] = int(i);
  int t = nn;
  for (int n = nn - 1; n >= 0; --n) {
    if (const int s = segment_ending_at_[size_t(n)]; s >= 0)
      for (int k = segments_[size_t(s)].begin; k <= n; ++k) rec_t[size_t(k)] = t++;
    bwd_t[size_t(n)] = t++;
  }
  const int t_end = t;

  // A global bitmap format applies where zeros come by construction (ReLU / dropout outputs and
  // max-pools of them). Other saved values (conv outputs: BN inputs) keep the dense format of the
  // same precision: a bitmap of a tensor without zeros is 1/32 larger and costs a pack and unpack.
  // auto keeps those as zero-copy fp32 (what its per-tensor choice would pick, without the count).
  // Per-layer overrides (below) apply as given.
  std::vector<uint8_t> sparse(size_t(nv), 0);
  for (int n = 0; n < nn; ++n) {
    const Node& node = graph_.node(n);
    const OutputZeros z = node.op->output_zeros();
    sparse[size_t(node.output)] = z == OutputZeros::Many || (z == OutputZeros::AsInput0 && sparse[size_t(node.inputs[0])]);
  }
  auto global_format = [&](int id) {
    switch (stash_options_.format) {
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
  push_after_.assign(size_t(nn), {});
  push_after_recompute_.assign(size_t(nn), {});
  pop_after_.assign(size_t(nn), {});
  std::vector<SavedValue> saved;
  for (int id = 0; id < nv; ++id) {
    if (first_saver[size_t(id)] < 0) continue;
    const Value& v = graph_.value(id);
    SavedValue sv;
    sv.value = id;
    sv.numel = v.shape.numel();
    sv.full = full[size_t(id)] != 0;
    // Inputs live for the whole step anyway: keep them in place.
    sv.format = v.kind == ValueKind::Input ? StashFormat::DenseF32 : format[size_t(id)];
    saved.push_back(sv);
    report_.stash_dense_bytes += size_t(sv.numel) * dtype_size(v.dtype);
    (recomputed[size_t(id)] ? push_after_recompute_ : push_after_)[size_t(first_saver[size_t(id)])].push_back(id);
  }
  // Pops after the first saver's backward; a node pushing several values pops them in reverse.
  for (int n = 0; n < nn; ++n) {
    auto& pops = pop_after_[size_t(n)];
    pops.assign(push_after_recompute_[size_t(n)].rbegin(), push_after_recompute_[size_t(n)].rend());
    pops.insert(pops.end(), push_after_[size_t(n)].rbegin(), push_after_[size_t(n)].rend());
  }
  // Decode buffers: only for values some reader needs as f32 (a recomputed segment always does).
  // Under the identity precision policy a reader may take the stored encoding (Op::reads_stored).
  std::vector<uint8_t> needs_decode(size_t(nv), 0);
  auto stored_dtypes = [](StashFormat f) -> DTypeSet {
    switch (f) {
      case StashFormat::DenseF32: return dtype_bit(DType::F32);
      case StashFormat::DenseF16: return dtype_bit(DType::F16);
      case StashFormat::DenseBF16: return dtype_bit(DType::BF16);
      case StashFormat::BitmapF32: return dtype_bit(DType::BitmapF32);
      case StashFormat::BitmapF16: return dtype_bit(DType::BitmapF16);
      case StashFormat::Auto: return dtype_bit(DType::BitmapF32) | dtype_bit(DType::F32);
    }
    return 0;
  };
  constexpr DTypeSet kMaskFromStored =
      dtype_bit(DType::F32) | dtype_bit(DType::BitmapF32) | dtype_bit(DType::BitmapF16);
  std::vector<DTypeSet> stored(size_t(nv), 0);
  for (const SavedValue& sv : saved) stored[size_t(sv.value)] = stored_dtypes(sv.format);
  for (int n = 0; n < nn; ++n) {
    const Node& node = graph_.node(n);
    const auto& specs = save_specs_[size_t(n)];
    for (size_t i = 0; i < specs.size(); ++i) {
      const int id = specs[i].input < 0 ? node.output : node.inputs[size_t(specs[i].input)];
      // A mask reads the bitmap, or the f32 values (a dense 16-bit copy decodes for it).
      const DTypeSet reads = specs[i].kind == SaveKind::Mask ? kMaskFromStored
                             : precision_->identity()        ? node.op->reads_stored(int(i), backend_, max_batch)
                                                             : dtype_bit(DType::F32);
      if ((stored[size_t(id)] & ~reads) != 0) needs_decode[size_t(id)] = 1;
    }
  }
  for (const Segment& s : segments_)
    for (int id : s.external) needs_decode[size_t(id)] = 1;
  auto saved_index = [&](int id) -> SavedValue* {
    for (SavedValue& sv : saved)
      if (sv.value == id) return &sv;
    return nullptr;
  };

  size_t persistent = 0;
  std::vector<size_t> persistent_offset(size_t(nv) * 2, 0);
  std::vector<size_t> slot_offset(size_t(nv), 0);
  auto bytes_of = [&](const Value& v) { return size_t(v.shape.numel()) * dtype_size(v.dtype); };

  // Activation gradients shared in place (Op::grad_in_place): an input whose only consumer may
  // overwrite the output gradient with it uses the output gradient's buffer; chains (conv -> bn ->
  // relu) collapse to one buffer. grad_parent links a value to its consumer's output.
  std::vector<int> grad_parent(size_t(nv), -1);
  for (int n = 0; n < nn; ++n) {
    const Node& node = graph_.node(n);
    const Value& out = graph_.value(node.output);
    if (!needs_backward_[size_t(n)] || out.kind != ValueKind::Activation) continue;
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      const int in = node.inputs[i];
      const Value& v = graph_.value(in);
      if (v.kind != ValueKind::Activation || !v.needs_grad || v.consumers.size() != 1 ||
          v.shape.numel() != out.shape.numel() || !node.op->grad_in_place(int(i)))
        continue;
      grad_parent[size_t(in)] = node.output;
      break;  // one input per node shares the output gradient
    }
  }
  auto grad_root = [&](int id) {
    while (grad_parent[size_t(id)] >= 0) id = grad_parent[size_t(id)];
    return id;
  };
  struct GradSpan { int first = INT32_MAX, last = -1; size_t bytes = 0; };
  std::vector<GradSpan> grad_span(static_cast<size_t>(nv));

  std::vector<BufferRequest> req;
  enum Role { Data, Grad, Unpack, Recompute };
  std::vector<std::pair<int, Role>> owner;  // (value, role) per request
  for (int id = 0; id < nv; ++id) {
    const Value& v = graph_.value(id);
    const size_t bytes = Arena::align_up(bytes_of(v));
    switch (v.kind) {
      case ValueKind::Param:
        persistent_offset[size_t(id) * 2] = persistent; persistent += bytes; report_.params += bytes;
        persistent_offset[size_t(id) * 2 + 1] = persistent; persistent += bytes; report_.grads += bytes;
        slot_offset[size_t(id)] = persistent; persistent += bytes * size_t(optimizer_slots_);
        report_.optimizer += bytes * size_t(optimizer_slots_);
        break;
      case ValueKind::Buffer:
        persistent_offset[size_t(id) * 2] = persistent; persistent += bytes; report_.buffers += bytes;
        break;
      case ValueKind::Input:
        persistent_offset[size_t(id) * 2] = persistent; persistent += bytes; report_.inputs += bytes;
        break;
      case ValueKind::Activation:
      case ValueKind::Aux: {
        const int p = v.producer;
        const bool rec = recomputed[size_t(id)] != 0;
        const SavedValue* sv = saved_index(id);
        const bool zero_copy = sv && sv->format == StashFormat::DenseF32;
        // Aux values (BN batch statistics) keep one buffer; a recompute rewrites the same values.
        int last = v.kind == ValueKind::Aux ? bwd_t[size_t(p)] : p;
        for (int c : v.consumers) last = std::max(last, c);
        if (zero_copy && !rec) last = std::max(last, bwd_t[size_t(first_saver[size_t(id)])]);
        if (id == graph_.logits || id == graph_.loss) last = t_end;  // read by the trainer after the step
        req.push_back({bytes, p, last});
        owner.emplace_back(id, Data);
        if (rewritten[size_t(id)]) {
          // The recomputed copy: read by the segment's own nodes, and by backward if saved in place.
          int rec_last = rec_t[size_t(p)];
          for (int c : v.consumers)
            if (seg_of[size_t(c)] == seg_of[size_t(p)] && reruns_[size_t(c)]) rec_last = std::max(rec_last, rec_t[size_t(c)]);
          if (zero_copy && rec) rec_last = std::max(rec_last, bwd_t[size_t(first_saver[size_t(id)])]);
          req.push_back({bytes, rec_t[size_t(p)], rec_last});
          owner.emplace_back(id, Recompute);
          report_.recompute += bytes;
        }
        if (v.needs_grad && v.kind == ValueKind::Activation) {
          // Lifetimes of a shared gradient buffer merge into its root's request (below).
          GradSpan& g = grad_span[size_t(grad_root(id))];
          g.first = std::min(g.first, bwd_t[size_t(p)]);
          for (int c : v.consumers) g.first = std::min(g.first, bwd_t[size_t(c)]);
          g.last = std::max(g.last, bwd_t[size_t(p)]);
          g.bytes = bytes;
        }
        if (sv && sv->full && !zero_copy && !needs_decode[size_t(id)]) {
          reads_as_stored_ = true;  // every reader decodes as it reads: no buffer
        } else if (sv && sv->full && !zero_copy) {
          // Decoded by the first reader: the last saver's backward, or a recomputed segment.
          int first = bwd_t[size_t(last_saver[size_t(id)])];
          // (recompute() decodes a segment's external inputs before its first node runs)
          for (int c : v.consumers)
            if (const int sc = seg_of[size_t(c)]; sc >= 0 && sc != seg_of[size_t(p)] && reruns_[size_t(c)])
              first = std::min(first, rec_t[size_t(segments_[size_t(sc)].begin)]);
          req.push_back({bytes, first, bwd_t[size_t(first_saver[size_t(id)])]});
          owner.emplace_back(id, Unpack);
          report_.unpack += bytes;
        }
        break;
      }
    }
  }
  for (int id = 0; id < nv; ++id)
    if (grad_span[size_t(id)].last >= 0) {
      req.push_back({grad_span[size_t(id)].bytes, grad_span[size_t(id)].first, grad_span[size_t(id)].last});
      owner.emplace_back(id, Grad);
    }
  size_t ws = 0;
  for (int n = 0; n < nn; ++n) ws = std::max(ws, graph_.node(n).op->workspace_bytes(backend_, max_batch));
  report_.workspace = Arena::align_up(ws);

  const MemoryPlan mp = plan_memory(req);
  report_.activations_planned = mp.total_bytes;
  report_.activations_unplanned = mp.sum_bytes;
  const size_t act_base = persistent;
  const size_t ws_base = act_base + mp.total_bytes;
  report_.total = ws_base + report_.workspace;
  {
    // Named in the out-of-memory message: the layer with the largest planned buffer.
    size_t largest = 0;
    int largest_id = -1;
    for (size_t r = 0; r < req.size(); ++r)
      if (req[r].bytes > largest) largest = req[r].bytes, largest_id = owner[r].first;
    std::string what = "the training step of this model (parameters, optimizer state and inputs " + std::to_string(persistent) + " bytes, activations " +
                       std::to_string(mp.total_bytes) + ", workspace " + std::to_string(report_.workspace) + ")";
    if (largest_id >= 0)
      what += "; its largest buffer is layer '" + graph_.value(largest_id).name + "' output, " +
              std::to_string(largest) + " bytes";
    arena_.reserve(report_.total, what);
  }

  data_.assign(size_t(nv), Tensor{});
  grads_.assign(size_t(nv), Tensor{});
  recompute_data_.assign(size_t(nv), Tensor{});
  slots_.assign(size_t(nv), {});
  for (int id = 0; id < nv; ++id) {
    const Value& v = graph_.value(id);
    if (v.kind == ValueKind::Activation || v.kind == ValueKind::Aux) continue;
    data_[size_t(id)] = Tensor::contiguous(arena_.at(persistent_offset[size_t(id) * 2]), v.shape, v.dtype);
    if (v.kind == ValueKind::Param) {
      grads_[size_t(id)] = Tensor::contiguous(arena_.at(persistent_offset[size_t(id) * 2 + 1]), v.shape, v.dtype);
      for (int s = 0; s < optimizer_slots_; ++s)
        slots_[size_t(id)].push_back(Tensor::contiguous(
            arena_.at(slot_offset[size_t(id)] + size_t(s) * Arena::align_up(bytes_of(v))), v.shape, v.dtype));
    }
  }
  for (size_t r = 0; r < req.size(); ++r) {
    const auto [id, role] = owner[r];
    const Value& v = graph_.value(id);
    Tensor t = Tensor::contiguous(arena_.at(act_base + mp.offsets[r]), v.shape, v.dtype);
    switch (role) {
      case Data: data_[size_t(id)] = t; break;
      case Grad: break;  // below: every value of the group gets a view with its own shape
      case Unpack: saved_index(id)->unpack = t; break;
      case Recompute: recompute_data_[size_t(id)] = t; break;
    }
  }
  // Death times of planned buffers, for release_pages. Time t maps back to the node that runs then.
  dies_after_forward_.assign(size_t(nn), {});
  dies_after_recompute_.assign(size_t(nn), {});
  dies_after_backward_.assign(size_t(nn), {});
  if (stash_options_.release_pages) {
    std::vector<std::pair<std::vector<Range>*, int>> at_time(size_t(t_end) + 1, {nullptr, -1});
    for (int n = 0; n < nn; ++n) {
      at_time[size_t(n)] = {&dies_after_forward_[size_t(n)], n};
      at_time[size_t(bwd_t[size_t(n)])] = {&dies_after_backward_[size_t(n)], n};
      if (rec_t[size_t(n)] >= 0) at_time[size_t(rec_t[size_t(n)])] = {&dies_after_recompute_[size_t(n)], n};
    }
    for (size_t r = 0; r < req.size(); ++r)
      if (req[r].last < t_end && at_time[size_t(req[r].last)].first)
        at_time[size_t(req[r].last)].first->push_back(Range{act_base + mp.offsets[r], req[r].bytes});
  }
  std::vector<void*> grad_memory(size_t(nv), nullptr);
  for (size_t r = 0; r < req.size(); ++r)
    if (owner[r].second == Grad) grad_memory[size_t(owner[r].first)] = arena_.at(act_base + mp.offsets[r]);
  for (int id = 0; id < nv; ++id) {
    const Value& v = graph_.value(id);
    if (v.needs_grad && v.kind == ValueKind::Activation)
      grads_[size_t(id)] = Tensor::contiguous(grad_memory[size_t(grad_root(id))], v.shape, v.dtype);
  }
  forward_data_ = data_;
  swapped_.clear();
  swapped_.reserve(size_t(nv));
  report_.recompute_segments = int(segments_.size());
  report_.recompute_nodes = int(std::count(reruns_.begin(), reruns_.end(), 1));
  workspace_ = Workspace{arena_.at(ws_base), report_.workspace};
  grad_written_.assign(size_t(nv), 0);
  stash_.configure(std::move(saved), nv, stash_options_.prune_threshold, stash_options_.release_pages);
  report_.stash_region = stash_.region_bytes();
  batch_ = max_batch;  // views have the full batch until a forward says otherwise
}

// Segments of checkpoint_every = m compute ops: each starts at a compute op (conv / linear) and runs
// until the next segment; the loss and what follows stay outside. A segment is kept only if it
// recomputes something the stash would otherwise hold.
void Executor::plan_segments(const std::vector<int>& first_saver, std::vector<int>* seg_of) {
  const int nn = graph_.num_nodes(), m = stash_options_.checkpoint_every;
  segments_.clear();
  seg_of->assign(size_t(nn), -1);
  if (m <= 0) return;
  std::vector<Segment> all;
  int computes = 0;
  for (int n = 0; n < nn; ++n) {
    const OpClass c = graph_.node(n).op->op_class();
    if (c == OpClass::Loss) break;
    if (c == OpClass::Compute && computes++ % m == 0) all.push_back(Segment{n, n, {}, {}, {}});
    if (!all.empty()) all.back().end = n;
  }
  if (computes < m)
    user_error("config key 'memory.checkpoint_every' = ", m, ": the model has only ", computes,
               " conv / linear layers, so no segment would be recomputed");
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

}  // namespace et
