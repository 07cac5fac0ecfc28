// conv2d on CPU: picks a kernel family per pass and geometry (choose() below) and sizes the
// workspace for that choice:
//   depthwise (conv_depthwise.cpp)  groups == C == K
//   direct    (conv_direct.cpp)     stride-1 windows on maps of 8x8 and up
//   gemm      (conv_gemm.cpp)       multi-image im2col + our packed SGEMM: 1x1, strided, small maps
//   implicit  (conv_implicit.cpp)   channels-last im2col packed straight into the SGEMM: many
//                                   channels on small maps, strided 3x3 convs (data gradient
//                                   by stride x stride phases)
//   channels last (conv_channels_last.cpp, behind the direct entry points) 3x3 weight gradients
//                                   with 16k input channels up to 128 x 128 channels (stride 1
//                                   or 2), strided data gradients with few output channels
//   winograd  (conv_winograd.cpp)   F(2x2, 3x3) (weight gradient: F(3x3, 2x2)) for 3x3 stride-1
//                                   layers with 64+ channels on 16x16..2x2 maps
//   winograd rows (conv_winograd_rows.cpp) F(2x2, 3x3) with 16 tiles of one plane per vector:
//                                   forward and data gradient of 3x3 stride-1 pad-1 layers on
//                                   32x32 maps with 16+ channels, 16x16 maps with 32 to 128, 8x8
//                                   maps with 16 to 128; their weight gradient with 32 to 128
//                                   (conv_winograd_wgrad.cpp); on AVX2 and NEON also the stems
//                                   and 16-channel weight gradients
// Every family is deterministic for a given thread count and allocates nothing.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_gemm.h"
#include "backends/cpu/conv_simd.h"
#include "backends/cpu/conv_implicit.h"
#include "backends/cpu/conv_winograd.h"
#include "backends/cpu/fused_elementwise.h"

