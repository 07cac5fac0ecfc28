// Executor: runs a Graph on a Backend. On construction it plans every buffer of a training step
// (params, gradients, optimizer slots, activations, activation gradients, decode and recompute
// buffers, workspace) into one arena (executor_plan.cpp, executor_layout.cpp), so a step allocates nothing. Forward
// runs nodes in order and pushes what each op saves into the stash (memory/stash.h) in its
// planned format; backward runs them in reverse with dL/dloss = 1, reading the stash, after
// running each recompute segment's forward again (checkpoint_every).
#pragma once
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "engine/graph.h"
#include "memory/arena.h"
#include "memory/stash.h"
#include "quant/policy.h"

namespace et {

// How the executor keeps activations for backward (docs/config.md, memory.*).
struct StashOptions {
  StashFormat format = StashFormat::DenseF32;
  std::vector<std::pair<std::string, StashFormat>> layers;  // per-layer overrides, by layer name
  float prune_threshold = 0.f;                              // BitTrain activation pruning (lossy)
  // Recomputation (memory.checkpoint_every = m): the graph splits into segments of m compute ops
  // (conv / linear) with the element-wise ops after them; what a segment produces and uses only
  // inside itself is not kept from the forward, the segment's forward runs again before its backward.
  int checkpoint_every = 0;
  // Which of those segments (Executor::candidate_segments, in node order) run again: one flag per
  // candidate; empty = all of them. The memory budget's planner (engine/budget.h) picks them.
  std::vector<uint8_t> segments;
  // Hand each planned buffer's pages and the stash's freed pages back to the OS when they die
  // (memory.release_pages), so USS follows what is live; costs page faults in the next step.
  bool release_pages = false;
  // memory.recompute_stack_outputs: outputs whose producer can recompute them from what it saves
  // itself (Op::recompute_output) are not kept; their readers' backward gets them recomputed.
  // Not with recompute segments (checkpoint_every), which already choose what is kept.
  bool recompute_stack_outputs = false;
  // memory.stash_headroom: in the stash's fixed layout (a GPU's, memory/stash.h), each bitmap entry's
  // room over the most it has kept, as a fraction; negative: every entry keeps its worst case.
  double room_headroom = 0.02;
  // Until the first fit, each such entry has room for this share of its elements, not its worst
  // case (negative: the worst case), so the region never takes the worst case. Set only where the
  // caller runs Executor::fit_stash_room after every training backward: the trainer, bench step and
  // memprofile (Config::stash_options: 0.5 while memory.stash_headroom >= 0).
  double first_room = -1;
};

// The operand buffers a quantized conv / linear node gets in the plan (executor_quant.cpp):
// X, W: the INT4 codes of input and weight, written by the forward, read by the backward;
// G: the FP4 codes of the output gradient (backward only); XF, WF, GF: f32 dequantised copies for
// the float kernels of the paths without an integer kernel (depthwise, FP32 backward).
enum class QuantSlot : uint8_t { X, W, G, XF, WF, GF };
constexpr int kQuantSlots = 6;
// Where the backend keeps the 4-bit scales in its memory (Backend::quant_scales_in_memory), per
// quantized node: X's, W's and G's (FP4 alpha) scales, and G's per SMP sample (alpha / smp).
enum class ScaleSlot : uint8_t { X, W, G, GSample };
constexpr int kScaleSlots = 4;
// What a quantizer met a non-finite value in (its message: OpContext::nonfinite_message).
enum class NonFiniteOperand : uint8_t { Input, Weight, OutputGradient };

// Per-node hook for profilers (edgetrain memprofile): called after each node's forward / backward.
class NodeObserver {
 public:
  virtual ~NodeObserver() = default;
  virtual void after_forward(int node) = 0;
  virtual void before_backward(int node) {}  // after a recompute ending at this node, if any
  virtual void after_backward(int node) = 0;
};

struct MemoryReport {
  size_t params = 0, grads = 0, optimizer = 0, inputs = 0, buffers = 0;
  size_t activations_planned = 0;    // peak of the lifetime plan (activations, aux, activation grads)
  size_t activations_unplanned = 0;  // what they would take without reuse
  size_t workspace = 0;
  size_t unpack = 0;             // decode buffers for compressed saves (inside the planned part)
  size_t stash_dense_bytes = 0;  // what the saved values take as dense fp32 (the baseline)
  size_t stash_region = 0;       // virtual size reserved for the stash (worst case)
  size_t recompute = 0;          // buffers of recomputed values (inside the planned part)
  size_t quant_operands = 0;     // 4-bit operand buffers (codes, dequantised copies; inside the planned part)
  int recompute_segments = 0;    // segments whose forward runs again in backward
  int recompute_nodes = 0;       // nodes of those segments that run again (the rest are kept)
  size_t total = 0;
};

// The time step of the activation plan with the most bytes alive at once, and what is alive there:
// a plan larger than alive_bytes is what the packing loses (`edgetrain plan` prints both).
struct ActivationPeak {
  struct Buffer {
    std::string value;  // the value's name
    const char* role;   // output, gradient, decoded, recomputed, operand
    size_t bytes;
  };
  size_t alive_bytes = 0;
  std::string when;             // "forward of conv1", "backward of ...", "recompute of ..."
  std::vector<Buffer> buffers;  // alive then, largest first
};

class Executor {
 public:
  // Persistent per-parameter buffers of the optimizer: SGD's momentum (engine/train/optimizer.h).
  static constexpr int kOptimizerSlots = 1;

