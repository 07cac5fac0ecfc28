// Executor::plan_layout(), the last planning pass: where every buffer of a training step lives.
// Persistent buffers (params, gradients, optimizer slots, BN buffers, inputs) first; then every
// buffer with a lifetime on plan()'s time line (activations, their gradients, decode and recompute
// copies, operand buffers other passes ask for), packed by memory/planner.h; then the workspace.
// Also the plan's peak (edgetrain plan) and the pages released after their last use.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/executor.h"
#include "engine/executor_plan_state.h"
#include "memory/planner.h"

namespace et {
// Layout: persistent buffers first, then every buffer planned by lifetime (activations, their
// gradients, decode and recompute buffers, and `extra` ones other passes ask for) packed by the
// planner, then the workspace; maps the arena and makes every view.
void Executor::plan_layout(PlanState& st, const std::vector<PlannedBuffer>& extra) {
  plan_persistent(st);
  share_gradients_in_place(st);
  st.buffers = activation_buffers(st);
  st.buffers.insert(st.buffers.end(), extra.begin(), extra.end());
  place_buffers(st);
  bind_views(st);
}

// Params (value, gradient, optimizer slots), BN buffers and the inputs live for the whole run.
void Executor::plan_persistent(PlanState& st) {
  st.persistent = 0;
  st.data_offset.assign(size_t(st.nv), 0);
  st.grad_offset.assign(size_t(st.nv), 0);
  st.slot_offset.assign(size_t(st.nv), 0);
  for (int id = 0; id < st.nv; ++id) {
    const Value& v = graph_.value(id);
    const size_t bytes = Arena::align_up(size_t(v.shape.numel()) * dtype_size(v.dtype));
    switch (v.kind) {
      case ValueKind::Param:
        st.data_offset[size_t(id)] = st.persistent; st.persistent += bytes; report_.params += bytes;
        if (v.frozen) break;
        st.grad_offset[size_t(id)] = st.persistent; st.persistent += bytes; report_.grads += bytes;
        st.slot_offset[size_t(id)] = st.persistent; st.persistent += bytes * size_t(kOptimizerSlots);
        report_.optimizer += bytes * size_t(kOptimizerSlots);
        break;
      case ValueKind::Buffer:
        st.data_offset[size_t(id)] = st.persistent; st.persistent += bytes; report_.buffers += bytes;
        break;
      case ValueKind::Input:
        st.data_offset[size_t(id)] = st.persistent; st.persistent += bytes; report_.inputs += bytes;
        break;
      case ValueKind::Activation:
      case ValueKind::Aux: break;  // planned by lifetime
    }
  }
}

// Activation gradients shared in place (Op::grad_in_place): an input whose only consumer may
// overwrite the output gradient with it uses the output gradient's buffer; chains (conv -> bn ->
// relu) collapse to one buffer. grad_parent links a value to its consumer's output.
//
// Fan-in first: a node that hands its output gradient unchanged to several inputs (a residual
// add) lets all of them share it, so its backward copies nothing. An input may have other
// consumers if this node is its last one: its backward then runs first and starts the input's
// gradient, and the others (the block's first conv) accumulate into the shared buffer. While
// those accumulate, the buffer must still hold the add's gradient, so a member's producer may
// write its own input gradient into the buffer (the chain below it) only if its backward runs
// after every other member's producer and consumers: ResNet's trunk (the block input's ReLU)
// keeps the chain, the residual branch's last BN writes its input gradient to its own buffer.
void Executor::share_gradients_in_place(PlanState& st) {
  st.grad_parent.assign(size_t(st.nv), -1);
  std::vector<uint8_t> no_chain(size_t(st.nv), 0);  // a fan-in member its producer must not overwrite
  auto shareable = [&](const Node& node, size_t i) {
    const Value& v = graph_.value(node.inputs[i]);
    return v.kind == ValueKind::Activation && v.needs_grad &&
           v.shape.numel() == graph_.value(node.output).shape.numel() && node.op->grad_in_place(int(i), backend_);
  };
  auto backward_node = [&](int n) {
    return needs_backward_[size_t(n)] && graph_.value(graph_.node(n).output).kind == ValueKind::Activation;
  };
  for (int n = 0; n < st.nn; ++n) {
    if (!backward_node(n)) continue;
    const Node& node = graph_.node(n);
    std::vector<int> members;
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      const int in = node.inputs[i];
      const std::vector<int>& cons = graph_.value(in).consumers;
      if (shareable(node, i) && *std::max_element(cons.begin(), cons.end()) == n &&
          std::find(members.begin(), members.end(), in) == members.end())
        members.push_back(in);
    }
    if (members.size() < 2) continue;
    for (int u : members) {
      st.grad_parent[size_t(u)] = node.output;
      const int pu = graph_.value(u).producer;
      for (int w : members) {
        if (w == u) continue;
        bool after = pu < graph_.value(w).producer;  // u's backward after w's producer's ...
        for (int c : graph_.value(w).consumers) after = after && pu < c;  // ... and w's consumers'
        if (!after) no_chain[size_t(u)] = 1;
      }
    }
  }
  for (int n = 0; n < st.nn; ++n) {
    const Node& node = graph_.node(n);
    if (!backward_node(n) || no_chain[size_t(node.output)]) continue;
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      const int in = node.inputs[i];
      if (!shareable(node, i) || graph_.value(in).consumers.size() != 1 || st.grad_parent[size_t(in)] >= 0) continue;
      st.grad_parent[size_t(in)] = node.output;
      break;  // one input per node shares the output gradient
    }
  }
}

