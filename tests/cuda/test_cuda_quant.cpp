// 4-bit training on CUDA (backends/cuda/cuda_quant.cu) against the CPU backend: the quantizers
// give the CPU's codes byte for byte (INT4 rounding, LUQ's stochastic FP4 with the shared
// counter-based bits, round-to-nearest FP4, an all-zero gradient), dequantisation the CPU's bits,
// and the integer conv and linear passes the CPU's floats bit for bit (power-of-two scales make
// the scaling after the exact integer sums exact, so an FMA on either side changes nothing).
// Then a few LUQ training steps of resnet8 as on the CPU.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "engine/executor.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "memory/code_bitmap.h"
#include "memory/stash_codec.h"
#include "models/models.h"
#include "quant/scales.h"
#include "tests/cuda/scoped_env.h"

using namespace et;

namespace {

// Host bytes and a device copy of them.
struct Mirror {
  std::vector<uint8_t> host;
  void* dptr = nullptr;
  explicit Mirror(size_t bytes) : host(bytes) { REQUIRE(cudaMalloc(&dptr, bytes + 16) == cudaSuccess); }
  ~Mirror() { cudaFree(dptr); }
  Mirror(const Mirror&) = delete;
  void upload() { REQUIRE(cudaMemcpy(dptr, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess); }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> out(host.size());
    REQUIRE(cudaMemcpy(out.data(), dptr, out.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
  Tensor on(bool dev, const Shape& s, DType t) const {
    return Tensor::contiguous(dev ? dptr : const_cast<uint8_t*>(host.data()), s, t, dev ? Device::CUDA : Device::CPU);
  }
  bool same() const { return download() == host; }
};

uint32_t lcg(uint32_t& s) { return s = s * 1664525u + 1013904223u; }

// Floats: normal values, a share of exact zeros, and a few far larger ones.
std::unique_ptr<Mirror> floats(int64_t n, uint32_t seed) {
  auto m = std::make_unique<Mirror>(size_t(n) * 4);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  float* f = reinterpret_cast<float*>(m->host.data());
  for (int64_t i = 0; i < n; ++i) f[i] = i % 7 == 3 ? 0.f : i % 97 == 5 ? 40.f * normal(rng) : normal(rng);
  m->upload();
  return m;
}
std::unique_ptr<Mirror> codes(int64_t n, int lo, int hi, uint32_t seed) {
  auto m = std::make_unique<Mirror>(size_t(n));
  for (auto& c : m->host) c = uint8_t(int8_t(lo + int((lcg(seed) >> 8) % uint32_t(hi - lo + 1))));
  m->upload();
  return m;
}
std::unique_ptr<Mirror> fp4_codes(int64_t n, uint32_t seed) {
  auto m = std::make_unique<Mirror>(size_t(n));
  for (auto& c : m->host) {
    const uint32_t r = lcg(seed) >> 8;
    c = uint8_t(quant::fp4_value(int(r & 1), int((r >> 1) % 8)));
  }
  m->upload();
  return m;
}
// f32 outputs on both sides, filled with the same starting values (accumulation reads them).
std::unique_ptr<Mirror> outputs(int64_t n, float start) {
  auto m = std::make_unique<Mirror>(size_t(n) * 4);
  float* f = reinterpret_cast<float*>(m->host.data());
  for (int64_t i = 0; i < n; ++i) f[i] = start + float(i % 5) * 0.25f;
  m->upload();
  return m;
}

struct Backends {
  std::unique_ptr<Backend> cpu = make_cpu_backend(), dev = make_cuda_backend(0);
};

}  // namespace

TEST_CASE("cuda: the 4-bit quantizers give the CPU's codes byte for byte", "[cuda][quant]") {
  Backends b;
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(65537)}) {
    INFO("n = " << n);
    auto x = floats(n, uint32_t(n));
    const Tensor xc = x->on(false, Shape{n}, DType::F32), xd = x->on(true, Shape{n}, DType::F32);
    const TensorStats sc = b.cpu->tensor_stats(xc), sd = b.dev->tensor_stats(xd);
    CHECK(sd.max_abs == sc.max_abs);
    CHECK(sd.finite);
    CHECK(sd.sum_sq == Approx(sc.sum_sq).epsilon(1e-12));
    CHECK(sd.sum_abs == Approx(sc.sum_abs).epsilon(1e-12));
    for (DType t : {DType::I4, DType::U4}) {
      Mirror q{size_t(n)};
      Tensor qc = q.on(false, Shape{n}, t), qd = q.on(true, Shape{n}, t);
      qc.scale = qd.scale = quant::sawb_scale(sc, n, t == DType::U4);
      b.cpu->quantize_int4(xc, qc);
      b.dev->quantize_int4(xd, qd);
      CHECK(q.same());
      Mirror y{size_t(n) * 4};
      Tensor yc = y.on(false, Shape{n}, DType::F32), yd = y.on(true, Shape{n}, DType::F32);
      b.cpu->dequantize(qc, yc);
      b.dev->dequantize(qd, yd);
      CHECK(y.same());
    }
    for (int levels : {7, 3})
      for (Fp4Rounding mode : {Fp4Rounding::Stochastic, Fp4Rounding::Nearest}) {
        Mirror q{size_t(n)};
        Tensor qc = q.on(false, Shape{n}, DType::F4), qd = q.on(true, Shape{n}, DType::F4);
        qc.scale = qd.scale = quant::fp4_alpha(sc.max_abs, levels);
        const QuantDraw draw{DropoutSeed{uint64_t(n) * 31 + uint64_t(levels), 77}, 1};
        b.cpu->quantize_fp4(xc, levels, mode, draw, qc);
        b.dev->quantize_fp4(xd, levels, mode, draw, qd);  // its key from the step seed on the device
        CHECK(q.same());
      }
    // Scales kept on the device (Backend::quant_scales_in_memory): the floats its statistics give
    // when read back, and the quantizers reading them there (Tensor::scale_at) give the same codes.
    Mirror kept(20);  // SAWB signed, unsigned, FP4 alpha, alpha / 3, the non-finite flag
    REQUIRE(cudaMemset(kept.dptr, 0, 20) == cudaSuccess);
    auto* at = static_cast<float*>(kept.dptr);
    auto* flag = reinterpret_cast<uint32_t*>(at + 4);
    b.dev->int4_scale_to(xd, false, at, flag, 9);
    b.dev->int4_scale_to(xd, true, at + 1, flag, 9);
    b.dev->fp4_alpha_to(xd, 7, at + 2, flag, 9);
    b.dev->divide_scale_to(at + 2, 3, at + 3);
    const std::vector<uint8_t> got = kept.download();
    float s[4];
    uint32_t flagged = 0;
    std::memcpy(s, got.data(), 16);
    std::memcpy(&flagged, got.data() + 16, 4);
    CHECK(s[0] == quant::sawb_scale(sd, n, false));
    CHECK(s[1] == quant::sawb_scale(sd, n, true));
    CHECK(s[2] == quant::fp4_alpha(sd.max_abs, 7));
    CHECK(s[3] == quant::fp4_alpha(sd.max_abs, 7) / 3.f);
    CHECK(flagged == 0);
    for (int k : {0, 2}) {
      Mirror by_value{size_t(n)}, by_place{size_t(n)};
      const DType t = k == 0 ? DType::I4 : DType::F4;
      Tensor qv = by_value.on(true, Shape{n}, t), qp = by_place.on(true, Shape{n}, t);
      qv.scale = s[k];
      qp.scale = 0.f;  // unused: the scale is read at qp.scale_at
      qp.scale_at = at + k;
      const QuantDraw draw{DropoutSeed{5, 6}, 0};
      if (k == 0) b.dev->quantize_int4(xd, qv), b.dev->quantize_int4(xd, qp);
      else b.dev->quantize_fp4(xd, 7, Fp4Rounding::Stochastic, draw, qv), b.dev->quantize_fp4(xd, 7, Fp4Rounding::Stochastic, draw, qp);
      CHECK(by_value.download() == by_place.download());
      Mirror yv{size_t(n) * 4}, yp{size_t(n) * 4};
      Tensor fv = yv.on(true, Shape{n}, DType::F32), fp = yp.on(true, Shape{n}, DType::F32);
      b.dev->dequantize(qv, fv);
      b.dev->dequantize(qp, fp);
      CHECK(yv.download() == yp.download());
    }
  }
  {  // a non-finite tensor flags its code once: the first one stays
    auto x = floats(1000, 3);
    reinterpret_cast<float*>(x->host.data())[17] = std::numeric_limits<float>::infinity();
    x->upload();
    Mirror kept(8);
    REQUIRE(cudaMemset(kept.dptr, 0, 8) == cudaSuccess);
    auto* at = static_cast<float*>(kept.dptr);
    auto* flag = reinterpret_cast<uint32_t*>(at + 1);
    b.dev->int4_scale_to(x->on(true, Shape{1000}, DType::F32), false, at, flag, 21);
    b.dev->fp4_alpha_to(x->on(true, Shape{1000}, DType::F32), 7, at, flag, 22);
    uint32_t flagged = 0;
    std::memcpy(&flagged, kept.download().data() + 4, 4);
    CHECK(flagged == 21);
  }
  // An all-zero gradient: alpha 0, every code 0 (the device buffer starts non-zero).
  auto z = outputs(300, 0.f);
  std::memset(z->host.data(), 0, z->host.size());
  z->upload();
  Mirror q(300);
  std::memset(q.host.data(), 0x55, q.host.size());
  q.upload();
  Tensor qd = q.on(true, Shape{300}, DType::F4);
  qd.scale = quant::fp4_alpha(b.dev->tensor_max_abs(z->on(true, Shape{300}, DType::F32)).max_abs, 7);
  CHECK(qd.scale == 0.f);
  b.dev->quantize_fp4(z->on(true, Shape{300}, DType::F32), 7, Fp4Rounding::Stochastic, QuantDraw{DropoutSeed{1, 2}, 0}, qd);
  CHECK(q.download() == std::vector<uint8_t>(300, 0));
}

TEST_CASE("cuda: the integer conv passes equal the CPU's bit for bit", "[cuda][quant]") {
  Backends b;
  struct Case {
    int64_t N, C, H, W, K, R, stride, pad;
  };
  // Strides, 1x1 and 5x5 windows, odd sizes, batch 1, channels off the tile sizes, a weight
  // gradient long enough to be split over blocks (8 x 32 x 32 positions), and deep layers on small
  // maps, whose few output tiles make the forward and data gradient split their sums too. Strided
  // data gradients run by phase (int_gemm::DataGradPhase): stride 3 with a 5x5 window and pads that
  // leave phases with fewer taps.
  // Tensor cores and dp4a (EDGETRAIN_CUDA_INT_MMA), and every operand gathered in both orders
  // (EDGETRAIN_CUDA_INT_GATHER): the same integers.
  test::ScopedEnv mma_mode("EDGETRAIN_CUDA_INT_MMA", "1"), gather_mode("EDGETRAIN_CUDA_INT_GATHER", "auto");
  for (const auto& mode : {std::make_pair("1", "auto"), std::make_pair("0", "auto"), std::make_pair("1", "across"),
                           std::make_pair("1", "k")}) {
    mma_mode.set(mode.first);
    gather_mode.set(mode.second);
    INFO("EDGETRAIN_CUDA_INT_MMA=" << mode.first << " EDGETRAIN_CUDA_INT_GATHER=" << mode.second);
    for (const Case& c : {Case{2, 16, 8, 8, 16, 3, 1, 1}, Case{3, 5, 7, 9, 6, 3, 2, 1}, Case{1, 8, 6, 6, 12, 1, 1, 0},
                          Case{4, 12, 5, 5, 8, 1, 2, 0}, Case{1, 3, 11, 11, 5, 5, 1, 2}, Case{5, 9, 4, 4, 70, 3, 1, 1},
                          Case{8, 16, 32, 32, 16, 3, 1, 1}, Case{2, 64, 16, 16, 128, 3, 2, 1},
                          Case{2, 256, 4, 4, 256, 3, 1, 1}, Case{2, 128, 8, 8, 256, 3, 2, 1},
                          Case{2, 3, 13, 11, 4, 5, 3, 2}, Case{1, 4, 9, 9, 6, 3, 2, 2}}) {
      Conv2dGeom g;
      g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.K = c.K, g.R = g.S = c.R;
      g.stride_h = g.stride_w = c.stride, g.pad_h = g.pad_w = c.pad;
      g.infer_output();
      const int64_t nx = g.N * g.C * g.H * g.W, nw = g.K * g.C * g.R * g.S, ny = g.N * g.K * g.P * g.Q;
      for (bool x_unsigned : {true, false}) {
        INFO("N" << g.N << " C" << g.C << " " << g.H << "x" << g.W << " K" << g.K << " R" << g.R << " stride "
                  << c.stride << " unsigned " << x_unsigned);
        auto x = x_unsigned ? codes(nx, 0, 15, 1) : codes(nx, -7, 7, 1);
        auto w = codes(nw, -7, 7, 2);
        auto gr = fp4_codes(ny, 3);
        auto bias = outputs(g.K, -1.f);
        const DType xt = x_unsigned ? DType::U4 : DType::I4;
        size_t hb = 0, db_bytes = 0;
        for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight}) {
          hb = std::max(hb, b.cpu->conv2d_q_workspace_bytes(g, p));
          db_bytes = std::max(db_bytes, b.dev->conv2d_q_workspace_bytes(g, p));
        }
        if (g.C >= 128) {  // the deep cases: split sums in every pass (beyond the forward's decode room)
          CHECK(b.dev->conv2d_q_workspace_bytes(g, ConvPass::Forward) > size_t(nx) + 256);
          CHECK(b.dev->conv2d_q_workspace_bytes(g, ConvPass::BackwardData) > 0);
        }
        Mirror wsc(hb), wsd(db_bytes);
        const Workspace wc{wsc.host.data(), hb}, wd{wsd.dptr, db_bytes};
        for (bool acc : {false, true}) {
          auto y = outputs(ny, 0.5f), dx = outputs(nx, 1.f), dw = outputs(nw, 2.f), db = outputs(g.K, 3.f);
          for (bool dev : {false, true}) {
            Backend& be = dev ? *b.dev : *b.cpu;
            Tensor xq = x->on(dev, Shape{g.N, g.C, g.H, g.W}, xt);
            Tensor wq = w->on(dev, Shape{g.K, g.C, g.R, g.S}, DType::I4);
            Tensor gq = gr->on(dev, Shape{g.N, g.K, g.P, g.Q}, DType::F4);
            xq.scale = 0.125f, wq.scale = 0.0625f, gq.scale = 0x1p-10f;
            Tensor yt = y->on(dev, gq.shape, DType::F32), dxt = dx->on(dev, xq.shape, DType::F32);
            Tensor dwt = dw->on(dev, wq.shape, DType::F32), dbt = db->on(dev, Shape{g.K}, DType::F32);
            const Workspace ws = dev ? wd : wc;
            be.conv2d_forward_q(g, xq, wq, acc ? bias->on(dev, Shape{g.K}, DType::F32) : Tensor{}, yt, ws);
            be.conv2d_backward_data_q(g, gq, wq, dxt, acc, ws);
            be.conv2d_backward_weight_q(g, xq, gq, dwt, dbt, acc, ws);
          }
          INFO("accumulate " << acc);
          CHECK(y->same());
          CHECK(dx->same());
          CHECK(dw->same());
          CHECK(db->same());
        }
      }
    }
  }
}