  Executor(Graph& graph, Backend& backend, const StashOptions& stash = {}, const QuantOptions& quant = {});
  // Planned, nothing allocated (the arena, the stash region, the coefficients and scales): the plan's
  // report, saves and schedule for a planner weighing candidates (engine/budget.h) on a device whose
  // memory may not hold them all; it runs no step.
  struct PlanOnly {};
  Executor(Graph& graph, Backend& backend, const StashOptions& stash, const QuantOptions& quant, PlanOnly);
  ~Executor();

  Graph& graph() { return graph_; }
  const Graph& graph() const { return graph_; }
  Backend& backend() const { return backend_; }

  // Runs the forward pass for the first `batch` samples of the inputs (batch <= graph batch size).
  void forward(int64_t batch, bool training);
  void backward();
  // After the backend replayed a recorded training step of `batch` (engine/step_replay.h): the
  // views take that batch again, as after forward(batch, true) and backward().
  void replayed(int64_t batch);

  Tensor value(int id) const;  // current view (batch applied)
  Tensor grad(int id) const;
  Tensor opt_slot(int param_id, int slot) const;
  const std::vector<int>& params() const { return params_; }  // the trained ones: Graph::params() less frozen
  // Their gradients, in the same order (the divergence guard checks them in one pass).
  const std::vector<Tensor>& param_grads() const { return param_grads_; }
  // Each trained parameter with its gradient and momentum (opt_slot 0), in params() order.
  const std::vector<SgdSlot>& sgd_slots() const { return sgd_slots_; }
  // What a step carries to the next, in a fixed order: params (frozen too), the trained ones'
  // gradients and optimizer slots, buffers (BN running statistics). Copying them between two executors of one graph moves
  // the training state across a re-plan (the trainer's switch to FNT).
  std::vector<Tensor> state_tensors() const;
  float loss() const;