// The buffers of activations and aux values, their recomputed copies, decode buffers, and one
// gradient buffer per in-place group, each with its lifetime on the time line.
std::vector<Executor::PlannedBuffer> Executor::activation_buffers(PlanState& st) {
  using Role = PlannedBuffer::Role;
  const std::vector<int>& bwd_t = st.bwd_t;
  const std::vector<int>& rec_t = st.rec_t;
  struct GradSpan { int first = INT32_MAX, last = -1; size_t bytes = 0; };
  std::vector<GradSpan> grad_span(static_cast<size_t>(st.nv));
  std::vector<PlannedBuffer> out;
  end_decode_after_.assign(size_t(st.nn), {});
  end_decode_after_recompute_.assign(size_t(st.nn), {});
  auto add = [&](size_t bytes, int first, int last, int id, Role role) {
    out.push_back(PlannedBuffer{BufferRequest{bytes, first, last}, id, role, 0});
  };
  for (int id = 0; id < st.nv; ++id) {
    const Value& v = graph_.value(id);
    if (v.kind != ValueKind::Activation && v.kind != ValueKind::Aux) continue;
    const size_t bytes = Arena::align_up(size_t(v.shape.numel()) * dtype_size(v.dtype));
    const int p = v.producer;
    const bool rec = st.recomputed[size_t(id)] != 0;
    const SavedValue* sv = st.saved_of(id);
    const bool zero_copy = sv && sv->stored_in_place();
    // Aux values (BN batch statistics) keep one buffer; a recompute rewrites the same values.
    // Forward-only ones (plane sums for a fused stack) die after their last reader.
    if (v.backward_only) {  // from its first reader's backward (they come before p's) to p's
      ET_CHECK(v.kind == ValueKind::Aux && !rec && !sv && !v.forward_only, "value ", v.name, ": backward only, but kept");
      int first = bwd_t[size_t(p)];
      for (int c : v.consumers) first = std::min(first, bwd_t[size_t(c)]);
      add(bytes, first, bwd_t[size_t(p)], id, Role::Data);
      continue;
    }
    int last = v.kind == ValueKind::Aux && !v.forward_only ? bwd_t[size_t(p)] : p;
    for (int c : v.consumers) last = std::max(last, c);
    last = std::max(last, st.read_through[size_t(id)]);
    if (zero_copy && !rec) last = std::max(last, bwd_t[size_t(st.first_saver[size_t(id)])]);
    if (id == graph_.logits || id == graph_.loss) last = st.t_end;  // read by the trainer after the step
    if (!by_readers_[size_t(id)]) add(bytes, p, last, id, Role::Data);
    if (st.rewritten[size_t(id)]) {
      // The recomputed copy: read by the segment's own nodes, and by backward if saved in place.
      int rec_last = rec_t[size_t(p)];
      for (int c : v.consumers)
        if (st.seg_of[size_t(c)] == st.seg_of[size_t(p)] && reruns_[size_t(c)]) rec_last = std::max(rec_last, rec_t[size_t(c)]);
      if (zero_copy && rec) rec_last = std::max(rec_last, bwd_t[size_t(st.first_saver[size_t(id)])]);
      add(bytes, rec_t[size_t(p)], rec_last, id, Role::Recompute);
      report_.recompute += bytes;
    }
    if (v.needs_grad && v.kind == ValueKind::Activation) {
      // Lifetimes of a shared gradient buffer merge into its root's request (below).
      GradSpan& g = grad_span[size_t(st.grad_root(id))];
      g.first = std::min(g.first, bwd_t[size_t(p)]);
      for (int c : v.consumers) g.first = std::min(g.first, bwd_t[size_t(c)]);
      g.last = std::max(g.last, bwd_t[size_t(p)]);
      g.bytes = bytes;
    }
    if (st.needs_unpack[size_t(id)]) {
      // Decoded by its first reader that reads f32: the latest such saver's backward, or a
      // recomputed segment (recompute() decodes a segment's external inputs before its first node
      // runs). It ends with the last such read, a saver's backward or a segment's rerun, where
      // the stash stops it (end_decode_after_); recomputed values keep the savers' whole span.
      const int from = st.decode_from[size_t(id)], until = st.decode_until[size_t(id)];
      int first = bwd_t[size_t(from >= 0 ? from : st.last_saver[size_t(id)])];
      int last = until >= 0 ? bwd_t[size_t(until)] : -1, end_segment = -1;
      for (int c : v.consumers)
        if (const int sc = st.seg_of[size_t(c)]; sc >= 0 && sc != st.seg_of[size_t(p)] && reruns_[size_t(c)]) {
          first = std::min(first, rec_t[size_t(segments_[size_t(sc)].begin)]);
          if (rec_t[size_t(c)] > last) last = rec_t[size_t(c)], end_segment = sc;
        }
      if (last < 0) {
        last = bwd_t[size_t(st.first_saver[size_t(id)])];
      } else if (end_segment >= 0) {
        end_decode_after_recompute_[size_t(segments_[size_t(end_segment)].end)].push_back(id);
      } else if (until != st.first_saver[size_t(id)]) {
        end_decode_after_[size_t(until)].push_back(id);
      }
      add(bytes, first, last, id, Role::Unpack);
      report_.unpack += bytes;
    }
  }
  for (int id = 0; id < st.nv; ++id)
    if (grad_span[size_t(id)].last >= 0)
      add(grad_span[size_t(id)].bytes, grad_span[size_t(id)].first, grad_span[size_t(id)].last, id, Role::Grad);
  return out;
}

