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
// GlobalAvgPool: the mean of each plane ([N, C, H, W] -> [N, C]); it ends the stack it is in.
enum class FusedKind : uint8_t { None, BatchNorm, Relu, Add, MaxPool, AvgPool, Dropout, GlobalAvgPool };

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
  float p = 0;                  // Dropout: the probability of dropping an element
};

inline FusedStage fused_stage(FusedKind kind) {
  FusedStage s;
  s.kind = kind;
  return s;
}

// stages[0] is the BatchNorm applied to the stack's input x (its statistics need all of x first,
// so a BN can only head a stack); the rest follow in graph order: at most one Add (its other
// operand is the stack's `side` input) and at most one pool, never a pool after the Add; at most
// one Dropout (inverted, its counter-based mask drawn again in the backward), not after the Add.
// A global average pool may end a stack without a pool or an Add, on whole planes (y is [N, C]:
// a plane's mean; P = Q = 1): neither the plane before it nor the gradient of that plane, dy / HW
// in every element, travels to memory.
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
  // Planes larger than the cache (memory order only): a tile is a band of `band_rows` rows of x's
  // plane instead of the whole plane (0: whole planes). The rows a band's pool windows reach
  // beyond it (the halo) are recomputed by each band that needs them, as in BrainSlug's Fig. 10.
  // A multiple of 16 / gcd(W, 16) rows, so every band but a plane's last is whole vectors long and
  // BN's backward sums carry across bands in the unfused order (bn_rows::GradLanes).
  int64_t band_rows = 0;
  // The last stage is a ReLU: the op saves y's mask, as the unfused ReLU does, and the backward
  // reads it (OpContext::saved_mask) instead of recomputing the stack (after an Add it could not:
  // the side input is not kept).
  bool saves_output_mask = false;
  // Streaming stores (no read of each line before it is written) for y, where x and y together
  // fill the last-level cache, and for dx where it is a tensor of its own and x and dx fill it (the
  // planner's rule, fusion.llc_kb): by the time their reader comes, their first lines have left
  // the cache anyway. Results are the same either way.
  bool stream_y = false, stream_dx = false;
  // The Add's other operand is a second BN's output, folded into the stack (a projection
  // shortcut's BN, ResNet's downsampling blocks): the side input is that BN's x2, and the stack
  // applies it as it reads x2 (forward), and takes its two backward sums in the first sweep and
  // writes dx2 in the second. Its statistics and parameters are FusedTensors' side_* ones. Memory
  // order on whole planes only (not small planes, slabs or bands); the first sweep stays in the stack.
  bool side_bn = false;
  FusedStage side_stage;  // that BN (eps, momentum)
  int add_stage() const {
    for (size_t i = 0; i < stages.size(); ++i)
      if (stages[i].kind == FusedKind::Add) return int(i);
    return -1;
  }
  const FusedStage& last() const { return stages.back(); }
  bool ends_in_global_pool() const { return stages.back().kind == FusedKind::GlobalAvgPool; }
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