  void set_step_seed(uint64_t s) {
    step_seed_ = s;
    backend_.set_step_seed(s);
  }
  // Per-node wall time of forward / backward, accumulated while enabled (seconds).
  void set_timing(bool on);
  const std::vector<double>& forward_seconds() const { return fwd_s_; }
  const std::vector<double>& backward_seconds() const { return bwd_s_; }
  double recompute_seconds() const { return rec_s_; }  // forward time spent recomputing (timing on)
  double quantize_seconds() const { return quant_s_; }  // 4-bit training: time in the quantizers (timing on)
  void set_observer(NodeObserver* o) { observer_ = o; }
  // The training step number (error messages of the quantizers name it).
  void set_step(int64_t step) { step_ = step; }
  // The training steps that follow run a step again on the same batch (the stash's room grew,
  // memory/stash.h): their forward leaves the BN running statistics as the first run left them.
  void set_repeating(bool on) { repeating_ = on; }
  int64_t step() const { return step_; }
  // Per node: what it does in 4 bits (docs/quant.md); all off without a quant config.
  const LayerQuant& layer_quant(int node) const { return quant_[size_t(node)]; }
  const MemoryReport& memory() const { return report_; }
  const ActivationPeak& activation_peak() const { return peak_; }
  size_t arena_resident_bytes() const { return arena_.resident_bytes(); }  // of memory().total
  Stash& stash() { return stash_; }
  // After a training step's backward (or a throw in it), before its update, outside the next step:
  // the stash's room in its fixed layout (memory/stash.h). Returns true when the step kept more of
  // a value than its room: the room has grown, and the step must run again on the same batch
  // (set_repeating) before its update. Else fits the room to the step the first time.
  bool fit_stash_room();
  // Backend::quant_scales_in_memory: throws the NonFiniteError a quantizer would have thrown where
  // one met a non-finite operand in this step's forward or backward (one read of the flag, which
  // each forward clears); nothing otherwise. The trainer calls it after the backward, and before
  // reporting a diverged loss (so the cause is the quantizer's, as where it throws at once).
  void check_quant_finite();
  int stash_room_grown() const { return room_grown_; }  // steps run again so far
  const Stash& stash() const { return stash_; }
  // Whether the readers of this value compute it in forward too (no buffer: plan_forward_by_readers).
  bool computed_by_readers(int value) const { return by_readers_[size_t(value)] != 0; }
  int64_t batch() const { return batch_; }
  // Values the stash takes after node n's forward (or its recompute), for profiles.
  std::vector<int> stashed_by(int node) const;
  // Those of them pushed by a recompute in backward (alive only until their reader's backward).
  const std::vector<int>& recomputed_by(int node) const { return push_after_recompute_[size_t(node)]; }
  // Whether node n's forward runs again in a recompute (checkpoint_every).
  bool reruns(int node) const { return !reruns_.empty() && reruns_[size_t(node)] != 0; }
  // The recompute segments checkpoint_every = m cuts the graph into (node ranges, inclusive), before
  // StashOptions::segments selects among them and before those with nothing to recompute drop out.
  static std::vector<std::pair<int, int>> candidate_segments(const Graph& g, int m);
  // The stash's pushes and pops over one training step, in order (push: value is pushed; else popped):
  // what a memory prediction replays with its own sizes (engine/budget.cpp).
  struct StashEvent {
    bool push;
    int value;
  };
  std::vector<StashEvent> stash_schedule() const;

 private:
  friend class OpContext;
  // A run of nodes whose forward runs again just before its backward (checkpoint_every).
  struct Segment {
    int begin = 0, end = 0;        // node range, inclusive
    std::vector<int> outputs;      // activations its rerun nodes write: recomputed into their own buffers
    std::vector<int> inside;       // the outputs only used inside: not kept from the first forward
    std::vector<int> external;     // activations from before the segment it reads: from the stash
  };
  // Planning passes (executor_plan.cpp; the layout: executor_layout.cpp), run in order by plan() over one PlanState.
  struct PlanState;
  struct PlannedBuffer;
  void plan();
  void plan_needs_backward();
  void plan_saves(PlanState& st);
  void plan_segments(const std::vector<int>& first_saver, std::vector<int>* seg_of);
  void plan_code_saves(PlanState& st);
  void plan_code_segments(PlanState& st);
  std::vector<StashFormat> stash_formats(const PlanState& st) const;
  void plan_recomputed_outputs(PlanState& st);
  void plan_forward_by_readers(PlanState& st);
  void plan_decode_buffers(PlanState& st);
  void plan_time_line(PlanState& st);
  void plan_layout(PlanState& st, const std::vector<PlannedBuffer>& extra);
  void plan_persistent(PlanState& st);
  void share_gradients_in_place(PlanState& st);
  std::vector<PlannedBuffer> activation_buffers(PlanState& st);
  void place_buffers(PlanState& st);
  void find_activation_peak(const PlanState& st, const std::vector<size_t>& alive);
  void bind_views(PlanState& st);
  void plan_page_release(const PlanState& st);
  void recompute(const Segment& s);
  void restore_views();
  void forward_nodes(bool training);
  void backward_nodes();
  void recover();