// Packs the lifetime-planned buffers (memory/planner.h) after the persistent ones, the workspace
// after them, and maps the arena.
void Executor::place_buffers(PlanState& st) {
  size_t ws = 0;
  for (int n = 0; n < st.nn; ++n) ws = std::max(ws, graph_.node(n).op->workspace_bytes(backend_, st.max_batch));
  ws = std::max(ws, quant_workspace_);
  report_.workspace = Arena::align_up(ws);

  std::vector<BufferRequest> requests;
  requests.reserve(st.buffers.size());
  for (const PlannedBuffer& b : st.buffers) requests.push_back(b.request);
  const MemoryPlan mp = plan_memory(requests);
  report_.activations_planned = mp.total_bytes;
  report_.activations_unplanned = mp.sum_bytes;
  const size_t act_base = st.persistent;
  for (size_t r = 0; r < st.buffers.size(); ++r) st.buffers[r].offset = act_base + mp.offsets[r];
  st.workspace_offset = act_base + mp.total_bytes;
  report_.total = st.workspace_offset + report_.workspace;
  find_activation_peak(st, live_bytes(requests));

  // Named in the out-of-memory message: the layer with the largest planned buffer.
  size_t largest = 0;
  int largest_id = -1;
  for (const PlannedBuffer& b : st.buffers)
    if (b.request.bytes > largest) largest = b.request.bytes, largest_id = b.value;
  std::string what = "the training step of this model (parameters, optimizer state and inputs " + std::to_string(st.persistent) + " bytes, activations " +
                     std::to_string(mp.total_bytes) + ", workspace " + std::to_string(report_.workspace) + ")";
  if (largest_id >= 0)
    what += "; its largest buffer is layer '" + graph_.value(largest_id).name + "' output, " +
            std::to_string(largest) + " bytes";
  what += kMemoryBudgetHint;
  // The stash region's message likewise: what it keeps, its largest layer and the way out.
  const SavedValue* largest_saved = nullptr;
  int kept = 0;
  for (const SavedValue& v : st.saved) {
    if (v.recomputed) continue;
    ++kept;
    if (!largest_saved || v.numel > largest_saved->numel) largest_saved = &v;
  }
  std::string stash_what = "the activation stash (" + std::to_string(kept) + " saved activations";
  if (largest_saved)
    stash_what += "; the largest, layer '" + graph_.value(largest_saved->value).name + "' output, " +
                  std::to_string(largest_saved->numel) + " values in " + stash_format_name(largest_saved->format);
  stash_.set_region_name(stash_what + ")" + kMemoryBudgetHint);
  // On transparent huge pages where the pages stay (not under memory.release_pages, whose
  // releases would split them and whose USS would count 2 MiB at a time). With 4 KiB pages a
  // kernel that walks many planes at once (a Winograd image: 16 planes of 4 KiB in, 16 out) misses
  // the TLB on most of them, and where the pages land in the physically indexed L2 changes from
  // run to run: ResNet-20's convs took up to 7 % longer in one process than in the next, the fused
  // and unfused steps' ratio swung between 1.04x and 1.13x, and the step was 2 % slower (session
  // 49). Peak USS did not change (the step touches all of the arena).
  if (plan_only_) return arena_.plan(report_.total, backend_.memory());
  arena_.reserve(report_.total, what, backend_.memory(), !stash_options_.release_pages);
}

