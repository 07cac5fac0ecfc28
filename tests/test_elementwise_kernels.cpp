// Element-wise CPU kernels against plain references: the ReLU backward from a bitmap mask (the
// AVX-512 word path and the scalar tail) equals the one from the dense saved output, for lengths
// around the 64-element word, with and without accumulation, and in place (dx = dy); the
// vectorised pooling planes against their reference loops.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backends/backend.h"
#include "backends/cpu/batchnorm_rows.h"
#include "backends/cpu/pool_planes.h"
#include "memory/bitmap.h"
#include "memory/half.h"

using namespace et;

TEST_CASE("BN's plane and gradient sums keep their fixed order bit for bit", "[kernels]") {
  // Values of magnitudes far apart, so any other order of additions changes the bits. The order:
  // lane j of 16 takes elements j, j + 16, ... (plane_sums: vector k into accumulator k % 4, the
  // four added (0 + 1) + (2 + 3)), then the lanes add by a halving tree (j + 8 into j, then 4, 2, 1).
  std::mt19937 rng(5);
  [[maybe_unused]] auto halving = [](float t[16]) {
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; ++j) t[j] += t[j + w];
    return t[0];
  };
  for (const int64_t len : {1, 7, 16, 33, 64, 100, 256, 1024}) {
    std::vector<float> x(static_cast<size_t>(len)), d(static_cast<size_t>(len));
    for (int rep = 0; rep < 50; ++rep) {
      for (float& v : x) v = std::ldexp(float(int(rng() % 2001) - 1000), int(rng() % 40) - 20);
      for (float& v : d) v = std::ldexp(float(int(rng() % 2001) - 1000), int(rng() % 40) - 20);
      const float mu = 0.375f;
      float s1, s2, a, b;
      bn_rows::plane_sums(x.data(), len, &s1, &s2);
      bn_rows::grad_sums(bn_rows::row_of(d.data()), x.data(), mu, len, &a, &b);
#if defined(__AVX512F__) || defined(ET_LANES16)
      // The gradient sums: the same lanes on AVX-512 and on AVX2's or NEON's registers (lanes16.h).
      float ga[16] = {}, gb[16] = {};
      for (int64_t i = 0; i < len; ++i) {
        const int j = int(i % 16);
        ga[j] += d[size_t(i)];
        gb[j] = std::fma(d[size_t(i)], x[size_t(i)] - mu, gb[j]);
      }
      CHECK(a == halving(ga));
      CHECK(b == halving(gb));
#else
      CHECK(std::isfinite(a + b));
#endif
#if defined(__AVX512F__)
      float p1[4][16] = {}, p2[4][16] = {};
      for (int64_t i = 0; i < len; ++i) {
        const int k = int(i / 16 % 4), j = int(i % 16);
        p1[k][j] += x[size_t(i)];
        p2[k][j] = std::fma(x[size_t(i)], x[size_t(i)], p2[k][j]);
      }
      float t1[16], t2[16];
      for (int j = 0; j < 16; ++j) {
        t1[j] = (p1[0][j] + p1[1][j]) + (p1[2][j] + p1[3][j]);
        t2[j] = (p2[0][j] + p2[1][j]) + (p2[2][j] + p2[3][j]);
      }
      CHECK(s1 == halving(t1));
      CHECK(s2 == halving(t2));
#else
      CHECK(std::isfinite(s1 + s2));  // the compiler's vector order
#endif
    }
  }
}

