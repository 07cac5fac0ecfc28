// Implicit-GEMM conv path of the CPU backend (conv_implicit.cpp), used by conv.cpp for dense convs
// with many channels on small maps (VGG's 8x8 / 4x4 / 2x2 stages), where im2col + col2im and the
// flattened-plane direct kernels spend more time moving data than multiplying.
//
// A chunk of images is copied once into a zero-padded channels-last buffer [img][Hp][Wp][C]; an
// im2col row (tap t, channel c) of output position j is then xn[base(j) + off(t) + c], so the
// GEMM's packing routines read im2col slivers straight from it (8 contiguous channels per load)
// and no column matrix is ever written:
//   forward:  y  [K, pos] = w [K, (t,c)]        x  im2col(x)  [(t,c), pos]
//   data:     dx [C, pos] = w' [C, (t,k)]       x  im2col(dy padded by R-1-pad)
//   weight:   dw [K, (t,c)] (+)= dy [K, pos]    x  im2col(x)^T [pos, (t,c)]
// (w' is w transposed and flipped.) The weight matrices are packed once per call. A strided
// conv's data gradient runs as stride * stride phases, one GEMM each: the dx positions of one
// parity class read one sub-kernel of w' (see Phase in conv_implicit.cpp), and no multiply-add
// is spent on the zeros of an upsampled dy (strides up to 2).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/backend.h"

namespace et {
class StoredReader;  // memory/stored_reader.h
}

namespace et::cpu {

bool implicit_applies(const Conv2dGeom& g, ConvPass pass);
size_t implicit_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
// sum1 / sum2 (optional, [N][K] from plane n * K + k): each output plane's sum and sum of squares
// (bn_rows::plane_sums), taken after each task's planes are written, while they are in cache.
void implicit_forward(const Conv2dGeom& g, const float* x, const float* w, const float* b, float* y, void* ws,
                      float* sum1 = nullptr, float* sum2 = nullptr);
// dz_sums (builds with ET_ELEMENTWISE_IN_REGISTERS): the first sweep of the fused stack before,
// on each task's planes of dx after its phases have written them (fused_elementwise::dz_sums_planes).
void implicit_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                            void* ws, const DzSumsEpilogue* dz_sums = nullptr);
void implicit_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                              bool accumulate, void* ws);

// One image [Ci][Hi][Wi] -> the interior of dst [Hp][Wp][Ci] at (ph, pw); rows / columns past
// Hp / Wp are dropped, the border is left untouched (the callers zero it once). With `stack`, src is
// a fused stack's f32 input and the image staged is its output relu(src * scale[c] + shift[c])
// (DType::AffineRelu), computed as it is staged with the arithmetic of the stack's run (one
// rounding, then relu_forward's rule): the same bits, and no pass of its own through a scratch image.
void to_channels_last(const float* src, int64_t Ci, int64_t Hi, int64_t Wi, int64_t ph, int64_t pw, int64_t Hp,
                      int64_t Wp, float* dst, const AffineReluSource* stack = nullptr);
// Image n of a weight gradient's x [N, Ci, Hi, Wi] staged as above: read through the reader (any
// stash encoding), or, where x is a fused stack's output over an f32 input, computed from that input.
void image_to_channels_last(StoredReader& xr, int64_t n, int64_t Ci, int64_t Hi, int64_t Wi, int64_t ph, int64_t pw,
                            int64_t Hp, int64_t Wp, float* dst);

}  // namespace et::cpu
