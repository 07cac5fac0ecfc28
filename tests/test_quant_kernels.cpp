// 4-bit training kernels (docs/quant.md): the integer GEMM on every path against its reference,
// the quantizers' vector paths against their scalar references (bit for bit), code tables, the
// SAWB scale against an independent computation, LUQ's unbiasedness and SMP's variance, and the
// integer conv / linear against the FP32 computation on the dequantised operands (bit-identical:
// with power-of-two scales and sums below 2^24 the FP32 arithmetic is exact).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "backends/cpu/conv_direct.h"
#include "backends/cpu/cpu_backend.h"
#include "tests/code_samples.h"
#include "backends/cpu/igemm.h"
#include "backends/cpu/quantize.h"
#include "quant/scales.h"

using namespace et;

namespace {

using test::codes;
using test::fp4_codes;
using test::lcg;
std::vector<float> gauss(size_t n, uint32_t seed, float sd) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i += 2) {
    const double u1 = (double(lcg(seed) >> 8) + 1.0) / 16777217.0, u2 = double(lcg(seed) >> 8) / 16777216.0;
    const double r = std::sqrt(-2.0 * std::log(u1));
    v[i] = float(r * std::cos(6.283185307179586 * u2) * sd);
    if (i + 1 < n) v[i + 1] = float(r * std::sin(6.283185307179586 * u2) * sd);
  }
  return v;
}

struct IsaGuard {  // restores the integer-kernel path a test case forces
  cpu::IgemmIsa saved = cpu::igemm_isa();
  ~IsaGuard() { cpu::igemm_force_isa(saved); }
};

}  // namespace

TEST_CASE("igemm: every path equals the reference, for both operand contracts and layouts", "[quant][igemm]") {
  IsaGuard guard;
  struct Case { int64_t M, N, K; bool trans; int64_t groups; };
  const Case cases[] = {{1, 1, 1, false, 1},  {8, 32, 4, false, 1},  {9, 33, 5, false, 1}, {16, 100, 144, false, 1},
                        {7, 64, 77, true, 1}, {20, 48, 36, true, 1}, {5, 64, 12, false, 4}, {32, 40, 576, true, 1},
                        {3, 17, 16, false, 2}};
  for (const Case& c : cases)
    for (int contract = 0; contract < 2; ++contract) {
      // contract 0: A = INT4 codes + 8, B = FP4 codes; contract 1: A = FP4 codes + 64, B = UINT4 codes.
      const int64_t Kg = c.K / c.groups;  // reduction columns per group (A's kg)
      const auto a = contract == 0 ? codes(size_t(c.M * c.K), -7, 7, uint32_t(c.M * 7 + c.K))
                                   : fp4_codes(size_t(c.M * c.K), uint32_t(c.M + c.N));
      const auto b = contract == 0 ? fp4_codes(size_t(c.K * c.N), uint32_t(c.N * 3))
                                   : codes(size_t(c.K * c.N), 0, 15, uint32_t(c.K + 11));
      cpu::IgemmA am{a.data(), c.M, c.K, c.K, 1, c.K, 0, contract == 0 ? 8 : 64};
      if (c.groups > 1) am = cpu::IgemmA{a.data(), c.M, c.K, Kg, 1, Kg, c.M * Kg, am.offset};  // [g][M][Kg]
      // Column groups for B (images side by side): jg = N / 2 columns per group when not transposed.
      const int64_t jg = c.trans ? 0 : (c.N % 2 == 0 ? c.N / 2 : c.N);
      const cpu::IgemmB bm = c.trans ? cpu::IgemmB{b.data(), c.K, c.N, c.K, 0, 0, true}
                                     : cpu::IgemmB{b.data(), c.K, c.N, jg, jg, c.K * jg, false};
      std::vector<int32_t> ref(size_t(c.M * c.N), 5);
      cpu::igemm_reference(am, bm, ref.data(), c.N, true);
      for (cpu::IgemmIsa isa : {cpu::IgemmIsa::Scalar, cpu::IgemmIsa::Avx2, cpu::IgemmIsa::Avx512Vnni}) {
        if (!cpu::igemm_supported(isa)) continue;
        cpu::igemm_force_isa(isa);
        std::vector<uint8_t> packed(cpu::igemm_packed_a_bytes(c.M, c.K)), scratch(cpu::igemm_scratch_bytes(c.K));
        const cpu::PackedA pa = cpu::igemm_pack_a(am, packed.data());
        std::vector<int32_t> got(size_t(c.M * c.N), 5);
        cpu::igemm(pa, bm, got.data(), c.N, true, scratch.data());
        INFO(cpu::igemm_isa_name(isa) << " M " << c.M << " N " << c.N << " K " << c.K << " trans " << c.trans
                                      << " contract " << contract);
        CHECK(got == ref);
      }
    }
}