TEST_CASE("relu backward from a bitmap mask equals the dense reference", "[kernels]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t n : {1, 15, 63, 64, 65, 130, 1000, 4099}) {
    for (bool accumulate : {false, true}) {
      for (bool in_place : {false, true}) {
        if (in_place && accumulate) continue;  // an in-place gradient is always the first writer
        INFO("n " << n << " accumulate " << accumulate << " in place " << in_place);
        const size_t len = static_cast<size_t>(n);
        std::vector<float> y(len, 0.f), dy(len, 0.f), start(len, 0.f);
        for (int64_t i = 0; i < n; ++i) {
          y[size_t(i)] = std::max(0.f, normal(rng));
          dy[size_t(i)] = normal(rng);
          start[size_t(i)] = normal(rng);
        }
        std::vector<uint64_t> bits(size_t(bitmap::num_words(n)), ~0ull);  // garbage past n must not matter
        bitmap::make_bits(y.data(), n, 0.f, bits.data());
        std::vector<float> expect(len, 0.f);
        for (int64_t i = 0; i < n; ++i) {
          const float v = y[size_t(i)] > 0.f ? dy[size_t(i)] : 0.f;
          expect[size_t(i)] = accumulate ? start[size_t(i)] + v : v;
        }
        std::vector<float> dy_copy = dy, out = in_place ? dy : start;
        Tensor tdy = Tensor::contiguous(in_place ? out.data() : dy_copy.data(), Shape{n});
        Tensor tdx = Tensor::contiguous(out.data(), Shape{n});
        MaskView mask;
        mask.numel = n;
        mask.bits = bits.data();
        be->relu_backward(tdy, mask, tdx, accumulate);
        CHECK(out == expect);
      }
    }
  }
}

// The product and the sum rounded apart (as the CUDA kernel spells them), in every loop version the
// compiler makes of the loop: lengths around its unrolling and the threads' split. Before, GCC
// contracted o + d * scale into one FMA in some versions only.
TEST_CASE("dropout's backward adds the scaled gradient rounded apart, whatever the length", "[kernels]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  const float p = 0.3f, scale = 1.f / (1.f - p);
  DropoutSeed seed;
  seed.step = 12345;
  seed.node = 678;
  size_t fused_would_differ = 0;
  for (int64_t n = 1; n <= 4200; n += n < 80 ? 1 : 173) {
    const size_t len = static_cast<size_t>(n);
    std::vector<float> dy(len), start(len);
    for (size_t i = 0; i < len; ++i) {
      dy[i] = normal(rng);
      start[i] = normal(rng);
    }
    std::vector<float> out = start;
    Tensor tdy = Tensor::contiguous(dy.data(), Shape{n});
    Tensor tdx = Tensor::contiguous(out.data(), Shape{n});
    be->dropout_backward(tdy, p, seed, tdx, true);
    std::vector<float> fresh(len);
    Tensor tfresh = Tensor::contiguous(fresh.data(), Shape{n});
    be->dropout_backward(tdy, p, seed, tfresh, false);
    for (size_t i = 0; i < len; ++i) {
      INFO("n " << n << " element " << i);
      const bool kept = fresh[i] != 0.f;
      volatile float product = dy[i] * scale;  // rounded: volatile keeps it from fusing into the sum
      REQUIRE(fresh[i] == (kept ? float(product) : 0.f));
      REQUIRE(out[i] == (kept ? start[i] + float(product) : start[i] + 0.f));
      if (kept && std::fma(dy[i], scale, start[i]) != start[i] + float(product)) ++fused_would_differ;
    }
  }
  CHECK(fused_would_differ > 0);  // the inputs tell the two roundings apart
}

TEST_CASE("relu forward writing its bitmap equals relu then make_bits", "[kernels]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t n : {int64_t(1), int64_t(63), int64_t(64), int64_t(1000), int64_t(3 * 64 * 1024 + 17)}) {
    for (float thr : {0.f, 0.05f, 0.5f}) {
      INFO("n " << n << " threshold " << thr);
      std::vector<float> x(static_cast<size_t>(n));
      for (auto& v : x) v = nd(rng);
      // Edge values: signed zeros, NaN, infinities, denormals, the threshold itself.
      const float edge[] = {0.f, -0.f, std::nanf(""), -std::nanf(""), INFINITY, -INFINITY, 1e-40f, -1e-40f, thr, -thr};
      for (size_t i = 0; i < x.size() && i < 10; ++i) x[i * 7 % x.size()] = edge[i];
      Tensor tx = Tensor::contiguous(x.data(), Shape{n}, DType::F32);
      std::vector<float> y_ref(x.size()), y(x.size());
      Tensor tyr = Tensor::contiguous(y_ref.data(), Shape{n}, DType::F32), ty = Tensor::contiguous(y.data(), Shape{n}, DType::F32);
      be->relu_forward(tx, tyr);
      std::vector<uint64_t> bits_ref(static_cast<size_t>(bitmap::num_words(n))), bits(bits_ref.size(), ~0ull);
      const int64_t kept_ref = bitmap::make_bits(y_ref.data(), n, thr, bits_ref.data());
      MaskOut m;
      m.bits = bits.data();
      m.prune_threshold = thr;
      be->relu_forward(tx, ty, &m);
      CHECK(m.kept == kept_ref);
      CHECK(bits == bits_ref);
      CHECK(std::memcmp(y.data(), y_ref.data(), x.size() * 4) == 0);
    }
  }
}