  Graph& graph_;
  Backend& backend_;
  Stash stash_;
  StashOptions stash_options_;
  std::vector<std::vector<int>> push_after_, pop_after_;  // per node: values the stash takes / drops
  std::vector<std::vector<int>> push_after_recompute_;    // per node: pushed when recomputed
  // Per node: decoded copies whose buffers end after its backward, or after the rerun of the
  // segment ending at it (Stash::end_decode).
  std::vector<std::vector<int>> end_decode_after_, end_decode_after_recompute_;
  std::vector<Segment> segments_;
  std::vector<int> segment_ending_at_;                    // per node: segment index or -1
  std::vector<uint8_t> reruns_;                           // per node: its forward runs in a recompute
  // release_pages: arena ranges whose buffer dies at a time step (forward n, recompute, backward).
  struct Range { size_t offset, bytes; };
  std::vector<std::vector<Range>> dies_after_forward_, dies_after_recompute_, dies_after_backward_;
  void release(const std::vector<Range>& ranges);
  std::vector<Tensor> forward_data_, recompute_data_;     // data_ as planned; recompute buffers
  // Per value read as DType::AffineRelu: its source and coefficients ([2, C], or null: none), filled
  // by its producer when a reader asks (OpContext::saved). The coefficients live in the backend's
  // memory (affine_room_), where its kernels read them.
  std::vector<AffineReluSource> affine_sources_;
  std::vector<float*> affine_coefficients_;
  Arena affine_room_;
  // Per value: computed by its readers in forward too (plan_forward_by_readers); data_ is then a
  // tensor of dtype AffineRelu over affine_sources_, which the producer's forward fills.
  std::vector<uint8_t> by_readers_;
  std::vector<int> swapped_;                              // values whose data_ view is swapped
  bool recomputing_ = false, repeating_ = false;
  bool plan_only_ = false;  // Executor::PlanOnly
  int room_grown_ = 0;
  double rec_s_ = 0, quant_s_ = 0;
  NodeObserver* observer_ = nullptr;
  // 4-bit training: the resolved per-node modes, and per quantized node its planned operand buffers
  // (full batch) with the scales its forward computed for its backward (executor_quant.cpp).
  QuantOptions quant_options_;
  std::vector<LayerQuant> quant_;
  std::vector<std::array<Tensor, kQuantSlots>> qbufs_;
  size_t quant_workspace_ = 0;
  int64_t step_ = 0;
  std::vector<std::pair<int, QuantSlot>> quant_owner_;  // (node, slot) of each planned operand buffer
  // Backend::quant_scales_in_memory: kScaleSlots floats per node, then the non-finite flag (uint32).
  Arena quant_scales_;
  Tensor quant_flag_word() const;  // the flag as a 1-element tensor; undefined without scales here
  // Per node: its input's codes are kept in the stash (bitmap_int4), not in X (executor_codes.cpp).
  std::vector<uint8_t> codes_in_stash_;
  std::vector<PlannedBuffer> plan_quant_operands(const PlanState& st);
  void bind_quant_operands(const PlanState& st, size_t first_extra);
  Arena arena_;
  std::vector<Tensor> data_, grads_;           // full-batch views, one per value
  std::vector<std::vector<Tensor>> slots_;     // optimizer slots per value (params only)
  std::vector<int> params_;                    // trained parameter value ids, in creation order
  std::vector<Tensor> param_grads_;            // grads_ of params_
  std::vector<SgdSlot> sgd_slots_;             // data_, grads_ and slots_[.][0] of params_
  std::vector<uint8_t> needs_backward_;        // per node
  std::vector<std::vector<SaveSpec>> save_specs_;  // per node, cached: Op::saves() allocates
  std::vector<uint8_t> grad_written_;          // per value, reset each backward
  Workspace workspace_;
  MemoryReport report_;
  ActivationPeak peak_;
  int64_t batch_ = 0;
  bool training_ = false;
  uint64_t step_seed_ = 0;
  bool timing_ = false;
  std::vector<double> fwd_s_, bwd_s_;
};

// What an op sees while it runs: its inputs, output, gradients, saved tensors and scratch.
class OpContext {
 public:
  OpContext(Executor& ex, int node_id) : ex_(ex), node_(ex.graph_.node(node_id)), node_id_(node_id) {}