TEST_CASE("FP4 and INT4 code tables", "[quant]") {
  for (int sign = 0; sign < 2; ++sign)
    for (int f = 0; f <= 7; ++f) {
      const int8_t v = quant::fp4_value(sign, f);
      CHECK(int(v) == (f == 0 ? 0 : (sign ? -1 : 1) * (1 << (f - 1))));
      CHECK(quant::fp4_from_nibble(quant::fp4_nibble(v)) == v);
      if (f > 0) CHECK(quant::fp4_nibble(v) == uint8_t((sign << 3) | f));
    }
  for (int v = -7; v <= 7; ++v) CHECK(quant::int4_from_nibble(quant::int4_nibble(int8_t(v)), true) == v);
  for (int v = 0; v <= 15; ++v) CHECK(quant::int4_from_nibble(quant::int4_nibble(int8_t(v)), false) == v);
}

TEST_CASE("quantizers: the vector paths equal the scalar references bit for bit", "[quant]") {
  for (int64_t n : {1, 15, 16, 17, 1000, 4096, 4097, 70001}) {
    auto x = gauss(size_t(n), uint32_t(n), 0.3f);
    x[size_t(n / 2)] = -0.f;
    if (n > 20) x[7] = 1e-42f;  // a subnormal
    cpu::quant_force_scalar(true);
    const TensorStats s0 = cpu::tensor_stats(x.data(), n);
    std::vector<int8_t> i0(static_cast<size_t>(n)), f0(i0), r0(i0);
    cpu::quantize_int4(x.data(), n, 1.f / 0.05f, -7, 7, i0.data());
    const quant::RngKey key = quant::rng_key(1234, 0);
    cpu::quantize_fp4(x.data(), n, 1.f / quant::fp4_alpha(s0.max_abs, 7), 7, Fp4Rounding::Stochastic, key,
                      f0.data());
    cpu::quantize_fp4(x.data(), n, 1.f / quant::fp4_alpha(s0.max_abs, 7), 7, Fp4Rounding::Nearest, key, r0.data());
    cpu::quant_force_scalar(false);
    const TensorStats s1 = cpu::tensor_stats(x.data(), n);
    std::vector<int8_t> i1(static_cast<size_t>(n)), f1(i1), r1(i1);
    cpu::quantize_int4(x.data(), n, 1.f / 0.05f, -7, 7, i1.data());
    cpu::quantize_fp4(x.data(), n, 1.f / quant::fp4_alpha(s1.max_abs, 7), 7, Fp4Rounding::Stochastic, key,
                      f1.data());
    cpu::quantize_fp4(x.data(), n, 1.f / quant::fp4_alpha(s1.max_abs, 7), 7, Fp4Rounding::Nearest, key, r1.data());
    INFO("n " << n);
    // The max-only pass (the FP4 alpha) gives the same maximum on both paths, and no sums.
    for (bool scalar : {true, false}) {
      cpu::quant_force_scalar(scalar);
      const TensorStats m = cpu::tensor_stats(x.data(), n, false);
      CHECK(m.max_abs == s0.max_abs);
      CHECK(m.finite);
      CHECK(m.sum_sq == 0.0);
    }
    cpu::quant_force_scalar(false);
    CHECK(std::memcmp(&s0.sum_sq, &s1.sum_sq, 8) == 0);
    CHECK(std::memcmp(&s0.sum_abs, &s1.sum_abs, 8) == 0);
    CHECK(s0.max_abs == s1.max_abs);
    CHECK(i0 == i1);
    CHECK(f0 == f1);
    CHECK(r0 == r1);
    // Every FP4 code is a signed power of two within the grid, and its sign is the input's.
    for (int64_t i = 0; i < n; ++i) {
      const int v = f1[size_t(i)], m = std::abs(v);
      CHECK((m == 0 || (m <= 64 && (m & (m - 1)) == 0)));
      if (v != 0) CHECK((v < 0) == std::signbit(x[size_t(i)]));
    }
  }
}

