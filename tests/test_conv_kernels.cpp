// CPU conv2d / linear kernels against a naive direct reference with double accumulation.
// Tolerance: |got - ref| <= 1e-4 * (max |ref| over the tensor) + 1e-5 (relative 1e-4 of the
// tensor's scale; float32 sums of up to a few hundred terms stay well inside it).
// Every geometry runs with the native SIMD vectors and with the scalar reference vectors.
// The weight gradient also reads x in each stash encoding the backend accepts (F16, BF16, bitmap):
// bit-identical to the same values decoded to f32 first.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/conv_implicit.h"
#include "backends/cpu/fused_elementwise.h"
#include "backends/cpu/conv_winograd.h"
#include "backends/cpu/conv_winograd_rows.h"
#include "engine/affine_relu.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/gemm.h"
#include "memory/bitmap.h"
#include "memory/half.h"

using namespace et;

namespace {

std::vector<float> rnd(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  uint32_t s = seed * 747796405u + 2891336453u;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = float(int32_t(s >> 8) % 2001 - 1000) / 1000.f;
  }
  return v;
}

Tensor view(std::vector<float>& v, const Shape& s) { return Tensor::contiguous(v.data(), s); }

void check_close(const std::vector<float>& got, const std::vector<double>& ref, const char* what) {
  REQUIRE(got.size() == ref.size());
  double scale = 0.0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  const double tol = 1e-4 * scale + 1e-5;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(double(got[i]) - ref[i]) <= tol)) {
      if (!bad) first = i;
      ++bad;
    }
  INFO(what << ": " << bad << " of " << got.size() << " off, first at " << first << " got "
            << (bad ? got[first] : 0.f) << " ref " << (bad ? ref[first] : 0.0) << " tol " << tol);
  CHECK(bad == 0);
}

struct Ref {  // naive direct conv, double accumulation
  const Conv2dGeom& g;
  template <class F>
  void each(F&& f) const {  // f(x index, w index, y index)
    const int64_t Cg = g.C / g.groups, Kg = g.K / g.groups;
    for (int64_t n = 0; n < g.N; ++n)
      for (int64_t k = 0; k < g.K; ++k)
        for (int64_t p = 0; p < g.P; ++p)
          for (int64_t q = 0; q < g.Q; ++q)
            for (int64_t c = 0; c < Cg; ++c)
              for (int64_t r = 0; r < g.R; ++r)
                for (int64_t s = 0; s < g.S; ++s) {
                  const int64_t h = p * g.stride_h - g.pad_h + r, w = q * g.stride_w - g.pad_w + s;
                  if (h < 0 || h >= g.H || w < 0 || w >= g.W) continue;
                  const int64_t ci = (k / Kg) * Cg + c;
                  f(((n * g.C + ci) * g.H + h) * g.W + w, ((k * Cg + c) * g.R + r) * g.S + s,
                    ((n * g.K + k) * g.P + p) * g.Q + q);
                }
  }
};

// x as the stash would store it in dtype t (zeros where i % 5 < 2 so bitmaps have something to
// drop, one -0.0), and the f32 values that encoding stands for.
struct Encoded {
  std::vector<uint64_t> storage;
  std::vector<float> decoded;
  Tensor view(const Shape& s) { return Tensor::contiguous(storage.data(), s, dtype); }
  DType dtype;
};

Encoded encode(const std::vector<float>& x, DType t) {
  const int64_t n = int64_t(x.size());
  std::vector<float> xz(x);
  for (int64_t i = 0; i < n; ++i)
    if (i % 5 < 2) xz[size_t(i)] = 0.f;
  if (n > 3) xz[3] = -0.f;
  Encoded e{std::vector<uint64_t>(size_t(bitmap::num_words(n) + n + 1)), std::vector<float>(size_t(n)), t};
  auto* h = reinterpret_cast<uint16_t*>(e.storage.data());
  auto* bits = e.storage.data();
  void* values = bits + bitmap::num_words(n);
  switch (t) {
    case DType::F16: f32_to_f16(xz.data(), n, h); f16_to_f32(h, n, e.decoded.data()); break;
    case DType::BF16: f32_to_bf16(xz.data(), n, h); bf16_to_f32(h, n, e.decoded.data()); break;
    case DType::BitmapF32:
    case DType::BitmapF16: {
      const auto vt = t == DType::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
      bitmap::pack(xz.data(), n, 0.f, bits, values, vt);
      bitmap::unpack(bits, values, n, vt, e.decoded.data());
      break;
    }
    default: FAIL("not a stash encoding");
  }
  return e;
}

void check_stored_inputs(const Conv2dGeom& g, const std::vector<float>& x, std::vector<float>& dy, bool bias,
                         bool accumulate, Workspace ws) {
  auto be = make_cpu_backend();
  const int64_t Cg = g.C / g.groups;
  const size_t wn = size_t(g.K * Cg * g.R * g.S);
  const DTypeSet reads = be->conv2d_weight_reads(g);
  CHECK(dtype_in(DType::F32, reads));
  Tensor dyt = view(dy, {g.N, g.K, g.P, g.Q}), none;
  for (DType t : {DType::F16, DType::BF16, DType::BitmapF32, DType::BitmapF16}) {
    if (!dtype_in(t, reads)) continue;
    INFO("x stored as " << dtype_name(t));
    Encoded e = encode(x, t);
    std::vector<float> dw_ref = rnd(wn, 8), dw = dw_ref, db_ref = rnd(size_t(g.K), 9), db = db_ref;
    Tensor dwr = view(dw_ref, {g.K, Cg, g.R, g.S}), dbr = view(db_ref, {g.K});
    Tensor dwt = view(dw, {g.K, Cg, g.R, g.S}), dbt = view(db, {g.K});
    be->conv2d_backward_weight(g, view(e.decoded, {g.N, g.C, g.H, g.W}), dyt, dwr, bias ? dbr : none, accumulate, ws);
    be->conv2d_backward_weight(g, e.view({g.N, g.C, g.H, g.W}), dyt, dwt, bias ? dbt : none, accumulate, ws);
    CHECK(std::memcmp(dw.data(), dw_ref.data(), wn * sizeof(float)) == 0);
    CHECK(std::memcmp(db.data(), db_ref.data(), size_t(g.K) * sizeof(float)) == 0);
  }
}