TEST_CASE("batchnorm backward reads 16-bit saved inputs exactly like their f32 decode", "[kernels]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  // HW = 36 (one chunk per row) and HW = 5000 (rows longer than the kernel's 4096-element chunk).
  for (int64_t hw : {int64_t(6), int64_t(50)}) {
    for (DType dt : {DType::F16, DType::BF16}) {
      const int64_t N = 3, C = 4, numel = N * C * hw * (hw == 6 ? 6 : 100);
      const Shape shape{N, C, hw, hw == 6 ? 6 : 100};
      std::vector<float> x(static_cast<size_t>(numel)), dy(x.size()), xd(x.size());
      for (auto& v : x) v = nd(rng);
      for (auto& v : dy) v = nd(rng);
      std::vector<uint16_t> h(x.size());
      dt == DType::F16 ? f32_to_f16(x.data(), numel, h.data()) : f32_to_bf16(x.data(), numel, h.data());
      dt == DType::F16 ? f16_to_f32(h.data(), numel, xd.data()) : bf16_to_f32(h.data(), numel, xd.data());
      std::vector<float> gamma(C), mean(C), invstd(C);
      for (int64_t c = 0; c < C; ++c) gamma[size_t(c)] = 0.5f + float(c), mean[size_t(c)] = 0.1f * float(c), invstd[size_t(c)] = 1.f + 0.2f * float(c);
      auto run = [&](const Tensor& xt, std::vector<float>& dx, std::vector<float>& dg, std::vector<float>& db) {
        dx.assign(x.size(), 0.f), dg.assign(size_t(C), 0.f), db.assign(size_t(C), 0.f);
        Tensor tdy = Tensor::contiguous(dy.data(), shape), tdx = Tensor::contiguous(dx.data(), shape);
        Tensor tdg = Tensor::contiguous(dg.data(), Shape{C}), tdb = Tensor::contiguous(db.data(), Shape{C});
        be->batchnorm_backward(tdy, xt, Tensor::contiguous(gamma.data(), Shape{C}), Tensor::contiguous(mean.data(), Shape{C}),
                               Tensor::contiguous(invstd.data(), Shape{C}), tdx, false, tdg, tdb, false);
      };
      std::vector<float> dx1, dg1, db1, dx2, dg2, db2;
      run(Tensor::contiguous(xd.data(), shape), dx1, dg1, db1);
      run(Tensor::contiguous(h.data(), shape, dt), dx2, dg2, db2);
      INFO("hw " << hw << " dtype " << int(dt));
      if (hw == 6) {  // same reduction order: bit-identical
        CHECK(dx1 == dx2);
        CHECK(dg1 == dg2);
        CHECK(db1 == db2);
      } else {  // chunked rows reduce in another order: equal up to float rounding
        for (size_t c = 0; c < size_t(C); ++c) {
          CHECK(dg2[c] == Approx(dg1[c]).epsilon(1e-5).margin(1e-4));
          CHECK(db2[c] == Approx(db1[c]).epsilon(1e-5).margin(1e-4));
        }
        double worst = 0;
        for (size_t i = 0; i < dx1.size(); ++i) worst = std::max(worst, double(std::fabs(dx1[i] - dx2[i])));
        CHECK(worst < 1e-5);
      }
    }
  }
}