TEST_CASE("tensor statistics: non-finite values are reported, not summed", "[quant]") {
  std::vector<float> x(100, 1.f);
  x[50] = NAN;
  CHECK_FALSE(cpu::tensor_stats(x.data(), 100).finite);
  CHECK_FALSE(cpu::tensor_stats(x.data(), 100, false).finite);  // the max-only pass too
  x[50] = -INFINITY;
  const TensorStats s = cpu::tensor_stats(x.data(), 100);
  CHECK_FALSE(s.finite);
  CHECK(s.sum_abs == 99.0);
  x[50] = 2.f;
  CHECK(cpu::tensor_stats(x.data(), 100).finite);
}

TEST_CASE("SAWB scale against an independent computation", "[quant]") {
  for (bool is_unsigned : {false, true}) {
    auto x = gauss(10000, 77, 0.7f);
    if (is_unsigned)
      for (auto& v : x) v = std::fabs(v);
    double s2 = 0, s1 = 0, mx = 0;
    for (float v : x) s2 += double(v) * v, s1 += std::fabs(double(v)), mx = std::max(mx, std::fabs(double(v)));
    double clip = 12.1 * std::sqrt(s2 / 1e4) - 12.2 * (s1 / 1e4);
    clip = std::min(clip, mx);
    const double want = clip / (is_unsigned ? 15.0 : 7.0);
    const float got = quant::sawb_scale(cpu::tensor_stats(x.data(), 10000), 10000, is_unsigned);
    CHECK(std::fabs(got - want) <= 1e-6 * want);
    // Gaussian data: SAWB clips well inside the range (about 2.7 sd for signed data).
    CHECK(clip < 0.8 * mx);
  }
  // A constant tensor: the formula is negative, the scale falls back to the maximum.
  std::vector<float> c(64, -0.5f);
  CHECK(quant::sawb_scale(cpu::tensor_stats(c.data(), 64), 64, false) == Approx(0.5 / 7));
  std::vector<float> z(64, 0.f);
  CHECK(quant::sawb_scale(cpu::tensor_stats(z.data(), 64), 64, false) == 1.f);
}

TEST_CASE("INT4 rounding: nearest, ties to even, clamped to the grid", "[quant]") {
  const std::vector<float> x = {0.f, 0.49f, 0.5f, 1.5f, 2.5f, -2.5f, 6.9f, 7.5f, 100.f, -100.f, -0.2f, 3.49f};
  std::vector<int8_t> s(x.size()), u(x.size());
  cpu::quantize_int4(x.data(), int64_t(x.size()), 1.f, -7, 7, s.data());
  cpu::quantize_int4(x.data(), int64_t(x.size()), 1.f, 0, 15, u.data());
  CHECK(s == std::vector<int8_t>{0, 0, 0, 2, 2, -2, 7, 7, 7, -7, 0, 3});
  CHECK(u == std::vector<int8_t>{0, 0, 0, 2, 2, 0, 7, 8, 15, 0, 0, 3});
}

namespace {
// Exact mean and variance of LUQ's Q(g) (in units of alpha), for a = |g| / alpha.
void luq_moments(double a, int levels, double* mean, double* var) {
  const double top = std::ldexp(1.0, levels - 1);
  if (a >= top) { *mean = top; *var = 0; return; }
  if (a < 1) { *mean = a; *var = a * (1 - a); return; }
  const double lo = std::ldexp(1.0, int(std::floor(std::log2(a))));
  *mean = a;
  *var = (2 * lo - a) * (a - lo);
}
}  // namespace