namespace et {

void Conv2dGeom::infer_output() {
  P = (H + 2 * pad_h - R) / stride_h + 1;
  Q = (W + 2 * pad_w - S) / stride_w + 1;
  if (H + 2 * pad_h < R || W + 2 * pad_w < S) P = Q = 0;
}

int cpu_threads() { return omp_get_max_threads(); }

namespace {

enum class Path { Gemm, Direct, Depthwise, Implicit, Winograd, WinogradRows };

cpu::ConvPathOverride initial_override() {
  const char* e = std::getenv("ET_CONV_PATH");
  if (e && !std::strcmp(e, "gemm")) return cpu::ConvPathOverride::Gemm;
  if (e && !std::strcmp(e, "direct")) return cpu::ConvPathOverride::Direct;
  if (e && !std::strcmp(e, "implicit")) return cpu::ConvPathOverride::Implicit;
  if (e && !std::strcmp(e, "winograd")) return cpu::ConvPathOverride::Winograd;
  if (e && !std::strcmp(e, "winograd_rows")) return cpu::ConvPathOverride::WinogradRows;
  return cpu::ConvPathOverride::Auto;
}
cpu::ConvPathOverride g_override = initial_override();

// Which kernel family runs a pass (the workspace is sized for the same choice).
// Dense convs: measured with bench/bench_conv (2 Zen 4 cores); the direct kernels win for 3x3
// windows on maps of 8x8 and up (1.5-2.5x) in forward / data gradient; the GEMM path (conv_gemm.cpp,
// several images per GEMM) wins for 1x1 (no im2col there), for 4x4 / 2x2 maps, and below.
// The implicit GEMM (conv_implicit.cpp) beats both on maps of 8x8 and below with 16+ channels
// (vgg 8x8..2x2: 1.1-1.5x; resnet20 64->64 8x8 weight gradient 1.7x) and on strided 3x3 convs
// (resnet20 downsampling forward / weight gradient 1.3-1.6x); on 16x16 and up the direct kernels
// stay ahead (measured single-threaded, process CPU time: bench_conv --cpu, batch 32 and 128).
// ET_CONV_PATH=gemm|direct|implicit overrides the choice where the forced path applies (A/B measurements).
// Winograd F(2x2, 3x3) (conv_winograd.cpp) beats everything on 3x3 stride-1 layers with 64+
// channels on 16x16 down to 2x2 maps (vgg forward / data gradient 1.2-1.9x, weight gradient
// 1.1-1.6x; resnet20 64->64 8x8 1.3x forward, even weight gradient); with fewer channels its
// transforms cost more than the multiply-adds they save, and on 32x32 maps the direct kernels are
// as fast (single-threaded CPU time, batch 32 and 128).
// Weight gradients need 128+ channels for Winograd to win (wall time, batch 128: vgg 128->256 on
// 8x8 1.15x the implicit GEMM, 128->128 on 16x16 even; with 64 channels it loses, resnet20 64->64
// on 8x8 0.75x and vgg 64->128 on 16x16 0.8x the implicit GEMM).
// With narrow vectors (AVX2, NEON: conv_simd.h's kNarrowVectors) the direct kernels' register
// blocks are a third of AVX-512's, and Winograd's forward / data gradient win on 32x32 maps too
// (vgg 64->64: 72 against 123 ms each, 2 Zen 3 cores, batch 128), while its weight gradient loses on
// 16x16 (vgg 128->128: 156 against 94 direct, 96 implicit GEMM) and stays ahead from 8x8 down.
bool prefer_winograd(const Conv2dGeom& g, ConvPass pass) {
  const bool wgrad = pass == ConvPass::BackwardWeight;
  const int64_t PQ = g.P * g.Q, min_channels = wgrad ? 128 : 64;
  const int64_t max_pq = cpu::kNarrowVectors ? (wgrad ? 64 : 1024) : 256;
  return cpu::winograd_applies(g, pass) && g.C / g.groups >= min_channels && g.K / g.groups >= min_channels &&
         PQ >= 4 && PQ <= max_pq;
}

// Winograd by rows of tiles (conv_winograd_rows.cpp), against the kernels it replaces (batch 128,
// 2 threads, the two alternating call by call, medians: bench_conv --against direct|winograd;
// session 46, Intel Xeon), forward / data gradient. 32x32 maps, against the direct kernels:
// 16 -> 16 (ResNet-20's first stage) 1.02-1.29x, 32 -> 32 1.14-1.22x, 64 -> 64 (VGG-16's and
// ResNet-18's first stage) 1.36-1.62x; a 3-channel input (the stems' forward) loses, 0.62x. 16x16 maps: 32 -> 32 (ResNet-20's second stage)
// 1.00-1.20x the direct kernels, 64 -> 64 1.40-1.52x and 64 -> 128 1.12-1.42x Winograd's GEMM
// form, 128 -> 128 0.92-1.09x it (1.34-1.40x on Zen 5); 16 -> 16 0.81-1.09x the direct kernels. 8x8 maps
// (one vector per plane): 64 -> 64 (ResNet-20's third stage) 1.41-1.65x Winograd's GEMM form,
// 64 -> 128 1.36x, 128 -> 128 1.14x, 128 -> 256 0.89x (U, 4 MiB there, leaves L2); 16 -> 16 and
// 32 -> 32 2.9x and 2.2x the implicit GEMM.
bool prefer_winograd_rows(const Conv2dGeom& g, ConvPass pass) {
  const int64_t in = pass == ConvPass::Forward ? g.C : g.K, out = pass == ConvPass::Forward ? g.K : g.C;
  if (!cpu::winograd_rows_applies(g, pass)) return false;
  // Weight gradients (conv_winograd_wgrad.cpp), against the kernels chosen before (session 48, Zen 5,
  // bench_conv --against): 32 -> 32 at 16x16 (ResNet-20's second stage) 1.16-1.43x the channels-last
  // direct kernels, 64 -> 64 at 32x32 (VGG-16's first stage) 1.38x, 64 -> 128 and 128 -> 128 at
  // 16x16 1.44x and 1.54x (VGG-16); 64 -> 64 at 8x8 (ResNet-20's third stage) 1.20-1.32x
  // (session 47, Intel Xeon), 1.5x faster itself since. 16 -> 16 at 32x32: even with the direct
  // kernels (0.95-1.16x), whose staging of x costs as much as the transforms save.
  // With narrow vectors (AVX2, session 50, Zen 5 cores running AVX2 code, bench_conv --against,
  // two runs each) the direct kernels' blocks are a third of AVX-512's and the vectors of tiles win
  // more: forward / data gradient 16 -> 16 at 32x32 1.59x / 1.62x the direct kernels, 32 -> 32 at
  // 16x16 1.69x / 1.69x, VGG-16's 64 -> 64 at 32x32 2.0x and 64 -> 128 / 128 -> 128 at 16x16
  // 1.8-1.9x the direct kernels (1.4-2.2x Winograd's GEMM form); the stems' forward with 16 or 32
  // output channels 1.13-1.19x (64: 0.95x) and their data gradients 1.28-1.32x; the weight gradient
  // 16 -> 16 at 32x32 1.10-1.21x, VGG's 64 -> 64 at 32x32 and 64 -> 128 / 128 -> 128 at 16x16
  // 1.44-1.49x the direct kernels; 64 -> 64 at 8x8 (ResNet-20's third stage) forward / data gradient
  // 2.0x Winograd's GEMM form (2.2-2.5x the direct kernels), weight gradient 1.55-1.9x the direct
  // kernels and the implicit GEMM. NEON takes the same rule, unmeasured on a Jetson.
  if (pass == ConvPass::BackwardWeight) return cpu::kNarrowVectors ? g.C >= 16 && g.K >= 16 : g.C >= 32 && g.K >= 32;
  if (g.W == 32) return (in >= 16 && out >= 16) || (cpu::kNarrowVectors && out <= 32);
  // 128 -> 128 at 16x16 (VGG-16's second stage): 0.92-1.09x the GEMM form on the Intel Xeon
  // (session 46), 1.34-1.40x on Zen 5 (session 48).
  if (g.W == 16) return in >= 32 && out >= 32 && in * out <= 128 * 128;
  return in >= 16 && out >= 16 && in * out <= 128 * 128;
}

// Strided data gradients run by phases (conv_implicit.h), no multiply-add spent on the zeros of an
// upsampled dy: resnet20 32->64 at 16x16 1.11x, 16->32 at 32x32 1.07x the GEMM's col2im (wall,
// batch 128, 3 alternating runs; the phases' GEMMs are shallow, 1-4 taps, so packing dominates).
bool prefer_implicit(const Conv2dGeom& g) {
  if (g.R * g.S == 1 || g.C / g.groups < 16 || g.K / g.groups < 16) return false;
  const bool small = g.P * g.Q <= 64, strided = g.stride_h > 1 || g.stride_w > 1;
  return small || strided;
}

// The stride-2 direct kernels by phases (conv_direct_strided.cpp) against the paths before them
// (bench_conv --filter _s2 --against direct, batch 128, 2 threads, two runs each; session 51, Zen 5),
// with narrow vectors (AVX2; NEON takes the same rule, unmeasured):
// - 3x3 data gradients, against the implicit GEMM's phases: ResNet-20's 16 -> 32 1.41x (3.37 ->
//   2.41 ms), 32 -> 64 1.08x; ResNet-18's 64 -> 128 1.14x, 128 -> 256 1.10x, 256 -> 512 1.09x;
// - 1x1 forwards (the shortcuts), against the GEMM path: 1.07-1.28x on all five;
// - 3x3 weight gradients with 64+ output positions a plane (the outer-product form over the
//   input's copies, conv_direct_wgrad.cpp), against the implicit GEMM: ResNet-20's 16 -> 32 at
//   32x32 1.50-1.67x, ResNet-18's 64 -> 128 1.09-1.24x; on 8x8 outputs, since a register tile
//   sums a chunk of images and adds into transposed partials by vectors (session 52), ResNet-20's
//   32 -> 64 1.19-1.36x and ResNet-18's 128 -> 256 1.05-1.07x (0.69-0.83x and 0.63-0.73x before);
//   on 4x4 outputs (256 -> 512, one image a chunk within the L2 budget) still 0.76x;
// - not the 3x3 forwards (0.93-1.04x the implicit GEMM: even), nor the 1x1 data gradients: into
//   dx of 32 columns 1.13-1.18x the GEMM path alone, but ResNet-20's shortcut took 0.1-0.2 ms
//   longer in the training step (it adds onto dx there; `bench step --profile --profile-nodes`),
//   and 0.87-1.0x on 16x16 and 8x8 dx.
// In the AVX2 ResNet-20 step (alternating runs, --profile-nodes): the downsampling blocks' 3x3
// backward 8.2-9.3 -> 5.5-6.1 ms (16 -> 32) and 6.0-6.9 -> 5.1-5.8 ms (32 -> 64), the shortcuts'
// forward 0.06-0.1 ms shorter each; the step 1.02-1.07x (docs/fusion-log.md, session 51).
// AVX-512: the forwards lose or tie (3x3 0.78-1.0x, 1x1 0.69-1.14x), the 3x3 data gradients with
// up to 64 output channels stay on the channels-last kernel (dgrad_cl_chosen, asked before this),
// ResNet-18's larger ones 0.88-1.1x the implicit GEMM: none taken.
bool prefer_direct_strided(const Conv2dGeom& g, ConvPass pass) {
  if (!cpu::kNarrowVectors || g.groups != 1 || g.C < 16 || g.K < 16) return false;
  const bool k3 = g.R == 3 && g.S == 3, k1 = g.R == 1 && g.S == 1;
  if (pass == ConvPass::BackwardWeight) return k3 && g.P * g.Q >= 64;
  return pass == ConvPass::BackwardData ? k3 : k1;
}

Path choose(const Conv2dGeom& g, ConvPass pass) {
  // winograd_rows forced where it does not apply: the automatic choice.
  const cpu::ConvPathOverride ov =
      g_override == cpu::ConvPathOverride::WinogradRows && !cpu::winograd_rows_applies(g, pass)
          ? cpu::ConvPathOverride::Auto
          : g_override;
  if (cpu::depthwise_applies(g, pass)) return Path::Depthwise;
  const bool strided = g.stride_h != 1 || g.stride_w != 1;
  // The strided direct kernels (by phases) where forced or measured ahead; else the paths before them.
  const bool direct = cpu::direct_dense_applies(g, pass) &&
                      (!strided || ov == cpu::ConvPathOverride::Direct || prefer_direct_strided(g, pass));
  const bool implicit = cpu::implicit_applies(g, pass);
  if (ov == cpu::ConvPathOverride::Gemm) return Path::Gemm;
  if (ov == cpu::ConvPathOverride::Direct) return direct ? Path::Direct : Path::Gemm;
  if (ov == cpu::ConvPathOverride::Winograd && cpu::winograd_applies(g, pass)) return Path::Winograd;
  if (ov == cpu::ConvPathOverride::WinogradRows) return Path::WinogradRows;
  if (ov == cpu::ConvPathOverride::Auto && prefer_winograd_rows(g, pass)) return Path::WinogradRows;
  if (ov == cpu::ConvPathOverride::Auto && prefer_winograd(g, pass)) return Path::Winograd;
  // 3x3 weight gradients with 16k input channels and up to 128 x 128 channels, strided or not: the
  // channels-last direct form (conv_channels_last.cpp, wgrad_cl_chosen has the measurements);
  // strided data gradients with few output channels too (dgrad_cl_chosen).
  if (ov == cpu::ConvPathOverride::Auto && pass == ConvPass::BackwardWeight && cpu::wgrad_cl_chosen(g))
    return Path::Direct;
  if (ov == cpu::ConvPathOverride::Auto && pass == ConvPass::BackwardData && g.stride_h > 1 &&
      cpu::dgrad_cl_chosen(g))
    return Path::Direct;
  if (ov == cpu::ConvPathOverride::Auto && strided && direct) return Path::Direct;  // prefer_direct_strided
  if (implicit && (ov == cpu::ConvPathOverride::Implicit || prefer_implicit(g))) return Path::Implicit;
  if (!direct) return Path::Gemm;
  const int64_t PQ = g.P * g.Q;
  const int64_t Cg = g.C / g.groups;
  // Stride-1 1x1 convs with narrow vectors (AVX2, session 50, bench_conv --filter mobilenet
  // --against direct): MobileNet-V2's forwards 1.06-1.75x faster on the direct kernels than on the
  // GEMM path, their data gradients on 16x16 and 32x32 maps 1.16-1.92x (even below); the weight
  // gradients on those maps with 16 to 144 output channels in multiples of 16 1.05-1.52x (32 -> 32,
  // 32 -> 16, 16 -> 96, 24 -> 144, 144 -> 32, 192 -> 32), the GEMM path ahead with 24 (1.03-1.14x)
  // and 192 (32 -> 192 at 16x16, 1.14-1.18x), and on smaller maps (up to 1.5x at 4x4; two runs
  // each). Since the direct weight gradient adds its tiles into transposed partials by vectors
  // (session 52), those on 8x8 maps (all seven, 64 to 576 output channels) 1.04-1.30x the GEMM
  // path (two runs); on 4x4 maps mixed (0.88-1.14x), left on it. NEON: the same, unmeasured.
  const bool narrow_1x1_wgrad = pass == ConvPass::BackwardWeight && g.K % 16 == 0 &&
                                ((PQ >= 256 && g.K <= 144) || (PQ >= 64 && PQ < 256));
  if (cpu::kNarrowVectors && g.R * g.S == 1 && g.stride_h == 1 && g.stride_w == 1 && g.groups == 1 &&
      (pass == ConvPass::Forward || (pass == ConvPass::BackwardData && PQ >= 256) || narrow_1x1_wgrad))
    return Path::Direct;
  if (g.R * g.S == 1 || PQ <= 16) return Path::Gemm;
  // Stem convs (3 input channels): the direct data gradient writes 3 planes from K, the GEMM's
  // col2im is cheaper (resnet20 / vgg16 / mobilenetv2 stems, 1.2-1.4x). Not with narrow vectors,
  // whose direct blocks of 4 channels waste 1 of 4 rows there, not 5 of 8: direct 2.2-2.4x the GEMM.
  if (pass == ConvPass::BackwardData && Cg < 8 && !cpu::kNarrowVectors) return Path::Gemm;
  // Weight gradient: the direct kernel's chunk of images shrinks to one on small maps with many
  // channels; the implicit GEMM wins there (vgg 64->128 on 16x16: 21 ms against 25 direct and 30
  // for the blocked GEMM, wall, batch 128), else the blocked GEMM.
  if (pass == ConvPass::BackwardWeight && PQ <= 256 && Cg >= 64) return implicit ? Path::Implicit : Path::Gemm;
  if (pass == ConvPass::BackwardWeight && PQ < 64) return Path::Gemm;
  // Everything else is direct, the stems' weight gradients included: resnet20 / mobilenetv2 /
  // vgg16 3-channel ones 2.5x / 2.2x / 1.7x faster than the GEMM (whose K x 27 output is too thin
  // for the micro-kernel; wall time, batch 128).
  return Path::Direct;
}

}  // namespace

namespace cpu {
void conv_set_path_override(ConvPathOverride p) { g_override = p; }
}  // namespace cpu

size_t CpuBackend::conv2d_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const {
  switch (choose(g, pass)) {
    case Path::Depthwise: return cpu::depthwise_workspace(g, pass, cpu_threads());
    case Path::Direct: return cpu::direct_dense_workspace(g, pass, cpu_threads());
    case Path::Implicit: return cpu::implicit_workspace(g, pass, cpu_threads());
    case Path::Winograd: return cpu::winograd_workspace(g, pass, cpu_threads());
    case Path::WinogradRows: return cpu::winograd_rows_workspace(g, pass, cpu_threads());
    case Path::Gemm: break;
  }
  return cpu::gemm_conv_workspace(g, pass, cpu_threads());
}

// The direct and depthwise kernels place x's planes in padded planes, Winograd copies each image
// channels-last, the GEMM path gathers it (or, 1x1, reads it in place): all but the implicit GEMM
// can compute a fused stack's output there (cpu::ConvInput), so nothing of y's size is written.
DTypeSet CpuBackend::conv2d_forward_reads(const Conv2dGeom& g) const {
  return choose(g, ConvPass::Forward) == Path::Implicit ? dtype_bit(DType::F32)
                                                        : dtype_bit(DType::F32) | dtype_bit(DType::AffineRelu);
}

void CpuBackend::conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                                Workspace ws) {
  ET_CHECK(dtype_in(x.dtype, conv2d_forward_reads(g)), "conv2d forward: x dtype ", dtype_name(x.dtype));
  switch (choose(g, ConvPass::Forward)) {
    case Path::Depthwise:
      return cpu::depthwise_forward(g, x, w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::Direct:
      return cpu::direct_dense_forward(g, x, w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::Implicit:
      return cpu::implicit_forward(g, x.f32(), w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::Winograd:
      return cpu::winograd_forward(g, x, w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::WinogradRows:
      return cpu::winograd_rows_forward(g, x, w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
    case Path::Gemm: break;
  }
  cpu::gemm_conv_forward(g, x, w.f32(), b.defined() ? b.f32() : nullptr, y.f32(), ws.data);
}

// The direct and depthwise kernels take the sums in their epilogue, the other paths per chunk of
// images while y is in cache. The same plane_sums every time: the same bits.
void CpuBackend::conv2d_forward_sums(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b,
                                     Tensor& y, Tensor& sums, Workspace ws) {
  ET_CHECK(dtype_in(x.dtype, conv2d_forward_reads(g)), "conv2d forward: x dtype ", dtype_name(x.dtype));
  const Path path = choose(g, ConvPass::Forward);
  ET_CHECK(sums.dim(0) == 2 && sums.dim(1) >= g.N && sums.dim(2) == g.K, "conv plane sums into ", sums.shape.str());
  float* s1 = sums.f32();
  float* s2 = s1 + sums.dim(1) * g.K;
  const float* bias = b.defined() ? b.f32() : nullptr;
  if (path == Path::Depthwise) return cpu::depthwise_forward(g, x, w.f32(), bias, y.f32(), ws.data, s1, s2);
  if (path == Path::Winograd) return cpu::winograd_forward(g, x, w.f32(), bias, y.f32(), ws.data, s1, s2);
  if (path == Path::WinogradRows) return cpu::winograd_rows_forward(g, x, w.f32(), bias, y.f32(), ws.data, s1, s2);
  if (path == Path::Implicit) return cpu::implicit_forward(g, x.f32(), w.f32(), bias, y.f32(), ws.data, s1, s2);
  if (path == Path::Gemm) return cpu::gemm_conv_forward(g, x, w.f32(), bias, y.f32(), ws.data, s1, s2);
  cpu::direct_dense_forward(g, x, w.f32(), bias, y.f32(), ws.data, s1, s2);
}

// The first sweep of the stack before in the epilogue of every dense data gradient, on the images
// (the implicit GEMM: the planes of a task) each has just written, added onto dx where accumulate.
bool CpuBackend::conv2d_backward_data_dz_sums(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                              bool accumulate, const DzSumsEpilogue& e, Workspace ws) {
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
  if (g.groups != 1) return false;
  switch (choose(g, ConvPass::BackwardData)) {
    case Path::Direct:
      if (!cpu::direct_dense_dz_sums_applies(g)) return false;
      cpu::direct_dense_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data, &e);
      return true;
    case Path::Winograd:
      cpu::winograd_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data, &e);
      return true;
    case Path::WinogradRows:
      cpu::winograd_rows_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data, &e);
      return true;
    case Path::Gemm:
      cpu::gemm_conv_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data, &e);
      return true;
    case Path::Implicit:
      cpu::implicit_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data, &e);
      return true;
    default:
      return false;
  }
#else
  (void)g, (void)dy, (void)w, (void)dx, (void)accumulate, (void)e, (void)ws;
  return false;
#endif
}

