// 4-bit training on CUDA (docs/quant.md, issue 13): the INT4 and LUQ FP4 quantizers, and the
// integer products of the conv and linear passes.
//
// Quantizers: one thread per element, the CPU's arithmetic in the same order with the rounding of
// each operation explicit (__fmul_rn: no contraction), and the FP4 field and the counter-based
// random bits from quant/codes.h, which the CPU calls too, so the codes are the CPU's codes.
//
// Integer products: one implicit-GEMM kernel, C[M][N] = sum_k A(m, k) B(k, n) over int8 codes with
// int32 sums, its operands gathered in place by the views of int_gemm_operands.h (no im2col
// buffer) into shared-memory tiles of 64 x 32 codes, four codes a word, multiplied by dp4a (4
// products and their sum in one instruction; sm_61 and later, a byte loop before). The sums are
// exact (|sum| < 2^31 is checked as on the CPU), so any tiling gives the CPU's integers; each
// output is then scaled once with the CPU's float operations in the CPU's order. The weight
// gradients sum over every position of the batch: the kernel splits that sum over blocks
// (split-K) and adds the parts with integer atomics into a workspace (exact in any order), which a
// second kernel scales.
#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/int_gemm_operands.h"
#include "quant/codes.h"

namespace et {

namespace {

using cuda::blocks_for;
using cuda::kThreads;
using int_gemm::ConvShape;

// ---- quantizers

__global__ void quantize_int4_kernel(const float* x, int64_t n, float inv_scale, float lo, float hi, int8_t* q) {
  ET_GRID_STRIDE(i, n) {
    const float r = fminf(fmaxf(rintf(__fmul_rn(x[i], inv_scale)), lo), hi);  // nearest, ties to even
    q[i] = int8_t(int(r));
  }
}

__global__ void quantize_fp4_kernel(const float* g, int64_t n, float inv_alpha, int levels, Fp4Rounding mode,
                                    quant::RngKey key, int8_t* q) {
  ET_GRID_STRIDE(i, n) {
    const float v = g[i];
    const int f = quant::fp4_field(__fmul_rn(fabsf(v), inv_alpha), levels, mode, quant::rng_bits(key, uint32_t(i)));
    q[i] = quant::fp4_value(signbit(v) ? 1 : 0, f);
  }
}

__global__ void dequantize_kernel(const int8_t* q, int64_t n, float scale, float* y) {
  ET_GRID_STRIDE(i, n) y[i] = __fmul_rn(float(q[i]), scale);
}

// ---- the integer product

constexpr int kTileM = 64, kTileN = 64, kTileK = 32;  // codes; kTileK / 4 words per row of a tile
constexpr int kGemmThreads = 256;                     // 16 x 16 threads, 4 x 4 outputs each

__device__ __forceinline__ int dot4(int a, int b, int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  return __dp4a(a, b, c);
#else
  for (int j = 0; j < 4; ++j) c += int(int8_t(a >> (8 * j))) * int(int8_t(b >> (8 * j)));
  return c;
#endif
}

// Block (x, y, z): outputs [n0, n0 + 64) x [m0, m0 + 64), the sum over k in [z * k_chunk, + k_chunk).
template <class A, class B, class Out>
__global__ void __launch_bounds__(kGemmThreads)
    int_gemm_kernel(int64_t M, int64_t N, int64_t K, int64_t k_chunk, A a, B b, Out out) {
  __shared__ __align__(16) int as[kTileK / 4][kTileM];  // word kw of row m: codes k0 + 4 kw .. + 3
  __shared__ __align__(16) int bs[kTileK / 4][kTileN];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  const int64_t k_begin = int64_t(blockIdx.z) * k_chunk, k_end = K < k_begin + k_chunk ? K : k_begin + k_chunk;
  int acc[4][4] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileK) {
    // 512 words of each operand, 2 per thread; consecutive threads take consecutive rows / columns.
    for (int i = 0; i < 2; ++i) {
      const int w = tid + kGemmThreads * i, kw = w / kTileM, r = w % kTileM;
      unsigned pa = 0, pb = 0;  // byte j: code k0 + 4 kw + j (0 past the end)
      for (int j = 0; j < 4; ++j) {
        const int64_t k = k0 + 4 * kw + j;
        if (k >= k_end) break;
        if (m0 + r < M) pa |= (unsigned(a.at(m0 + r, k)) & 0xFFu) << (8 * j);
        if (n0 + r < N) pb |= (unsigned(b.at(k, n0 + r)) & 0xFFu) << (8 * j);
      }
      as[kw][r] = int(pa);
      bs[kw][r] = int(pb);
    }
    __syncthreads();
#pragma unroll
    for (int kw = 0; kw < kTileK / 4; ++kw) {
      const int4 av = *reinterpret_cast<const int4*>(&as[kw][ty * 4]);
      const int4 bv = *reinterpret_cast<const int4*>(&bs[kw][tx * 4]);
      const int ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = dot4(ar[i], br[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      const int64_t m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (m < M && n < N) out(m, n, acc[i][j]);
    }
}

// Outputs: the CPU's float operations on the exact sum, each rounded as the CPU rounds it.
// y = float(v) * scale + bias (0 without one); bias by row (conv: the output channel) or column.
template <class Index>
struct BiasedOut {
  float* y;
  Index at;
  float scale;
  const float* bias;
  bool bias_by_row;
  __device__ void operator()(int64_t m, int64_t n, int v) const {
    const float b = bias ? bias[bias_by_row ? m : n] : 0.f;
    y[at.at(m, n)] = __fadd_rn(__fmul_rn(float(v), scale), b);
  }
};
// d = float(v) * scale, + d where it accumulates; plus_zero: + 0 otherwise (the CPU's form there).
template <class Index>
struct ScaledOut {
  float* d;
  Index at;
  float scale;
  bool accumulate, plus_zero;
  __device__ void operator()(int64_t m, int64_t n, int v) const {
    float* p = d + at.at(m, n);
    const float s = __fmul_rn(float(v), scale);
    *p = accumulate ? __fadd_rn(s, *p) : plus_zero ? __fadd_rn(s, 0.f) : s;
  }
};
// The split sums, added into an int32 workspace (zeroed first).
struct AtomicOut {
  int* acc;
  int64_t ld;
  __device__ void operator()(int64_t m, int64_t n, int v) const { atomicAdd(acc + m * ld + n, v); }
};

__global__ void scale_sums_kernel(const int* acc, int64_t n, float scale, bool accumulate, float* d) {
  ET_GRID_STRIDE(i, n) d[i] = __fadd_rn(__fmul_rn(float(acc[i]), scale), accumulate ? d[i] : 0.f);
}

// The bias gradient: db[k] = float(sum of g's codes of channel k) * scale (+ db). g is
// [rows][channels][run] (conv: run = P * Q; linear: run = 1). One block per channel.
__global__ void code_sums_kernel(const int8_t* g, int64_t rows, int64_t channels, int64_t run, float scale,
                                 bool accumulate, float* db) {
  __shared__ long long part[kThreads];
  const int64_t k = blockIdx.x;
  long long s = 0;
  for (int64_t i = threadIdx.x; i < rows * run; i += blockDim.x) s += g[(i / run * channels + k) * run + i % run];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int h = kThreads / 2; h > 0; h /= 2) {
    if (int(threadIdx.x) < h) part[threadIdx.x] += part[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[k] = __fadd_rn(__fmul_rn(float(part[0]), scale), accumulate ? db[k] : 0.f);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// C = A x B into out on the stream; the k range split over `splits` blocks (out must add then).
template <class A, class B, class Out>
void run_int_gemm(cudaStream_t stream, int64_t M, int64_t N, int64_t K, const A& a, const B& b, const Out& out,
              int64_t splits = 1) {
  if (M == 0 || N == 0) return;
  const int64_t k_chunk = ceil_div(ceil_div(std::max<int64_t>(K, 1), splits), kTileK) * kTileK;
  splits = ceil_div(std::max<int64_t>(K, 1), k_chunk);
  ET_CHECK(ceil_div(M, kTileM) <= 65535 && splits <= 65535, "integer product: ", M, " rows, ", splits, " splits");
  const dim3 grid(unsigned(ceil_div(N, kTileN)), unsigned(ceil_div(M, kTileM)), unsigned(splits));
  int_gemm_kernel<<<grid, kGemmThreads, 0, stream>>>(M, N, K, k_chunk, a, b, out);
  cuda::launched("int_gemm");
}

// Splits of a weight gradient's long sum: about 512 blocks in all, at least 1024 codes of k each.
int64_t weight_splits(int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = ceil_div(M, kTileM) * ceil_div(N, kTileN);
  return std::max<int64_t>(1, std::min(ceil_div(512, tiles), K / 1024));
}

ConvShape conv_shape(const Conv2dGeom& g) {
  ET_CHECK(g.C * g.H * g.W < (int64_t(1) << 31) && g.K * g.P * g.Q < (int64_t(1) << 31), "conv too large");
  return int_gemm::conv_shape_of(g);
}

// The input codes a kernel reads in place: dense INT4 (bitmap_int4's stored codes are refused by
// the CUDA stash codec before a step runs).
void check_input_codes(const Tensor& xq) {
  ET_CHECK(xq.dtype == DType::I4 || xq.dtype == DType::U4, "CUDA integer kernels read dense INT4 input codes, not ",
           dtype_name(xq.dtype));
}

}  // namespace

void CudaBackend::quantize_int4(const Tensor& x, Tensor& q) {
  ET_CHECK(x.numel() == q.numel() && q.scale > 0.f && (q.dtype == DType::I4 || q.dtype == DType::U4));
  const bool u = q.dtype == DType::U4;
  quantize_int4_kernel<<<blocks_for(x.numel()), kThreads, 0, stream_>>>(
      x.f32(), x.numel(), 1.f / q.scale, u ? 0.f : float(-quant::kInt4SignedMax),
      float(u ? quant::kInt4UnsignedMax : quant::kInt4SignedMax), q.codes());
  cuda::launched("quantize_int4");
}

void CudaBackend::quantize_fp4(const Tensor& g, int levels, Fp4Rounding mode, quant::RngKey key, Tensor& q) {
  ET_CHECK(g.numel() == q.numel() && q.dtype == DType::F4);
  ET_CHECK(levels >= 1 && levels <= quant::kFp4MaxLevels, "FP4 levels ", levels);
  ET_CHECK(g.numel() < (int64_t(1) << 32), "tensor too large for 32-bit RNG counters");
  if (q.scale == 0.f) {  // an all-zero gradient: every code is zero
    cuda::check(cudaMemsetAsync(q.codes(), 0, size_t(q.numel()), stream_), "cudaMemsetAsync");
    return;
  }
  quantize_fp4_kernel<<<blocks_for(g.numel()), kThreads, 0, stream_>>>(g.f32(), g.numel(), 1.f / q.scale, levels,
                                                                         mode, key, q.codes());
  cuda::launched("quantize_fp4");
}

void CudaBackend::dequantize(const Tensor& q, Tensor& y) {
  ET_CHECK(q.numel() == y.numel());
  dequantize_kernel<<<blocks_for(q.numel()), kThreads, 0, stream_>>>(q.codes(), q.numel(), q.scale, y.f32());
  cuda::launched("dequantize");
}

size_t CudaBackend::conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  // The weight gradient's split sums, one int32 per weight.
  return pass == ConvPass::BackwardWeight ? size_t(g.K * g.C * g.R * g.S) * 4 : 0;
}

void CudaBackend::conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                                   Workspace) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4);
  check_input_codes(xq);
  const ConvShape s = conv_shape(g);
  const int64_t CRS = g.C * g.R * g.S, PQ = g.P * g.Q;
  const BiasedOut<int_gemm::PlanesOut> out{y.f32(), int_gemm::PlanesOut{g.K, PQ}, xq.scale * wq.scale,
                                           b.defined() ? b.f32() : nullptr, true};
  run_int_gemm(stream_, g.K, g.N * PQ, CRS, int_gemm::Dense{wq.codes(), CRS, 1}, int_gemm::ConvInputByTaps{xq.codes(), s},
           out);
}

void CudaBackend::conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx,
                                         bool accumulate, Workspace) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4 && gq.dtype == DType::F4);
  const ConvShape s = conv_shape(g);
  const int64_t HW = g.H * g.W;
  const ScaledOut<int_gemm::PlanesOut> out{dx.f32(), int_gemm::PlanesOut{g.C, HW}, gq.scale * wq.scale, accumulate,
                                           false};
  run_int_gemm(stream_, g.C, g.N * HW, g.K * g.R * g.S, int_gemm::WeightsByInputChannel{wq.codes(), s},
           int_gemm::GradByTaps{gq.codes(), s}, out);
}