TEST_CASE("cuda: the integer conv passes read bitmap_int4's stored codes as the CPU does", "[cuda][quant][stash]") {
  // The forward (a recompute of BN's input) and the weight gradient take the input codes as the
  // stash keeps them under memory.stash = bitmap_int4: each backend's codec encodes them, the
  // kernels decode them (CUDA: into the workspace), and the outputs agree bit for bit.
  Backends b;
  struct Case {
    int64_t N, C, H, W, K, stride;
  };
  for (const Case& c : {Case{2, 16, 8, 8, 16, 1}, Case{3, 24, 9, 7, 8, 2}, Case{2, 256, 4, 4, 256, 1}}) {
    Conv2dGeom g;
    g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.K = c.K, g.R = g.S = 3;
    g.stride_h = g.stride_w = c.stride, g.pad_h = g.pad_w = 1;
    g.infer_output();
    const int64_t nx = g.N * g.C * g.H * g.W, nw = g.K * g.C * 9, ny = g.N * g.K * g.P * g.Q;
    INFO("N" << g.N << " C" << g.C << " " << g.H << "x" << g.W << " K" << g.K << " stride " << c.stride);
    auto x = floats(nx, 21);  // a seventh of them exact zeros: their bits are clear
    auto xc = codes(nx, 0, 15, 22);
    auto w = codes(nw, -7, 7, 23);
    auto gr = fp4_codes(ny, 24);
    const size_t cap = code_bitmap::encoded_bytes(nx, nx);
    Mirror enc(cap);
    const int64_t hk = host_stash_codec().encode_codes(reinterpret_cast<const float*>(x->host.data()),
                                                       reinterpret_cast<const int8_t*>(xc->host.data()), nx, 0.f,
                                                       enc.host.data(), nx, nullptr);
    CHECK(b.dev->stash_codec().encode_codes(static_cast<const float*>(x->dptr), static_cast<const int8_t*>(xc->dptr),
                                            nx, 0.f, enc.dptr, nx, nullptr) == hk);
    size_t hb = 0, db_bytes = 0;
    for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardWeight}) {
      hb = std::max(hb, b.cpu->conv2d_q_workspace_bytes(g, p));
      db_bytes = std::max(db_bytes, b.dev->conv2d_q_workspace_bytes(g, p));
    }
    Mirror wsc(hb), wsd(db_bytes);
    auto y = outputs(ny, 0.5f), dw = outputs(nw, 2.f), db = outputs(g.K, 3.f);
    for (bool dev : {false, true}) {
      Backend& be = dev ? *b.dev : *b.cpu;
      Tensor xq = enc.on(dev, Shape{g.N, g.C, g.H, g.W}, DType::BitmapU4);
      Tensor wq = w->on(dev, Shape{g.K, g.C, 3, 3}, DType::I4);
      Tensor gq = gr->on(dev, Shape{g.N, g.K, g.P, g.Q}, DType::F4);
      xq.scale = 0.125f, wq.scale = 0.0625f, gq.scale = 0x1p-10f;
      Tensor yt = y->on(dev, gq.shape, DType::F32), dwt = dw->on(dev, wq.shape, DType::F32);
      Tensor dbt = db->on(dev, Shape{g.K}, DType::F32);
      const Workspace ws = dev ? Workspace{wsd.dptr, db_bytes} : Workspace{wsc.host.data(), hb};
      be.conv2d_forward_q(g, xq, wq, Tensor{}, yt, ws);
      be.conv2d_backward_weight_q(g, xq, gq, dwt, dbt, false, ws);
    }
    CHECK(y->same());
    CHECK(dw->same());
    CHECK(db->same());
  }
}