TEST_CASE("LUQ is unbiased: the mean over many draws equals g within its standard error", "[quant][luq]") {
  const int64_t n = 2048;
  const int draws = 3000;
  for (int kind = 0; kind < 3; ++kind) {
    // 0: mixed signs; 1: all negative; 2: max not on a power of two (alpha * 2^6 = max exactly, but
    // values spread over every binade and below alpha).
    auto g = gauss(size_t(n), uint32_t(kind + 5), 1e-3f);
    if (kind == 1)
      for (auto& v : g) v = -std::fabs(v);
    if (kind == 2) g[3] = 3.3e-3f;
    const TensorStats st = cpu::tensor_stats(g.data(), n);
    const int levels = 7;
    const float alpha = quant::fp4_alpha(st.max_abs, levels);
    std::vector<double> sum(size_t(n), 0.0);
    std::vector<int8_t> q(static_cast<size_t>(n));
    for (int d = 0; d < draws; ++d) {
      cpu::quantize_fp4(g.data(), n, 1.f / alpha, levels, Fp4Rounding::Stochastic, quant::rng_key(uint64_t(d) * 31 + 7, 0),
                        q.data());
      for (int64_t i = 0; i < n; ++i) sum[size_t(i)] += double(q[size_t(i)]);
    }
    int outside = 0;
    double zsum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double a = std::fabs(double(g[size_t(i)])) * double(1.f / alpha);
      double mean, var;
      luq_moments(a, levels, &mean, &var);
      const double got = std::fabs(sum[size_t(i)] / draws);
      const double se = std::sqrt(var / draws) + 1e-9;
      const double z = (got - mean) / se;
      zsum += z;
      outside += std::fabs(z) > 5.5;
    }
    INFO("kind " << kind);
    CHECK(outside == 0);
    // The average z-score of n independent elements: |mean z| < 5 / sqrt(n) (a bias of even 0.2
    // standard errors per element would fail this).
    CHECK(std::fabs(zsum / double(n)) < 5.0 / std::sqrt(double(n)));
  }
}

TEST_CASE("FP4 round-to-nearest is biased (the ablation), LUQ is not", "[quant][luq]") {
  // a = 1.25 alpha: nearest gives alpha always (bias -0.25 alpha); LUQ averages to 1.25 alpha.
  std::vector<float> g(4096, 1.25f);
  g[0] = 64.f;  // max -> alpha = 1
  std::vector<int8_t> q(g.size());
  cpu::quantize_fp4(g.data(), 4096, 1.f, 7, Fp4Rounding::Nearest, quant::rng_key(1, 0), q.data());
  CHECK(q[1] == 1);
  CHECK(q[0] == 64);
  cpu::quantize_fp4(g.data(), 4096, 1.f, 7, Fp4Rounding::Stochastic, quant::rng_key(1, 0), q.data());
  double s = 0;
  for (size_t i = 1; i < q.size(); ++i) s += q[i];
  CHECK(s / 4095 == Approx(1.25).margin(5 * std::sqrt(0.75 * 0.25 / 4095)));
}

TEST_CASE("SMP: the variance of the mean of N samples falls as 1/N", "[quant][luq]") {
  const int64_t n = 4096;
  auto g = gauss(size_t(n), 99, 1.f);
  const float alpha = quant::fp4_alpha(cpu::tensor_stats(g.data(), n).max_abs, 7);
  std::vector<int8_t> q(static_cast<size_t>(n));
  double var[3];
  const int Ns[3] = {1, 2, 4};
  for (int t = 0; t < 3; ++t) {
    // Empirical variance of the N-sample mean around g, summed over elements, over 64 repetitions.
    double acc = 0;
    for (int rep = 0; rep < 64; ++rep) {
      std::vector<double> m(size_t(n), 0.0);
      for (int s = 0; s < Ns[t]; ++s) {
        cpu::quantize_fp4(g.data(), n, 1.f / alpha, 7, Fp4Rounding::Stochastic, quant::rng_key(uint64_t(rep), s),
                          q.data());
        for (int64_t i = 0; i < n; ++i) m[size_t(i)] += double(q[size_t(i)]) * alpha / Ns[t];
      }
      for (int64_t i = 0; i < n; ++i) acc += (m[size_t(i)] - g[size_t(i)]) * (m[size_t(i)] - g[size_t(i)]);
    }
    var[t] = acc / 64;
  }
  CHECK(var[1] / var[0] == Approx(0.5).margin(0.05));
  CHECK(var[2] / var[0] == Approx(0.25).margin(0.03));
}

