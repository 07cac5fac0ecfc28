// Depth-first fusion's kernels against the layers' on values the graph tests do not reach: tied
// windows with NaN, -0 and +-inf, and the relu(affine) run a stack output's readers compute.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "backends/cpu/fused_bn_relu_pool.h"
#include "backends/cpu/fused_common.h"
#include "backends/cpu/pool_planes.h"
#include "engine/check.h"
#include "memory/bitmap.h"
#include "tests/tiny_training.h"

using namespace et;

TEST_CASE("fusion: ReLU + pool kernels equal the layers on tied windows with NaN and -0", "[fusion]") {
  // Values from a small set, so windows hold ties (at zero and above), NaN, -0 and negatives; dy
  // holds -0. The layers: relu_forward, the pool forward / backward on r, relu_backward by r > 0.
  auto be = make_cpu_backend();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float values[] = {-1.f, -0.f, 0.f, 0.5f, 1.f, nan, 2.f, 1.f};
  struct Case {
    FusedKind kind;
    int64_t H, W, k, s, p;
  };
  for (const Case c : {Case{FusedKind::MaxPool, 6, 7, 2, 2, 0}, Case{FusedKind::MaxPool, 9, 40, 2, 2, 0},
                       Case{FusedKind::MaxPool, 5, 6, 2, 2, 1}, Case{FusedKind::MaxPool, 7, 8, 3, 3, 1},
                       Case{FusedKind::AvgPool, 6, 7, 2, 2, 0}, Case{FusedKind::AvgPool, 7, 5, 3, 4, 1}}) {
    for (bool accumulate : {false, true}) {
      DYNAMIC_SECTION((c.kind == FusedKind::MaxPool ? "max " : "avg ") << c.H << "x" << c.W << " " << c.k << "/"
                                                                        << c.s << "/" << c.p << (accumulate ? " acc" : "")) {
        Conv2dGeom g;
        g.N = 2; g.C = 3; g.H = c.H; g.W = c.W; g.K = 3; g.R = g.S = c.k;
        g.stride_h = g.stride_w = c.s;
        g.pad_h = g.pad_w = c.p;
        g.infer_output();
        const int64_t n = g.N * g.C * g.H * g.W, m = g.N * g.C * g.P * g.Q;
        std::mt19937 rng(11);
        std::vector<float> x(static_cast<size_t>(n)), r(x.size()), y_ref(static_cast<size_t>(m)), y(y_ref.size()), dy(y_ref.size());
        for (auto& v : x) v = values[rng() % 8];
        for (auto& v : dy) v = rng() % 5 == 0 ? -0.f : float(int(rng() % 9) - 4) * 0.25f;
        std::vector<float> gb(x.size()), dx_ref(x.size(), 0.75f), dx(x.size(), 0.75f);
        const Shape xs{g.N, g.C, g.H, g.W}, ys{g.N, g.C, g.P, g.Q};
        Tensor xt = Tensor::contiguous(x.data(), xs), rt = Tensor::contiguous(r.data(), xs);
        Tensor yt = Tensor::contiguous(y_ref.data(), ys), dyt = Tensor::contiguous(dy.data(), ys);
        Tensor gbt = Tensor::contiguous(gb.data(), xs), dxt = Tensor::contiguous(dx_ref.data(), xs);
        std::vector<float> ws_ref(be->maxpool2d_workspace_bytes(g) / 4 + 16);
        be->relu_forward(xt, rt);
        if (c.kind == FusedKind::MaxPool) {
          be->maxpool2d_forward(g, rt, yt);
          be->maxpool2d_backward(g, dyt, rt, gbt, false, Workspace{ws_ref.data(), ws_ref.size() * 4});
        } else {
          be->avgpool2d_forward(g, rt, yt);
          be->avgpool2d_backward(g, dyt, gbt, false);
        }
        MaskView mask;
        mask.dense = rt;
        mask.numel = n;
        be->relu_backward(gbt, mask, dxt, accumulate);

        FusedStage relu_stage = fused_stage(FusedKind::Relu), pool = fused_stage(c.kind);
        relu_stage.H = relu_stage.P = pool.H = g.H;
        relu_stage.W = relu_stage.Q = pool.W = g.W;
        pool.P = g.P;
        pool.Q = g.Q;
        pool.pool = PoolWindow{g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
        FusedStack st;
        st.stages = {relu_stage, pool};
        st.C = g.C;
        std::vector<uint64_t> pass(size_t(g.N * g.C * pass_words_per_plane(relu_stage)));
        std::vector<float> ws(be->fused_workspace_bytes(st, g.N) / 4 + 16);
        const Workspace w{ws.data(), ws.size() * 4};
        FusedTensors t;
        t.x = xt;
        t.y = Tensor::contiguous(y.data(), ys);
        t.pass = Tensor::contiguous(pass.data(), Shape{int64_t(pass.size() * 8)}, DType::U8);
        be->fused_forward(st, t, true, nullptr, w);
        CHECK(std::memcmp(y.data(), y_ref.data(), y.size() * 4) == 0);
        FusedGrads fg;
        fg.dy = dyt;
        fg.dx = Tensor::contiguous(dx.data(), xs);
        fg.dx_accumulate = accumulate;
        t.x = Tensor{};
        be->fused_backward(st, t, fg, w);
        CHECK(std::memcmp(dx.data(), dx_ref.data(), dx.size() * 4) == 0);
      }
    }
  }
}

#if defined(ET_POOL_IN_REGISTERS)
// The kernels' 16-lane vectors to memory, on AVX-512 and on lanes16.h's AVX2 / NEON lanes.
#if defined(__AVX512F__)
inline void store_vector(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void fence_streams() { _mm_sfence(); }
#else
inline void store_vector(float* p, const lanes16::Lanes16& v) { lanes16::store16(lanes16::Full{}, p, v); }
inline void fence_streams() { lanes16::stream_fence(); }
#endif

TEST_CASE("fusion: BN -> ReLU -> 2x2 max-pool in registers equals the layers on tied windows", "[fusion]") {
  // x from a small set, so windows hold ties (at zero and above), NaN, -0, +inf and negatives; dy
  // holds -0. The register kernels (fused_bn_relu_pool.h), plane by plane and by blocks, against
  // BN's FMA, relu_forward's rule, the pool's reference loops and relu_backward's rule.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float values[] = {-1.f, -0.f, 0.f, 0.5f, 1.f, nan, 2.f, 1.f, inf, 0.5f};
  struct Coefficients {
    float scale, shift;
  };
  for (const int64_t Q : {1, 2, 4, 8, 16})
    for (const Coefficients k : {Coefficients{1.f, 0.f}, Coefficients{1.5f, -0.5f}}) {
      DYNAMIC_SECTION("Q " << Q << ", scale " << k.scale << ", shift " << k.shift) {
        const int64_t W = 2 * Q, H = 256 / W, HW = H * W;  // four 64-float blocks
        std::mt19937 rng{static_cast<unsigned>(Q)};
        alignas(64) float x[256], y[64], y_ref[64], dy[64], dz[256], dz_ref[256], scale[256], shift[256];
        for (float& v : x) v = values[rng() % 10];
        for (float& v : dy) v = rng() % 5 == 0 ? -0.f : float(int(rng() % 9) - 4) * 0.25f;
        for (int64_t i = 0; i < HW; ++i) scale[i] = k.scale, shift[i] = k.shift;
        float r[256];
        for (int64_t i = 0; i < HW; ++i) {
          const float z = std::fma(x[i], k.scale, k.shift);
          r[i] = z > 0.f ? z : 0.f;
        }
        FusedStage pool = fused_stage(FusedKind::MaxPool);
        pool.H = H, pool.W = W, pool.P = H / 2, pool.Q = Q;
        pool.pool = PoolWindow{2, 2, 2, 2, 0, 0};
        const pool_planes::Plane g = pool_planes::of(pool);
        pool_planes::max_forward_reference(g, r, y_ref);
        float dr[256] = {};
        pool_planes::max_backward_reference(g, r, dy, dr);
        for (int64_t i = 0; i < HW; ++i) dz_ref[i] = r[i] > 0.f ? dr[i] : 0.f;

        const fused_bn_relu_pool::Layout layout(Q);
        for (bool stream : {false, true}) {
          std::fill(y, y + 64, 7.f);
          fused_bn_relu_pool::forward(layout, x, fused_bn_relu_pool::ChannelBn(k.scale, k.shift), HW, y, stream);
          fence_streams();
          CHECK(std::memcmp(y, y_ref, sizeof y) == 0);
        }
        std::fill(y, y + 64, 7.f);
        fused_bn_relu_pool::forward(layout, x, fused_bn_relu_pool::ElementBn{scale, shift}, HW, y, false);
        CHECK(std::memcmp(y, y_ref, sizeof y) == 0);

        fused_bn_relu_pool::PlaneDz d(layout, x, dy, k.scale, k.shift);
#if defined(__AVX512F__)
        for (int64_t i = 0; i < HW; i += 16) store_vector(dz + i, d(i, __mmask16(0xFFFF)));
#else
        for (int64_t i = 0; i < HW; i += 16) store_vector(dz + i, d(i, lanes16::Full{}));
#endif
        CHECK(std::memcmp(dz, dz_ref, sizeof dz) == 0);
        std::fill(dz, dz + 256, 7.f);
        fused_bn_relu_pool::backward_dz(layout, x, fused_bn_relu_pool::ElementBn{scale, shift}, dy, HW, dz);
        CHECK(std::memcmp(dz, dz_ref, sizeof dz) == 0);
      }
    }
}
#endif

namespace {
// The forward's BN arithmetic (bn_rows::apply): one FMA where its kernels have vectors (AVX-512,
// AVX2, NEON), else the scalar loop's product and sum rounded apart (an x86-64 build without
// -march, EDGETRAIN_PORTABLE, has no FMA instruction to contract them into).
float forward_affine(float x, float scale, float shift) {
#if defined(__AVX512F__) || defined(__AVX2__) || (defined(__ARM_NEON) && defined(__aarch64__))
  return std::fma(x, scale, shift);
#else
  const float product = x * scale;
  return product + shift;
#endif
}
}  // namespace

TEST_CASE("fusion: the relu(affine) run a reader computes a stack output with is the forward's arithmetic",
          "[fusion][kernels]") {
  // Backend::fused_affine_relu: what the conv weight gradients apply to x as they read a stack
  // output nobody kept (memory.recompute_stack_outputs). Its bits must be the forward's: one FMA
  // (forward_affine), then relu_forward's rule (NaN and -0 give +0). Runs of every length up to 40 (masked tails) on
  // special values, and on a product whose separate rounding differs from the FMA's; then pieces
  // over planes of 1 to 20 elements of 3 channels, from any start.
  FusedStack s;
  s.C = 1;
  FusedStage bn = fused_stage(FusedKind::BatchNorm), relu = fused_stage(FusedKind::Relu);
  bn.H = relu.H = bn.P = relu.P = 8;
  bn.W = relu.W = bn.Q = relu.Q = 8;
  s.stages = {bn, relu};
  auto be = make_cpu_backend();
  const AffineReluRun run = be->fused_affine_relu(s);
  REQUIRE(run != nullptr);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float fma_x = 1.f + 0x1p-12f;  // fma_x * fma_x - 1: 2^-11 + 2^-24 with one rounding, 2^-11 with two
  std::vector<float> x;
  for (float v : {0.f, -0.f, 1.f, -1.f, inf, -inf, nan, 1e-40f, -1e-40f, 3.5f, -2.25f, fma_x})
    for (int k = 0; k < 4; ++k) x.push_back(v);
  for (int64_t len = 1; len <= 40; ++len)
    for (auto [scale, shift] : std::vector<std::pair<float, float>>{{1.f, 0.f}, {-1.f, 0.f}, {fma_x, -1.f}, {0.5f, -0.f}}) {
      std::vector<float> y(static_cast<size_t>(len) + 1, 7.f), ref(static_cast<size_t>(len));
      for (int64_t i = 0; i < len; ++i) {
        const float v = forward_affine(x[size_t(i)], scale, shift);
        ref[size_t(i)] = v > 0.f ? v : 0.f;
      }
      run(x.data(), &scale, &shift, 1, len, 0, len, y.data());
      INFO("len " << len << " scale " << scale << " shift " << shift);
      CHECK(std::memcmp(y.data(), ref.data(), size_t(len) * 4) == 0);
      CHECK(y[size_t(len)] == 7.f);  // nothing past the run
      // In place, as a reader does on a decoded piece in its scratch.
      std::vector<float> z(x.begin(), x.begin() + len);
      run(z.data(), &scale, &shift, 1, len, 0, len, z.data());
      CHECK(std::memcmp(z.data(), ref.data(), size_t(len) * 4) == 0);
    }
  const float scales[3] = {fma_x, -0.5f, 2.f}, shifts[3] = {-1.f, 0.25f, -0.f};
  for (int64_t plane = 1; plane <= 20; ++plane)
    for (int64_t begin : {int64_t(0), int64_t(1), plane - 1, plane, 2 * plane + 1}) {
      const int64_t count = std::min<int64_t>(int64_t(x.size()), 4 * plane + 3);
      std::vector<float> y(static_cast<size_t>(count) + 1, 7.f), ref(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) {
        const int64_t c = (begin + i) / plane % 3;
        const float v = forward_affine(x[size_t(i)], scales[c], shifts[c]);
        ref[size_t(i)] = v > 0.f ? v : 0.f;
      }
      run(x.data(), scales, shifts, 3, plane, begin, count, y.data());
      INFO("plane " << plane << " begin " << begin);
      CHECK(std::memcmp(y.data(), ref.data(), size_t(count) * 4) == 0);
      CHECK(y[size_t(count)] == 7.f);
    }
  // Planes of 1, 2, 4 and 8 elements over 8 and 32 channels, several vectors long, which AVX-512
  // takes 16 / plane planes a vector (each lane its channel's coefficients, wrapping after the last
  // channel), from a start on a vector's first channel, on another channel, or inside a plane.
  std::vector<float> xs, sc(32), sh(32);
  for (int k = 0; k < 12; ++k) xs.insert(xs.end(), x.begin(), x.end());  // 576 values
  for (int64_t c = 0; c < 32; ++c) {
    sc[size_t(c)] = c % 3 == 0 ? fma_x : float(c - 12) / 8.f;
    sh[size_t(c)] = c % 4 == 0 ? -1.f : float(7 - c) / 16.f;
  }
  for (int64_t channels : {8, 32})
    for (int64_t plane : {1, 2, 4, 8})
      for (int64_t begin : {int64_t(0), plane, int64_t(16), 3 * plane, int64_t(1), 40 * plane}) {
        const int64_t count = std::min<int64_t>(int64_t(xs.size()), 9 * 16 + 5);
        std::vector<float> y(static_cast<size_t>(count) + 1, 7.f), ref(static_cast<size_t>(count));
        for (int64_t i = 0; i < count; ++i) {
          const int64_t c = (begin + i) / plane % channels;
          const float v = forward_affine(xs[size_t(i)], sc[size_t(c)], sh[size_t(c)]);
          ref[size_t(i)] = v > 0.f ? v : 0.f;
        }
        run(xs.data(), sc.data(), sh.data(), channels, plane, begin, count, y.data());
        INFO("channels " << channels << " plane " << plane << " begin " << begin);
        CHECK(std::memcmp(y.data(), ref.data(), size_t(count) * 4) == 0);
        CHECK(y[size_t(count)] == 7.f);
      }
}
