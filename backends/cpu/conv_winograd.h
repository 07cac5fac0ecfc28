// Winograd F(2x2, 3x3) path of the CPU backend (conv_winograd.cpp): forward, data gradient and
// weight gradient (F(3x3, 2x2), its transpose) of dense 3x3 stride-1 convs (pad <= 2), 2.25x
// fewer multiply-adds than the direct / GEMM paths.
#pragma once
#include <cstddef>

#include "backends/backend.h"

namespace et::cpu {

bool winograd_applies(const Conv2dGeom& g, ConvPass pass);
size_t winograd_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
// x: f32, or DType::AffineRelu (a fused stack's output, computed image by image from the stack's
// f32 input before the channels-last copy). sum1 / sum2 (optional, [N][K] from plane n * K + k):
// each output plane's sum and sum of squares (bn_rows::plane_sums, the BN statistics a fused stack
// reading y takes from its producer), taken per chunk of images while y is in this core's cache.
void winograd_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                      float* sum1 = nullptr, float* sum2 = nullptr);
// dz_sums (or null): conv_direct.h's epilogue, on each chunk of images as written.
void winograd_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                            void* ws, const DzSumsEpilogue* dz_sums = nullptr);
// x: f32 or any stash encoding (memory/stored_reader.h), decoded an image at a time.
void winograd_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                              bool accumulate, void* ws);

// Winograd F(2x2, 3x3) by rows of tiles (conv_winograd_rows.cpp): forward and data gradient of
// 3x3 stride-1 pad-1 convs on 32x32, 16x16 and 8x8 planes, AVX-512, AVX2 and aarch64 NEON builds
// (conv_winograd_rows.h's ET_WINOGRAD_ROWS); the same interfaces as above
// (winograd_rows_applies and _workspace answer for the weight gradient too: winograd_wgrad_rows's).
bool winograd_rows_applies(const Conv2dGeom& g, ConvPass pass);
size_t winograd_rows_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
void winograd_rows_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                           float* sum1 = nullptr, float* sum2 = nullptr);
void winograd_rows_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                                 void* ws, const DzSumsEpilogue* dz_sums = nullptr);
// ... and the weight gradient on the same planes, channels in multiples of 4
// (conv_winograd_wgrad.cpp); x: f32 or any stash encoding (memory/stored_reader.h), decoded a plane
// (8x8: an image) at a time.
bool winograd_wgrad_rows_applies(const Conv2dGeom& g);
size_t winograd_wgrad_rows_workspace(const Conv2dGeom& g, int threads);
void winograd_wgrad_rows(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db, bool accumulate,
                         void* ws);

}  // namespace et::cpu