void CpuBackend::conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                      bool accumulate, Workspace ws) {
  switch (choose(g, ConvPass::BackwardData)) {
    case Path::Depthwise: return cpu::depthwise_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::Direct: return cpu::direct_dense_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::Implicit: return cpu::implicit_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::Winograd: return cpu::winograd_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::WinogradRows:
      return cpu::winograd_rows_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
    case Path::Gemm: break;
  }
  cpu::gemm_conv_backward_data(g, dy.f32(), w.f32(), dx.f32(), accumulate, ws.data);
}

// Every weight-gradient kernel reads x one image (or plane) at a time into its own staging layout;
// it decodes a stashed x there (memory/stored_reader.h) instead of reading a decoded copy of the
// whole tensor, or computes it there from the stack before it (DType::AffineRelu). (The implicit,
// Winograd and GEMM kernels split the output over threads, so each thread decodes every image:
// twice the decode work, but in cache, and no shared buffer to sync.)
DTypeSet CpuBackend::conv2d_weight_reads(const Conv2dGeom& g) const {
  switch (choose(g, ConvPass::BackwardWeight)) {
    case Path::Direct:
    case Path::Implicit:
    case Path::Winograd:
    case Path::WinogradRows:
    case Path::Gemm:
    case Path::Depthwise: return kReaderDTypes;
  }
  return dtype_bit(DType::F32);
}

void CpuBackend::conv2d_backward_weight(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw,
                                        Tensor& db, bool accumulate, Workspace ws) {
  float* dbp = db.defined() ? db.f32() : nullptr;
  ET_CHECK(dtype_in(x.dtype, conv2d_weight_reads(g)), "conv2d weight gradient: x dtype ", dtype_name(x.dtype));
  switch (choose(g, ConvPass::BackwardWeight)) {
    case Path::Depthwise:
      return cpu::depthwise_backward_weight(g, x, dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::Direct:
      return cpu::direct_dense_backward_weight(g, x, dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::Implicit:
      return cpu::implicit_backward_weight(g, x, dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::Winograd:
      return cpu::winograd_backward_weight(g, x, dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::WinogradRows:  // 32x32, 16x16, 8x8 planes (winograd_rows_applies)
      return cpu::winograd_wgrad_rows(g, x, dy.f32(), dw.f32(), dbp, accumulate, ws.data);
    case Path::Gemm: break;
  }
  cpu::gemm_conv_backward_weight(g, x, dy.f32(), dw.f32(), dbp, accumulate, ws.data);
}

}  // namespace et
