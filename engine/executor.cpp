#include "engine/executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "memory/planner.h"

namespace et {

using Clock = std::chrono::steady_clock;

namespace {
uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

Executor::Executor(Graph& graph, Backend& backend, int optimizer_slots, const StashOptions& stash)
    : graph_(graph), backend_(backend), stash_options_(stash), optimizer_slots_(optimizer_slots) {
  plan();
}

Executor::~Executor() = default;

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

  // Time line: forward of node n at n, backward of node n at 2*nn - 1 - n.
  auto bwd_time = [&](int n) { return 2 * nn - 1 - n; };
  std::vector<BufferRequest> req;
  std::vector<std::pair<int, int>> owner;  // (value, 0 = data / 1 = grad / 2 = unpack) per request
  save_specs_.assign(size_t(nn), {});
  for (int n = 0; n < nn; ++n) save_specs_[size_t(n)] = graph_.node(n).op->saves();

  // Saved values: the first saving consumer pushes (its backward is the last reader and pops),
  // the last saving consumer's backward is the first reader.
  std::vector<int> first_saver(size_t(nv), -1), last_saver(size_t(nv), -1);
  std::vector<uint8_t> full(size_t(nv), 0);
  for (int n = 0; n < nn; ++n)
    for (const SaveSpec& sp : save_specs_[size_t(n)]) {
      const Node& node = graph_.node(n);
      const int id = sp.input < 0 ? node.output : node.inputs[size_t(sp.input)];
      if (first_saver[size_t(id)] < 0) first_saver[size_t(id)] = n;
      last_saver[size_t(id)] = n;
      full[size_t(id)] |= sp.kind == SaveKind::Full;
    }
  std::vector<StashFormat> format(size_t(nv), stash_options_.format);
  for (const auto& [layer, f] : stash_options_.layers) {
    const int id = graph_.find_value(layer);
    if (id < 0 || graph_.value(id).producer < 0)
      user_error("config key 'memory.layers.", layer, "': no layer of that name in the model");
    if (first_saver[size_t(id)] < 0)
      user_error("config key 'memory.layers.", layer, "': nothing saves the output of this layer for backward");
    format[size_t(id)] = f;
  }
  push_after_.assign(size_t(nn), {});
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
    push_after_[size_t(first_saver[size_t(id)])].push_back(id);
  }
  for (int n = 0; n < nn; ++n) pop_after_[size_t(n)].assign(push_after_[size_t(n)].rbegin(), push_after_[size_t(n)].rend());
  auto saved_index = [&](int id) -> SavedValue* {
    for (SavedValue& sv : saved)
      if (sv.value == id) return &sv;
    return nullptr;
  };

  size_t persistent = 0;
  std::vector<size_t> persistent_offset(size_t(nv) * 2, 0);
  std::vector<size_t> slot_offset(size_t(nv), 0);
  auto bytes_of = [&](const Value& v) { return size_t(v.shape.numel()) * dtype_size(v.dtype); };

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
        int last = v.kind == ValueKind::Aux ? bwd_time(p) : p;
        for (int c : v.consumers) last = std::max(last, c);
        const SavedValue* sv = saved_index(id);
        if (sv && sv->format == StashFormat::DenseF32) last = std::max(last, bwd_time(first_saver[size_t(id)]));
        if (id == graph_.logits || id == graph_.loss) last = 2 * nn;  // read by the trainer after the step
        req.push_back({bytes, p, last});
        owner.emplace_back(id, 0);
        if (v.needs_grad && v.kind == ValueKind::Activation) {
          int first = bwd_time(p);
          for (int c : v.consumers) first = std::min(first, bwd_time(c));
          req.push_back({bytes, first, bwd_time(p)});
          owner.emplace_back(id, 1);
        }
        if (sv && sv->full && sv->format != StashFormat::DenseF32) {
          req.push_back({bytes, bwd_time(last_saver[size_t(id)]), bwd_time(first_saver[size_t(id)])});
          owner.emplace_back(id, 2);
          report_.unpack += bytes;
        }
        break;
      }
    }
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
  arena_.reserve(report_.total, "the training step of this model");

  data_.assign(size_t(nv), Tensor{});
  grads_.assign(size_t(nv), Tensor{});
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
    if (role == 2)
      saved_index(id)->unpack = t;
    else
      (role == 1 ? grads_ : data_)[size_t(id)] = t;
  }
  workspace_ = Workspace{arena_.at(ws_base), report_.workspace};
  grad_written_.assign(size_t(nv), 0);
  stash_.configure(std::move(saved), nv, stash_options_.prune_threshold);
  report_.stash_region = stash_.region_bytes();
  batch_ = max_batch;  // views have the full batch until a forward says otherwise
}

