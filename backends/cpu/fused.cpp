// Fused stacks on CPU (engine/fused_stack.h, docs/fusion.md), headed by a BN, on planes larger than
// kSmallPlane (smaller ones: fused_blocks.cpp): the forward, and the outputs recomputed or computed
// by their readers (the backward: fused_backward.cpp). BN's statistics are per channel over the
// whole batch, so the forward makes two sweeps (statistics, then the stages). Each plane runs
// through every stage in a thread's scratch (one plane per stage), so the values between stages
// never reach memory. Every stage calls the row / plane functions the layer kernels call (bn_rows,
// pool_planes, the same element-wise expressions) and the reductions keep their order (per plane
// in float, planes in double, n in order), so the results equal the unfused layers' bit for bit.
//
// Forward (training): statistics, then planes x (+ side) -> y, with y's bitmap words and, where the
// stash keeps y as bitmap + values, the packed values (PackRounds); element-wise stacks and BN ->
// ReLU -> 2x2 max-pool go from x to y in registers, BN -> ReLU -> stride-1 max-pool through
// pool_stride1.h (its y summed as written, SummedY), and y bypasses the cache where the planner
// says so (FusedStack::stream_y). A last global average pool takes each plane's mean from scratch.
#include <omp.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/fused_common.h"
#include "backends/cpu/fused_bn_relu_pool.h"
#include "backends/cpu/fused_elementwise.h"
#include "backends/cpu/pool_planes.h"
#include "memory/bitmap.h"

namespace et {
using namespace fused_elementwise;

namespace fused_planes {

namespace {
size_t g_pack_round_bytes = 0;
}
size_t pack_round_bytes() { return g_pack_round_bytes ? g_pack_round_bytes : size_t(128) << 10; }
void set_pack_round_bytes(size_t bytes) { g_pack_round_bytes = bytes; }

}  // namespace fused_planes

namespace {

using namespace fused_planes;

// y's kept values packed in the forward pass, in the stash's layout (memory/bitmap.h: in element
// order behind the bitmap), so the stash reads nothing of y afterwards. A value's place in that
// order is the count of kept elements before it, which a thread learns only once the planes
// before its own are done. So the planes go in rounds: each thread takes `planes` consecutive
// planes of the round, writes them (and their bitmap words), posts its count, and after a barrier
// packs its planes' values from y, still in its L2, at the offset the counts before it give.
// The same bytes as the stash's own pack, whatever the thread count (tested).
class PackRounds {
 public:
  static constexpr int kMaxThreads = 256;
  PackRounds(const MaskOut& mask, int64_t plane_elems, int64_t num_planes)
      : bits_(mask.bits),
        values_(static_cast<char*>(mask.values)),
        type_(mask.values_f16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32),
        plane_(plane_elems),
        planes_(std::max<int64_t>(1, int64_t(pack_round_bytes()) / (4 * plane_elems))),
        num_planes_(num_planes) {
    ET_CHECK(cpu_threads() <= kMaxThreads, "fused stack: ", cpu_threads(), " threads");
  }
  // On every thread of the parallel region: plane(pl) writes plane pl and returns its kept count.
  // Returns the thread's kept count.
  template <class Plane>
  int64_t run(const float* y, Plane&& plane) {
    const int T = omp_get_num_threads(), me = omp_get_thread_num();
    int64_t base = 0, mine = 0;
    for (int64_t r0 = 0, round = 0; r0 < num_planes_; r0 += planes_ * T, ++round) {
      const int64_t a = std::min(num_planes_, r0 + me * planes_), b = std::min(num_planes_, a + planes_);
      int64_t k = 0;
      for (int64_t pl = a; pl < b; ++pl) k += plane(pl);
      // Two count rows in turn: row r % 2 is written before round r's barrier and read after it;
      // a thread writes it again in round r + 2 only past round r + 1's barrier, which no thread
      // reaches before it has read round r's counts.
      int64_t* row = counts_[round & 1];
      row[me] = k;
#pragma omp barrier
      int64_t before = base;
      for (int u = 0; u < T; ++u) {
        if (u < me) before += row[u];
        base += row[u];
      }
      if (b > a)
        bitmap::best_impl().pack_values(y + a * plane_, bits_ + a * plane_ / 64, (b - a) * plane_,
                                        values_ + before * bitmap::value_bytes(type_), type_);
      mine += k;
    }
    return mine;
  }