TEST_CASE("cuda: the integer linear passes equal the CPU's bit for bit", "[cuda][quant]") {
  Backends b;
  test::ScopedEnv gather_mode("EDGETRAIN_CUDA_INT_GATHER", "auto");  // each operand in both orders too
  const std::vector<std::pair<const char*, std::vector<int64_t>>> runs = {  // (order, {N, I, O})
      {"auto", {4, 64, 10}},   {"auto", {7, 33, 5}},   {"auto", {128, 512, 10}}, {"across", {4, 64, 10}},
      {"across", {7, 33, 5}}, {"across", {128, 512, 10}}, {"k", {4, 64, 10}},   {"k", {7, 33, 5}},
      {"k", {128, 512, 10}}};
  for (const auto& [gather, s] : runs) {
    gather_mode.set(gather);
    const int64_t N = s[0], I = s[1], O = s[2];
    INFO("N " << N << " I " << I << " O " << O << " EDGETRAIN_CUDA_INT_GATHER=" << gather);
    auto x = codes(N * I, 0, 15, 4), w = codes(O * I, -7, 7, 5);
    auto gr = fp4_codes(N * O, 6);
    auto bias = outputs(O, 0.5f);
    Mirror wsc(b.cpu->linear_q_workspace_bytes(N, I, O)), wsd(b.dev->linear_q_workspace_bytes(N, I, O));
    for (bool acc : {false, true}) {
      auto y = outputs(N * O, 0.f), dx = outputs(N * I, 1.f), dw = outputs(O * I, 2.f), db = outputs(O, 3.f);
      for (bool dev : {false, true}) {
        Backend& be = dev ? *b.dev : *b.cpu;
        const Workspace ws = dev ? Workspace{wsd.dptr, wsd.host.size()} : Workspace{wsc.host.data(), wsc.host.size()};
        Tensor xq = x->on(dev, Shape{N, I}, DType::U4), wq = w->on(dev, Shape{O, I}, DType::I4);
        Tensor gq = gr->on(dev, Shape{N, O}, DType::F4);
        xq.scale = 0.5f, wq.scale = 0.25f, gq.scale = 0x1p-8f;
        Tensor yt = y->on(dev, Shape{N, O}, DType::F32), dxt = dx->on(dev, Shape{N, I}, DType::F32);
        Tensor dwt = dw->on(dev, Shape{O, I}, DType::F32), dbt = db->on(dev, Shape{O}, DType::F32);
        be.linear_forward_q(xq, wq, acc ? bias->on(dev, Shape{O}, DType::F32) : Tensor{}, yt, ws);
        be.linear_backward_data_q(gq, wq, dxt, acc, ws);
        be.linear_backward_weight_q(xq, gq, dwt, dbt, acc, ws);
      }
      INFO("accumulate " << acc);
      CHECK(y->same());
      CHECK(dx->same());
      CHECK(dw->same());
      CHECK(db->same());
    }
  }
}