TEST_CASE("max-pool backward reads stash encodings exactly like the f32 decode", "[kernels]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  Conv2dGeom g;
  g.N = 3; g.C = 5; g.H = 7; g.W = 9; g.K = 5; g.R = g.S = 2; g.stride_h = g.stride_w = 2;  // odd map: planes not word aligned
  g.infer_output();
  const int64_t n = g.N * g.C * g.H * g.W, m = g.N * g.C * g.P * g.Q;
  std::vector<float> x(static_cast<size_t>(n)), dy(static_cast<size_t>(m));
  for (auto& v : x) v = std::max(0.f, normal(rng));  // a ReLU output: ties at zero decide by order
  for (auto& v : dy) v = normal(rng);
  std::vector<float> ws(be->maxpool2d_workspace_bytes(g) / 4 + 16);
  const Workspace w{ws.data(), ws.size() * 4};
  for (DType t : {DType::F16, DType::BF16, DType::BitmapF32, DType::BitmapF16}) {
    INFO(dtype_name(t));
    REQUIRE(dtype_in(t, be->maxpool2d_backward_reads()));
    std::vector<uint64_t> store(static_cast<size_t>(bitmap::num_words(n) + n));
    std::vector<float> decoded(static_cast<size_t>(n));
    auto* h = reinterpret_cast<uint16_t*>(store.data());
    const bool bm = t == DType::BitmapF32 || t == DType::BitmapF16;
    const auto vt = t == DType::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
    if (bm) {
      bitmap::pack(x.data(), n, 0.f, store.data(), store.data() + bitmap::num_words(n), vt);
      bitmap::unpack(store.data(), store.data() + bitmap::num_words(n), n, vt, decoded.data());
    } else if (t == DType::F16) {
      f32_to_f16(x.data(), n, h);
      f16_to_f32(h, n, decoded.data());
    } else {
      f32_to_bf16(x.data(), n, h);
      bf16_to_f32(h, n, decoded.data());
    }
    const Shape xs{g.N, g.C, g.H, g.W};
    std::vector<float> dx_ref(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
    Tensor dyt = Tensor::contiguous(dy.data(), Shape{g.N, g.C, g.P, g.Q});
    Tensor ref_t = Tensor::contiguous(dx_ref.data(), xs), got_t = Tensor::contiguous(dx.data(), xs);
    be->maxpool2d_backward(g, dyt, Tensor::contiguous(decoded.data(), xs), ref_t, false, w);
    be->maxpool2d_backward(g, dyt, Tensor::contiguous(store.data(), xs, t), got_t, false, w);
    CHECK(std::memcmp(dx.data(), dx_ref.data(), size_t(n) * 4) == 0);
    float s = 0;
    for (float v : dx_ref) s += std::fabs(v);
    CHECK(s > 0);
  }
}

namespace {
// A stride-1 window over a random plane: sides and window sizes drawn from `side` and `window`
// (3x3 where `three`), each padding below the window's.
pool_planes::Plane random_stride1(std::mt19937& rng, std::uniform_int_distribution<int>& side,
                                  std::uniform_int_distribution<int>& window, bool three) {
  pool_planes::Plane g;
  g.H = side(rng), g.W = side(rng), g.R = window(rng), g.S = window(rng);
  if (three) g.R = g.S = 3;
  g.pad_h = int64_t(rng() % uint32_t(g.R)), g.pad_w = int64_t(rng() % uint32_t(g.S));
  g.P = g.H + 2 * g.pad_h - g.R + 1, g.Q = g.W + 2 * g.pad_w - g.S + 1;
  return g;
}
}  // namespace

// Stride-1 windows (pool_stride1.h on AVX2, AVX-512 and NEON) over random shapes: plane sizes against the
// 8-lane vectors and the rings (a row shorter than the window's padding, rows cut mid-vector),
// windows of 1 to 5 rows and columns with every padding below them, the unrolled 3x3 included.
TEST_CASE("pooling planes: stride-1 windows of random shapes equal the reference loops", "[kernels]") {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> level(-3, 3), side(1, 40), window(1, 5);
  int shapes = 0;
  while (shapes < 300) {
    const pool_planes::Plane g = random_stride1(rng, side, window, shapes % 3 == 0);
    if (g.P <= 0 || g.Q <= 0) continue;
    ++shapes;
    INFO(g.H << "x" << g.W << " window " << g.R << "x" << g.S << " pad " << g.pad_h << "," << g.pad_w);
    std::vector<float> x(size_t(g.H * g.W)), dy(size_t(g.P * g.Q));
    for (float& v : x) {  // ties inside windows, both zeros, a few NaN and -inf
      const int l = level(rng);
      v = l == 0 ? (rng() % 2 ? -0.f : 0.f) : 0.5f * float(l);
      if (rng() % 40 == 0) v = rng() % 2 ? NAN : -INFINITY;
    }
    for (float& v : dy)  // magnitudes far apart: a changed order of additions changes the bits
      v = (rng() % 2 ? -1.f : 1.f) * std::ldexp(1.f + float(rng() % 1024) / 1024.f, int(rng() % 25) - 12);
    std::vector<float> y1(dy.size()), y2(dy.size());
    pool_planes::max_forward_reference(g, x.data(), y1.data());
    pool_planes::max_forward(g, x.data(), y2.data());
    CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
    std::vector<float> d1(x.size(), 0.25f), d2(x.size(), 0.25f), d3(x.size(), NAN), d4(x.size(), 0.f);
    pool_planes::max_backward_reference(g, x.data(), dy.data(), d1.data());
    pool_planes::max_backward(g, x.data(), dy.data(), d2.data());
    CHECK(std::memcmp(d1.data(), d2.data(), d1.size() * 4) == 0);
    pool_planes::max_backward_reference(g, x.data(), dy.data(), d4.data());
    pool_planes::max_backward(g, x.data(), dy.data(), d3.data(), false);
    CHECK(std::memcmp(d3.data(), d4.data(), d3.size() * 4) == 0);
  }
}

// The fused stacks' use of the stride-1 backward (backends/cpu/fused_backward.cpp): the pool's input through
// BN and ReLU (BnReluInput) and dy handed on by the BN after the pool (DyAffine: dy = (a d + b y) +
// c0 with y the pool's output), against the reference loops composed: relu(fma(x, scale, shift)),
// max_forward_reference, the affine dy, max_backward_reference, the ReLU's mask.
TEST_CASE("pooling planes: the stride-1 backward with BN's dy handed on equals the references",
          "[kernels]") {
#if defined(ET_POOL_STRIDE1)
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> level(-3, 3), side(1, 40), window(1, 4);
  int shapes = 0;
  while (shapes < 200) {
    const pool_planes::Plane g = random_stride1(rng, side, window, shapes % 2 == 0);
    if (g.P != g.H || g.Q != g.W) continue;  // the BN after the pool: y and x of one size
    ++shapes;
    INFO(g.H << "x" << g.W << " window " << g.R << "x" << g.S << " pad " << g.pad_h << "," << g.pad_w);
    const int64_t HW = g.H * g.W;
    const size_t n = static_cast<size_t>(HW);
    std::vector<float> x(n), d(n);
    for (float& v : x) v = 0.5f * float(level(rng));  // ties after BN and ReLU, exact zeros
    for (float& v : d)  // magnitudes far apart: a changed order of additions changes the bits
      v = (rng() % 2 ? -1.f : 1.f) * std::ldexp(1.f + float(rng() % 1024) / 1024.f, int(rng() % 25) - 12);
    const float scale = 0.75f, shift = 0.125f, a = 1.5f, b = -0.3125f, c0 = 0.0625f;
    // The references.
    std::vector<float> r(n), y(n), dy(n), dr(n, 0.f), want(n);
    for (int64_t i = 0; i < HW; ++i) {
      const float t = std::fma(x[size_t(i)], scale, shift);
      r[size_t(i)] = t > 0.f ? t : 0.f;
    }
    pool_planes::max_forward_reference(g, r.data(), y.data());
    for (int64_t i = 0; i < HW; ++i) dy[size_t(i)] = std::fma(a, d[size_t(i)], b * y[size_t(i)]) + c0;
    pool_planes::max_backward_reference(g, r.data(), dy.data(), dr.data());
    for (int64_t i = 0; i < HW; ++i) want[size_t(i)] = std::fma(x[size_t(i)], scale, shift) > 0.f ? dr[size_t(i)] : 0.f;
    // The kernel.
    const pool_planes::BnReluInput in(scale, shift);
    const pool_planes::DyAffine affine(a, b, c0);
    std::vector<float> got(n, NAN);
    pool_planes::max_backward_stride1(g, x.data(), in, d.data(), got.data(), false, &affine);
    CHECK(std::memcmp(got.data(), want.data(), size_t(HW) * 4) == 0);
  }
#else
  SUCCEED("no stride-1 kernels on this target (they need AVX2 or NEON)");
#endif
}

// BrainSlug's window (3x3, stride 1, pad 1) on planes 16 and 32 wide (pool_3x3_rows.h on AVX-512,
// pool_stride1.h's general kernels elsewhere), of 1 to 64 rows and one row past the buffers, the
// plane as it is (ties, both zeros, NaN and -inf) and through BN and ReLU with and without the dy a
// BN after the pool hands on, against the reference loops.
TEST_CASE("pooling planes: 3x3 stride-1 windows on 16- and 32-wide planes equal the references", "[kernels]") {
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> level(-3, 3);
  for (int special : {40, 2})  // one value in `special` NaN or -inf: at 2, windows nobody wins
  for (int64_t W : {16, 32})
    for (int64_t H : {1, 2, 3, 5, 16, 31, 32, 33, 64, 65}) {
      pool_planes::Plane g;
      g.H = g.P = H, g.W = g.Q = W, g.R = g.S = 3, g.pad_h = g.pad_w = 1;
      INFO(H << "x" << W << ", one value in " << special << " NaN or -inf");
#if defined(ET_POOL_3X3_ROWS)
      CHECK(pool_planes::rows3x3::applies(g) == (H <= pool_planes::rows3x3::kMaxRows));
#endif
      const size_t n = size_t(H * W);
      std::vector<float> x(n), dy(n);
      for (float& v : x) {
        const int l = level(rng);
        v = l == 0 ? (rng() % 2 ? -0.f : 0.f) : 0.5f * float(l);
        if (rng() % unsigned(special) == 0) v = rng() % 2 ? NAN : -INFINITY;
      }
      for (float& v : dy)  // magnitudes far apart: a changed order of additions changes the bits
        v = (rng() % 2 ? -1.f : 1.f) * std::ldexp(1.f + float(rng() % 1024) / 1024.f, int(rng() % 25) - 12);
      std::vector<float> y1(n), y2(n);
      pool_planes::max_forward_reference(g, x.data(), y1.data());
      pool_planes::max_forward(g, x.data(), y2.data());
      CHECK(std::memcmp(y1.data(), y2.data(), n * 4) == 0);
      std::vector<float> d1(n, 0.25f), d2(n, 0.25f), d3(n, NAN), d4(n, 0.f);
      pool_planes::max_backward_reference(g, x.data(), dy.data(), d1.data());
      pool_planes::max_backward(g, x.data(), dy.data(), d2.data());  // accumulates onto dx
      CHECK(std::memcmp(d1.data(), d2.data(), n * 4) == 0);
      pool_planes::max_backward_reference(g, x.data(), dy.data(), d4.data());
      pool_planes::max_backward(g, x.data(), dy.data(), d3.data(), false);
      CHECK(std::memcmp(d3.data(), d4.data(), n * 4) == 0);
#if defined(ET_POOL_STRIDE1)
      // Through BN and ReLU (ties and exact zeros after them), dy as it is and as a BN hands it on.
      for (float& v : x) v = 0.5f * float(level(rng));
      const float scale = 0.75f, shift = 0.125f, a = 1.5f, b = -0.3125f, c0 = 0.0625f;
      std::vector<float> r(n), y(n), dya(n), want(n), want_a(n), dr(n, 0.f), dra(n, 0.f);
      for (size_t i = 0; i < n; ++i) {
        const float t = std::fma(x[i], scale, shift);
        r[i] = t > 0.f ? t : 0.f;
      }
      pool_planes::max_forward_reference(g, r.data(), y.data());
      for (size_t i = 0; i < n; ++i) dya[i] = std::fma(a, dy[i], b * y[i]) + c0;
      pool_planes::max_backward_reference(g, r.data(), dy.data(), dr.data());
      pool_planes::max_backward_reference(g, r.data(), dya.data(), dra.data());
      for (size_t i = 0; i < n; ++i) {
        want[i] = r[i] > 0.f ? dr[i] : 0.f;
        want_a[i] = r[i] > 0.f ? dra[i] : 0.f;
      }
      const pool_planes::BnReluInput in(scale, shift);
      const pool_planes::DyAffine affine(a, b, c0);
      std::vector<float> yk(n), got(n, NAN), got_a(n, NAN);
      pool_planes::max_forward_stride1(g, x.data(), in, yk.data());
      CHECK(std::memcmp(yk.data(), y.data(), n * 4) == 0);
      pool_planes::max_backward_stride1(g, x.data(), in, dy.data(), got.data(), true);  // the mask: written whole
      CHECK(std::memcmp(got.data(), want.data(), n * 4) == 0);
      pool_planes::max_backward_stride1(g, x.data(), in, dy.data(), got_a.data(), false, &affine);
      CHECK(std::memcmp(got_a.data(), want_a.data(), n * 4) == 0);
#endif
    }
}

TEST_CASE("pooling planes: the vectorised loops equal the reference loops bit for bit", "[kernels]") {
  struct Geom {
    int64_t H, W, R, S, sh, sw, ph, pw;
  };
  std::mt19937 rng(7);
  // Values on a coarse grid (ties inside windows), zeros of both signs, and a few NaN / -inf,
  // which never win a window, as padding never does.
  std::uniform_int_distribution<int> level(-4, 4);
  std::uniform_real_distribution<float> mantissa(1.f, 2.f);
  std::uniform_int_distribution<int> exponent(-12, 12);
  for (const Geom& gm : {Geom{32, 32, 3, 3, 1, 1, 1, 1}, Geom{32, 32, 2, 2, 2, 2, 0, 0}, Geom{7, 5, 3, 3, 1, 1, 1, 1},
                         Geom{9, 11, 3, 3, 2, 2, 1, 1}, Geom{13, 6, 3, 3, 1, 1, 0, 0}, Geom{4, 4, 2, 2, 2, 2, 0, 0},
                         Geom{2, 2, 2, 2, 2, 2, 0, 0}, Geom{16, 40, 3, 2, 1, 3, 1, 1}, Geom{5, 3, 5, 3, 1, 1, 2, 1},
                         Geom{8, 8, 2, 2, 1, 1, 1, 1}, Geom{1, 1, 3, 3, 1, 1, 1, 1}, Geom{3, 17, 3, 5, 1, 1, 1, 2},
                         Geom{12, 12, 9, 9, 1, 1, 4, 4},      // window taller than the ring: reference loops
                         Geom{6, 300, 3, 3, 1, 1, 1, 1},      // rows wider than the ring: reference loops
                         Geom{20, 33, 4, 4, 1, 1, 2, 2}, Geom{15, 15, 3, 3, 3, 3, 0, 0}, Geom{10, 21, 1, 3, 1, 2, 0, 1},
                         // windows that tile the plane with Q of 1 to 8 (AVX-512 gathers): tall planes
                         // (the fused small-plane blocks), rows and columns past the last window, a
                         // last vector of outputs cut short
                         Geom{64, 4, 2, 2, 2, 2, 0, 0}, Geom{33, 2, 2, 2, 2, 2, 0, 0}, Geom{9, 5, 2, 2, 2, 2, 0, 0},
                         Geom{16, 16, 2, 2, 2, 2, 0, 0}, Geom{12, 12, 3, 3, 3, 3, 0, 0}, Geom{8, 17, 4, 2, 4, 2, 0, 0},
                         // 2x2 stride 2 (AVX-512 pairs, pool_pairs.h): Q of 4 and 8 with whole and cut
                         // vectors of rows, Q of 16, 20 (a last vector cut short), 40, odd H and W
                         Geom{10, 8, 2, 2, 2, 2, 0, 0}, Geom{6, 9, 2, 2, 2, 2, 0, 0}, Geom{14, 17, 2, 2, 2, 2, 0, 0},
                         Geom{7, 32, 2, 2, 2, 2, 0, 0}, Geom{5, 41, 2, 2, 2, 2, 0, 0}, Geom{64, 80, 2, 2, 2, 2, 0, 0},
                         // AVX2's and NEON's pairs: W = 2Q with Q of 1, 2 (tall planes whose last
                         // outputs are not a whole vector of 8 or 4), 24 (a multiple of 8, not a
                         // power of 2) and 12 (a multiple of 4, not of 8)
                         Geom{22, 2, 2, 2, 2, 2, 0, 0}, Geom{14, 4, 2, 2, 2, 2, 0, 0}, Geom{6, 48, 2, 2, 2, 2, 0, 0},
                         Geom{6, 24, 2, 2, 2, 2, 0, 0},
                         // stride 1 (AVX2, AVX-512, NEON: pool_stride1.h): rows of 1 to 3 vectors of 8 and a cut one,
                         // 3x3 unrolled and other windows, rows narrower than the window's padding
                         Geom{9, 8, 3, 3, 1, 1, 1, 1}, Geom{11, 23, 3, 3, 1, 1, 1, 1}, Geom{3, 47, 3, 3, 1, 1, 0, 0},
                         Geom{40, 2, 3, 3, 1, 1, 1, 1}, Geom{17, 70, 3, 3, 1, 1, 1, 1}, Geom{12, 9, 7, 2, 1, 1, 3, 1},
                         Geom{20, 13, 8, 8, 1, 1, 0, 7}}) {
    pool_planes::Plane g;
    g.H = gm.H; g.W = gm.W; g.R = gm.R; g.S = gm.S;
    g.stride_h = gm.sh; g.stride_w = gm.sw; g.pad_h = gm.ph; g.pad_w = gm.pw;
    g.P = (g.H + 2 * g.pad_h - g.R) / g.stride_h + 1;
    g.Q = (g.W + 2 * g.pad_w - g.S) / g.stride_w + 1;
    DYNAMIC_SECTION(g.H << "x" << g.W << " window " << g.R << "x" << g.S << " stride " << g.stride_h << "," << g.stride_w
                         << " pad " << g.pad_h << "," << g.pad_w) {
      std::vector<float> x(size_t(g.H * g.W)), dy(size_t(g.P * g.Q));
      for (float& v : x) {
        const int l = level(rng);
        v = l == 0 ? (rng() % 2 ? -0.f : 0.f) : 0.25f * float(l);
        if (rng() % 50 == 0) v = rng() % 2 ? NAN : -INFINITY;
      }
      // Magnitudes far apart, so a changed order of additions changes the bits.
      for (float& v : dy) v = (rng() % 2 ? -1.f : 1.f) * std::ldexp(mantissa(rng), exponent(rng));
      std::vector<float> y1(dy.size()), y2(dy.size());
      pool_planes::max_forward_reference(g, x.data(), y1.data());
      pool_planes::max_forward(g, x.data(), y2.data());
      CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
      {  // the arguments too (a fused stack without a BN keeps where they fall)
        std::vector<int32_t> a2(dy.size());
        std::vector<float> y3(dy.size());
        pool_planes::max_forward_args(g, x.data(), y3.data(), a2.data());
        CHECK(std::memcmp(y1.data(), y3.data(), y1.size() * 4) == 0);
        int wrong = 0;
        for (int64_t p = 0; p < g.P; ++p)
          for (int64_t q = 0; q < g.Q; ++q) {
            int64_t a;
            pool_planes::max_at(g, x.data(), p, q, &a);
            wrong += a2[size_t(p * g.Q + q)] != int32_t(a);
          }
        CHECK(wrong == 0);
      }
      {
        std::vector<float> xa = x;  // finite, for the average pool
        for (float& v : xa)
          if (std::isnan(v) || std::isinf(v)) v = 0.5f;
        pool_planes::avg_forward_reference(g, xa.data(), y1.data());
        pool_planes::avg_forward(g, xa.data(), y2.data());
        CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
      }
      if (g.H == 33) {  // a window of NaN and -inf only: -FLT_MAX and no gradient, as in the reference
        x[0] = NAN, x[1] = -INFINITY, x[2] = -INFINITY, x[3] = NAN;
        pool_planes::max_forward_reference(g, x.data(), y1.data());
        pool_planes::max_forward(g, x.data(), y2.data());
        CHECK(y2[0] == -FLT_MAX);
        CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * 4) == 0);
      }
      for (float start : {0.5f, -0.f}) {  // accumulates into what is there, -0 + 0 included
        std::vector<float> d1(x.size(), start), d2(x.size(), start);
        pool_planes::max_backward_reference(g, x.data(), dy.data(), d1.data());
        pool_planes::max_backward(g, x.data(), dy.data(), d2.data());
        CHECK(std::memcmp(d1.data(), d2.data(), d1.size() * 4) == 0);
      }
      {  // or writes dx whole, as onto +0 (what was there is never read)
        std::vector<float> d1(x.size(), 0.f), d2(x.size(), NAN);
        pool_planes::max_backward_reference(g, x.data(), dy.data(), d1.data());
        pool_planes::max_backward(g, x.data(), dy.data(), d2.data(), false);
        CHECK(std::memcmp(d1.data(), d2.data(), d1.size() * 4) == 0);
      }
    }
  }
}