 private:
  uint64_t* bits_;
  char* values_;
  bitmap::ValueType type_;
  int64_t plane_, planes_, num_planes_;
  int64_t counts_[2][kMaxThreads] = {};
};

#if defined(ET_POOL_STRIDE1_SUMS)
// The stride-1 pool's output plane, rows of whole vectors (Q % 16 == 0): each vector stored, or
// streamed (y 64-byte aligned; the caller fences), and summed for the next BN as it is written, in
// plane_sums's order (bn_rows::PlaneSumLanes), so y is not read back for its sums and can bypass
// the cache.
struct SummedY {
  float* y;
  int64_t Q;
  bool stream;
  bn_rows::PlaneSumLanes lanes;
  ET_ALWAYS_INLINE void put(int64_t p, int64_t q, lanes512::F v) {
    const int64_t i = p * Q + q;
    if (stream)
      lanes512::stream(y + i, v);
    else
      lanes512::store(y + i, v);
    lanes.add(i / 16, v);
  }
};
#endif



}  // namespace

size_t CpuBackend::fused_workspace_bytes(const FusedStack& s, int64_t batch) const {
  const int64_t per_thread = s.small_planes() ? block_thread_floats(s) : thread_floats(s);
  return sizeof(float) * size_t(per_thread * cpu_threads() + table_floats(s, batch));
}

// The stack output's bitmap: counted where the planes wrote whole words, else one pass over y.
void CpuBackend::finish_output_mask(Tensor y, MaskOut* mask, bool plane_words, int64_t kept) {
  if (plane_words)
    mask->kept = kept;
  else
    relu_forward(y, y, mask);  // y >= +0: an identity that writes the bitmap
}

// Two orders of the planes, with equal results (docs/fusion.md):
// - memory order (fusion.tile auto): every sweep streams the tensors plane after plane as they
//   lie, each thread a contiguous range; per-plane sums go to an [N, C] table and add per channel
//   in double over n in order, the BN layer's order, so every result is the same.
// - channel slabs (an explicit fusion.tile): threads over channels; a channel's slab of N planes (a
//   plane apart in memory) is read from memory by the first sweep and found again in this core's
//   L2 by the second. Slower on the hosts measured (a page-strided walk: the prefetcher restarts
//   on every plane), but it keeps x in L2 where memory is slow and the L2 holds a slab.
namespace {
// Inside a parallel region, stacks in memory order: BN's batch statistics from the per-plane sums
// (given by x's producer, else taken here into tab), the running ones updated, and each channel's
// scale / shift for y = x * scale + shift (the batch statistics' in training, the running ones'
// in evaluation). Ends with a barrier.
// `planes`: N * C items (plane_ranges), for the sums' sweep.
// `bn`: the stack's head BN, or a folded side BN (its x and parameters in t).
void statistics_in_region(const FusedStage& bn, int64_t C, FusedTensors& t, bool training, const SumTables& tab,
                          float* scale, float* shift, cpu::StealingRanges& planes) {
  const int64_t N = t.x.dim(0), HW = bn.H * bn.W;
  const bool sums_given = t.x_sums.defined();
  if (training && !sums_given) {
    const float* xp = t.x.f32();
    planes.run([&](int64_t p0, int64_t p1) {
      for (int64_t pl = p0; pl < p1; ++pl) bn_rows::plane_sums(xp + pl * HW, HW, &tab.sum1[pl], &tab.sum2[pl]);
    });
#pragma omp barrier
  }
  const float* sum1 = sums_given ? t.x_sums.f32() : tab.sum1;
  const float* sum2 = sums_given ? t.x_sums.f32() + t.x_sums.dim(1) * C : tab.sum2;
  int64_t ca, cb;
  thread_channels(C, &ca, &cb);
  if (training) sum_over_batch(sum1, sum2, N, C, ca, cb, tab.d1, tab.d2);
  for (int64_t c = ca; c < cb; ++c) {
    if (training) {
      bn_rows::finish_statistics(tab.d1[c], tab.d2[c], N * HW, c, bn.momentum, bn.eps, t.running_mean, t.running_var,
                                 t.mean, t.invstd);
      bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale[c],
                                  &shift[c]);
    } else {
      bn_rows::eval_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.running_mean.f32()[c], t.running_var.f32()[c],
                                 bn.eps, &scale[c], &shift[c]);
    }
  }
#pragma omp barrier
}
}  // namespace