namespace {

// resnet8 at batch 8 with LUQ (INT4 forward, FP4 backward; first and last layers FP32).
struct QuantRun {
  Graph g;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Executor> ex;
  QuantRun(std::unique_ptr<Backend> backend, int smp, StashFormat stash = StashFormat::DenseF32)
      : be(std::move(backend)) {
    ModelSpec spec;
    spec.name = "resnet8";
    spec.batch = 8;
    build_model(g, spec);
    QuantOptions q;
    q.forward = ForwardQuant::Int4;
    q.backward = BackwardQuant::LuqFp4;
    q.smp_samples = smp;
    StashOptions so;
    so.format = stash;
    ex = std::make_unique<Executor>(g, *be, so, q);
    init_parameters(*ex, 5);
    const Tensor x = ex->value(g.image_input);
    const HostView xv(*be, x, HostView::Write), yv(*be, ex->value(g.label_input), HostView::Write);
    for (int64_t i = 0; i < x.numel(); ++i) xv.f32()[i] = float((i * 2654435761u) % 2001) / 1000.f - 1.f;
    for (int64_t i = 0; i < 8; ++i) yv.i32()[i] = int32_t(i * 3 % 10);
  }
  float step(int s) {
    ex->set_step_seed(uint64_t(s) * 7919);
    ex->set_step(s);
    ex->forward(8, true);
    const float loss = ex->loss();
    ex->backward();
    REQUIRE(sgd_update(*ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
    return loss;
  }
};

}  // namespace

TEST_CASE("cuda: LUQ training steps of resnet8 follow the CPU's", "[cuda][quant][training]") {
  // bitmap_int4: the INT4 input codes kept as the stash's code bitmap (encoded and decoded on the
  // device), the BN inputs recomputed from them.
  for (const auto& [smp, stash] : {std::make_pair(1, StashFormat::DenseF32), std::make_pair(2, StashFormat::DenseF32),
                                   std::make_pair(1, StashFormat::BitmapI4)}) {
    INFO("smp " << smp << ", stash " << stash_format_name(stash));
    QuantRun cpu(make_cpu_backend(), smp, stash), dev(make_cuda_backend(0), smp, stash);
    // The first forward: FP32 stem (other summation order), then integer layers on codes that
    // agree but where a SAWB scale differs in its last bit (the statistics' double sums run in
    // another order): within 1e-4. Later steps add the FP32 layers' and optimizer's differences.
    for (int s = 0; s < 4; ++s) {
      const float a = cpu.step(s), d = dev.step(s);
      INFO("step " << s << ": cpu " << a << ", cuda " << d);
      REQUIRE(std::isfinite(d));
      CHECK(std::fabs(a - d) <= (s == 0 ? 1e-4f : 1e-2f) * std::fabs(a));
    }
  }
}