namespace {

// conv on codes, exact: int64 sums of code products, then one float multiply (+ bias).
struct ConvCase { int64_t N, C, H, W, K, R, stride, pad; };

Conv2dGeom geom(const ConvCase& c) {
  Conv2dGeom g;
  g.N = c.N; g.C = c.C; g.H = c.H; g.W = c.W; g.K = c.K; g.R = g.S = c.R;
  g.stride_h = g.stride_w = c.stride;
  g.pad_h = g.pad_w = c.pad;
  g.infer_output();
  return g;
}

template <class F>
void each_tap(const Conv2dGeom& g, F&& f) {  // f(x index, w index, y index)
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t k = 0; k < g.K; ++k)
      for (int64_t p = 0; p < g.P; ++p)
        for (int64_t q = 0; q < g.Q; ++q)
          for (int64_t c = 0; c < g.C; ++c)
            for (int64_t r = 0; r < g.R; ++r)
              for (int64_t s = 0; s < g.S; ++s) {
                const int64_t h = p * g.stride_h - g.pad_h + r, w = q * g.stride_w - g.pad_w + s;
                if (h < 0 || h >= g.H || w < 0 || w >= g.W) continue;
                f(((n * g.C + c) * g.H + h) * g.W + w, ((k * g.C + c) * g.R + r) * g.S + s,
                  ((n * g.K + k) * g.P + p) * g.Q + q);
              }
}

}  // namespace