// alive: the planned buffers' bytes alive at each time step (memory/planner.h, live_bytes).
void Executor::find_activation_peak(const PlanState& st, const std::vector<size_t>& alive) {
  using Role = PlannedBuffer::Role;
  peak_ = ActivationPeak{};
  if (alive.empty()) return;
  const int t = int(std::max_element(alive.begin(), alive.end()) - alive.begin());
  peak_.alive_bytes = alive[size_t(t)];
  for (int n = 0; n < st.nn; ++n) {
    const std::string& name = graph_.node(n).name;
    if (n == t) peak_.when = "forward of " + name;
    if (st.rec_t[size_t(n)] == t) peak_.when = "recompute of " + name;
    if (st.bwd_t[size_t(n)] == t) peak_.when = "backward of " + name;
  }
  if (peak_.when.empty()) peak_.when = "after the step";  // the trainer's reads of the loss and logits
  for (const PlannedBuffer& b : st.buffers) {
    if (b.request.first > t || t > b.request.last || b.request.bytes == 0) continue;
    const char* role = b.role == Role::Data        ? "output"
                       : b.role == Role::Grad      ? "gradient"
                       : b.role == Role::Unpack    ? "decoded"
                       : b.role == Role::Recompute ? "recomputed"
                                                   : "operand";
    peak_.buffers.push_back({b.value >= 0 ? graph_.value(b.value).name : std::string("?"), role, b.request.bytes});
  }
  std::stable_sort(peak_.buffers.begin(), peak_.buffers.end(),
                   [](const ActivationPeak::Buffer& a, const ActivationPeak::Buffer& b) { return a.bytes > b.bytes; });
}