// planned_batch > g.N: the workspace is sized for that batch, as the executor sizes it for its
// planned batch and runs a partial last batch in it.
void run_geometry(Conv2dGeom g, bool bias, bool accumulate, int64_t planned_batch = 0) {
  g.infer_output();
  REQUIRE(g.P > 0);
  const int64_t Cg = g.C / g.groups;
  const size_t xn = size_t(g.N * g.C * g.H * g.W), wn = size_t(g.K * Cg * g.R * g.S), yn = size_t(g.N * g.K * g.P * g.Q);
  auto x = rnd(xn, 1), w = rnd(wn, 2), b = rnd(size_t(g.K), 3), dy = rnd(yn, 4);
  const auto dx0 = rnd(xn, 5), dw0 = rnd(wn, 6), db0 = rnd(size_t(g.K), 7);

  std::vector<double> y_ref(yn, 0.0), dx_ref(xn, 0.0), dw_ref(wn, 0.0), db_ref(size_t(g.K), 0.0);
  Ref{g}.each([&](int64_t xi, int64_t wi, int64_t yi) {
    y_ref[yi] += double(x[xi]) * w[wi];
    dx_ref[xi] += double(dy[yi]) * w[wi];
    dw_ref[wi] += double(dy[yi]) * x[xi];
  });
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t i = 0; i < g.P * g.Q; ++i) {
        if (bias) y_ref[size_t((n * g.K + k) * g.P * g.Q + i)] += b[size_t(k)];
        db_ref[size_t(k)] += dy[size_t((n * g.K + k) * g.P * g.Q + i)];
      }
  if (accumulate) {
    for (size_t i = 0; i < xn; ++i) dx_ref[i] += dx0[i];
    for (size_t i = 0; i < wn; ++i) dw_ref[i] += dw0[i];
    for (size_t i = 0; i < size_t(g.K); ++i) db_ref[i] += db0[i];
  }

  auto be = make_cpu_backend();
  size_t wsb = 0;
  Conv2dGeom planned = g;
  planned.N = std::max(g.N, planned_batch);
  for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
    wsb = std::max(wsb, be->conv2d_workspace_bytes(planned, p));
  for (bool scalar : {false, true}) {
    INFO("scalar vectors " << scalar);
    cpu::conv_force_scalar(scalar);
    // Guard words after the workspace catch overruns of the declared size.
    std::vector<float> wsv(wsb / sizeof(float) + 64, 0.f);
    for (size_t i = wsb / sizeof(float); i < wsv.size(); ++i) wsv[i] = 12345.f;
    Workspace ws{wsv.data(), wsb};
    std::vector<float> y(yn, 7.f), dx = accumulate ? dx0 : std::vector<float>(xn, 7.f);
    std::vector<float> dw = accumulate ? dw0 : std::vector<float>(wn, 7.f);
    std::vector<float> db = accumulate ? db0 : std::vector<float>(size_t(g.K), 7.f);
    Tensor none;
    Tensor xt = view(x, {g.N, g.C, g.H, g.W}), wt = view(w, {g.K, Cg, g.R, g.S}), bt = view(b, {g.K});
    Tensor yt = view(y, {g.N, g.K, g.P, g.Q}), dyt = view(dy, {g.N, g.K, g.P, g.Q});
    Tensor dxt = view(dx, {g.N, g.C, g.H, g.W}), dwt = view(dw, {g.K, Cg, g.R, g.S}), dbt = view(db, {g.K});
    be->conv2d_forward(g, xt, wt, bias ? bt : none, yt, ws);
    be->conv2d_backward_data(g, dyt, wt, dxt, accumulate, ws);
    be->conv2d_backward_weight(g, xt, dyt, dwt, bias ? dbt : none, accumulate, ws);
    check_close(y, y_ref, "forward");
    check_close(dx, dx_ref, "backward data");
    check_close(dw, dw_ref, "backward weight");
    if (bias) check_close(db, db_ref, "bias grad");
    for (size_t i = wsb / sizeof(float); i < wsv.size(); ++i) REQUIRE(wsv[i] == 12345.f);

    // Determinism: a second run gives bit-identical results.
    std::vector<float> y2(yn), dx2 = accumulate ? dx0 : std::vector<float>(xn), dw2 = accumulate ? dw0 : std::vector<float>(wn);
    Tensor y2t = view(y2, {g.N, g.K, g.P, g.Q}), dx2t = view(dx2, {g.N, g.C, g.H, g.W}), dw2t = view(dw2, {g.K, Cg, g.R, g.S});
    be->conv2d_forward(g, xt, wt, bias ? bt : none, y2t, ws);
    be->conv2d_backward_data(g, dyt, wt, dx2t, accumulate, ws);
    be->conv2d_backward_weight(g, xt, dyt, dw2t, none, accumulate, ws);
    CHECK(std::memcmp(y.data(), y2.data(), yn * sizeof(float)) == 0);
    CHECK(std::memcmp(dx.data(), dx2.data(), xn * sizeof(float)) == 0);
    CHECK(std::memcmp(dw.data(), dw2.data(), wn * sizeof(float)) == 0);
    // The direct kernels' flat form (junk columns, a tile, an extract) gives the row form's bits.
    cpu::conv_direct_rows(false);
    std::vector<float> y4(yn), dx4 = accumulate ? dx0 : std::vector<float>(xn);
    Tensor y4t = view(y4, {g.N, g.K, g.P, g.Q}), dx4t = view(dx4, {g.N, g.C, g.H, g.W});
    be->conv2d_forward(g, xt, wt, bias ? bt : none, y4t, ws);
    be->conv2d_backward_data(g, dyt, wt, dx4t, accumulate, ws);
    cpu::conv_direct_rows(true);
    CHECK(std::memcmp(y.data(), y4.data(), yn * sizeof(float)) == 0);
    CHECK(std::memcmp(dx.data(), dx4.data(), xn * sizeof(float)) == 0);
    if (!scalar) check_stored_inputs(g, x, dy, bias, accumulate, ws);

    // The forward with BN's per-plane sums (a fused stack's statistics, docs/fusion.md): the same y,
    // and the sums plane_sums takes of it, bit for bit (the direct and depthwise kernels take them
    // as they write each plane, the other paths per chunk of images). The table is sized for the
    // planned batch.
    std::vector<float> y3(yn, 7.f), sums(size_t(2 * planned.N * g.K), 7.f), ref(sums.size(), 7.f);
    Tensor y3t = view(y3, {g.N, g.K, g.P, g.Q}), sums_t = view(sums, {2, planned.N, g.K});
    Tensor ref_t = view(ref, {2, planned.N, g.K});
    be->conv2d_forward_sums(g, xt, wt, bias ? bt : none, y3t, sums_t, ws);
    be->plane_sums(yt, ref_t);
    CHECK(std::memcmp(y.data(), y3.data(), yn * sizeof(float)) == 0);
    CHECK(std::memcmp(sums.data(), ref.data(), sums.size() * sizeof(float)) == 0);
    for (int64_t i = 0; i < g.N * g.K; i += std::max<int64_t>(1, g.N * g.K / 7)) {  // and they are the sums
      double s1 = 0, s2 = 0;
      for (int64_t j = 0; j < g.P * g.Q; ++j) {
        const double v = y[size_t(i * g.P * g.Q + j)];
        s1 += v;
        s2 += v * v;
      }
      CHECK(sums[size_t(i)] == Approx(s1).epsilon(1e-4).margin(1e-3));
      CHECK(sums[size_t(planned.N * g.K + i)] == Approx(s2).epsilon(1e-4).margin(1e-3));
    }
  }
  cpu::conv_force_scalar(false);
}