TEST_CASE("integer conv equals the exact product of the codes and the FP32 conv of the dequantised operands",
          "[quant][conv]") {
  IsaGuard guard;
  auto be = make_cpu_backend();
  cpu::conv_set_path_override(cpu::ConvPathOverride::Gemm);  // FP32 sums in order: exact on these values
  const ConvCase cases[] = {{2, 16, 8, 8, 16, 3, 1, 1}, {3, 5, 7, 9, 6, 3, 2, 1},   {1, 8, 6, 6, 12, 1, 1, 0},
                            {4, 12, 5, 5, 8, 1, 2, 0},  {16, 32, 2, 2, 16, 3, 1, 1}, {1, 3, 11, 11, 5, 5, 1, 2},
                            {5, 9, 4, 4, 33, 3, 1, 1},  {2, 8, 20, 20, 8, 3, 1, 1}, {1, 5, 18, 17, 9, 3, 1, 1},
                            {2, 8, 20, 20, 8, 3, 2, 1}, {2, 4, 12, 12, 8, 1, 2, 0}};
  // (Large maps take the padded staging, small ones and strides the per-tap one: both covered.)
  for (const ConvCase& cc : cases)
    for (bool x_unsigned : {true, false})
      for (cpu::IgemmIsa isa :
           {cpu::IgemmIsa::Scalar, cpu::IgemmIsa::Avx2, cpu::IgemmIsa::Avx512Vnni, cpu::IgemmIsa::NeonDot}) {
        if (!cpu::igemm_supported(isa)) continue;
        cpu::igemm_force_isa(isa);
        const Conv2dGeom g = geom(cc);
        const int64_t nx = g.N * g.C * g.H * g.W, nw = g.K * g.C * g.R * g.S, ny = g.N * g.K * g.P * g.Q;
        auto xc = x_unsigned ? codes(size_t(nx), 0, 15, 1) : codes(size_t(nx), -7, 7, 1);
        auto wc = codes(size_t(nw), -7, 7, 2);
        auto gc = fp4_codes(size_t(ny), 3);
        const float sx = 0.125f, sw = 0.0625f, sg = 0x1p-10f;  // powers of two: FP32 products are exact
        Tensor xq = Tensor::contiguous(xc.data(), Shape{g.N, g.C, g.H, g.W}, x_unsigned ? DType::U4 : DType::I4);
        Tensor wq = Tensor::contiguous(wc.data(), Shape{g.K, g.C, g.R, g.S}, DType::I4);
        Tensor gq = Tensor::contiguous(gc.data(), Shape{g.N, g.K, g.P, g.Q}, DType::F4);
        xq.scale = sx, wq.scale = sw, gq.scale = sg;
        std::vector<float> bias(size_t(g.K));
        for (int64_t k = 0; k < g.K; ++k) bias[size_t(k)] = float(k) * 0.25f;
        size_t wsb = 0;
        for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
          wsb = std::max({wsb, be->conv2d_q_workspace_bytes(g, p), be->conv2d_workspace_bytes(g, p)});
        std::vector<uint8_t> wsv(wsb);
        const Workspace ws{wsv.data(), wsb};

        // Exact references from the codes.
        std::vector<int64_t> ry(size_t(ny), 0), rdx(size_t(nx), 0), rdw(size_t(nw), 0);
        each_tap(g, [&](int64_t xi, int64_t wi, int64_t yi) {
          ry[size_t(yi)] += int64_t(xc[size_t(xi)]) * wc[size_t(wi)];
          rdx[size_t(xi)] += int64_t(gc[size_t(yi)]) * wc[size_t(wi)];
          rdw[size_t(wi)] += int64_t(gc[size_t(yi)]) * xc[size_t(xi)];
        });
        std::vector<double> rdb(size_t(g.K), 0);
        for (int64_t i = 0; i < ny; ++i) rdb[size_t((i / (g.P * g.Q)) % g.K)] += gc[size_t(i)];

        std::vector<float> y(static_cast<size_t>(ny)), dx(static_cast<size_t>(nx), 1.f), dw(static_cast<size_t>(nw), 1.f),
            db(static_cast<size_t>(g.K), 1.f);
        Tensor yt = Tensor::contiguous(y.data(), Shape{g.N, g.K, g.P, g.Q});
        Tensor bt = Tensor::contiguous(bias.data(), Shape{g.K});
        Tensor dxt = Tensor::contiguous(dx.data(), xq.shape), dwt = Tensor::contiguous(dw.data(), wq.shape);
        Tensor dbt = Tensor::contiguous(db.data(), Shape{g.K});
        be->conv2d_forward_q(g, xq, wq, bt, yt, ws);
        be->conv2d_backward_data_q(g, gq, wq, dxt, true, ws);  // accumulate onto 1
        be->conv2d_backward_weight_q(g, xq, gq, dwt, dbt, false, ws);
        INFO(cpu::igemm_isa_name(isa) << " N" << g.N << " C" << g.C << " " << g.H << "x" << g.W << " K" << g.K << " R"
                                      << g.R << " s" << cc.stride << " unsigned " << x_unsigned);
        bool ok = true;
        for (int64_t i = 0; i < ny; ++i)
          ok &= y[size_t(i)] == float(ry[size_t(i)]) * (sx * sw) + bias[size_t((i / (g.P * g.Q)) % g.K)];
        CHECK(ok);
        ok = true;
        for (int64_t i = 0; i < nx; ++i) ok &= dx[size_t(i)] == float(rdx[size_t(i)]) * (sg * sw) + 1.f;
        CHECK(ok);
        ok = true;
        for (int64_t i = 0; i < nw; ++i) ok &= dw[size_t(i)] == float(rdw[size_t(i)]) * (sx * sg);
        CHECK(ok);
        ok = true;
        for (int64_t k = 0; k < g.K; ++k) ok &= db[size_t(k)] == float(rdb[size_t(k)]) * sg;
        CHECK(ok);

        // The FP32 conv of the dequantised operands (fake quantisation) gives the same forward.
        std::vector<float> xf(static_cast<size_t>(nx)), wf(static_cast<size_t>(nw)), yf(static_cast<size_t>(ny));
        Tensor xft = Tensor::contiguous(xf.data(), xq.shape), wft = Tensor::contiguous(wf.data(), wq.shape);
        Tensor yft = Tensor::contiguous(yf.data(), yt.shape);
        be->dequantize(xq, xft);
        be->dequantize(wq, wft);
        be->conv2d_forward(g, xft, wft, bt, yft, ws);
        CHECK(yf == y);

        // With y's plane sums for a fused BN stack (taken per chunk of images in cache): the same y,
        // and the sums plane_sums takes over it, at the sums' batch stride (N + 1).
        std::vector<float> y2(static_cast<size_t>(ny), 3.f), sums(static_cast<size_t>(2 * (g.N + 1) * g.K), 5.f),
            want(sums.size(), 5.f);
        Tensor y2t = Tensor::contiguous(y2.data(), yt.shape);
        Tensor st = Tensor::contiguous(sums.data(), Shape{2, g.N + 1, g.K}), wt = Tensor::contiguous(want.data(), st.shape);
        be->conv2d_forward_q_sums(g, xq, wq, bt, y2t, st, ws);
        be->plane_sums(yt, wt);
        CHECK(y2 == y);
        CHECK(std::memcmp(sums.data(), want.data(), sums.size() * sizeof(float)) == 0);
      }
  cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
}