void CpuBackend::fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) {
  // (plane sums are neither given nor asked for there: fusion::takes_plane_sums)
  if (!s.headed_by_bn()) return relu_pool_forward(s, t, training, mask, ws);
  if (s.small_planes()) return fused_blocks_forward(s, t, training, mask, ws);
  const FusedStage &bn = s.stages[0], &last = s.last();
  const int64_t N = t.x.dim(0), C = s.C, HW = bn.H * bn.W, PQ = last.P * last.Q, S = int64_t(s.stages.size());
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  ET_CHECK(S <= kMaxStages, "fused stack of ", S, " stages");
  const float* xp = t.x.f32();
  float* yp = t.y.f32();
  // The bitmap is written plane by plane when planes cover whole 64-bit words, else in a pass over y.
  const bool want_mask = training && mask && mask->bits && output_nonnegative(s);
  const bool plane_words = PQ % 64 == 0;
  // Values packed here where the stash keeps them behind the bitmap (memory order only).
  const bool pack_values = want_mask && plane_words && mask->values && !s.channel_slabs;
  PackRounds rounds(pack_values ? *mask : MaskOut{}, PQ, N * C);
  const uint32_t tb = want_mask ? bitmap::keep_threshold_bits(mask->prune_threshold) : 0;
  const int add = s.add_stage();
  const int64_t side_plane = add >= 0 ? s.stages[size_t(add)].H * s.stages[size_t(add)].W : 0;
  // A folded side BN (FusedStack::side_bn): its statistics from x2 (t.side) as the BN layer takes
  // them, then each plane of its output applied into the thread's scratch as the stack reaches it.
  ET_CHECK(!s.side_bn || (!s.channel_slabs && s.band_rows == 0 && side_plane == HW), "fused stack: a side BN ",
           "off whole planes in memory order");
  const SumTables side_tab = side_bn_tables(static_cast<float*>(ws.data) + thread_floats(s) * cpu_threads(), N, C);
  float *side_scale = side_tab.rest, *side_shift = side_tab.rest + C;
  FusedTensors side_t;  // (no FusedStack copy: its vector would allocate in the step)
  if (s.side_bn) {
    side_t.x = t.side;
    side_t.gamma = t.side_gamma, side_t.beta = t.side_beta;
    side_t.running_mean = t.side_running_mean, side_t.running_var = t.side_running_var;
    side_t.mean = t.side_mean, side_t.invstd = t.side_invstd;
    side_t.x_sums = t.side_x_sums;
  }
  const int64_t per_thread = thread_floats(s), plane = stage_buffer(s);
  const SumTables tab(static_cast<float*>(ws.data) + per_thread * cpu_threads(), N, C);
  float *scale = tab.rest, *shift = tab.rest + C;
  const bool memory_order = !s.channel_slabs;
  // BN's per-plane sums: from x's producer (memory order), or taken here. y's for the next stack.
  const bool sums_given = memory_order && t.x_sums.defined();
  float* y_sum1 = t.y_sums.defined() ? t.y_sums.f32() : nullptr;
  float* y_sum2 = y_sum1 ? y_sum1 + t.y_sums.dim(1) * C : nullptr;
  if (sums_given) ET_CHECK(t.x_sums.dim(1) >= N && t.x_sums.dim(2) == C, "fused stack: x sums ", t.x_sums.shape.str());
  if (y_sum1) ET_CHECK(t.y_sums.dim(1) >= N && t.y_sums.dim(2) == C, "fused stack: y sums ", t.y_sums.shape.str());
  int64_t kept = 0;
  uint64_t* const words = want_mask && plane_words ? mask->bits : nullptr;
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
  // In registers, x to y: BN -> ReLU -> 2x2 max-pool (fused_bn_relu_pool.h), and the
  // stacks whose stages after the BN are element-wise.
#if defined(ET_POOL_IN_REGISTERS)
  const bool pool_in_registers = fused_bn_relu_pool::applies(s);
  const fused_bn_relu_pool::Layout pool_layout(pool_in_registers ? last.Q : 4);
#else
  const bool pool_in_registers = false;
#endif
  // A last global average pool: the stages before it (elementwise_kind_before_global_pool).
  const ElementwiseOnly ew = elementwise_kind_before_global_pool(s);
  // Streaming stores where the planner asks for them (FusedStack::stream_y) and nothing reads
  // y back in the pass: not the rounds that pack y's values, not y's sums; with the pool, not the
  // bitmap words either (the element-wise planes take theirs in registers).
  const bool stream = s.stream_y && !pack_values && !y_sum1 && PQ % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(yp) % 64 == 0 &&
                      (ew != ElementwiseOnly::No || (pool_in_registers && !words));
#endif
  [[maybe_unused]] const bool pool_stride1 = bn_relu_pool_stride1(s);
  // y [N, C]: each plane's mean (FusedStack::ends_in_global_pool; whole planes only).
  const bool global_pool = s.ends_in_global_pool();
  ET_CHECK(!global_pool || s.band_rows == 0, "fused stack: a global pool over bands");
#if defined(ET_POOL_STRIDE1_SUMS)
  // The stride-1 pool writes y through SummedY where its rows are whole vectors: y's sums for the
  // next BN in the pass, and streaming stores where the planner asks for them and nothing else
  // reads y back (the bitmap words, the packed values).
  const bool pool_summed = pool_stride1 && last.Q % 16 == 0;
  const bool pool_stream = pool_summed && s.stream_y && !words && !pack_values &&
                           reinterpret_cast<uintptr_t>(yp) % 64 == 0;
#endif
  // Plane (n, c) through every stage into y, with its bitmap words (and its sums, in L1).
  auto forward_one = [&](float* const* scratch_out, int64_t pl, float sc, float sh) -> int64_t {
    int64_t kept_in_registers = -1;  // the element-wise planes count their bitmap words' bits themselves
    bool summed = false;             // y's sums taken as y was written
    // The Add's other operand, plane pl: the side input's, or the folded BN's output in scratch.
    const float* side_in = add >= 0 ? t.side.f32() + pl * side_plane : nullptr;
    if (s.side_bn) {
      float* applied = scratch_out[0] + side_plane_buffer(s);
      bn_rows::apply(side_in, side_scale[pl % C], side_shift[pl % C], side_plane, applied);
      side_in = applied;
    }
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
    if (ew != ElementwiseOnly::No && global_pool) {  // the element-wise stages into scratch, its mean into y
      if (memory_order && pl + 1 < N * C) prefetch_plane(xp + (pl + 1) * HW, HW);
      elementwise_forward_plane(ew, xp + pl * HW, side_in, sc, sh, HW,
                                scratch_out[0], false, 0, nullptr);
      yp[pl] = pool_planes::plane_mean(scratch_out[0], HW);
    } else if (ew != ElementwiseOnly::No) {
      // The next plane's first lines (see prefetch_plane): ResNet-20's stacks' forward 4.7 -> 3.4 ms.
      if (memory_order && pl + 1 < N * C) {
        prefetch_plane(xp + (pl + 1) * HW, HW);
        if (add >= 0) prefetch_plane(t.side.f32() + (pl + 1) * side_plane, side_plane);
        if (!stream) prefetch_plane_for_write(yp + (pl + 1) * PQ, PQ);
      }
      kept_in_registers =
          elementwise_forward_plane(ew, xp + pl * HW, side_in, sc, sh, HW,
                                    yp + pl * PQ, stream, tb, words ? words + pl * PQ / 64 : nullptr);
    } else
#endif
#if defined(ET_POOL_IN_REGISTERS)
    if (pool_in_registers) {
      fused_bn_relu_pool::forward(pool_layout, xp + pl * HW, fused_bn_relu_pool::ChannelBn(sc, sh), HW, yp + pl * PQ,
                                  stream);
    } else
#endif
#if defined(ET_POOL_STRIDE1_SUMS)
    if (pool_summed) {
      SummedY out{yp + pl * PQ, last.Q, pool_stream, {}};
      pool_planes::max_forward_stride1_to(pool_planes::of(last), xp + pl * HW, pool_planes::BnReluInput(sc, sh), out);
      if (y_sum1) out.lanes.finish(y_sum1 + pl, y_sum2 + pl);
      summed = true;
    } else
#endif
#if defined(ET_BN_RELU_POOL_STRIDE1)
    if (pool_stride1) {
      pool_planes::max_forward_stride1(pool_planes::of(last), xp + pl * HW, pool_planes::BnReluInput(sc, sh),
                                       yp + pl * PQ);
    } else
#endif
    if (global_pool) {  // the plane through the stages in scratch, its mean into y
      float* out[kMaxStages];
      for (int64_t k = 0; k < S; ++k) out[k] = scratch_out[k];
      out[S - 1] = yp + pl;
      forward_rows(s, whole_planes(s, pl, 1, t.seed), s.stages.size(), xp + pl * HW,
                   side_in, sc, sh, out, training);
    } else {  // the whole plane, or bands of rows (planes larger than the cache), their halos recomputed
      float* out[kMaxStages];
      for (int64_t k = 0; k < S; ++k) out[k] = scratch_out[k];
      const int64_t step = s.band_rows > 0 ? forward_band_out_rows(s) : last.P;
      for (int64_t r0 = 0; r0 < last.P; r0 += step) {
        const BandRows b = forward_band(s, r0, std::min(last.P, r0 + step));
        const StageRows rows = one_band(s, b, pl, t.seed);
        out[S - 1] = yp + rows.y_off;  // the last stage writes y's rows
        forward_rows(s, rows, s.stages.size(), xp + pl * HW + b.b0 * bn.W,
                     add >= 0 ? side_in + (rows.side_off - pl * side_plane) : nullptr, sc, sh, out, training);
      }
    }
    if (y_sum1 && !summed) bn_rows::plane_sums(yp + pl * PQ, PQ, y_sum1 + pl, y_sum2 + pl);
    if (kept_in_registers >= 0) return kept_in_registers;
    return words ? mask_words(yp, pl * PQ / 64, (pl + 1) * PQ / 64, tb, words) : int64_t(0);
  };
  auto coefficients = [&](int64_t c, float* sc, float* sh) {
    if (training)
      bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], sc, sh);
    else
      bn_rows::eval_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.running_mean.f32()[c], t.running_var.f32()[c],
                                 bn.eps, sc, sh);
  };
  cpu::StealingRanges sum_planes = plane_ranges(N * C, HW), y_planes = plane_ranges(N * C, HW),
                      side_sum_planes = plane_ranges(N * C, HW);