Conv2dGeom geom(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t R, int64_t stride, int64_t pad,
                int64_t groups) {
  Conv2dGeom g;
  g.N = N; g.C = C; g.H = H; g.W = W; g.K = K; g.R = g.S = R;
  g.stride_h = g.stride_w = stride;
  g.pad_h = g.pad_w = pad;
  g.groups = groups;
  return g;
}

}  // namespace

TEST_CASE("conv kernels match the naive reference", "[conv]") {
  struct Case { int64_t N, C, H, W, K, R, stride, pad, groups; };
  const Case cases[] = {
      {1, 3, 7, 5, 10, 3, 1, 1, 1},   {5, 3, 7, 5, 10, 3, 2, 1, 1},   {2, 4, 9, 9, 6, 3, 1, 0, 2},
      {5, 6, 8, 8, 6, 3, 1, 1, 6},    {5, 6, 9, 7, 6, 3, 2, 1, 6},    {1, 8, 6, 6, 8, 5, 1, 2, 8},
      {2, 16, 8, 8, 16, 3, 1, 1, 1},  {2, 16, 9, 9, 32, 3, 2, 1, 1},  {2, 16, 8, 8, 32, 1, 2, 0, 1},
      {3, 12, 5, 7, 20, 1, 1, 0, 1},  {1, 5, 11, 13, 7, 5, 1, 2, 1},  {2, 5, 6, 6, 7, 5, 2, 2, 1},
      {1, 4, 6, 6, 8, 3, 1, 2, 2},    {2, 9, 4, 4, 9, 3, 1, 1, 9},    {1, 32, 2, 2, 24, 3, 1, 1, 1},
      {5, 10, 7, 5, 10, 5, 1, 2, 10}, {2, 6, 10, 10, 6, 3, 2, 0, 6},  {1, 33, 4, 3, 17, 1, 1, 0, 1},
      // Implicit-GEMM shapes: depth > one KC block (360, 1152 > the 1024-column block), several
      // forward / weight-gradient chunks (9 x 16, 20 x 64 positions), odd channel counts, batch 1.
      {5, 40, 8, 8, 24, 3, 1, 1, 1},  {9, 32, 4, 4, 8, 3, 1, 1, 1},   {20, 8, 8, 8, 8, 3, 1, 1, 1},
      {2, 128, 4, 4, 16, 3, 1, 1, 1}, {1, 16, 2, 2, 9, 3, 1, 1, 1},   {3, 24, 3, 5, 13, 3, 2, 1, 1},
      {2, 13, 6, 5, 11, 3, 1, 0, 1},
      // Strided data gradients by phases (implicit path): maps whose last window does not reach
      // the border, pad 0, 2x2 / 4x4 kernels (1 and 4 taps per phase), a 1x1 map, a ResNet
      // downsampling stage over several chunks.
      {3, 16, 10, 9, 24, 3, 2, 0, 1}, {2, 8, 8, 7, 16, 2, 2, 0, 1},   {2, 16, 9, 10, 8, 4, 2, 1, 1},
      {1, 16, 1, 1, 8, 3, 2, 1, 1},   {6, 32, 16, 16, 64, 3, 2, 1, 1},
      {2, 16, 10, 10, 16, 3, 3, 1, 1},  // stride 3: beyond the phases, another path takes it
      // Winograd F(2x2, 3x3): pad 2 (the data gradient's padding is 0), odd maps (partial tiles),
      // channel counts off the 8 / 16 blocks, and one wide enough for the automatic choice.
      {2, 5, 5, 6, 7, 3, 1, 2, 1},    {2, 67, 5, 5, 70, 3, 1, 1, 1},
      // The direct weight gradient's dot form (Kg <= 16, Cg < 8; also taken above with channel
      // counts off its 8-channel blocks, groups and 5x5 windows): a ResNet stem over several
      // chunks per thread, the last one partial.
      {7, 3, 32, 32, 16, 3, 1, 1, 1},
      // The channels-last weight gradient (3x3, 16k input channels, up to 16 output channels):
      // two channel blocks with a map width off the 8-column transposes and an uneven split of
      // the batch, output channels in blocks of 3 + 3 + 3 + 3 + 2 + 2, 3 + 2, 2 + 2 and 1, pad 0
      // and 2, batch 1 (a thread without images).
      {3, 32, 7, 11, 16, 3, 1, 1, 1}, {1, 16, 9, 6, 5, 3, 1, 0, 1},   {2, 16, 5, 5, 1, 3, 1, 2, 1},
      {2, 16, 8, 8, 4, 3, 1, 1, 1},
      // ... and its strided forms (data gradient too): two channel blocks, odd maps, 16 outputs.
      {3, 32, 11, 13, 16, 3, 2, 1, 1},
      // The stride-2 direct kernels by phases (conv_direct_strided.cpp; forced, and where chosen):
      // the row form (ResNet's 32x32 -> 16x16 downsampling; its data gradient's row form with
      // channels the channels-last kernel does not take), groups, a map of odd rows and columns.
      {2, 16, 32, 32, 32, 3, 2, 1, 1}, {2, 12, 32, 32, 20, 3, 2, 1, 1}, {2, 8, 12, 12, 8, 3, 2, 1, 2},
      {3, 7, 9, 11, 5, 3, 2, 1, 1},
      // The direct forward / data gradient's row form (whole vectors per row): ResNet's 16x16 and
      // 32x32 stages, output channels off the 8-channel blocks (20, 7), a 5x5 window, groups,
      // and a map with one row of vectors.
      {2, 16, 16, 16, 16, 3, 1, 1, 1}, {3, 12, 16, 32, 20, 3, 1, 1, 1}, {2, 9, 8, 16, 7, 5, 1, 2, 1},
      {2, 8, 16, 16, 8, 3, 1, 1, 2},   {2, 4, 1, 48, 6, 3, 1, 1, 1},
      // Winograd by rows of tiles (32x32 planes): ResNet's first stage and stem, output channels
      // in blocks of 16 + 16 + 2 + 1, input channels off any block, more threads than images.
      {3, 16, 32, 32, 16, 3, 1, 1, 1}, {2, 3, 32, 32, 16, 3, 1, 1, 1}, {2, 21, 32, 32, 35, 3, 1, 1, 1},
      {1, 16, 32, 32, 12, 3, 1, 1, 1},
      // ... on 16x16 planes (two rows of 8 tiles per vector): ResNet's second stage, tails.
      {3, 32, 16, 16, 32, 3, 1, 1, 1}, {2, 33, 16, 16, 19, 3, 1, 1, 1},
      // ... on 8x8 planes (the plane's 16 tiles in one vector): ResNet's third stage, tails.
      {3, 64, 8, 8, 64, 3, 1, 1, 1},   {2, 21, 8, 8, 35, 3, 1, 1, 1},
      // Its weight gradient (conv_winograd_wgrad.cpp, channels in multiples of 4) takes every
      // square 8x8, 16x16 and 32x32 case above with such channels (8x8: 16 x 16, 40 -> 24 over a
      // partial chunk of 8 images, 16 -> 4, 20 images of 8 channels; 16x16: chunks of 2 images,
      // the last one partial on a thread with 3) and these: 5 images of 32x32 (a chunk each), 16x16
      // with 4 -> 8 channels (a whole and a partial chunk on one thread).
      {5, 8, 32, 32, 4, 3, 1, 1, 1},   {5, 4, 16, 16, 8, 3, 1, 1, 1},
  };
  for (auto path : {cpu::ConvPathOverride::Auto, cpu::ConvPathOverride::Gemm, cpu::ConvPathOverride::Direct,
                    cpu::ConvPathOverride::Implicit, cpu::ConvPathOverride::Winograd,
                    cpu::ConvPathOverride::WinogradRows})
  for (const Case& c : cases)
    for (bool bias : {false, true})
      for (bool acc : {false, true}) {
        cpu::conv_set_path_override(path);
        INFO("path " << int(path));
        INFO("N " << c.N << " C " << c.C << " H " << c.H << " W " << c.W << " K " << c.K << " R " << c.R << " stride "
                  << c.stride << " pad " << c.pad << " groups " << c.groups << " bias " << bias << " acc " << acc);
        run_geometry(geom(c.N, c.C, c.H, c.W, c.K, c.R, c.stride, c.pad, c.groups), bias, acc);
        cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
      }
}