void Executor::set_timing(bool on) {
  timing_ = on;
  fwd_s_.assign(size_t(graph_.num_nodes()), 0.0);
  bwd_s_.assign(size_t(graph_.num_nodes()), 0.0);
}

Tensor Executor::value(int id) const {
  const Value& v = graph_.value(id);
  return v.batched ? data_[size_t(id)].with_batch(batch_) : data_[size_t(id)];
}

Tensor Executor::grad(int id) const {
  const Value& v = graph_.value(id);
  return v.batched ? grads_[size_t(id)].with_batch(batch_) : grads_[size_t(id)];
}

Tensor Executor::opt_slot(int param_id, int slot) const { return slots_[size_t(param_id)][size_t(slot)]; }

float Executor::loss() const { return data_[size_t(graph_.loss)].f32()[0]; }

void Executor::forward(int64_t batch, bool training) {
  ET_CHECK(batch > 0 && batch <= graph_.batch_size(), "batch ", batch, " outside 1..", graph_.batch_size());
  batch_ = batch;
  training_ = training;
  if (training) stash_.clear();  // a forward without its backward leaves nothing behind
  for (int n = 0; n < graph_.num_nodes(); ++n) {
    OpContext ctx(*this, n);
    const auto t0 = timing_ ? Clock::now() : Clock::time_point{};
    graph_.node(n).op->forward(ctx);
    if (timing_) fwd_s_[size_t(n)] += std::chrono::duration<double>(Clock::now() - t0).count();
    if (!training) continue;
    for (int id : push_after_[size_t(n)]) stash_.push(id, value(id));
  }
}

void Executor::backward() {
  ET_CHECK(training_, "backward after an evaluation forward");
  std::fill(grad_written_.begin(), grad_written_.end(), 0);
  for (int n = graph_.num_nodes() - 1; n >= 0; --n) {
    const Node& node = graph_.node(n);
    if (needs_backward_[size_t(n)]) {
      OpContext ctx(*this, n);
      const auto t0 = timing_ ? Clock::now() : Clock::time_point{};
      node.op->backward(ctx);
      if (timing_) bwd_s_[size_t(n)] += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    for (int id : pop_after_[size_t(n)]) stash_.pop(id);
  }
}

uint64_t OpContext::seed() const { return mix64(ex_.step_seed_ ^ mix64(uint64_t(node_id_) + 1)); }

int OpContext::saved_value(int i) const {
  const SaveSpec& s = ex_.save_specs_[size_t(node_id_)][size_t(i)];
  return s.input < 0 ? node_.output : node_.inputs[size_t(s.input)];
}

Tensor OpContext::saved(int i) const { return ex_.stash_.get(saved_value(i)); }

MaskView OpContext::saved_mask(int i) const { return ex_.stash_.get_mask(saved_value(i)); }

GradOut OpContext::grad_input(int i) const {
  const int id = node_.inputs[size_t(i)];
  GradOut g;
  g.wanted = ex_.graph_.value(id).needs_grad;
  if (!g.wanted) return g;
  g.t = ex_.grad(id);
  g.accumulate = ex_.grad_written_[size_t(id)] != 0;
  // Asking for a wanted gradient commits the op to writing it, so a later request for the same
  // value (add(a, a), or another consumer) accumulates.
  ex_.grad_written_[size_t(id)] = 1;
  return g;
}

}  // namespace et