#pragma omp parallel reduction(+ : kept)
  {
    float* scratch = static_cast<float*>(ws.data) + omp_get_thread_num() * per_thread;
    float* out[kMaxStages];
    for (int64_t k = 0; k < S; ++k) out[k] = scratch + k * plane;
    if (memory_order) {
      statistics_in_region(bn, C, t, training, tab, scale, shift, sum_planes);
      if (s.side_bn) statistics_in_region(s.side_stage, C, side_t, training, side_tab, side_scale, side_shift, side_sum_planes);
      if (pack_values) {
        kept += rounds.run(yp, [&](int64_t pl) { return forward_one(out, pl, scale[pl % C], shift[pl % C]); });
      } else {
        y_planes.run([&](int64_t p0, int64_t p1) {
          for (int64_t pl = p0; pl < p1; ++pl) kept += forward_one(out, pl, scale[pl % C], shift[pl % C]);
        });
      }
    } else {
#pragma omp for schedule(static, s.tile_channels)
      for (int64_t c = 0; c < C; ++c) {
        if (training)
          bn_rows::channel_statistics(xp, N, C, HW, c, bn.momentum, bn.eps, t.running_mean, t.running_var, t.mean,
                                      t.invstd);
        float sc, sh;
        coefficients(c, &sc, &sh);
        for (int64_t n = 0; n < N; ++n) {
          const int64_t pl = n * C + c;
          if (n + 1 < N) {  // x's next plane is in L2 already (the statistics read it)
            prefetch_plane_for_write(yp + (pl + C) * PQ, PQ);
            if (add >= 0) prefetch_plane(t.side.f32() + (pl + C) * side_plane, side_plane);
          }
          kept += forward_one(out, pl, sc, sh);
        }
      }
    }
#if defined(ET_POOL_STRIDE1_SUMS)
    if (pool_stream) _mm_sfence();  // as below
#endif
#if defined(__AVX512F__)
    if (stream) _mm_sfence();  // this thread's streaming stores, before y's readers
#elif defined(ET_LANES16)
    if (stream) lanes16::stream_fence();
#endif
  }
  if (want_mask) finish_output_mask(t.y, mask, plane_words, kept);
  if (pack_values) mask->values_written = true;
}