TEST_CASE("a partial batch runs in the workspace sized for the planned batch", "[conv]") {
  // The implicit GEMM's layout for few positions holds the whole batch in one chunk: a batch of 7
  // on 8x8 maps took more workspace than the planned batch of 8 (an overflow found by ASan in
  // training: resnet8, a partial last batch).
  struct Case { int64_t N, C, H, K, stride, planned; };
  const Case cases[] = {{7, 32, 8, 32, 1, 8}, {7, 16, 16, 32, 2, 8}, {3, 64, 4, 64, 1, 64}, {1, 24, 2, 24, 1, 128}};
  for (auto path : {cpu::ConvPathOverride::Auto, cpu::ConvPathOverride::Gemm, cpu::ConvPathOverride::Direct,
                    cpu::ConvPathOverride::Implicit, cpu::ConvPathOverride::Winograd})
    for (const Case& c : cases) {
      cpu::conv_set_path_override(path);
      INFO("path " << int(path) << " N " << c.N << " C " << c.C << " H " << c.H << " K " << c.K << " stride " << c.stride
                   << " planned " << c.planned);
      run_geometry(geom(c.N, c.C, c.H, c.H, c.K, 3, c.stride, 1, 1), true, false, c.planned);
      cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
    }
}

namespace {
// A stack's run as the backends' are: per element an FMA with its channel's coefficients, then
// the ReLU (channel c = flat index / plane % channels).
void test_run(const float* x, const float* scale, const float* shift, int64_t channels, int64_t plane, int64_t begin,
              int64_t count, float* y) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t c = (begin + i) / plane % channels;
    y[i] = std::max(std::fma(x[i], scale[c], shift[c]), 0.f);
  }
}
}  // namespace

