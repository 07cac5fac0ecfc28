// Direct (im2col-free) conv kernels of the CPU backend, used by conv.cpp where they apply.
//
// The trick shared by all of them ("flattened padded planes"): an input plane is copied, zero
// padded, into rows of width Wp; a stride-1 correlation then reads, for output position
// j = p*Wp + q and tap (r,s), the element j + r*Wp + s. So every output row is computed over the
// full padded width (the last S-1 columns are junk and dropped when the result is copied out) and
// the whole output plane is one contiguous vector loop, whatever the map size. Where output rows
// are whole vectors (Q a multiple of 16: ResNet's 32x32 and 16x16 stages) the forward and data
// gradient skip the junk columns instead, a vector per 16 columns of a row, and write the output
// directly (the "row form", same bits). Backward data is
// the same correlation over the (zero-upsampled, for stride > 1) padded output gradient with the
// kernel flipped and channels swapped.
#pragma once
#include <cstddef>

#include "backends/backend.h"
#include "backends/cpu/conv_simd.h"

namespace et::cpu {

// Tests: run the scalar reference vectors instead of the native SIMD ones.
void conv_force_scalar(bool on);
// Tests: the direct forward / data gradient's row form (whole vectors per output row, no junk
// columns, results straight to the output; default on) or the flat form everywhere: the same bits.
void conv_direct_rows(bool on);
// Tests / A-B measurements: where both the GEMM and the direct kernels apply, force one
// (conv.cpp; the environment variable ET_CONV_PATH=gemm|direct|implicit|winograd|winograd_rows sets
// the initial value; implicit / winograd / winograd_rows fall back to the automatic choice where
// they do not apply).
enum class ConvPathOverride { Auto, Gemm, Direct, Implicit, Winograd, WinogradRows };
void conv_set_path_override(ConvPathOverride p);

// Dense (groups >= 1, not depthwise) kernels, stride 1 (and stride 2 through the phase kernels below).
bool direct_dense_applies(const Conv2dGeom& g, ConvPass pass);
size_t direct_dense_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
// x: f32, or DType::AffineRelu (ConvInput: computed row by row as the kernel places x's planes in
// its padded planes). sum1 / sum2 [N, K] (or null): each output
// plane's sums as BN takes them (bn_rows::plane_sums), taken right after the plane is written,
// while it is in L1.
void direct_dense_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                          float* sum1 = nullptr, float* sum2 = nullptr);
// dz_sums (groups 1; or null): the first backward sweep of the fused stack
// whose output is x, on each image's planes of dx right after they are written, while they are in
// this core's cache (fused_elementwise::dz_sums_piece; AVX-512, AVX2 and NEON builds).
void direct_dense_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                                void* ws, const DzSumsEpilogue* dz_sums = nullptr);
// Whether direct_dense_backward_data does the epilogue above for g (its own path, or dgrad_cl's).
bool direct_dense_dz_sums_applies(const Conv2dGeom& g);
// x: f32 or any stash encoding (memory/stored_reader.h), decoded a plane at a time
// (conv_direct_wgrad.cpp).
void direct_dense_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                                  bool accumulate, void* ws);
size_t direct_dense_wgrad_workspace(const Conv2dGeom& g, int threads);  // its own forms' (not wgrad_cl's)

// The 3x3 weight and data gradients (stride 1 or 2) with vectors along 16 input channels
// (conv_channels_last.cpp), which direct_dense_backward_weight / _data hand over to where
// wgrad_cl_chosen / dgrad_cl_chosen say (strided layers reach them through conv.cpp's choice, as
// direct_dense_applies is for stride 1).
bool wgrad_cl_applies(const Conv2dGeom& g);  // both passes
bool wgrad_cl_chosen(const Conv2dGeom& g);
size_t wgrad_cl_workspace(const Conv2dGeom& g, int threads);
void wgrad_cl(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db, bool accumulate,
              void* ws);
bool dgrad_cl_chosen(const Conv2dGeom& g);
size_t dgrad_cl_workspace(const Conv2dGeom& g, int threads);
// dz_sums: direct_dense_backward_data's epilogue, on each image right after it is unstaged.
void dgrad_cl(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate, void* ws,
              const DzSumsEpilogue* dz_sums = nullptr);

// Depthwise kernels (groups == C == K), any stride.
bool depthwise_applies(const Conv2dGeom& g, ConvPass pass);
size_t depthwise_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
// x: f32, or DType::AffineRelu (ConvInput). sum1 / sum2 [N * C] (both or neither): each output
// plane's sum and sum of squares for the BN after it (bn_rows::plane_sums), taken as it is written.
void depthwise_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                       float* sum1 = nullptr, float* sum2 = nullptr);
void depthwise_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                             void* ws);
// x: f32 or any stash encoding (memory/stored_reader.h), decoded a plane at a time.
void depthwise_backward_weight(const Conv2dGeom& g, const Tensor& x, const float* dy, float* dw, float* db,
                               bool accumulate, void* ws);