// BN then ReLU, on large planes or small-plane blocks alike: every element of y is the BN stage's
// FMA with its channel's coefficients, then the ReLU, so a plane at a time gives the forward's bits
// (the blocks' forward expands the same coefficients per element).
bool CpuBackend::fused_recomputes(const FusedStack& s) const {
  return s.headed_by_bn() && s.stages.size() == 2 && s.stages[1].kind == FusedKind::Relu;
}

void CpuBackend::fused_recompute_output(const FusedStack& s, const FusedTensors& t, Tensor& y) {
  ET_CHECK(fused_recomputes(s), "fused stack: no output recompute for this stack");
  const int64_t N = t.x.dim(0), C = s.C, HW = s.stages[0].H * s.stages[0].W;
  ET_CHECK(y.numel() == N * C * HW && y.dtype == DType::F32, "fused stack: recompute into ", y.shape.str());
  float* yp = y.f32();
#pragma omp parallel for schedule(static)
  for (int64_t pl = 0; pl < N * C; ++pl) {
    const int64_t c = pl % C;
    float scale, shift;
    bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], &scale,
                                &shift);
    float* yl = yp + pl * HW;  // the ReLU in place over the BN stage's output
    bn_rows::apply(bn_rows::x_f32(t.x, pl * HW, HW, yl), scale, shift, HW, yl);
    relu_run(yl, HW, yl);
  }
}