TEST_CASE("a conv forward computes a fused stack's output as it stages x (DType::AffineRelu)", "[conv][fusion]") {
  struct Case { int64_t N, C, H, W, K, R, stride, pad, groups; };
  // The direct row form (16 columns), its flat form (odd maps), groups, a 5x5 window; Winograd
  // with partial tiles and channels off its 8-channel blocks; the GEMM path's 1x1 (x in place, one
  // image per GEMM; several images on a 4x4 map) and strided forms; the direct stride-2 kernels by
  // phases (forced; AVX2 / NEON's 1x1 by default); depthwise, strided too.
  const Case cases[] = {{2, 16, 16, 16, 16, 3, 1, 1, 1}, {3, 12, 5, 7, 20, 3, 1, 1, 1}, {2, 8, 16, 16, 8, 3, 1, 1, 2},
                        {1, 5, 11, 13, 7, 5, 1, 2, 1},    {2, 67, 5, 5, 70, 3, 1, 1, 1},  {3, 9, 7, 6, 11, 3, 1, 2, 1},
                        {3, 12, 16, 16, 20, 1, 1, 0, 1},  {5, 24, 4, 4, 8, 1, 1, 0, 1},   {2, 16, 8, 8, 32, 1, 2, 0, 1},
                        {2, 8, 9, 9, 8, 3, 1, 1, 8},      {2, 6, 9, 7, 6, 3, 2, 1, 6},    {2, 16, 9, 9, 32, 3, 2, 1, 1},
                        {2, 16, 32, 32, 16, 3, 1, 1, 1},  {1, 20, 32, 32, 18, 3, 1, 1, 1},
                        {2, 16, 32, 32, 24, 3, 2, 1, 1}};
  auto be = make_cpu_backend();
  const cpu::ConvPathOverride paths[] = {cpu::ConvPathOverride::Auto, cpu::ConvPathOverride::Direct,
                                         cpu::ConvPathOverride::Winograd, cpu::ConvPathOverride::Gemm,
                                         cpu::ConvPathOverride::WinogradRows};
  int ran[5] = {0, 0, 0, 0, 0};
  for (int pi = 0; pi < 5; ++pi)
    for (const Case& c : cases)
      for (bool sums : {false, true}) {
        cpu::conv_set_path_override(paths[pi]);
        const Conv2dGeom g = [&] {
          Conv2dGeom r = geom(c.N, c.C, c.H, c.W, c.K, c.R, c.stride, c.pad, c.groups);
          r.infer_output();
          return r;
        }();
        if (!dtype_in(DType::AffineRelu, be->conv2d_forward_reads(g))) continue;
        if (paths[pi] == cpu::ConvPathOverride::Winograd && !cpu::winograd_applies(g, ConvPass::Forward)) continue;
        if (paths[pi] == cpu::ConvPathOverride::WinogradRows && !cpu::winograd_rows_applies(g, ConvPass::Forward))
          continue;
        INFO("path " << pi << " N " << c.N << " C " << c.C << " H " << c.H << " W " << c.W << " K " << c.K << " R "
                     << c.R << " stride " << c.stride << " groups " << c.groups << " sums " << sums);
        ++ran[pi];
        const int64_t xn = g.N * g.C * g.H * g.W, yn = g.N * g.K * g.P * g.Q;
        std::vector<float> x = rnd(size_t(xn), 11), w = rnd(size_t(g.K * (g.C / g.groups) * g.R * g.S), 12),
                           b = rnd(size_t(g.K), 13), k = rnd(size_t(2 * g.C), 14), y_in = std::vector<float>(size_t(xn));
        test_run(x.data(), k.data(), k.data() + g.C, g.C, g.H * g.W, 0, xn, y_in.data());
        AffineReluSource src;
        src.x = view(x, {g.N, g.C, g.H, g.W});
        src.scale = k.data();
        src.shift = k.data() + g.C;
        src.run = test_run;
        const Tensor xa = affine_relu_tensor(src);
        std::vector<float> ws(be->conv2d_workspace_bytes(g, ConvPass::Forward) / sizeof(float) + 16);
        std::vector<float> want = std::vector<float>(size_t(yn)), got = std::vector<float>(size_t(yn), 7.f),
                           s_want = std::vector<float>(size_t(2 * g.N * g.K)), s_got = s_want;
        Tensor tw = view(want, {g.N, g.K, g.P, g.Q}), tg = view(got, {g.N, g.K, g.P, g.Q});
        Tensor sw = view(s_want, {2, g.N, g.K}), sg = view(s_got, {2, g.N, g.K});
        const Tensor wt = view(w, {g.K, g.C / g.groups, g.R, g.S}), bt = view(b, {g.K}), yt = view(y_in, {g.N, g.C, g.H, g.W});
        const Workspace wsp{ws.data(), ws.size() * sizeof(float)};
        if (sums) {
          be->conv2d_forward_sums(g, yt, wt, bt, tw, sw, wsp);
          be->conv2d_forward_sums(g, xa, wt, bt, tg, sg, wsp);
          CHECK(std::memcmp(s_want.data(), s_got.data(), s_want.size() * sizeof(float)) == 0);
        } else {
          be->conv2d_forward(g, yt, wt, bt, tw, wsp);
          be->conv2d_forward(g, xa, wt, bt, tg, wsp);
        }
        // The same input values, placed by the same kernel: the same bits.
        CHECK(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) == 0);
        cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
      }
  cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
  // Every case but the strided 3x3 ones (the implicit GEMM takes x as f32 only) under Auto; forced
  // paths fall back where they do not apply (depthwise first, then the GEMM); the direct kernels
  // take the strided ones by phases (conv_direct_strided.cpp).
  // Winograd by rows: the two 32x32 cases (Auto's choice there too) and the 16 -> 16 one on
  // 16x16 (not Auto's), on AVX-512, AVX2 and aarch64 NEON builds.
  CHECK(ran[0] == 26);
  CHECK(ran[1] == 30);
  CHECK(ran[2] == 12);
  CHECK(ran[3] == 30);