void CudaBackend::conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& gq, Tensor& dw,
                                           Tensor& db, bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && gq.dtype == DType::F4);
  check_input_codes(xq);
  // |sum| <= N * PQ * 15 * 64 must fit the int32 sums (the CPU's check).
  ET_CHECK(double(g.N) * double(g.P * g.Q) * 64.0 * 15.0 < 2147483647.0, "int32 weight-gradient sums could overflow");
  const ConvShape s = conv_shape(g);
  const int64_t CRS = g.C * g.R * g.S, PQ = g.P * g.Q, NPQ = g.N * PQ;
  ET_CHECK(ws.bytes >= conv2d_q_workspace_bytes(g, ConvPass::BackwardWeight), "conv int workspace");
  int* acc = static_cast<int*>(ws.data);
  cuda::check(cudaMemsetAsync(acc, 0, size_t(g.K * CRS) * 4, stream_), "cudaMemsetAsync");
  run_int_gemm(stream_, g.K, CRS, NPQ, int_gemm::GradByPositions{gq.codes(), s},
           int_gemm::ConvInputByPositions{int_gemm::ConvInputByTaps{xq.codes(), s}}, AtomicOut{acc, CRS},
           weight_splits(g.K, CRS, NPQ));
  scale_sums_kernel<<<blocks_for(g.K * CRS), kThreads, 0, stream_>>>(acc, g.K * CRS, xq.scale * gq.scale, accumulate,
                                                                      dw.f32());
  if (db.defined())
    code_sums_kernel<<<unsigned(g.K), kThreads, 0, stream_>>>(gq.codes(), g.N, g.K, PQ, gq.scale, accumulate, db.f32());
  cuda::launched("conv2d_backward_weight_q");
}