// Row bands (FusedStack::band_rows): the rows of each stage a band covers. The stages before the
// pool and the pool's input cover rows [b0, b1) of the H x W planes; the pool's output and the
// stages after it rows [o0, o1) of the P x Q planes. Without a pool both are the band's own rows.
struct BandRows {
  int64_t b0 = 0, b1 = 0;  // input side: x, BN, the ReLUs before the pool, the pool's input
  int64_t o0 = 0, o1 = 0;  // output side: the pool's output, the stages after it, y
};
inline int pool_stage(const FusedStack& s) {
  for (size_t i = 0; i < s.stages.size(); ++i)
    if (s.stages[i].kind == FusedKind::MaxPool || s.stages[i].kind == FusedKind::AvgPool) return int(i);
  return -1;
}
// The rows the windows of output rows [o0, o1) read, [o0 * sh - ph, (o1 - 1) * sh - ph + R) within [0, H).
inline void pool_input_rows(const FusedStage& st, int64_t o0, int64_t o1, int64_t* b0, int64_t* b1) {
  const int64_t lo = o0 * st.pool.stride_h - st.pool.pad_h, hi = (o1 - 1) * st.pool.stride_h - st.pool.pad_h + st.pool.R;
  *b0 = lo < 0 ? 0 : lo;
  *b1 = hi > st.H ? st.H : hi;
}
// Forward: output rows [r0, r1) of y, and the input rows their windows read (the halo included).
inline BandRows forward_band(const FusedStack& s, int64_t r0, int64_t r1) {
  BandRows b;
  b.b0 = b.o0 = r0;
  b.b1 = b.o1 = r1;
  const int k = pool_stage(s);
  if (k >= 0) pool_input_rows(s.stages[size_t(k)], r0, r1, &b.b0, &b.b1);
  return b;
}
// The output rows per forward band: about band_rows input rows each.
inline int64_t forward_band_out_rows(const FusedStack& s) {
  const int k = pool_stage(s);
  const int64_t r = k >= 0 ? s.band_rows / s.stages[size_t(k)].pool.stride_h : s.band_rows;
  return r < 1 ? 1 : r;
}
// Backward: dz rows [a0, a1) of x's plane. The pool's gradient there comes from the outputs whose
// windows reach those rows, [o0, o1); their windows read rows beyond the band, which the band
// recomputes. [b0, b1) joins those rows and the band (rows in no window take no gradient).
inline BandRows backward_band(const FusedStack& s, int64_t a0, int64_t a1) {
  BandRows b;
  b.b0 = b.o0 = a0;
  b.b1 = b.o1 = a1;
  const int k = pool_stage(s);
  if (k < 0) return b;
  const FusedStage& st = s.stages[size_t(k)];
  const int64_t sh = st.pool.stride_h, first = a0 + st.pool.pad_h - st.pool.R + 1, last = a1 - 1 + st.pool.pad_h;
  b.o0 = first <= 0 ? 0 : (first + sh - 1) / sh;
  b.o1 = last < 0 ? 0 : last / sh + 1;
  if (b.o1 > st.P) b.o1 = st.P;
  if (b.o0 > b.o1) b.o0 = b.o1;
  if (b.o1 > b.o0) {
    int64_t w0, w1;
    pool_input_rows(st, b.o0, b.o1, &w0, &w1);
    if (w0 < b.b0) b.b0 = w0;
    if (w1 > b.b1) b.b1 = w1;
  }
  return b;
}
// The floats of one stage buffer of a band: its rows (the band's and the halo, 2 R at most) times
// the widest plane; never more than a whole plane.
inline int64_t band_buffer_floats(const FusedStack& s) {
  int64_t plane = 0, width = 0;
  for (const FusedStage& st : s.stages) {
    plane = st.H * st.W > plane ? st.H * st.W : plane;
    plane = st.P * st.Q > plane ? st.P * st.Q : plane;
    width = st.W > width ? st.W : width;
    width = st.Q > width ? st.Q : width;
  }
  const int k = pool_stage(s);
  const int64_t R = k >= 0 ? s.stages[size_t(k)].pool.R : 0;
  int64_t band = (s.band_rows + 2 * R) * width;
  band = band < plane ? band : plane;
  return (band + 15) / 16 * 16;
}
// The row unit of a band: 16 / gcd(W, 16) rows of x's plane are whole vectors of 16 floats.
inline int64_t band_row_unit(const FusedStack& s) {
  int64_t w = s.stages[0].W, u = 16;
  while (u > 1 && w % 2 == 0) w /= 2, u /= 2;
  return u;
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
  // FusedStack::side_bn: `side` is the second BN's input x2; its parameters, running statistics and
  // batch statistics (its layer's aux values, written by a training forward).
  Tensor side_gamma, side_beta, side_running_mean, side_running_var, side_mean, side_invstd;
  Tensor side_x_sums;  // x2's per-plane sums from its producer, as x_sums, or undefined
  // Dropout: the dropout layer's seed for this step (OpContext::seed of its node, which the fused
  // node keeps); its mask is a function of the seed and each element's index in its tensor.
  uint64_t seed = 0;
};

// A BN-headed stack whose x is the output of the fused stack before it (x's only reader) may hand
// its second backward sweep on to that stack (docs/fusion.md, "The second sweep handed on"): it
// leaves dz parked in dx and writes its coefficients here instead of dx = (a * dz + b * x) + c0,
// and the stack before builds its dy from dz and its own y as it reads it, which saves writing dx
// and reading it back. [1 + 3 C] floats: [0] = 1 where the reader handed the sweep on (0: dx holds
// the gradient), then channel c's a, b and c0 at dy_coef_of(c).
inline int64_t dy_coef_floats(int64_t C) { return 1 + 3 * C; }
inline int64_t dy_coef_of(int64_t c) { return 1 + 3 * c; }