// Stride-2 forward and data gradient by phases (conv_direct_strided.cpp): stride-1 correlations
// over the input's column-phase copies (forward) or into dx's four phases (data gradient), on the
// direct kernels' register blocks; direct_dense_* hand stride-2 convs to them (the weight gradient
// too: conv_direct_wgrad.cpp, over the same copies). The forward takes x as f32 or
// DType::AffineRelu and takes y's plane sums like direct_dense_forward; the data gradient takes
// dz_sums per image (groups 1). The workspace: forward and data gradient (the weight gradient's is
// direct_dense_wgrad_workspace's).
bool direct_strided_applies(const Conv2dGeom& g, ConvPass pass);
size_t direct_strided_workspace(const Conv2dGeom& g, ConvPass pass, int threads);
void direct_strided_forward(const Conv2dGeom& g, const Tensor& x, const float* w, const float* b, float* y, void* ws,
                            float* sum1 = nullptr, float* sum2 = nullptr);
void direct_strided_backward_data(const Conv2dGeom& g, const float* dy, const float* w, float* dx, bool accumulate,
                                  void* ws, const DzSumsEpilogue* dz_sums = nullptr);

// ---- shared helpers (conv_direct.cpp)
constexpr int kMaxTaps = 64;  // R*S bound of the direct kernels
// The forward / data gradient's register block: kDirectMR output channels (the rows of a block of
// packed weights) by vectors of 16 positions (conv_direct.cpp).
constexpr int kDirectMR = kNarrowVectors ? 6 : 8;
// tile [Kr, Jr] = the correlation of Cin planes xp [Cin][L] (plane stride L) with packed weights
// wpk [Kr / kDirectMR][Cin][RS][kDirectMR]: tile[k][j] = sum over c, t of the weight of (k, c, t) times
// xp[c * L + j + off[t]] (the flat form: every position j < Jr, a multiple of 16).
void corr_planes_any(const float* xp, int64_t Cin, int64_t L, const int64_t* off, int RS, const float* wpk,
                     int64_t Kr, float* tile, int64_t Jr);
// The row form: out [nk][P * Q] (plane stride ldo; nk <= kDirectMR, one block of packed weights)
// (+)= the same correlation at positions p * Wp + q of the planes, q < Q (a multiple of 16), + bias,
// the same bits as the flat form. Whether it applies (Q a multiple of 16; tests can turn it off):
bool rows_apply(int64_t Q);
void corr_planes_rows_any(const float* xp, int64_t Cin, int64_t L, int64_t Wp, const int64_t* off, int RS,
                          const float* wpk, int nk, int64_t P, int64_t Q, float* out, int64_t ldo, const float* bias,
                          bool accumulate);
// The staging of a stride-2 conv's input (conv_direct_strided.cpp; its forward and the direct
// weight gradient): per channel 2 x S copies of the plane, copy (a, s) holding xpad[2i + a][2j + s]
// at (i, j), Q columns a row (Hq rows, Lc floats apart; L a channel). Tap (r, s) of output (p, q)
// reads copy (r % 2, s) at (p + r / 2, q): offset off[t] from the dense position p * Q + q.
struct StridedCopies {
  int64_t Hq, Lc, L;
  int64_t off[kMaxTaps];
  int RS;
};
StridedCopies strided_copies(const Conv2dGeom& g);
// Plane src [H, W] into its copies at dst; positions outside the plane are not written (zero them once).
void place_strided_copies(const Conv2dGeom& g, const StridedCopies& f, const float* src, float* dst);
// One group's weights w [Kg][Cg][RS] packed for the above. Forward: out = Kg, in = Cg. Backward data
// (flip): out = Cg, in = Kg, tap t reads w[k][c][RS-1-t]. Rows >= out are zero.
void pack_weights(const float* w, int64_t Kg, int64_t Cg, int RS, bool flip, float* wpk);
inline int64_t round16(int64_t v) { return (v + 15) / 16 * 16; }
// Plane stride for padded planes of Hp x Wp read by an S-wide window over a domain rounded up to 16.
inline int64_t plane_stride(int64_t Hp, int64_t Wp, int64_t S) { return round16(Hp * Wp + S + 16); }
// src [H,W] -> dst at rows top + h*dil, columns left + w*dil of width-Wp rows; other elements untouched.
void place_plane(const float* src, int64_t H, int64_t W, int64_t dil, int64_t top, int64_t left, int64_t Wp,
                 float* dst);
// A forward's x: f32 planes, or (DType::AffineRelu) a fused stack's output y = relu(x * scale[c] +
// shift[c]) that the kernel computes from the stack's f32 input as it stages it. `planes` is what
// the kernel reads from: x's own values, or the stack's input.
struct ConvInput {
  const float* planes = nullptr;
  const AffineReluSource* stack = nullptr;
  explicit ConvInput(const Tensor& x);
  explicit ConvInput(const float* x) : planes(x) {}
  // Plane pl = (n, c) of the C-channel input, [H, W], placed as place_plane does (dil 1).
  void place(int64_t C, int64_t pl, int64_t H, int64_t W, int64_t top, int64_t left, int64_t Wp, float* dst) const;
  // Image n of the C-channel input, [C, H, W]: x's own planes, or computed into `scratch`.
  const float* image(int64_t C, int64_t HW, int64_t n, float* scratch) const;
};
// dst [P,Q] (+)= tile[(p*s)*Wp + q*s] + bias
void extract_plane(const float* tile, int64_t Wp, int64_t P, int64_t Q, int64_t s, float bias, bool accumulate,
                   float* dst);
bool scalar_forced();

}  // namespace et::cpu