#if defined(ET_WINOGRAD_ROWS)
  CHECK(ran[4] == 6);
#else
  CHECK(ran[4] == 0);
#endif
}

TEST_CASE("a conv data gradient takes the first backward sweep of the BN -> ReLU stack before it", "[conv][fusion]") {
  // dx as conv2d_backward_data writes it, then dz = dx where x * scale + shift > 0 (else +0) in its
  // place and each plane's sums as the stack's own sweep takes them (bn_rows::grad_sums), at the
  // sums' batch stride. The direct kernel's row form (16 and 32 columns) and flat form (odd maps),
  // Winograd (partial tiles, several chunks) and the GEMM's (1x1, small maps, few channels, and
  // every case forced), the strided channels-last form (AVX-512: dgrad_cl_chosen; image by image),
  // the implicit GEMM (small maps of 16+ channels, strided ones elsewhere; per task, after its
  // phases; and every case forced), the stride-2 direct kernels by phases (AVX2 / NEON's 32x32
  // downsampling; and forced); groups decline and leave dx alone.
  struct Case { int64_t N, C, H, W, K, R, stride, pad, groups; bool takes; };
  const Case cases[] = {{3, 16, 16, 16, 16, 3, 1, 1, 1, true}, {2, 16, 32, 32, 8, 3, 1, 1, 1, true},
                        {3, 12, 9, 11, 20, 3, 1, 1, 1, true},  {1, 9, 13, 13, 7, 5, 1, 2, 1, true},
                        {2, 8, 16, 16, 8, 3, 1, 1, 2, false},  {2, 16, 9, 9, 32, 3, 2, 1, 1, true},
                        {3, 12, 16, 16, 20, 1, 1, 0, 1, true}, {2, 8, 4, 4, 8, 3, 1, 1, 1, true},
                        {2, 16, 6, 6, 16, 3, 1, 1, 1, true},   {2, 4, 16, 16, 8, 3, 1, 1, 1, true},
                        {5, 72, 7, 9, 70, 3, 1, 1, 1, true},   {3, 16, 32, 32, 16, 3, 1, 1, 1, true},
                        {2, 16, 32, 32, 24, 3, 2, 1, 1, true}};
  auto be = make_cpu_backend();
  const cpu::ConvPathOverride paths[] = {cpu::ConvPathOverride::Auto, cpu::ConvPathOverride::Winograd,
                                         cpu::ConvPathOverride::Gemm, cpu::ConvPathOverride::WinogradRows,
                                         cpu::ConvPathOverride::Implicit, cpu::ConvPathOverride::Direct};
  int took_on[6] = {0, 0, 0, 0, 0, 0};
  for (int pi = 0; pi < 6; ++pi) {
    for (const Case& c : cases) {
      Conv2dGeom g = geom(c.N, c.C, c.H, c.W, c.K, c.R, c.stride, c.pad, c.groups);
      g.infer_output();
      cpu::conv_set_path_override(paths[pi]);
      // Forced: Winograd where it applies, the GEMM everywhere; the automatic choice elsewhere.
      const bool forced = (pi == 1 && cpu::winograd_applies(g, ConvPass::BackwardData)) || pi == 2 ||
                          (pi == 3 && cpu::winograd_rows_applies(g, ConvPass::BackwardData)) ||
                          (pi == 4 && cpu::implicit_applies(g, ConvPass::BackwardData)) ||
                          (pi == 5 && cpu::direct_dense_applies(g, ConvPass::BackwardData));
      const bool takes = forced ? c.groups == 1 : c.takes;
      INFO("path " << pi << " N " << c.N << " C " << c.C << " H " << c.H << " W " << c.W << " K " << c.K << " R "
                   << c.R << " stride " << c.stride << " groups " << c.groups);
      const int64_t HW = g.H * g.W, xn = g.N * g.C * HW, max_n = g.N + 2;
      std::vector<float> x = rnd(size_t(xn), 21), dy = rnd(size_t(g.N * g.K * g.P * g.Q), 22),
                         w = rnd(size_t(g.K * (g.C / g.groups) * g.R * g.S), 23), k = rnd(size_t(3 * g.C), 24);
      for (size_t i = 0; i < x.size(); i += 7) x[i] = 0.f;  // x * scale + shift == shift: a tie where shift is 0
      k[size_t(g.C)] = 0.f;
      const float* scale = k.data();
      const float* shift = k.data() + g.C;
      const float* mean = k.data() + 2 * g.C;
      std::vector<float> ws(be->conv2d_workspace_bytes(g, ConvPass::BackwardData) / sizeof(float) + 16);
      const Workspace wsp{ws.data(), ws.size() * sizeof(float)};
      const Tensor dyt = view(dy, {g.N, g.K, g.P, g.Q}), wt = view(w, {g.K, g.C / g.groups, g.R, g.S});
      std::vector<float> want(static_cast<size_t>(xn)), got(static_cast<size_t>(xn), 7.f),
          sums(static_cast<size_t>(2 * max_n * g.C), 5.f);
      Tensor tw = view(want, {g.N, g.C, g.H, g.W}), tg = view(got, {g.N, g.C, g.H, g.W});
      be->conv2d_backward_data(g, dyt, wt, tw, false, wsp);
      DzSumsEpilogue e;
      e.x = x.data();
      e.scale = scale;
      e.shift = shift;
      e.mean = mean;
      e.sum1 = sums.data();
      e.sum2 = sums.data() + max_n * g.C;
      const bool took = be->conv2d_backward_data_dz_sums(g, dyt, wt, tg, false, e, wsp);
      cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
  #if defined(ET_ELEMENTWISE_IN_REGISTERS)
      CHECK(took == takes);
  #else
      CHECK(!took);  // portable builds: the stack sweeps itself
      (void)takes;
  #endif
      took_on[pi] += took;
      if (!took) {
        CHECK(got == std::vector<float>(size_t(xn), 7.f));
        CHECK(sums == std::vector<float>(size_t(2 * max_n * g.C), 5.f));
        continue;
      }
      for (int64_t n = 0; n < g.N; ++n)
        for (int64_t ch = 0; ch < g.C; ++ch) {
          const int64_t pl = n * g.C + ch, o = pl * HW;
          std::vector<float> dz(static_cast<size_t>(HW));
          for (int64_t i = 0; i < HW; ++i)
            dz[size_t(i)] = std::fma(x[size_t(o + i)], scale[ch], shift[ch]) > 0.f ? want[size_t(o + i)] : 0.f;
          CHECK(std::memcmp(dz.data(), got.data() + o, sizeof(float) * size_t(HW)) == 0);
          float a = 0.f, b = 0.f;
          bn_rows::grad_sums(bn_rows::row_of(dz.data()), x.data() + o, mean[ch], HW, &a, &b);
          CHECK(std::memcmp(&a, &sums[size_t(pl)], sizeof a) == 0);
          CHECK(std::memcmp(&b, &sums[size_t(max_n * g.C + pl)], sizeof b) == 0);
        }
      CHECK(sums[size_t(g.N * g.C)] == 5.f);  // the sums of images past the batch untouched
    }
  }
#if defined(ET_ELEMENTWISE_IN_REGISTERS)
  CHECK(took_on[1] >= 6);  // Winograd forced: its 3x3 stride-1 cases
  CHECK(took_on[2] == 12);
  CHECK(took_on[4] == 12);  // the implicit GEMM forced: every dense case
  CHECK(took_on[5] == 12);  // the direct kernels forced: every dense case, strided ones by phases
#if defined(ET_WINOGRAD_ROWS)
  CHECK(took_on[3] >= 5);  // Winograd by rows forced: its 32x32 and 16x16 cases (Auto elsewhere)
#endif
#endif
}