namespace {
// forward_plane's arithmetic for a BN -> ReLU stack over a run of one channel: bn_rows::apply's FMA,
// then relu_forward's rule, which a max with +0 as second operand is (NaN and -0 give +0), in one
// pass as elementwise_forward_plane does (maskz forms: GCC 12 warns on the plain max).
inline void bn_relu_channel(const float* x, float scale, float shift, int64_t len, float* y) {
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(scale), vt = _mm512_set1_ps(shift), zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16)
    _mm512_storeu_ps(y + i, _mm512_maskz_max_ps(0xFFFF, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), vs, vt), zero));
  if (i < len) {
    const __mmask16 m = __mmask16((1u << (len - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, _mm512_maskz_max_ps(0xFFFF, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), vs, vt), zero));
  }
#elif defined(ET_LANES16)
  using namespace lanes16;
  const Lanes16 vs = splat16(scale), vt = splat16(shift);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) store16(Full{}, y + i, relu16(fmadd16(load16(Full{}, x + i), vs, vt)));
  if (i < len) {
    const Lanes16 m = lanes_first(len - i);
    store16(m, y + i, relu16(fmadd16(load16(m, x + i), vs, vt)));
  }
#else
  bn_rows::apply(x, scale, shift, len, y);
  relu_run(y, len, y);
#endif
}

