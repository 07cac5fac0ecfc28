// 4-bit training on CUDA: the weight and bias gradients of conv and linear, dw = gq^T xq over int8
// codes by the integer product of cuda_int_gemm.cuh (its file comment says why this is a file of its own).
#include <cstdint>

#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_int_gemm.cuh"

namespace et {

namespace {

// The bias gradient: db[k] = float(sum of g's codes of channel k) * scale (+ db). g is
// [rows][channels][run] (conv: run = P * Q; linear: run = 1). One block per channel.
__global__ void code_sums_kernel(const int8_t* g, int64_t rows, int64_t channels, int64_t run, ScaleRef scale,
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
  if (threadIdx.x == 0) db[k] = __fadd_rn(__fmul_rn(float(part[0]), scale.get()), accumulate ? db[k] : 0.f);
}

}  // namespace

void CudaBackend::conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq_in, const Tensor& gq, Tensor& dw,
                                           Tensor& db, bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && gq.dtype == DType::F4);
  // |sum| <= N * PQ * 15 * 64 must fit the int32 sums (the CPU's check).
  ET_CHECK(double(g.N) * double(g.P * g.Q) * 64.0 * 15.0 < 2147483647.0, "int32 weight-gradient sums could overflow");
  const ConvShape s = conv_shape(g);
  const int64_t CRS = g.C * g.R * g.S, PQ = g.P * g.Q;
  const size_t decode = decode_bytes(g, ConvPass::BackwardWeight);
  const Tensor xq = dense_codes(*codec_, xq_in, ws);
  // dw = float(sum) * scale, + dw where it accumulates, else + 0 (the CPU's form).
  const ScaledOut<int_gemm::RowsOut> out{dw.f32(), int_gemm::RowsOut{CRS}, ScaleProduct{scale_ref(xq), scale_ref(gq)},
                                         accumulate, true};
  run_split_int_gemm(stream_, sm_count_, g.K, CRS, g.N * PQ, int_gemm::GradByPositions{gq.codes(), s},
                     int_gemm::ConvInputByPositions{int_gemm::ConvInputByTaps{xq.codes(), s}}, out,
                     split_part(ws, decode));
  if (db.defined())
    code_sums_kernel<<<unsigned(g.K), kThreads, 0, stream_>>>(gq.codes(), g.N, g.K, PQ, scale_ref(gq), accumulate,
                                                              db.f32());
  cuda::launched("conv2d_backward_weight_q");
}

// Linear layers: dw[O, I] = gq^T xq.
void CudaBackend::linear_backward_weight_q(const Tensor& xq_in, const Tensor& gq, Tensor& dw, Tensor& db,
                                           bool accumulate, Workspace ws) {
  const Tensor xq = dense_codes(*codec_, xq_in, ws);
  const int64_t N = xq.dim(0), I = xq.dim(1), O = gq.dim(1);
  const ScaledOut<int_gemm::RowsOut> out{dw.f32(), int_gemm::RowsOut{I}, ScaleProduct{scale_ref(xq), scale_ref(gq)},
                                         accumulate, true};
  run_int_gemm(stream_, O, I, N, int_gemm::Dense{gq.codes(), 1, O}, int_gemm::Dense{xq.codes(), I, 1}, out);
  if (db.defined())
    code_sums_kernel<<<unsigned(O), kThreads, 0, stream_>>>(gq.codes(), N, O, 1, scale_ref(gq), accumulate, db.f32());
  cuda::launched("linear_backward_weight_q");
}

}  // namespace et
