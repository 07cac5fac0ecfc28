// im2col + SGEMM conv path of the CPU backend (conv_gemm.cpp), used by conv.cpp for what the
// direct kernels do not cover well: 1x1 convs, strided convs, small maps.
//
// Several images go into one GEMM so that its N dimension is large even on 4x4 / 2x2 maps:
// for a chunk of nb images (cols = nb*P*Q columns, image b at columns [b*PQ, (b+1)*PQ)):
//   forward:  y [Kg, cols]   = w [Kg, CRS] x col [CRS, cols]              (per thread, own images)
//   data:     col [CRS, cols] = w^T x dy [Kg, cols];  dx = col2im(col)    (per thread, own images)
//   weight:   dw [K, CRS]   (+)= dy [K, cols] x col^T                      (threads split K rows;
//                                                                       1x1: threads split images)
// The weight gradient walks the chunks in order and every dw element belongs to one thread, so
// its summation order depends on the geometry only, not on the thread count; for 1x1 convs it
// depends on the thread count too (per-thread partials, reduced in thread order).
#pragma once
#include <cstddef>

#include "backends/backend.h"

namespace et::cpu {

size_t gemm_conv_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
// x: f32, or DType::AffineRelu (conv_direct.h, ConvInput: computed an image at a time).
// sum1 / sum2 (optional, [N][K] from plane n * K + k): each output plane's sum and sum of squares
// (bn_rows::plane_sums), taken after each chunk of images is written, while it is in cache.
void gemm_conv_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                       float* sum1 = nullptr, float* sum2 = nullptr);
// dz_sums (groups 1; or null): conv_direct.h's epilogue, on each thread's chunk
// of images as written.
void gemm_conv_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                             void* ws, const DzSumsEpilogue* dz_sums = nullptr);
void gemm_conv_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                               bool accumulate, void* ws);

}  // namespace et::cpu