#if defined(__AVX512F__)
// Whole planes of 1, 2, 4 or 8 elements (VGG's 2x2 maps, 1x1 after pooling), 16 / plane of them a
// vector, from channel c0 on where channels is a multiple of 16 / plane: each vector's coefficients
// the next 16 / plane channels' (contiguous, never wrapping), spread plane lanes each. The same FMA
// and max per element as bn_relu_channel's (maskz forms: GCC 12 warns on the plain permute). Returns
// the elements done (whole vectors).
int64_t bn_relu_small_planes(const float* x, const float* scale, const float* shift, int64_t channels, int64_t plane,
                             int64_t c0, int64_t count, float* y) {
  const int64_t per = 16 / plane;
  if (plane >= 16 || 16 % plane != 0 || channels % per != 0 || c0 % per != 0) return 0;
  alignas(64) int32_t lane_channel[16];
  for (int l = 0; l < 16; ++l) lane_channel[l] = int32_t(l / plane);
  const __m512i spread = _mm512_load_si512(lane_channel);
  const __mmask16 first = __mmask16((1u << per) - 1);
  const __m512 zero = _mm512_setzero_ps();
  int64_t i = 0, c = c0;
  for (; i + 16 <= count; i += 16) {
    const __m512 vs = _mm512_maskz_permutexvar_ps(0xFFFF, spread, _mm512_maskz_loadu_ps(first, scale + c));
    const __m512 vt = _mm512_maskz_permutexvar_ps(0xFFFF, spread, _mm512_maskz_loadu_ps(first, shift + c));
    _mm512_storeu_ps(y + i, _mm512_maskz_max_ps(0xFFFF, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), vs, vt), zero));
    c += per;
    if (c == channels) c = 0;
  }
  return i;
}
#endif

// AffineReluRun: the piece channel run by channel run, each from its plane's boundary or the
// piece's; the channel found once and then counted (no division a run: on 4x4 and 2x2 planes that
// cost more than the run, session 42), small planes a vector at a time where they can.
void bn_relu_run(const float* x, const float* scale, const float* shift, int64_t channels, int64_t plane,
                 int64_t begin, int64_t count, float* y) {
  int64_t c = begin / plane % channels, at = begin % plane, i = 0;
#if defined(__AVX512F__)
  if (at == 0) {
    i = bn_relu_small_planes(x, scale, shift, channels, plane, c, count, y);
    c = (c + i / plane) % channels;
  }
#endif
  while (i < count) {
    const int64_t len = std::min(count - i, plane - at);
    bn_relu_channel(x + i, scale[c], shift[c], len, y + i);
    i += len;
    at = 0;
    if (++c == channels) c = 0;
  }
}
}  // namespace

AffineReluRun CpuBackend::fused_affine_relu(const FusedStack& s) const {
  return fused_recomputes(s) ? bn_relu_run : nullptr;
}

void CpuBackend::fused_affine_coefficients(const FusedStack& s, const FusedTensors& t, float* scale, float* shift) {
  ET_CHECK(fused_recomputes(s), "fused stack: no relu(affine) output for this stack");
  for (int64_t c = 0; c < s.C; ++c)
    bn_rows::train_coefficients(t.gamma.f32()[c], t.beta.f32()[c], t.mean.f32()[c], t.invstd.f32()[c], scale + c,
                                shift + c);
}

// The readers compute y (Backend::fused_forward_by_readers): stacks y = relu(x * scale + shift) of
// x's planes in memory order, where fused_forward's statistics are statistics_in_region's.
bool CpuBackend::fused_forward_by_readers(const FusedStack& s) const {
  return fused_recomputes(s) && !s.small_planes() && !s.channel_slabs;
}

void CpuBackend::fused_forward_statistics(const FusedStack& s, FusedTensors& t, bool training, float* scale,
                                          float* shift, Workspace ws) {
  ET_CHECK(fused_forward_by_readers(s), "fused stack: its readers cannot compute its output");
  const int64_t N = t.x.dim(0), C = s.C;
  ET_CHECK(ws.bytes >= fused_workspace_bytes(s, N), "fused stack: workspace");
  if (t.x_sums.defined()) ET_CHECK(t.x_sums.dim(1) >= N && t.x_sums.dim(2) == C, "fused stack: x sums ", t.x_sums.shape.str());
  const SumTables tab(static_cast<float*>(ws.data) + thread_floats(s) * cpu_threads(), N, C);
  cpu::StealingRanges planes = plane_ranges(N * C, s.stages[0].H * s.stages[0].W);
#pragma omp parallel
  statistics_in_region(s.stages[0], s.C, t, training, tab, scale, shift, planes);
}

}  // namespace et
