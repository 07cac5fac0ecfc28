// Op: one layer's forward and backward, plus what it tells the executor and its memory planner
// about itself (what it saves for backward, how it reads saved values, its scratch, in-place
// gradients) and, for a fusion scheduler, its class. Each op family lives in layers/<family>.cpp
// with its builder, forward and backward side by side; kernels live in the backend.
#pragma once
#include <cstdint>
#include <vector>

#include "backends/backend.h"
#include "engine/affine_relu.h"
#include "engine/fused_stack.h"
#include "engine/tensor.h"

namespace et {

class OpContext;

// How ops group: the executor's recompute segments start at Compute ops and end before the Loss;
// bitmap_int4 recomputes the inputs of Normalize ops (BN, and fused stacks headed by a BN).
enum class OpClass : uint8_t { Compute, Normalize, Elementwise, Pool, Reshape, Loss };

// What an op keeps for its backward. The stash decides the storage format (dense fp32 / fp16 /
// bf16, bitmap, auto: memory/stash_format.h) without op code changing.
enum class SaveKind : uint8_t {
  Full,  // every element is needed (conv input for the weight gradient, BN input)
  Mask,  // only "is > 0" is needed (ReLU output): 1 bit per element suffices
};

// Whether an op's output holds zeros by construction, which decides where the bitmap stash formats
// pay off (memory.stash = bitmap_*: a value no sparse op produced keeps the dense format).
enum class OutputZeros : uint8_t {
  None,      // conv, BN, linear, add: zeros only by accident
  Many,      // relu, dropout: a large share of exact zeros
  AsInput0,  // max-pool, reshapes: as sparse as input 0
};

struct SaveSpec {
  int input = -1;   // index into node.inputs, or -1 for the node's output
  SaveKind kind = SaveKind::Full;
};

// What a layer computes beyond its type() and its values' shapes, for code that reads the graph as
// a network description (the ONNX exporter, engine/io/onnx_export.h). Each op fills its fields.
struct OpAttributes {
  Conv2dGeom window;            // conv2d (groups included), maxpool2d, avgpool2d: kernel, stride, padding
  float eps = 0.f;              // batchnorm2d
  bool masked = false;          // batchnorm2d with memory.double_mask_bn (y = 0 where x = 0)
  float p = 0.f;                // dropout
  int64_t stride = 1;           // subsample_pad
  int64_t pad_channels = 0;     // subsample_pad: zero channels before x's
};

// What a reader that takes a fused stack's first backward sweep is given (Op::take_dz_sums): the
// stack's mean (its input `mean_input`) and where to write the sums (input `sums_input`, an aux
// value of the stack). Where the reader's input is the stack's output in f32 (a stack ending in an
// add, whose y the next block reads, or a y with several readers) rather than computed from x as
// read (DType::AffineRelu), also the value id of the stack's input x, which the reader's backward
// reads while the stash holds it in place (OpContext::held_in_place), and whether the stack ends in
// a ReLU (the mask is then y > 0; else dz = dy).
struct TakenSweep1 {
  int mean_input = -1, sums_input = -1;
  int stack_x = -1;
  int y_bits_input = -1;  // y's bitmap from the stack's forward (y_bits_floats), or -1
  bool relu = true;
};

class Op {
 public:
  virtual ~Op() = default;
  virtual const char* type() const = 0;
  virtual OpClass op_class() const = 0;
  // Its kernels take the step's seed (OpContext::seed), so a replayed step (engine/step_replay.h)
  // would draw the recorded step's numbers again.
  virtual bool draws_random() const { return false; }
  // Activations this op reads again in backward (params and aux values are always available).
  virtual std::vector<SaveSpec> saves() const { return {}; }
  // Whether save `s` is read by the gradients wanted (input_wants_grad[i] for node input i): a conv
  // whose weight is frozen needs its input only for nothing. Default: every save is read.
  virtual bool save_needed(const SaveSpec& s, const std::vector<uint8_t>& input_wants_grad) const { return true; }
  // The encodings (engine/tensor.h dtypes) in which backward reads saves()[i] straight from the
  // stash, through OpContext::saved(i, set): a value whose every reader takes its encoding gets no
  // f32 decode buffer (the executor plans one otherwise). F32 alone: the decoded values.
  virtual DTypeSet reads_stored(int save_index, const Backend& backend, int64_t batch) const {
    return dtype_bit(DType::F32);
  }
  // Scratch needed by forward / backward on `backend` for the graph's batch size.
  virtual size_t workspace_bytes(const Backend& backend, int64_t batch) const { return 0; }
  virtual OutputZeros output_zeros() const { return OutputZeros::None; }
  // Whether every output element is >= 0 given whether input 0's are (ReLU: always; pooling,
  // flatten, dropout: as their input). Decides unsigned INT4 codes for a quantized consumer.
  virtual bool output_nonnegative(bool input0_nonnegative) const { return false; }
  // Scratch of the 4-bit path (conv / linear on codes, docs/quant.md) for the graph's batch.
  virtual size_t quant_workspace_bytes(const Backend& backend, int64_t batch) const { return 0; }
  // Whether the backend multiplies this op's codes as integers (else the 4-bit path dequantises
  // its operands for the float kernels: depthwise convs).
  virtual bool int_kernels() const { return false; }
  // True if backward may write input i's gradient over the output gradient it reads (element-wise
  // backward that reads dy[j] before writing dx[j]): the executor then gives both one buffer when
  // this op is the input's only consumer. The op still sees two tensors (maybe one memory).
  virtual bool grad_in_place(int input, const Backend& backend) const { return false; }
  // What this layer is to the fusion planner (engine/fused_stack.h, fusion/): kind None ends a stack.
  // The planner fills in the planes from the graph's shapes.
  virtual FusedStage fusion_stage() const { return {}; }
  // Whether this op's training forward can also write the per-plane sums of its output that the
  // BN-headed fused stack reading it takes its batch statistics from (docs/fusion.md, "Statistics
  // in the producer"). write_plane_sums asks it to, into its aux value `aux_index` ([2, N, C],
  // Backend::plane_sums), on every first (not recomputing) training forward.
  virtual bool can_write_plane_sums() const { return false; }
  virtual void write_plane_sums(int aux_index) { ET_CHECK(false, type(), " writes no plane sums"); }
  // Whether this op's data gradient can do the first backward sweep of the fused stack whose output
  // is its input 0 (FusedGrads::dz_sums, TakenSweep1 below).
  virtual bool can_take_dz_sums() const { return false; }
  virtual void take_dz_sums(const TakenSweep1& sweep) { ET_CHECK(false, type(), " takes no first sweep"); }
  // Whether the backward of a later reader may get this op's output from recompute_output()
  // instead of the stash keeping it (memory.recompute_stack_outputs): only from what this op saves
  // for its own backward (which outlives every later reader's) and its parameters and aux values,
  // and equal bit for bit to its forward's output where those saves are exact.
  virtual bool output_recomputable(const Backend& backend) const { return false; }
  // Writes the output of this node's last training forward into `y` (the current batch); runs
  // during another node's backward, so it must not touch the workspace.
  virtual void recompute_output(OpContext& ctx, Tensor& y) const { ET_CHECK(false, type(), " recomputes no output"); }
  // Where output_recomputable: whether its output is relu(x * scale[c] + shift[c]) of its input x as
  // saved (x stored in kStashDTypes), so a reader that takes DType::AffineRelu computes it as it reads
  // (engine/affine_relu.h) and nothing of y's size is written. describe_output fills `src`: x as
  // stored, the coefficients into `scale` / `shift` [C], the producer's run; during another node's
  // backward, like recompute_output.
  virtual bool output_is_affine_relu(const Backend& backend) const { return false; }
  virtual void describe_output(OpContext& ctx, AffineReluSource& src, float* scale, float* shift) const {
    ET_CHECK(false, type(), " describes no output");
  }
  // Where output_is_affine_relu: whether this op's forward may also leave its output to its readers,
  // computing only the coefficients (OpContext::output_source). The executor does so where every
  // reader's forward takes DType::AffineRelu (forward_reads) and the stash does not keep the output.
  virtual bool output_by_readers_in_forward(const Backend& backend) const { return false; }
  // The dtypes this op's forward reads input i in at this batch: f32, and DType::AffineRelu where its
  // kernel computes another op's output from that op's input as it reads it.
  virtual DTypeSet forward_reads(int input, const Backend& backend, int64_t batch) const {
    return dtype_bit(DType::F32);
  }
  virtual OpAttributes attributes() const { return {}; }
  virtual void forward(OpContext& ctx) = 0;
  virtual void backward(OpContext& ctx) = 0;
};

// An input gradient as a backward pass sees it: the tensor to write, whether to add into it, and
// whether it is wanted at all (inputs that need no gradient get `wanted = false`).
struct GradOut {
  Tensor t;
  bool accumulate = false;
  bool wanted = false;
};

}  // namespace et