// Views into the arena: values, gradients, optimizer slots, recompute and decode buffers, workspace.
void Executor::bind_views(PlanState& st) {
  using Role = PlannedBuffer::Role;
  const int nv = st.nv;
  data_.assign(size_t(nv), Tensor{});
  grads_.assign(size_t(nv), Tensor{});
  recompute_data_.assign(size_t(nv), Tensor{});
  slots_.assign(size_t(nv), {});
  for (int id = 0; id < nv; ++id) {
    const Value& v = graph_.value(id);
    if (v.kind == ValueKind::Activation || v.kind == ValueKind::Aux) continue;
    data_[size_t(id)] = Tensor::contiguous(arena_.at(st.data_offset[size_t(id)]), v.shape, v.dtype);
    if (v.kind == ValueKind::Param && !v.frozen) {
      grads_[size_t(id)] = Tensor::contiguous(arena_.at(st.grad_offset[size_t(id)]), v.shape, v.dtype);
      const size_t slot_bytes = Arena::align_up(size_t(v.shape.numel()) * dtype_size(v.dtype));
      for (int s = 0; s < kOptimizerSlots; ++s)
        slots_[size_t(id)].push_back(
            Tensor::contiguous(arena_.at(st.slot_offset[size_t(id)] + size_t(s) * slot_bytes), v.shape, v.dtype));
    }
  }
  std::vector<void*> grad_memory(size_t(nv), nullptr);
  for (const PlannedBuffer& b : st.buffers) {
    const Value& v = graph_.value(b.value);
    const Tensor t = Tensor::contiguous(arena_.at(b.offset), v.shape, v.dtype);
    switch (b.role) {
      case Role::Data: data_[size_t(b.value)] = t; break;
      // Below: every value of the group gets a view with its own shape.
      case Role::Grad: grad_memory[size_t(b.value)] = t.data; break;
      case Role::Unpack: st.saved_of(b.value)->unpack = t; break;
      case Role::Recompute: recompute_data_[size_t(b.value)] = t; break;
      case Role::Extra: break;  // bound by the pass that asked for it
    }
  }
  for (int id = 0; id < nv; ++id) {
    const Value& v = graph_.value(id);
    if (v.needs_grad && v.kind == ValueKind::Activation)
      grads_[size_t(id)] = Tensor::contiguous(grad_memory[size_t(st.grad_root(id))], v.shape, v.dtype);
    if (by_readers_[size_t(id)])  // its producer's forward fills the source
      data_[size_t(id)] = Tensor::contiguous(&affine_sources_[size_t(id)], v.shape, DType::AffineRelu);
  }
  forward_data_ = data_;
  swapped_.clear();
  swapped_.reserve(size_t(nv));
  workspace_ = Workspace{arena_.at(st.workspace_offset), report_.workspace};
  grad_written_.assign(size_t(nv), 0);
}

// Death times of planned buffers, for release_pages. Time t maps back to the node that runs then.
void Executor::plan_page_release(const PlanState& st) {
  const int nn = st.nn;
  dies_after_forward_.assign(size_t(nn), {});
  dies_after_recompute_.assign(size_t(nn), {});
  dies_after_backward_.assign(size_t(nn), {});
  if (!stash_options_.release_pages) return;
  std::vector<std::pair<std::vector<Range>*, int>> at_time(size_t(st.t_end) + 1, {nullptr, -1});
  for (int n = 0; n < nn; ++n) {
    at_time[size_t(n)] = {&dies_after_forward_[size_t(n)], n};
    at_time[size_t(st.bwd_t[size_t(n)])] = {&dies_after_backward_[size_t(n)], n};
    if (st.rec_t[size_t(n)] >= 0) at_time[size_t(st.rec_t[size_t(n)])] = {&dies_after_recompute_[size_t(n)], n};
  }
  for (const PlannedBuffer& b : st.buffers)
    if (b.request.last < st.t_end && at_time[size_t(b.request.last)].first)
      at_time[size_t(b.request.last)].first->push_back(Range{b.offset, b.request.bytes});
}

}  // namespace et