size_t CudaBackend::linear_q_workspace_bytes(int64_t, int64_t, int64_t) const { return 0; }

// Linear layers: y[N, O] = xq[N, I] wq^T; dx[N, I] = gq[N, O] wq[O, I]; dw[O, I] = gq^T xq.
void CudaBackend::linear_forward_q(const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace) {
  check_input_codes(xq);
  const int64_t N = xq.dim(0), I = xq.dim(1), O = wq.dim(0);
  const BiasedOut<int_gemm::RowsOut> out{y.f32(), int_gemm::RowsOut{O}, xq.scale * wq.scale,
                                         b.defined() ? b.f32() : nullptr, false};
  run_int_gemm(stream_, N, O, I, int_gemm::Dense{xq.codes(), I, 1}, int_gemm::Dense{wq.codes(), 1, I}, out);
}

void CudaBackend::linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate, Workspace) {
  const int64_t N = gq.dim(0), O = gq.dim(1), I = wq.dim(1);
  const ScaledOut<int_gemm::RowsOut> out{dx.f32(), int_gemm::RowsOut{I}, gq.scale * wq.scale, accumulate, true};
  run_int_gemm(stream_, N, I, O, int_gemm::Dense{gq.codes(), O, 1}, int_gemm::Dense{wq.codes(), I, 1}, out);
}

void CudaBackend::linear_backward_weight_q(const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db, bool accumulate,
                                           Workspace) {
  check_input_codes(xq);
  const int64_t N = xq.dim(0), I = xq.dim(1), O = gq.dim(1);
  const ScaledOut<int_gemm::RowsOut> out{dw.f32(), int_gemm::RowsOut{I}, xq.scale * gq.scale, accumulate, true};
  run_int_gemm(stream_, O, I, N, int_gemm::Dense{gq.codes(), 1, O}, int_gemm::Dense{xq.codes(), I, 1}, out);
  if (db.defined())
    code_sums_kernel<<<unsigned(O), kThreads, 0, stream_>>>(gq.codes(), N, O, 1, gq.scale, accumulate, db.f32());
  cuda::launched("linear_backward_weight_q");
}

}  // namespace et