  Backend& backend() { return ex_.backend_; }
  const Node& node() const { return node_; }
  // 4-bit training: this node's modes, or nullptr when it trains in FP32.
  const LayerQuant* quant() const {
    const LayerQuant& q = ex_.quant_[size_t(node_id_)];
    return q.on() ? &q : nullptr;
  }
  // The node's planned operand buffer (batch applied), carrying the scale last set for it.
  Tensor quant_operand(QuantSlot s) const;
  // The INT4 codes of input 0 this node's forward computed, with their scale, for its backward and
  // a recompute: X, or under bitmap_int4 the stash's BitmapI4 / BitmapU4 encoding (the integer
  // kernels read both through memory/stored_codes.h).
  Tensor input_codes() const;
  void set_quant_scale(QuantSlot s, float scale) { ex_.qbufs_[size_t(node_id_)][size_t(s)].scale = scale; }
  // Backend::quant_scales_in_memory: this node's scale floats and the step's non-finite flag in the
  // backend's memory, and the code to leave there for `what` (Executor::check_quant_finite).
  float* quant_scale(ScaleSlot s) const;
  uint32_t* quant_flag() const;
  uint32_t nonfinite_code(NonFiniteOperand what) const { return uint32_t(node_id_ + 1) * 4 + uint32_t(what); }
  // "layer 'conv1': non-finite input at training step 12 (INT4 forward): the training diverged", ...
  std::string nonfinite_message(NonFiniteOperand what) const;
  QuantDraw quant_draw(int sample) const { return QuantDraw{dropout_seed(), sample}; }
  int64_t step() const { return ex_.step_; }
  // Quantizers report their time here (bench step --profile); a no-op unless timing is on.
  bool timing() const { return ex_.timing_; }
  void add_quantize_seconds(double s) { ex_.quant_s_ += s; }
  bool training() const { return ex_.training_; }
  // True while a segment's forward runs again for its backward (checkpoint_every): results must be
  // identical to the first forward and side effects (BN running statistics) must not repeat.
  bool recomputing() const { return ex_.recomputing_; }
  // The BN running statistics were updated by an earlier forward of this step's batch (recomputing,
  // or the step running again: Executor::set_repeating): they must not be updated again.
  bool statistics_updated() const { return ex_.recomputing_ || ex_.repeating_; }
  int64_t batch() const { return ex_.batch_; }
  // Per-step, per-node seed for stochastic ops (dropout).
  uint64_t seed() const;
  // The same seed in its two parts, for the backend's dropout (engine/kernel_types.h).
  DropoutSeed dropout_seed() const;

  Tensor input(int i) const { return ex_.value(node_.inputs[size_t(i)]); }
  bool has_input(int i) const { return size_t(i) < node_.inputs.size(); }
  Tensor output() const { return ex_.value(node_.output); }
  Tensor aux(int i) const { return ex_.value(node_.aux[size_t(i)]); }
  // Saved tensors, indexed like Op::saves().
  Tensor saved(int i) const;
  // The same values as stored (F16 / BF16 copy, BitmapF32 / BitmapF16 encoding, f32) when that
  // dtype is in `accepted` (what the op's reads_stored() declared), else decoded to f32: for
  // kernels that decode as they read, skipping the decode pass and its buffer.
  Tensor saved(int i, DTypeSet accepted) const;
  MaskView saved_mask(int i) const;
  // Save i is not kept: its readers compute it from this op's saved input (DType::AffineRelu).
  bool saved_computed_by_readers(int i) const;
  // Another node's saved value `value_id` as the forward wrote it, where the stash holds it in
  // place in f32 at this moment (zero copy: between its push and pop, the arena keeps its buffer),
  // else undefined. For a reader taking a fused stack's first backward sweep (TakenSweep1::stack_x):
  // its backward runs before the stack's, so the stack's x is still held unless recomputed later or
  // kept in another encoding, and the reader leaves the sweep to the stack then.
  Tensor held_in_place(int value_id) const;

  // Where the op may write its output's bitmap during forward (Backend MaskOut), or nullptr: set
  // when the stash stores this output as a bitmap right after this forward.
  MaskOut* output_mask() { return mask_.bits ? &mask_ : nullptr; }
  // Where this node's readers compute its output in forward (Op::output_by_readers_in_forward):
  // the source to fill (x and run), and its coefficients [2, C] to write (scale, then shift, which
  // the source points at); else nullptr.
  AffineReluSource* output_source() {
    return ex_.by_readers_[size_t(node_.output)] ? &ex_.affine_sources_[size_t(node_.output)] : nullptr;
  }
  float* output_coefficients() { return ex_.affine_coefficients_[size_t(node_.output)]; }
  Tensor grad_output() const { return ex_.grad(node_.output); }
  // A wanted input gradient; the op must write it (overwrite or add, per `accumulate`).
  GradOut grad_input(int i) const;
  Workspace workspace() const { return ex_.workspace_; }

 private:
  int saved_value(int i) const;
  friend class Executor;
  Executor& ex_;
  const Node& node_;
  int node_id_;
  MaskOut mask_;
};

}  // namespace et