TEST_CASE("integer linear equals the exact product of the codes", "[quant][linear]") {
  auto be = make_cpu_backend();
  for (auto [N, I, O] : {std::tuple<int64_t, int64_t, int64_t>{4, 64, 10}, {7, 33, 5}, {128, 512, 10}}) {
    auto xc = codes(size_t(N * I), 0, 15, 4), wc = codes(size_t(O * I), -7, 7, 5);
    auto gc = fp4_codes(size_t(N * O), 6);
    Tensor xq = Tensor::contiguous(xc.data(), Shape{N, I}, DType::U4);
    Tensor wq = Tensor::contiguous(wc.data(), Shape{O, I}, DType::I4);
    Tensor gq = Tensor::contiguous(gc.data(), Shape{N, O}, DType::F4);
    xq.scale = 0.5f, wq.scale = 0.25f, gq.scale = 0x1p-8f;
    std::vector<uint8_t> wsv(be->linear_q_workspace_bytes(N, I, O));
    const Workspace ws{wsv.data(), wsv.size()};
    std::vector<float> bias(static_cast<size_t>(O), 0.5f), y(static_cast<size_t>(N * O)), dx(static_cast<size_t>(N * I)),
        dw(static_cast<size_t>(O * I)), db(static_cast<size_t>(O));
    Tensor bt = Tensor::contiguous(bias.data(), Shape{O}), yt = Tensor::contiguous(y.data(), Shape{N, O});
    Tensor dxt = Tensor::contiguous(dx.data(), Shape{N, I}), dwt = Tensor::contiguous(dw.data(), Shape{O, I});
    Tensor dbt = Tensor::contiguous(db.data(), Shape{O});
    be->linear_forward_q(xq, wq, bt, yt, ws);
    be->linear_backward_data_q(gq, wq, dxt, false, ws);
    be->linear_backward_weight_q(xq, gq, dwt, dbt, false, ws);
    bool ok = true;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < O; ++o) {
        int64_t s = 0;
        for (int64_t i = 0; i < I; ++i) s += int64_t(xc[size_t(n * I + i)]) * wc[size_t(o * I + i)];
        ok &= y[size_t(n * O + o)] == float(s) * 0.125f + 0.5f;
      }
    CHECK(ok);
    ok = true;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < I; ++i) {
        int64_t s = 0;
        for (int64_t o = 0; o < O; ++o) s += int64_t(gc[size_t(n * O + o)]) * wc[size_t(o * I + i)];
        ok &= dx[size_t(n * I + i)] == float(s) * (0x1p-8f * 0.25f);
      }
    CHECK(ok);
    ok = true;
    for (int64_t o = 0; o < O; ++o) {
      int64_t sb = 0;
      for (int64_t n = 0; n < N; ++n) sb += gc[size_t(n * O + o)];
      ok &= db[size_t(o)] == float(sb) * 0x1p-8f;
      for (int64_t i = 0; i < I; ++i) {
        int64_t s = 0;
        for (int64_t n = 0; n < N; ++n) s += int64_t(gc[size_t(n * O + o)]) * xc[size_t(n * I + i)];
        ok &= dw[size_t(o * I + i)] == float(s) * (0.5f * 0x1p-8f);
      }
    }
    CHECK(ok);
  }
}