// A BN-headed stack whose later stages are element-wise (BN -> ReLU, BN -> add -> ReLU, BN -> add)
// may have its first backward sweep done in the data gradient of a conv reading y (docs/fusion.md,
// "Sweep 1 in the data gradient"), the reader whose backward comes last, so that its dx completes
// this stack's dy: as each image's planes of that dx are written, still in cache, the conv builds
// dz from them with the stack's mask, writes it in dy's place and takes each plane's two sums, and
// the stack runs sweep 2 alone (writing the side gradient there). [1 + 2 N C] floats for a batch of
// up to N: [0] = 1 where the conv did (0: dy holds the gradient of y), then sum dz per plane
// [N, C], then sum dz * (x - mean) per plane [N, C].
inline int64_t dz_sums_floats(int64_t N, int64_t C) { return 1 + 2 * N * C; }

// Where the epilogue's ReLU mask comes from: relu(x * scale + shift) > 0 recomputed (the conv's
// input is y computed by its readers, DType::AffineRelu), y > 0 read from y itself (the conv's
// input in f32), y > 0 read from the bitmap of y the stack wrote in its forward (y_bits_floats),
// or none (a stack ending in the add: dz = dy).
enum class DzMask : uint8_t { FromX, FromY, FromBits, None };

// A stack that ends in an add and a ReLU, whose first sweep its reader takes, writes y's bitmap
// in its forward for that sweep's mask (1 bit an element read instead of y's 32): an aux value of
// [2 + N * C * PQ / 32] floats for a batch of up to N, [0] = 1 where the forward wrote it (0: the
// stash took y's bitmap itself), [1] unused, then the words of memory/bitmap.h's layout over y [N, C, P, Q]
// (planes of whole 64-bit words only: fusion::StackPlan::y_bits).
inline int64_t y_bits_floats(int64_t N, int64_t C, int64_t PQ) { return 2 + N * C * PQ / 32; }

// What that data gradient needs of the stack (Backend::conv2d_backward_data_dz_sums): x, the BN's
// input, f32 as the forward wrote it; dz = dy where the mask is on, else +0, as the stack's own
// sweep 1 builds it.
struct DzSumsEpilogue {
  const float* x = nullptr;  // [N, C, H, W]
  const float *scale = nullptr, *shift = nullptr, *mean = nullptr;  // [C]; scale, shift: FromX
  DzMask mask = DzMask::FromX;
  const float* y = nullptr;                // [N, C, H, W]: FromY
  const uint64_t* bits = nullptr;          // y > 0 by element of [N, C, H, W] (planes of whole words): FromBits
  float *sum1 = nullptr, *sum2 = nullptr;  // [N, C] each: sum dz, sum dz * (x - mean) per plane
};

struct FusedGrads {
  Tensor dy;          // gradient of y (or see dy_coef, dz_sums)
  // Undefined, or (dz_sums_floats) where [0] = 1: the reader's data gradient did the first sweep,
  // dy holds dz and this the planes' sums (Backend::fused_takes_dz_sums: which stacks can).
  Tensor dz_sums;
  // Undefined, or the reader's coefficients (dy_coef_floats): where [0] = 1, the gradient of y is
  // (a * dy + b * y) + c0 with channel c's a, b, c0 (Backend::fused_reads_dy_affine: which stacks can).
  Tensor dy_coef;
  // Undefined, or where this stack may hand its second sweep on (dy_coef of the stack before).
  Tensor dx_coef;
  MaskView y_mask;    // FusedStack::saves_output_mask: y's saved mask
  // x is the forward's x bit for bit (not a rounded stash copy), or y was not kept and its readers
  // computed it from this x (DType::AffineRelu): a last ReLU without an Add before it recomputes
  // its mask from x, which the backward reads anyway, instead of reading y_mask.
  bool x_exact = false;
  // x holds the forward's values: x_exact, or a bitmap stash of f32 values (-0 read back as +0).
  bool x_lossless = false;
  Tensor dx;          // undefined: not wanted
  bool dx_accumulate = false;
  Tensor dside;       // undefined: not wanted
  bool dside_accumulate = false;
  Tensor dgamma, dbeta;
  bool params_accumulate = false;
  // FusedStack::side_bn: the gradients of x2 (in dside) and of the second BN's parameters.
  Tensor side_dgamma, side_dbeta;
  bool side_params_accumulate = false;
};

}  // namespace et
