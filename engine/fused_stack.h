// A fused stack (docs/fusion.md): a run of memory-bound layers after a convolution (BN apply,
// ReLU, residual add, max / average pooling) that a backend executes depth-first, tile by tile, so
// the values between them never travel to memory. The fusion planner (fusion/) finds stacks in the
// graph; the backend gets this description and the tensors. Backend-neutral and C++14, like
// engine/kernel_types.h, so a .cu file can include it.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/kernel_types.h"
#include "engine/tensor.h"

namespace et {

// What a layer is to the fusion planner (Op::fusion_stage): its kind and the parameters a fused
// kernel needs. Layers that are none of these end a stack.
enum class FusedKind : uint8_t { None, BatchNorm, Relu, Add, MaxPool, AvgPool };

// A pooling window over one plane (the Conv2dGeom fields a plane kernel reads).
struct PoolWindow {
  int64_t R = 1, S = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
};

struct FusedStage {
  FusedKind kind = FusedKind::None;
  PoolWindow pool;             // MaxPool / AvgPool
  int64_t H = 0, W = 0;        // this stage's input plane
  int64_t P = 0, Q = 0;        // its output plane (= H, W for element-wise stages)
  float eps = 0, momentum = 0;  // BatchNorm
};

inline FusedStage fused_stage(FusedKind kind) {
  FusedStage s;
  s.kind = kind;
  return s;
}

// stages[0] is the BatchNorm applied to the stack's input x (its statistics need all of x first,
// so a BN can only head a stack); the rest follow in graph order: at most one Add (its other
// operand is the stack's `side` input) and at most one pool, never a pool after the Add.
// A stack without a BN (VGG without BN: conv, ReLU, pool) is exactly {Relu, pool} with windows
// that do not overlap: its backward needs one bit per element of x (`FusedTensors::pass`), set
// where dx takes a gradient, instead of the ReLU output the unfused layers keep.
struct FusedStack {
  std::vector<FusedStage> stages;
  int64_t C = 0;              // channels (every stage keeps them)
  // How a BN-headed stack walks the batch (backends/cpu/fused.cpp). Large planes: in memory order,
  // a tile is one plane (channel_slabs false, fusion.tile auto), or by slabs of tile_channels
  // channels over the whole batch (an explicit fusion.tile). Small planes: blocks of tile_channels
  // channels of one image, in memory order.
  int64_t tile_channels = 1;
  bool channel_slabs = false;
  // The last stage is a ReLU: the op saves y's mask, as the unfused ReLU does, and the backward
  // reads it (OpContext::saved_mask) instead of recomputing the stack (after an Add it could not:
  // the side input is not kept).
  bool saves_output_mask = false;
  // Streaming stores (no read of each line before it is written) for y, where x and y together
  // fill the last-level cache, and for dx where it is a tensor of its own and x and dx fill it (the
  // planner's rule, fusion.llc_kb): by the time their reader comes, their first lines have left
  // the cache anyway. Results are the same either way.
  bool stream_y = false, stream_dx = false;
  int add_stage() const {
    for (size_t i = 0; i < stages.size(); ++i)
      if (stages[i].kind == FusedKind::Add) return int(i);
    return -1;
  }
  const FusedStage& last() const { return stages.back(); }
  bool headed_by_bn() const { return stages[0].kind == FusedKind::BatchNorm; }
  bool small_planes() const;
};

// Small planes (H * W <= kSmallPlane: VGG's 4x4 and 2x2, the ResNets' and MobileNetV2's 4x4): the
// per-plane work is a few vectors, less than the cost of visiting a plane, so BN (the layer and
// the stacks it heads) works on channel blocks instead: one image's planes of consecutive channels,
// contiguous in memory (backends/cpu/batchnorm_rows.h). An auto tile of such a stack is one block
// of about kSmallPlaneBlock floats per image.
constexpr int64_t kSmallPlane = 16;
constexpr int64_t kSmallPlaneBlock = 256;
inline bool FusedStack::small_planes() const {
  return headed_by_bn() && stages[0].H * stages[0].W <= kSmallPlane;
}
inline int64_t small_plane_block_channels(int64_t plane, int64_t C) {
  int64_t L = kSmallPlaneBlock / plane / 16 * 16;
  L = L < 16 ? 16 : L;
  return L < C ? L : C;
}

// The pass bits of a stack without a BN: one 64-bit word run per plane (planes never share a word,
// so threads write whole words), [N, C, words_per_plane] in bytes.
inline int64_t pass_words_per_plane(const FusedStage& head) { return (head.H * head.W + 63) / 64; }

// The tensors of one fused call (batch applied). BN: gamma, beta, running statistics [C], the
// batch mean / invstd [C] (written by a training forward, read by the backward).
struct FusedTensors {
  Tensor x, side, y;
  Tensor gamma, beta, running_mean, running_var, mean, invstd;
  // Without a BN: bit i of x's plane is set where dx[i] takes a gradient (written by a training
  // forward, read by the backward): ReLU's mask, and for a max-pool also the window's first maximum.
  Tensor pass;
  // Per-plane sums [2, >= N, C] (Backend::plane_sums), or undefined. x_sums: x's, written by the
  // layer that produced x (a conv, or the stack before), from which a training forward takes BN's
  // statistics instead of reading x once more. y_sums: to be written for the stack that reads y.
  Tensor x_sums, y_sums;
};

struct FusedGrads {
  Tensor dy;          // gradient of y
  MaskView y_mask;    // FusedStack::saves_output_mask: y's saved mask
  // x is the forward's x bit for bit (not a rounded stash copy), or y was not kept and its readers
  // computed it from this x (DType::AffineRelu): a last ReLU without an Add before it recomputes
  // its mask from x, which the backward reads anyway, instead of reading y_mask.
  bool x_exact = false;
  Tensor dx;          // undefined: not wanted
  bool dx_accumulate = false;
  Tensor dside;       // undefined: not wanted
  bool dside_accumulate = false;
  Tensor dgamma, dbeta;
  bool params_accumulate = false;
};

}  // namespace et
