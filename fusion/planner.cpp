// Finding and sizing the stacks (docs/fusion.md, "planner").
//
// A stack starts at a training-mode BN (its statistics need all of its input, so a BN can only
// head one) and takes the layers after it while each value has a single consumer: ReLU, one Add,
// one max / average pool, one dropout (not after the Add), and a global average pool at the end of
// a stack without a pool or an Add (on whole planes in memory order only). Rules: nothing after an Add but the ReLU that ends the stack (that
// ReLU's mask is saved, since the Add's other operand is not kept for a recompute), and no pool
// after an Add. A stack of a BN alone is left as it is, but a BN whose output only the stack's Add
// reads (a projection shortcut's) folds into the stack (FusedStack::side_bn) where the stack goes
// by whole planes in memory order. Where no BN heads it, a ReLU followed by
// a pool whose windows do not overlap is a stack of its own (VGG without BN).
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <utility>

#include "engine/check.h"
#include "fusion/fusion.h"

namespace et {
namespace fusion {

namespace {

size_t f32(int64_t elements) { return size_t(elements) * 4; }
size_t bits(int64_t elements) { return size_t(elements + 7) / 8; }

// Bytes the layers read and write per training step, one by one (kernel traffic of activations
// and their gradients; parameters and stash copies are not counted, the same in both).
size_t unfused_bytes(const FusedStack& s, int64_t N) {
  size_t b = 0;
  for (size_t k = 0; k < s.stages.size(); ++k) {
    const FusedStage& st = s.stages[k];
    const int64_t in = N * s.C * st.H * st.W, out = N * s.C * st.P * st.Q;
    switch (st.kind) {
      case FusedKind::BatchNorm: b += f32(3 * in) + f32(5 * in); break;  // stats, apply | sums, dx
      case FusedKind::Relu: b += f32(2 * in) + bits(in) + f32(2 * in) + bits(in); break;  // + mask out, in
      case FusedKind::Add: b += f32(3 * in) + f32(2 * in); break;         // a, b, y | dy, side grad
      case FusedKind::MaxPool: b += f32(in + out) + f32(3 * in + out); break;  // | zero, x, dy, dx
      case FusedKind::AvgPool: b += f32(in + out) + f32(2 * in + out); break;
      case FusedKind::GlobalAvgPool: b += f32(in + out) + f32(in + out); break;  // x, y | dy, dx
      case FusedKind::Dropout: b += f32(2 * in) + f32(2 * in); break;  // x, y | dy, dx
      default: break;
    }
  }
  if (s.side_bn) b += f32(8 * N * s.C * s.side_stage.H * s.side_stage.W);  // the folded BN as a layer
  return b;
}

// One backward sweep of a BN-headed stack: x and dy (and y's mask).
size_t sweep_bytes(const FusedStack& s, int64_t N) {
  const int64_t in = N * s.C * s.stages[0].H * s.stages[0].W, out = N * s.C * s.last().P * s.last().Q;
  return f32(in + out) + (s.saves_output_mask ? bits(out) : 0);
}

// A stack that can take the second backward sweep of the stack after it (StackPlan::
// sweep_to_producer): BN -> ReLU -> max-pool of stride 1 on whole planes (the backends that can:
// Backend::fused_reads_dy_affine).
// A stack whose first backward sweep its reader's data gradient can do (StackPlan::sweep1_to_reader):
// BN -> ReLU, BN -> add -> ReLU or BN -> add on whole planes in memory order (the backends that
// can: Backend::fused_takes_dz_sums).
bool takes_dz_sums(const FusedStack& s) {
  if (!s.headed_by_bn() || s.small_planes() || s.channel_slabs || s.band_rows != 0 || s.side_bn) return false;
  const size_t n = s.stages.size();
  const FusedKind second = n > 1 ? s.stages[1].kind : FusedKind::None;
  if (n == 2) return second == FusedKind::Relu || second == FusedKind::Add;
  return n == 3 && second == FusedKind::Add && s.stages[2].kind == FusedKind::Relu;
}

bool takes_dy_affine(const FusedStack& s) {
  return s.headed_by_bn() && !s.small_planes() && s.band_rows == 0 && s.stages.size() == 3 &&
         s.stages[1].kind == FusedKind::Relu && s.stages[2].kind == FusedKind::MaxPool &&
         s.stages[2].pool.stride_h == 1 && s.stages[2].pool.stride_w == 1;
}

// The fused kernels: statistics and one tiled pass forward; two tiled sweeps backward. Without a
// BN: one pass each way, x -> y and the pass bits, then dy and the bits -> dx.
size_t fused_bytes(const FusedStack& s, int64_t N) {
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t in = N * s.C * bn.H * bn.W, out = N * s.C * last.P * last.Q;
  if (!s.headed_by_bn()) return f32(in + out) + bits(in) + f32(out + in) + bits(in);
  const int add = s.add_stage();
  const int64_t side = add >= 0 ? N * s.C * s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  const size_t mask = s.saves_output_mask ? bits(out) : 0;
  const size_t fwd = f32(in) + f32(in + side + out) + mask;
  const size_t sweep = sweep_bytes(s, N);
  // A folded side BN: its statistics read x2 once more, and each backward sweep reads x2 (side is
  // then x2, read in the forward pass instead of the BN's output; its gradient is dx2).
  const size_t side_bn = s.side_bn ? f32(3 * side) : 0;
  return fwd + 2 * sweep + f32(side) + f32(in) + side_bn;  // + side gradient, dx
}

// A thread's scratch for bands of s.band_rows rows (backends/cpu/fused_common.h, thread_floats):
// a buffer per stage, two gradient buffers and x's rows widened from a 16-bit stash.
size_t band_scratch_bytes(const FusedStack& s) { return f32(band_buffer_floats(s) * int64_t(s.stages.size() + 3)); }

// The most rows (a multiple of band_row_unit, fewer than the plane's) whose scratch fits the cache;
// 0 if not even one unit does.
int64_t band_rows_within(const FusedStack& s, size_t cache_bytes) {
  const int64_t unit = band_row_unit(s), H = s.stages[0].H;
  FusedStack t = s;
  for (int64_t rows = (H - 1) / unit * unit; rows >= unit; rows -= unit) {
    t.band_rows = rows;
    if (band_scratch_bytes(t) <= cache_bytes) return rows;
  }
  return 0;
}

// The rows of x's plane that bands read beyond their own, forward and in the first backward sweep.
int64_t halo_rows(const FusedStack& s) {
  const int64_t H = s.stages[0].H, P = s.last().P, step = forward_band_out_rows(s);
  int64_t forward = 0, backward = 0;
  for (int64_t r0 = 0; r0 < P; r0 += step) {
    const BandRows b = forward_band(s, r0, std::min(P, r0 + step));
    forward += b.b1 - b.b0;
  }
  for (int64_t a0 = 0; a0 < H; a0 += s.band_rows) {
    const BandRows b = backward_band(s, a0, std::min(H, a0 + s.band_rows));
    backward += b.b1 - b.b0;
  }
  return std::max<int64_t>(0, forward - H) + std::max<int64_t>(0, backward - H);
}

// A thread's scratch for whole planes: one plane per stage, two gradient planes and x's widened
// from a 16-bit stash (backends/cpu/fused_common.h, thread_floats).
size_t plane_scratch_bytes(const FusedStack& s) {
  int64_t plane = 0;
  for (const FusedStage& st : s.stages) plane = std::max({plane, st.H * st.W, st.P * st.Q});
  return f32(plane) * (s.stages.size() + 3 + (s.side_bn ? 1 : 0));  // + x2's plane applied (side_bn)
}

bool is_pool(FusedKind k) { return k == FusedKind::MaxPool || k == FusedKind::AvgPool; }

// A stack's last global pool goes back to being a layer where the stack does not run on whole
// planes in memory order (small planes, bands, an explicit fusion.tile): those kernels have no
// such stage.
void drop_global_pool(StackPlan& sp) {
  if (!sp.stack.ends_in_global_pool()) return;
  sp.stack.stages.pop_back();
  sp.nodes.pop_back();
  sp.output = sp.vanished.back();
  sp.vanished.pop_back();
  sp.stack.saves_output_mask = sp.stack.last().kind == FusedKind::Relu;
}

// A folded side BN goes back to being a layer where the stack does not run on whole planes in
// memory order (bands, an explicit fusion.tile): those kernels do not apply it.
void unfold_side_bn(StackPlan& sp) {
  if (!sp.stack.side_bn) return;
  sp.stack.side_bn = false;
  sp.nodes.erase(std::find(sp.nodes.begin(), sp.nodes.end(), sp.side_bn_node));
  sp.vanished.erase(std::find(sp.vanished.begin(), sp.vanished.end(), sp.side_bn_output));
  sp.side = sp.side_bn_output;
  sp.side_bn_node = sp.side_bn_output = -1;
}

// The stack headed by node `head` (a BN), or an empty one; nodes already in a stack end it.
// whole_tensors (FusionSpec): BN -> ReLU [-> max-pool | average pool | global average pool], BN ->
// add [-> ReLU], a side BN folded as on the CPU (stacks without a BN: find_relu_stack, as on the CPU).
StackPlan find_stack(const Graph& g, int head, const std::vector<uint8_t>& claimed, bool fold_side_bn,
                     bool whole_tensors) {
  StackPlan sp;
  const Node& bn = g.node(head);
  FusedStage first = bn.op->fusion_stage();
  const Shape& xs = g.value(bn.inputs[0]).shape;
  if (first.kind != FusedKind::BatchNorm || xs.ndim != 4) return sp;
  first.H = first.P = xs[2];
  first.W = first.Q = xs[3];
  sp.name = bn.name;
  sp.nodes = {head};
  sp.input = bn.inputs[0];
  sp.stack.C = xs[1];
  sp.stack.stages = {first};
  int cur = bn.output;
  bool has_add = false, has_pool = false, has_dropout = false;
  for (;;) {
    const Value& v = g.value(cur);
    if (v.consumers.size() != 1 || cur == g.logits || cur == g.loss) break;
    const int k = v.consumers[0];
    if (claimed[size_t(k)]) break;  // a projection shortcut's BN feeding an add another stack took
    const Node& node = g.node(k);
    FusedStage st = node.op->fusion_stage();
    const Shape& out = g.value(node.output).shape;
    if (whole_tensors) {
      const std::vector<FusedStage>& ss = sp.stack.stages;
      const bool after_bn = ss.size() == 1, after = ss.size() == 2;
      const bool fits = (st.kind == FusedKind::Add && after_bn) ||
                        (st.kind == FusedKind::Relu && (after_bn || (after && ss[1].kind == FusedKind::Add))) ||
                        ((is_pool(st.kind) || st.kind == FusedKind::GlobalAvgPool) && after &&
                         ss[1].kind == FusedKind::Relu);
      if (!fits) break;
    }
    if (st.kind == FusedKind::GlobalAvgPool) {  // ends the stack: its output is [N, C]
      if (has_pool || has_add || v.shape.ndim != 4) break;
      st.H = v.shape[2];
      st.W = v.shape[3];
      st.P = st.Q = 1;
      sp.stack.stages.push_back(st);
      sp.nodes.push_back(k);
      sp.vanished.push_back(cur);
      cur = node.output;
      break;
    }
    if (out.ndim != 4) break;
    if (st.kind == FusedKind::Add) {
      if (has_add || has_pool || node.inputs.size() != 2 || node.inputs[0] == node.inputs[1]) break;
      sp.side = node.inputs[0] == cur ? node.inputs[1] : node.inputs[0];
      // y = x + BN(x): the side is the stack's own input. Its gradient would be written twice, the
      // add's share by sweep 1 and BN's dx by sweep 2 over it; the add stays a layer.
      if (sp.side == sp.input) {
        sp.side = -1;
        break;
      }
      has_add = true;
      // The other operand a training BN's output read by this Add alone, of the same shape, and the
      // Add right after the head BN (BN -> add [-> ReLU], nothing to recompute through the Add): that
      // BN joins the stack (whole planes in memory order only: not on small planes, and the planner
      // undoes it for bands; the caller asks for none under an explicit fusion.tile).
      const Value& side = g.value(sp.side);
      const int sb = side.producer;
      if (fold_side_bn && sp.stack.stages.size() == 1 && sb >= 0 && !claimed[size_t(sb)] &&
          side.consumers.size() == 1 && sb != head) {
        const Node& bn2 = g.node(sb);
        FusedStage s2 = bn2.op->fusion_stage();
        if (s2.kind == FusedKind::BatchNorm && g.value(bn2.inputs[0]).shape == v.shape &&
            bn2.inputs[0] != sp.input && v.shape[2] * v.shape[3] > kSmallPlane) {
          s2.H = s2.P = v.shape[2];
          s2.W = s2.Q = v.shape[3];
          sp.stack.side_bn = true;
          sp.stack.side_stage = s2;
          sp.side_bn_node = sb;
          sp.side_bn_output = sp.side;
          sp.side = bn2.inputs[0];
          sp.nodes.push_back(sb);  // before the Add: members stay in the order they run
          sp.vanished.push_back(sp.side_bn_output);
        }
      }
    } else if (is_pool(st.kind)) {
      if (has_pool || has_add) break;
      has_pool = true;
    } else if (st.kind == FusedKind::Dropout) {
      if (has_dropout || has_add) break;
      has_dropout = true;
    } else if (st.kind != FusedKind::Relu) {
      break;
    }
    st.H = v.shape[2];
    st.W = v.shape[3];
    st.P = out[2];
    st.Q = out[3];
    sp.stack.stages.push_back(st);
    sp.nodes.push_back(k);
    sp.vanished.push_back(cur);
    cur = node.output;
    if (st.kind == FusedKind::Relu && has_add) break;  // its mask is saved: nothing may follow
  }
  sp.output = cur;
  sp.stack.saves_output_mask = sp.stack.last().kind == FusedKind::Relu;
  return sp;
}

// A stack without a BN, headed by node `head`: a ReLU whose only consumer is a pool with windows
// that do not overlap (VGG without BN), or an empty one. Its backward needs one bit per element of
// x, not the ReLU output: an overlapping window's input would need its count of wins.
StackPlan find_relu_stack(const Graph& g, int head, const std::vector<uint8_t>& claimed) {
  StackPlan sp;
  const Node& relu = g.node(head);
  FusedStage first = relu.op->fusion_stage();
  const Shape& xs = g.value(relu.inputs[0]).shape;
  const Value& r = g.value(relu.output);
  if (first.kind != FusedKind::Relu || xs.ndim != 4 || r.consumers.size() != 1 || relu.output == g.logits)
    return sp;
  const int k = r.consumers[0];
  if (claimed[size_t(k)]) return sp;
  const Node& pool = g.node(k);
  FusedStage st = pool.op->fusion_stage();
  const Shape& out = g.value(pool.output).shape;
  if (!is_pool(st.kind) || out.ndim != 4 || st.pool.stride_h < st.pool.R || st.pool.stride_w < st.pool.S)
    return sp;
  first.H = first.P = st.H = xs[2];
  first.W = first.Q = st.W = xs[3];
  st.P = out[2];
  st.Q = out[3];
  sp.name = relu.name;
  sp.nodes = {head, k};
  sp.input = relu.inputs[0];
  sp.output = pool.output;
  sp.vanished = {relu.output};
  sp.stack.C = xs[1];
  sp.stack.stages = {first, st};
  return sp;
}

}  // namespace

Plan plan(const Graph& g, const FusionSpec& spec) {
  Plan p;
  if (spec.cache_kb < 0) user_error("config key 'fusion.cache_kb' = ", spec.cache_kb, ": must be > 0 (or 0 = this core's L2)");
  if (spec.tile < 0) user_error("config key 'fusion.tile' = ", spec.tile, ": must be a channel count >= 1 (or auto)");
  if (spec.llc_kb < 0) user_error("config key 'fusion.llc_kb' = ", spec.llc_kb, ": must be > 0 (or 0 = this machine's last level)");
  if (spec.whole_tensors && spec.tile > 0)
    user_error("config key 'fusion.tile' = ", spec.tile, ": the CUDA backend's stacks run on whole tensors (tile auto)");
  // Each cache: the config's size, else the machine's (sysfs or CPUID, asked only then), else a
  // default for the L2 (tiles need a size) and unknown for the last level (then nothing streams).
  auto resolve = [](int64_t kb, const char* key, CacheSize (*machine)(), const char* what, size_t* bytes,
                    std::string* source) {
    if (kb > 0) {
      *bytes = size_t(kb) * 1024;
      *source = key;
      return;
    }
    const CacheSize m = machine();
    *bytes = m.bytes;
    *source = std::string(m.source) + what + (m.note.empty() ? "" : ": " + m.note);
  };
  resolve(spec.cache_kb, "fusion.cache_kb", l2_cache, " L2 of cpu0", &p.cache_bytes, &p.cache_source);
  if (p.cache_bytes == 0) {
    p.cache_bytes = 1 << 20;
    p.cache_source = "default (neither sysfs nor the CPU gives the L2)";
  }
  resolve(spec.llc_kb, "fusion.llc_kb", last_level_cache, ", cpu0's last level", &p.llc_bytes, &p.llc_source);
  if (p.llc_bytes == 0) p.llc_source = "unknown (neither sysfs nor the CPU gives it)";
  // A configured last level is taken as one that gives dy back at cache speed.
  p.llc_slow_reread = spec.llc_kb == 0 && p.llc_bytes > 0 && last_level_rereads_slowly();
  if (p.llc_slow_reread) p.llc_source += "; re-reads from it cost about what memory's do (Intel)";
  const int64_t N = g.batch_size();
  std::vector<uint8_t> claimed(size_t(g.num_nodes()), 0);
  std::vector<int> fused_stack_ending_at(size_t(g.num_nodes()), -1);  // index into p.stacks
  for (int n = 0; n < g.num_nodes(); ++n) {
    if (claimed[size_t(n)]) continue;
    StackPlan sp = find_stack(g, n, claimed, spec.fold_side_bn && spec.tile == 0, spec.whole_tensors);
    if (sp.nodes.size() < 2) sp = find_relu_stack(g, n, claimed);
    if (sp.nodes.size() < 2) continue;
    FusedStack& s = sp.stack;
    // A last global pool needs whole planes: not slabs or bands. The whole-tensor plan (CUDA's) has
    // no bands and takes it on small planes too; the CPU's plan leaves it a layer there (its
    // small-plane blocks run it, fused_blocks.cpp, but that plan's speed is not measured).
    if (s.ends_in_global_pool() && (spec.tile > 0 || (!spec.whole_tensors && (s.small_planes() ||
                                                                              plane_scratch_bytes(s) > p.cache_bytes))))
      drop_global_pool(sp);
    if (sp.nodes.size() < 2) continue;
    for (int m : sp.nodes) claimed[size_t(m)] = 1;
    // A tile is one plane in memory order (auto), or `tile_channels` channels of the whole batch
    // (an explicit fusion.tile: BN reduces per channel over the batch, so the backward's second
    // sweep finds the slab of x and the parked dz in the cache if the tile fits), or on small
    // planes a block of channels of one image. Each plane runs through the stages in the thread's
    // scratch (fused.cpp).
    const size_t scratch = plane_scratch_bytes(s);
    // Without a BN nothing reduces over the batch: a tile is one plane, its scratch.
    const size_t slab = s.headed_by_bn() ? f32(N * s.stages[0].H * s.stages[0].W) * 2 : 0;  // x and dz of one channel
    sp.bytes_unfused = unfused_bytes(s, N);
    sp.bytes_fused = fused_bytes(s, N);
    // Planes whose scratch exceeds the cache go by bands of rows in memory order (BN-headed stacks,
    // fusion.tile auto): the most rows whose scratch fits, each band recomputing its pool's halo.
    if (scratch > p.cache_bytes && s.headed_by_bn() && !s.small_planes() && spec.tile == 0 && !spec.whole_tensors)
      s.band_rows = band_rows_within(s, p.cache_bytes);
    if (s.band_rows > 0) {
      unfold_side_bn(sp);
      sp.bytes_unfused = unfused_bytes(s, N);
      sp.bytes_fused = fused_bytes(s, N);
    }
    if (std::find(spec.disable.begin(), spec.disable.end(), sp.name) != spec.disable.end()) {
      sp.why_not = "fusion.disable";
    } else if (scratch > p.cache_bytes && s.band_rows == 0 && !spec.whole_tensors) {
      sp.why_not = "one plane's scratch (" + std::to_string(scratch / 1024) + " KiB) exceeds the cache";
      if (s.headed_by_bn() && !s.small_planes() && spec.tile == 0) {
        FusedStack one = s;
        one.band_rows = band_row_unit(s);
        sp.why_not += ", and so does one band of " + std::to_string(one.band_rows) + " rows (" +
                      std::to_string(band_scratch_bytes(one) / 1024) + " KiB)";
      }
    } else {
      sp.fused = true;
      // auto: the finest split over threads; on small planes one channel block (fused_stack.h)
      s.tile_channels = spec.tile > 0           ? std::min(spec.tile, s.C)
                        : s.small_planes() ? small_plane_block_channels(s.stages[0].H * s.stages[0].W, s.C)
                                           : 1;
      s.channel_slabs = spec.tile > 0 && slab > 0 && !s.small_planes();
      if (s.channel_slabs && scratch + size_t(s.tile_channels) * slab > p.cache_bytes)
        user_error("config key 'fusion.tile' = ", spec.tile, ": a tile of stack ", sp.name, " needs ",
                   (scratch + size_t(s.tile_channels) * slab) / 1024, " KiB, more than the ", p.cache_bytes / 1024,
                   " KiB cache");
      sp.tile_bytes = scratch + (s.channel_slabs ? size_t(s.tile_channels) * slab : 0);
      if (s.small_planes()) sp.tile_bytes = scratch * size_t(s.tile_channels);
      if (s.band_rows > 0) {
        sp.tile_bytes = band_scratch_bytes(s);
        sp.bytes_fused += f32(N * s.C * halo_rows(s) * s.stages[0].W);  // x's halo rows, read again
      }
      // BN's per-plane sums from x's producer: a conv (in its epilogue) or a stack walking its
      // planes in memory order, when this stack is x's only reader.
      // And BN's second backward sweep handed on to the stack before, where that stack can take it.
      const Value& x = g.value(sp.input);
      const bool only_reader = x.producer >= 0 && x.consumers.size() == 1 && !spec.whole_tensors;
      if (only_reader) sp.producer_stack = fused_stack_ending_at[size_t(x.producer)];
      const StackPlan* before = sp.producer_stack >= 0 ? &p.stacks[size_t(sp.producer_stack)] : nullptr;
      if (takes_plane_sums(s) && only_reader)
        sp.sums_from_producer =
            before ? takes_plane_sums(before->stack) : g.node(x.producer).op->can_write_plane_sums();
      sp.sweep_to_producer = s.headed_by_bn() && !s.small_planes() && before && takes_dy_affine(before->stack);
      // BN's first backward sweep in the data gradient of y's reader (not with the second handed on:
      // that one wants dz parked in dx, the reader leaves it in dy): y's first reader, whose backward
      // comes after the others' (a residual block's output: the next block's first conv, after the
      // next add's side gradient), so its dx completes dy. fusion.sweep1_in_reader = false turns it
      // off (A/B measurements: bench step --against fusion.sweep1_in_reader=false).
      // What it saves is the stack reading dy back and writing dz; x is read either way. Where x and
      // y fit the last-level cache, dy comes back from there at cache speed, and the reader's
      // epilogue costs the conv more than that (Zen 5 with a 32 MiB share, session 49: ResNet-20's
      // step 1.3-2.2 % slower with it; a wash on the Zen 4 and the Xeon of sessions 37 and 42). So
      // `auto` (the config's default) gives it to the reader only where they do not fit (a Jetson's
      // few MiB against ResNet-20's 16 MiB at batch 128), the last level is unknown, or a re-read
      // from it is slow (Intel's mesh L3: the Xeon of session 55, ResNet-20 1.5-2 % faster so).
      const size_t x_bytes = f32(N * s.C * s.stages[0].H * s.stages[0].W), y_bytes = f32(N * s.C * s.last().P * s.last().Q);
      const bool to_reader = spec.sweep1_in_reader_auto
                                 ? p.llc_bytes == 0 || p.llc_slow_reread || x_bytes + y_bytes >= p.llc_bytes
                                 : spec.sweep1_in_reader;
      const Value& y = g.value(sp.output);
      const int first_reader = y.consumers.empty() ? -1 : *std::min_element(y.consumers.begin(), y.consumers.end());
      if (to_reader && takes_dz_sums(s) && !sp.sweep_to_producer && first_reader >= 0 && !spec.whole_tensors &&
          g.node(first_reader).op->can_take_dz_sums()) {
        sp.sweep1_to_reader = true;
        sp.reader_node = first_reader;
      }
      if (sp.sums_from_producer) sp.bytes_fused -= x_bytes;  // one read of x
      // A folded side BN's sums from x2's producer, where the stack alone reads x2 and a layer (a
      // conv) produced it.
      if (s.side_bn) {
        const Value& x2 = g.value(sp.side);
        sp.side_sums_from_producer = x2.producer >= 0 && x2.consumers.size() == 1 && !spec.whole_tensors &&
                                     fused_stack_ending_at[size_t(x2.producer)] < 0 &&
                                     g.node(x2.producer).op->can_write_plane_sums();
        if (sp.side_sums_from_producer) sp.bytes_fused -= f32(N * s.C * s.side_stage.H * s.side_stage.W);
      }
      // The second sweep handed on: it reads x and dy (the stack before reads dz instead of dy)
      // and writes dx no more.
      if (sp.sweep_to_producer) sp.bytes_fused -= sweep_bytes(s, N) + x_bytes;
      // The first sweep in the reader's data gradient: dy is in cache there (x is still read).
      if (sp.sweep1_to_reader) sp.bytes_fused -= y_bytes;
      s.stream_y = p.llc_bytes > 0 && x_bytes + y_bytes >= p.llc_bytes && !spec.whole_tensors;
      // dx: only after a pool (element-wise stacks write dx in dy's place, whose lines are cached).
      s.stream_dx = p.llc_bytes > 0 && y_bytes < x_bytes && 2 * x_bytes >= p.llc_bytes && !spec.whole_tensors;
      // y's bitmap for the first sweep of a stack ending in an add and a ReLU (StackPlan::y_bits).
      const FusedStage& last = s.last();
      sp.y_bits = s.headed_by_bn() && s.add_stage() >= 0 && last.kind == FusedKind::Relu &&
                  (last.P * last.Q) % 64 == 0 && !s.small_planes() && !s.channel_slabs && s.band_rows == 0 &&
                  !spec.whole_tensors;
      fused_stack_ending_at[size_t(sp.nodes.back())] = int(p.stacks.size());
      p.bytes_unfused += sp.bytes_unfused;
      p.bytes_fused += sp.bytes_fused;
    }
    p.stacks.push_back(std::move(sp));
  }
  for (const std::string& name : spec.disable) {
    bool found = false;
    for (const StackPlan& sp : p.stacks) found |= sp.name == name;
    if (!found) {
      std::string known;
      for (const StackPlan& sp : p.stacks) known += (known.empty() ? "" : ", ") + sp.name;
      user_error("config key 'fusion.disable': no stack named '", name, "' (stacks: ", known, ")");
    }
  }
  return p;
}

namespace {
const char* kind_name(FusedKind k) {
  switch (k) {
    case FusedKind::BatchNorm: return "bn";
    case FusedKind::Relu: return "relu";
    case FusedKind::Add: return "add";
    case FusedKind::MaxPool: return "maxpool";
    case FusedKind::AvgPool: return "avgpool";
    case FusedKind::Dropout: return "dropout";
    case FusedKind::GlobalAvgPool: return "gap";
    default: return "?";
  }
}
std::string mb(size_t b) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(2);
  o << double(b) / 1e6;
  return o.str();
}
}  // namespace

std::string describe(const Graph& g, const Plan& p) {
  std::ostringstream o;
  o << "cache: " << p.cache_bytes / 1024 << " KiB (" << p.cache_source << "), last level " << p.llc_bytes / 1024
    << " KiB (" << p.llc_source << "), batch " << g.batch_size() << "\n";
  o << "stack                 stages                  planes         tile  KiB/tile  MB unfused  MB fused  vanish  "
       "statistics sweep 1  sweep 2    streamed\n";
  for (const StackPlan& sp : p.stacks) {
    std::string stages;
    for (const FusedStage& st : sp.stack.stages)
      stages += std::string(stages.empty() ? "" : ",") + kind_name(st.kind) +
                (st.kind == FusedKind::Add && sp.stack.side_bn ? "(bn)" : "");
    const FusedStage& bn = sp.stack.stages[0];
    const std::string planes = std::to_string(sp.stack.C) + "x" + std::to_string(bn.H) + "x" + std::to_string(bn.W);
    o << sp.name << std::string(sp.name.size() < 22 ? 22 - sp.name.size() : 1, ' ') << stages
      << std::string(stages.size() < 24 ? 24 - stages.size() : 1, ' ') << planes
      << std::string(planes.size() < 11 ? 11 - planes.size() : 1, ' ');
    if (sp.fused) {
      char line[160];
      const FusedStack& s = sp.stack;
      char tile[32];
      if (s.channel_slabs || s.small_planes())
        std::snprintf(tile, sizeof tile, "%lldch%s", (long long)s.tile_channels, s.channel_slabs ? " slab" : "");
      else if (s.band_rows > 0)
        std::snprintf(tile, sizeof tile, "%lld rows", (long long)s.band_rows);
      else
        std::snprintf(tile, sizeof tile, "plane");
      std::snprintf(line, sizeof line, "%10s %8zu%s %10s %9s %6zu  %-10s %-7s %-9s %s\n", tile, sp.tile_bytes / 1024,
                    sp.tile_bytes <= p.cache_bytes ? " " : "*", mb(sp.bytes_unfused).c_str(),
                    mb(sp.bytes_fused).c_str(), sp.vanished.size(),
                    !s.headed_by_bn() ? "-" : sp.sums_from_producer ? "producer" : "own sweep",
                    !s.headed_by_bn() ? "-" : sp.sweep1_to_reader ? "reader" : "own",
                    !s.headed_by_bn() ? "-" : sp.sweep_to_producer ? "handed on" : "own",
                    s.stream_y ? (s.stream_dx ? "y, dx" : "y") : s.stream_dx ? "dx" : "-");
      o << line;
    } else {
      o << "not fused: " << sp.why_not << "\n";
    }
  }
  int fused = 0;
  for (const StackPlan& sp : p.stacks) fused += sp.fused;
  o << "(tile: plane = one plane, in memory order; N rows = a band of N rows of a plane, in memory order, "
       "its pool's halo recomputed; Nch = a block of N channels of one image; Nch slab = N "
       "channels over the whole batch (fusion.tile), * = larger than the cache: the second backward sweep "
       "re-reads x from memory; statistics: producer = BN's per-plane sums written by x's producer, "
       "own sweep = the stack reads x for them; sweep 1: reader = BN's dz and its sums are taken by the data "
       "gradient of the conv reading y, where that conv computes y from x as it reads it and its kernel can "
       "(else the stack's own); sweep 2: handed on = BN's dx is built by the stack before, "
       "as it reads its dy (AVX2, AVX-512 and NEON builds); streamed: y where x and y fill the last-level cache, dx where "
       "x and dx do (written around the cache; dx only where it is a tensor of its own, after a pool))\n";
  o << "fused stacks: " << fused << " of " << p.stacks.size() << " (one sequence each); bytes moved per step: "
    << mb(p.bytes_unfused) << " MB unfused, " << mb(p.bytes_fused) << " MB fused ("
    << (p.bytes_fused ? double(p.bytes_unfused) / double(p.bytes_fused) : 0.0) << "x less)\n";
  return o.str();
}

}  // namespace fusion
}  // namespace et