TEST_CASE("linear kernels match the naive reference", "[conv][linear]") {
  for (int64_t N : {1, 5, 37})
    for (int64_t I : {3, 64, 130})
      for (int64_t O : {1, 10, 33})
        for (bool acc : {false, true}) {
          INFO("N " << N << " I " << I << " O " << O << " acc " << acc);
          auto x = rnd(size_t(N * I), 1), w = rnd(size_t(O * I), 2), b = rnd(size_t(O), 3), dy = rnd(size_t(N * O), 4);
          const auto dx0 = rnd(size_t(N * I), 5), dw0 = rnd(size_t(O * I), 6), db0 = rnd(size_t(O), 7);
          std::vector<double> y_ref(static_cast<size_t>(N * O)), dx_ref(static_cast<size_t>(N * I)), dw_ref(static_cast<size_t>(O * I)), db_ref(static_cast<size_t>(O));
          for (int64_t n = 0; n < N; ++n)
            for (int64_t o = 0; o < O; ++o) {
              double s = b[size_t(o)];
              for (int64_t i = 0; i < I; ++i) {
                s += double(x[size_t(n * I + i)]) * w[size_t(o * I + i)];
                dx_ref[size_t(n * I + i)] += double(dy[size_t(n * O + o)]) * w[size_t(o * I + i)];
                dw_ref[size_t(o * I + i)] += double(dy[size_t(n * O + o)]) * x[size_t(n * I + i)];
              }
              y_ref[size_t(n * O + o)] = s;
              db_ref[size_t(o)] += dy[size_t(n * O + o)];
            }
          if (acc) {
            for (size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] += dx0[i];
            for (size_t i = 0; i < dw_ref.size(); ++i) dw_ref[i] += dw0[i];
            for (size_t i = 0; i < db_ref.size(); ++i) db_ref[i] += db0[i];
          }
          auto be = make_cpu_backend();
          std::vector<float> y(size_t(N * O), 7.f), dx = acc ? dx0 : std::vector<float>(size_t(N * I), 7.f);
          std::vector<float> dw = acc ? dw0 : std::vector<float>(size_t(O * I), 7.f);
          std::vector<float> db = acc ? db0 : std::vector<float>(size_t(O), 7.f);
          Tensor yt = view(y, {N, O}), dxt = view(dx, {N, I}), dwt = view(dw, {O, I}), dbt = view(db, {O});
          be->linear_forward(view(x, {N, I}), view(w, {O, I}), view(b, {O}), yt);
          be->linear_backward_data(view(dy, {N, O}), view(w, {O, I}), dxt, acc);
          be->linear_backward_weight(view(x, {N, I}), view(dy, {N, O}), dwt, dbt, acc);
          check_close(y, y_ref, "linear forward");
          check_close(dx, dx_ref, "linear backward data");
          check_close(dw, dw_ref, "linear backward weight");
          check_close(db, db_ref, "linear bias grad");
        }
}

