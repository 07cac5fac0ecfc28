// Executor: runs forward, recomputed segments and backward over the planned buffers (executor_plan.cpp).
#include "engine/executor.h"

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <cstring>

#include "quant/codes.h"

namespace et {

using Clock = std::chrono::steady_clock;

namespace {
// A timed profile's clock: after the backend's queued work, so an op's time is its own on a GPU.
Clock::time_point tick(bool timing, Backend& backend) {
  if (!timing) return {};
  backend.synchronize();
  return Clock::now();
}

}  // namespace

Executor::Executor(Graph& graph, Backend& backend, const StashOptions& stash, const QuantOptions& quant)
    : graph_(graph), backend_(backend), stash_options_(stash), quant_options_(quant) {
  plan();
}

Executor::Executor(Graph& graph, Backend& backend, const StashOptions& stash, const QuantOptions& quant, PlanOnly)
    : graph_(graph), backend_(backend), stash_options_(stash), plan_only_(true), quant_options_(quant) {
  plan();
}

Executor::~Executor() = default;

void Executor::set_timing(bool on) {
  timing_ = on;
  rec_s_ = quant_s_ = 0;
  stash_.set_timing(on);
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

std::vector<Tensor> Executor::state_tensors() const {
  std::vector<Tensor> out;
  for (int p : graph_.params()) out.push_back(data_[size_t(p)]);  // frozen ones too
  for (int p : params_) {
    out.push_back(grads_[size_t(p)]);
    for (const Tensor& t : slots_[size_t(p)]) out.push_back(t);
  }
  for (int b : graph_.buffers()) out.push_back(data_[size_t(b)]);
  return out;
}

float Executor::loss() const {
  const Tensor& t = data_[size_t(graph_.loss)];
  if (backend_.host_addressable()) return t.f32()[0];
  ET_CHECK(t.numel() == 1 && t.dtype == DType::F32);
  float l = 0.f;
  backend_.copy_to_host(t, &l);
  return l;
}

bool Executor::fit_stash_room() {
  if (stash_.overflowed() >= 0) {
    stash_.fit(stash_options_.room_headroom);
    ++room_grown_;
    return true;
  }
  if (stash_.wants_fit()) stash_.fit(stash_options_.room_headroom);
  return false;
}

void Executor::forward(int64_t batch, bool training) {
  ET_CHECK(!plan_only_, "a plan-only executor runs no step");
  ET_CHECK(batch > 0 && batch <= graph_.batch_size(), "batch ", batch, " outside 1..", graph_.batch_size());
  batch_ = batch;
  training_ = training;
  if (training) stash_.clear();  // a forward without its backward leaves nothing behind
  if (Tensor flag = quant_flag_word(); flag.defined()) backend_.fill(flag, 0.f);  // covers this pass and its backward
  restore_views();
  try {
    forward_nodes(training);
  } catch (...) {
    recover();
    throw;
  }
}

void Executor::replayed(int64_t batch) {
  ET_CHECK(batch > 0 && batch <= graph_.batch_size(), "batch ", batch, " outside 1..", graph_.batch_size());
  batch_ = batch;
  training_ = true;
  restore_views();
  stash_.replayed();
}

// An op threw mid-step (a quantizer's NonFiniteError): views may still point at recompute buffers
// or into the stash. Puts every view back as planned, so the next step (a divergence guard's
// re-run, a rollback) starts clean. Never on the normal path.
void Executor::recover() {
  data_ = forward_data_;  // equal sizes: element-wise assignment, no allocation
  swapped_.clear();
  recomputing_ = false;
  stash_.abandon();  // (the throw may come from values a push had no room for: fit() follows)
}

void Executor::forward_nodes(bool training) {
  for (int n = 0; n < graph_.num_nodes(); ++n) {
    OpContext ctx(*this, n);
    const auto& pushes = push_after_[size_t(n)];
    // The output goes to the stash first: an op may write its bitmap there as it computes it.
    const bool own_first = training && !pushes.empty() && pushes.front() == graph_.node(n).output;
    if (own_first) ctx.mask_ = stash_.mask_target(pushes.front(), value(pushes.front()).numel());
    const auto t0 = tick(timing_, backend_);
    graph_.node(n).op->forward(ctx);
    if (timing_) fwd_s_[size_t(n)] += std::chrono::duration<double>(tick(timing_, backend_) - t0).count();
    if (training)
      for (int id : pushes)  // bitmap_int4 pushes the codes this node computed from its input
        stash_.push(id, value(id), own_first && id == pushes.front() ? ctx.mask_ : MaskOut{},
                    stash_.stores_codes(id) ? ctx.quant_operand(QuantSlot::X) : Tensor{});
    if (training) release(dies_after_forward_[size_t(n)]);  // eval forwards read logits only
    if (observer_) observer_->after_forward(n);
  }
}

std::vector<int> Executor::stashed_by(int node) const {
  std::vector<int> ids = push_after_[size_t(node)];
  ids.insert(ids.end(), push_after_recompute_[size_t(node)].begin(), push_after_recompute_[size_t(node)].end());
  return ids;
}

void Executor::release(const std::vector<Range>& ranges) {
  for (const Range& r : ranges) arena_.release(r.offset, r.bytes);
}

void Executor::restore_views() {
  for (int id : swapped_) data_[size_t(id)] = forward_data_[size_t(id)];
  swapped_.clear();
}

// Runs again the nodes of a segment that plan_segments marked: their values go to recompute
// buffers, what they read from earlier segments comes from the stash, and what the segment's ops
// save is pushed now instead of in forward.
void Executor::recompute(const Segment& s) {
  const auto t0 = tick(timing_, backend_);
  for (int id : s.outputs) {
    data_[size_t(id)] = recompute_data_[size_t(id)];
    swapped_.push_back(id);  // capacity: every value at most once per backward
  }
  for (int id : s.external) data_[size_t(id)] = stash_.get(id).with_batch(graph_.value(id).shape[0]);
  recomputing_ = true;
  for (int n = s.begin; n <= s.end; ++n) {
    if (reruns_[size_t(n)]) {
      OpContext ctx(*this, n);
      graph_.node(n).op->forward(ctx);
    }
    for (int id : push_after_recompute_[size_t(n)]) stash_.push(id, value(id));
    release(dies_after_recompute_[size_t(n)]);
  }
  recomputing_ = false;
  for (int id : s.external) data_[size_t(id)] = forward_data_[size_t(id)];
  if (timing_) rec_s_ += std::chrono::duration<double>(tick(timing_, backend_) - t0).count();
}

void Executor::backward() {
  ET_CHECK(!plan_only_, "a plan-only executor runs no step");
  ET_CHECK(training_, "backward after an evaluation forward");
  try {
    backward_nodes();
  } catch (...) {
    recover();
    throw;
  }
}

void Executor::backward_nodes() {
  std::fill(grad_written_.begin(), grad_written_.end(), 0);
  for (int n = graph_.num_nodes() - 1; n >= 0; --n) {
    const Node& node = graph_.node(n);
    if (const int s = segment_ending_at_[size_t(n)]; s >= 0) {
      recompute(segments_[size_t(s)]);
      for (int id : end_decode_after_recompute_[size_t(n)]) stash_.end_decode(id);
    }
    if (observer_) observer_->before_backward(n);
    if (needs_backward_[size_t(n)]) {
      OpContext ctx(*this, n);
      const auto t0 = tick(timing_, backend_);
      node.op->backward(ctx);
      if (timing_) bwd_s_[size_t(n)] += std::chrono::duration<double>(tick(timing_, backend_) - t0).count();
    }
    for (int id : end_decode_after_[size_t(n)]) stash_.end_decode(id);
    for (int id : pop_after_[size_t(n)]) stash_.pop(id);
    release(dies_after_backward_[size_t(n)]);
    if (observer_) observer_->after_backward(n);
  }
  restore_views();
}

DropoutSeed OpContext::dropout_seed() const {
  DropoutSeed s;
  s.step = ex_.step_seed_;
  s.node = quant::mix64(uint64_t(node_.seed_index) + 1);
  return s;
}

uint64_t OpContext::seed() const {
  const DropoutSeed s = dropout_seed();
  return quant::mix64(s.step ^ s.node);
}

int OpContext::saved_value(int i) const {
  const SaveSpec& s = ex_.save_specs_[size_t(node_id_)][size_t(i)];
  return s.input < 0 ? node_.output : node_.inputs[size_t(s.input)];
}

Tensor OpContext::saved(int i) const { return ex_.stash_.get(saved_value(i)); }

Tensor OpContext::saved(int i, DTypeSet accepted) const {
  const int id = saved_value(i);
  if (ex_.stash_.recomputed(id)) {
    if (!ex_.stash_.affine_relu(id) || !dtype_in(DType::AffineRelu, accepted)) return ex_.stash_.get(id);
    // Computed by the reader as it reads: the producer says from what.
    const int p = ex_.graph_.value(id).producer;
    AffineReluSource& src = ex_.affine_sources_[size_t(id)];
    float* k = ex_.affine_coefficients_[size_t(id)];
    OpContext producer(ex_, p);
    ex_.graph_.node(p).op->describe_output(producer, src, k, k + ex_.graph_.value(id).shape[1]);
    return affine_relu_tensor(src);
  }
  Tensor t = ex_.stash_.get_stored(id);
  return dtype_in(t.dtype, accepted) ? t : ex_.stash_.get(id);
}

MaskView OpContext::saved_mask(int i) const { return ex_.stash_.get_mask(saved_value(i)); }

bool OpContext::saved_computed_by_readers(int i) const {
  const int id = saved_value(i);
  return ex_.stash_.recomputed(id) && ex_.stash_.affine_relu(id);
}

Tensor OpContext::held_in_place(int value_id) const { return ex_.stash_.held_in_place(value_id); }

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
