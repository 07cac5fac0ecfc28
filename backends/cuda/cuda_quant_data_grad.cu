// 4-bit training on CUDA: the data gradients of conv and linear, dx = gq x wq over int8 codes by the
// integer product of cuda_int_gemm.cuh (its file comment says why this is a file of its own).
#include <cstdint>

#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/cuda_int_gemm.cuh"

namespace et {

void CudaBackend::conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx,
                                         bool accumulate, Workspace ws) {
  ET_CHECK(g.groups == 1 && wq.dtype == DType::I4 && gq.dtype == DType::F4);
  const ConvShape s = conv_shape(g);
  const int64_t HW = g.H * g.W;
  const ScaleProduct scale{scale_ref(gq), scale_ref(wq)};
  if (s.stride_h == 1 && s.stride_w == 1) {
    const ScaledOut<int_gemm::PlanesOut> out{dx.f32(), int_gemm::PlanesOut{g.C, HW}, scale, accumulate, false};
    run_split_int_gemm(stream_, sm_count_, g.C, g.N * HW, g.K * g.R * g.S,
                       int_gemm::WeightsByInputChannel{wq.codes(), s}, int_gemm::GradByTaps{gq.codes(), s}, out, ws);
    return;
  }
  // Strided: each phase of the input positions over its own taps (int_gemm::DataGradPhase), not
  // the zeros between the strided outputs. A phase without taps writes its dx as the CPU does
  // with a zero sum (0 * scale, + dx where it accumulates).
  for_each_data_grad_phase(s, [&](const int_gemm::DataGradPhase& ph) {
    const ScaledOut<int_gemm::PhaseOut> out{dx.f32(), int_gemm::PhaseOut{g.C, s, ph}, scale, accumulate, false};
    run_split_int_gemm(stream_, sm_count_, g.C, g.N * ph.positions(), g.K * ph.taps(),
                       int_gemm::WeightsByPhaseTaps{wq.codes(), s, ph}, int_gemm::GradByPhaseTaps{gq.codes(), s, ph},
                       out, ws);
  });
}

// Linear layers: dx[N, I] = gq[N, O] wq[O, I].
void CudaBackend::linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate, Workspace) {
  const int64_t N = gq.dim(0), O = gq.dim(1), I = wq.dim(1);
  const ScaledOut<int_gemm::RowsOut> out{dx.f32(), int_gemm::RowsOut{I}, ScaleProduct{scale_ref(gq), scale_ref(wq)},
                                         accumulate, true};
  run_int_gemm(stream_, N, I, O, int_gemm::Dense{gq.codes(), O, 1}, int_gemm::Dense{wq.codes(), I, 1}, out);
}

}  // namespace et