// The blocked SGEMM against a double reference: random shapes with edge sizes around the tile and
// block sizes (1, 7, 33, 257 cross KC = 256, MC = 96, the 8x32 / 4x16 tiles), every transpose
// combination, alpha / beta, padded leading dimensions; native and scalar tiles. Also checks the
// scratch bound, that beta = 0 ignores NaN garbage in C, and bit-identical repeats.
TEST_CASE("sgemm matches a double reference", "[conv][gemm]") {
  struct MNK { int64_t M, N, K; };
  std::vector<MNK> shapes = {{9, 1600, 3}, {5, 1601, 300}, {100, 17, 600}};  // past NC = 1536, narrow C
  for (int64_t M : {1, 7, 33, 257})
    for (int64_t N : {1, 7, 33, 257})
      for (int64_t K : {1, 7, 33, 257}) shapes.push_back({M, N, K});
  uint32_t seed = 11;
  for (bool scalar : {false, true})
    for (const MNK& sh : shapes)
      for (int tr = 0; tr < 4; ++tr) {
        const int64_t M = sh.M, N = sh.N, K = sh.K;
        const bool ta = tr & 1, tb = tr & 2;
        const uint32_t h = (seed * 2654435761u) >> 16;  // alpha / beta vary independently of tr
        const float alpha = (h % 3 == 0) ? 1.f : -0.75f;
        const float beta = (h / 3 % 3 == 0) ? 0.f : (h / 3 % 3 == 1 ? 1.f : 0.5f);
        ++seed;
        INFO("scalar " << scalar << " M " << M << " N " << N << " K " << K << " ta " << ta << " tb " << tb
                       << " alpha " << alpha << " beta " << beta);
        cpu::conv_force_scalar(scalar);
        const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 5;
        auto a = rnd(size_t((ta ? K : M) * lda), seed), b = rnd(size_t((tb ? N : K) * ldb), seed + 1);
        auto c = rnd(size_t(M * ldc), seed + 2);
        if (beta == 0.f)
          for (auto& v : c) v = std::nanf("");
        std::vector<double> ref(size_t(M * N));
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double s = 0.0;
            for (int64_t k = 0; k < K; ++k)
              s += double(ta ? a[size_t(k * lda + i)] : a[size_t(i * lda + k)]) *
                   double(tb ? b[size_t(j * ldb + k)] : b[size_t(k * ldb + j)]);
            ref[size_t(i * N + j)] = alpha * s + (beta != 0.f ? beta * double(c[size_t(i * ldc + j)]) : 0.0);
          }
        const size_t sn = cpu::sgemm_scratch_floats(M, N, K);
        REQUIRE(sn <= cpu::sgemm_scratch_floats_max());
        std::vector<float> scratch(sn + 16, 0.f);
        for (size_t i = sn; i < scratch.size(); ++i) scratch[i] = 12345.f;
        auto c1 = c, c2 = c;
        cpu::sgemm(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c1.data(), ldc, scratch.data());
        cpu::sgemm(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c2.data(), ldc, scratch.data());
        for (size_t i = sn; i < scratch.size(); ++i) REQUIRE(scratch[i] == 12345.f);
        std::vector<float> got(size_t(M * N));
        size_t pad_written = 0;  // columns N..ldc of C are never touched
        for (int64_t i = 0; i < M; ++i) {
          for (int64_t j = 0; j < N; ++j) got[size_t(i * N + j)] = c1[size_t(i * ldc + j)];
          pad_written += std::memcmp(&c1[size_t(i * ldc + N)], &c[size_t(i * ldc + N)], sizeof(float) * size_t(ldc - N)) != 0;
        }
        CHECK(pad_written == 0);
        check_close(got, ref, "sgemm");
        CHECK(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) == 0);
        // The naive reference agrees too (it is what the other backends' tests may use).
        auto c3 = c;
        cpu::sgemm_reference(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c3.data(), ldc);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) got[size_t(i * N + j)] = c3[size_t(i * ldc + j)];
        check_close(got, ref, "sgemm_reference");
      }
  cpu::conv_force_scalar(false);
}
