// 4-bit training on CUDA (docs/quant.md, issue 13): the INT4 and LUQ FP4 quantizers, and the
// integer products of the conv and linear passes.
//
// Quantizers: one thread per element, the CPU's arithmetic in the same order with the rounding of
// each operation explicit (__fmul_rn: no contraction), and the FP4 field and the counter-based
// random bits from quant/codes.h, which the CPU calls too, so the codes are the CPU's codes.
//
// The integer products: cuda_int_gemm.cuh; the backward passes' in cuda_quant_data_grad.cu and
// cuda_quant_weight_grad.cu.
#include <cstdint>

#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_int_gemm.cuh"
#include "quant/codes.h"

namespace et {

namespace {

// ---- quantizers (1 / scale rounded as the CPU's division)

__global__ void quantize_int4_kernel(const float* x, int64_t n, ScaleRef scale, float lo, float hi, int8_t* q) {
  const float inv_scale = __fdiv_rn(1.f, scale.get());
  ET_GRID_STRIDE(i, n) {
    const float r = fminf(fmaxf(rintf(__fmul_rn(x[i], inv_scale)), lo), hi);  // nearest, ties to even
    q[i] = int8_t(int(r));
  }
}

// The key from the step seed on the device (set_step_seed), as dropout's: a replayed step rounds
// with its own bits. alpha 0: an all-zero gradient, every code 0 (the CPU's memset).
__global__ void quantize_fp4_kernel(const float* g, int64_t n, ScaleRef alpha, int levels, Fp4Rounding mode,
                                    const uint64_t* step_seed, QuantDraw draw, int8_t* q) {
  const float a = alpha.get();
  const float inv_alpha = a == 0.f ? 0.f : __fdiv_rn(1.f, a);
  const quant::RngKey key = draw.key_for(*step_seed);
  ET_GRID_STRIDE(i, n) {
    if (a == 0.f) {
      q[i] = 0;
      continue;
    }
    const float v = g[i];
    const int f = quant::fp4_field(__fmul_rn(fabsf(v), inv_alpha), levels, mode, quant::rng_bits(key, uint32_t(i)));
    q[i] = quant::fp4_value(signbit(v) ? 1 : 0, f);
  }
}

__global__ void dequantize_kernel(const int8_t* q, int64_t n, ScaleRef scale, float* y) {
  const float s = scale.get();
  ET_GRID_STRIDE(i, n) y[i] = __fmul_rn(float(q[i]), s);
}

}  // namespace

void CudaBackend::quantize_int4(const Tensor& x, Tensor& q) {
  ET_CHECK(x.numel() == q.numel() && (q.scale_at || q.scale > 0.f) && (q.dtype == DType::I4 || q.dtype == DType::U4));
  const bool u = q.dtype == DType::U4;
  quantize_int4_kernel<<<blocks_for(x.numel()), kThreads, 0, stream_>>>(
      x.f32(), x.numel(), scale_ref(q), u ? 0.f : float(-quant::kInt4SignedMax),
      float(u ? quant::kInt4UnsignedMax : quant::kInt4SignedMax), q.codes());
  cuda::launched("quantize_int4");
}

void CudaBackend::quantize_fp4(const Tensor& g, int levels, Fp4Rounding mode, const QuantDraw& draw, Tensor& q) {
  ET_CHECK(g.numel() == q.numel() && q.dtype == DType::F4);
  ET_CHECK(levels >= 1 && levels <= quant::kFp4MaxLevels, "FP4 levels ", levels);
  ET_CHECK(g.numel() < (int64_t(1) << 32), "tensor too large for 32-bit RNG counters");
  set_step_seed(draw.seed.step);
  quantize_fp4_kernel<<<blocks_for(g.numel()), kThreads, 0, stream_>>>(g.f32(), g.numel(), scale_ref(q), levels,
                                                                         mode, step_seed_dev_, draw, q.codes());
  cuda::launched("quantize_fp4");
}

void CudaBackend::dequantize(const Tensor& q, Tensor& y) {
  ET_CHECK(q.numel() == y.numel());
  dequantize_kernel<<<blocks_for(q.numel()), kThreads, 0, stream_>>>(q.codes(), q.numel(), scale_ref(q), y.f32());
  cuda::launched("dequantize");
}

// The products as GEMMs: forward K x (N P Q) over C R S; data gradient C x (N H W) over K R S;
// weight gradient K x (C R S) over N P Q.
size_t CudaBackend::conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  const int64_t CRS = g.C * g.R * g.S, NPQ = g.N * g.P * g.Q;
  size_t split = pass == ConvPass::Forward ? split_bytes(g.K, NPQ, CRS, sm_count_)
                                           : split_bytes(g.K, CRS, NPQ, sm_count_);
  if (pass == ConvPass::BackwardData) {  // one product per phase (strided), one after another
    split = 0;
    for_each_data_grad_phase(conv_shape(g), [&](const int_gemm::DataGradPhase& ph) {
      split = std::max(split, split_bytes(g.C, g.N * ph.positions(), g.K * ph.taps(), sm_count_));
    });
  }
  return decode_bytes(g, pass) + split;
}

void CudaBackend::conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq_in, const Tensor& wq, const Tensor& b,
                                   Tensor& y, Workspace ws) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4);
  const ConvShape s = conv_shape(g);
  const int64_t CRS = g.C * g.R * g.S, PQ = g.P * g.Q;
  const size_t decode = decode_bytes(g, ConvPass::Forward);
  const Tensor xq = dense_codes(*codec_, xq_in, ws);  // a recompute may read the stash's codes
  const BiasedOut<int_gemm::PlanesOut> out{y.f32(), int_gemm::PlanesOut{g.K, PQ}, ScaleProduct{scale_ref(xq), scale_ref(wq)},
                                           b.defined() ? b.f32() : nullptr, true};
  run_split_int_gemm(stream_, sm_count_, g.K, g.N * PQ, CRS, int_gemm::Dense{wq.codes(), CRS, 1},
                     int_gemm::ConvInputByTaps{xq.codes(), s}, out, split_part(ws, decode));
}

// Room to decode stored input codes (memory.stash = bitmap_int4).
size_t CudaBackend::linear_q_workspace_bytes(int64_t n, int64_t in, int64_t) const { return size_t(n * in); }

// Linear layers: y[N, O] = xq[N, I] wq^T.
void CudaBackend::linear_forward_q(const Tensor& xq_in, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws) {
  const Tensor xq = dense_codes(*codec_, xq_in, ws);
  const int64_t N = xq.dim(0), I = xq.dim(1), O = wq.dim(0);
  const BiasedOut<int_gemm::RowsOut> out{y.f32(), int_gemm::RowsOut{O}, ScaleProduct{scale_ref(xq), scale_ref(wq)},
                                         b.defined() ? b.f32() : nullptr, false};
  run_int_gemm(stream_, N, O, I, int_gemm::Dense{xq.codes(), I, 1}, int_gemm::Dense{wq.codes(), 1, I}, out);
}

}  // namespace et
