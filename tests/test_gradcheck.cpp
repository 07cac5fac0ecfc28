// Finite-difference gradient checks for every op, through the executor (forward, backward, planned
// memory, stash) rather than by calling kernels directly.
//
// Method. Each check builds a tiny graph
//     images [N,C,H,W] -> probe (1x1 conv, weight = identity, no bias) -> op(s) under test
//                      -> [flatten] -> [linear head] -> softmax cross-entropy (mean over N)
// The probe makes the gradient with respect to the op's input observable: the executor only computes
// gradients for values downstream of a parameter, and with an identity 1x1 weight probe(x) == x
// exactly, so dL/d(images) == dL/d(probe output) == ex.grad(probe). Perturbing an image element
// therefore perturbs exactly one element of the op's input.
//
// For a tensor T (a parameter of the op under test, or the images) and a set of coordinates i
// (all of them if T has at most kMaxCoords elements, else a random subset of kMaxCoords):
//     numeric_i  = (L(T + eps e_i) - L(T - eps e_i)) / (2 eps),   eps = 1e-2, loss in float32
//     analytic_i = the executor's gradient after one forward + backward at T
// and each coordinate must satisfy
//     |analytic - numeric| <= kRtol * max(|analytic|, |numeric|) + kAtol,  kRtol = 1e-2, kAtol = 2e-4.
// kAtol covers float32 rounding in the loss (~1e-7 relative, / 2 eps ~ 1e-5 in the derivative) and the
// O(eps^2) truncation term. Every check also requires max |numeric| >= kMinSignal (1e-2) so that an
// all-zero gradient cannot pass by accident, and the sanity cases at the end show that a gradient off
// by a few percent (or an op with a deliberately wrong backward) fails the same comparison.
// Non-smooth ops (relu, maxpool) get inputs at least 5 eps away from their kinks / ties.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>

#include "backends/cpu/conv_direct.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "layers/layers.h"

using namespace et;

namespace {

constexpr float kEps = 1e-2f;
constexpr double kRtol = 1e-2, kAtol = 2e-4, kMinSignal = 1e-2;
constexpr int64_t kMaxCoords = 400;

struct Comparison {
  int64_t checked = 0, failed = 0;
  double max_abs_numeric = 0, max_abs_analytic = 0, worst_excess = -1e30;
  std::string worst;
  bool ok() const { return checked > 0 && failed == 0 && max_abs_numeric >= kMinSignal; }
};

// The pass/fail rule, separate from the finite differences so the sanity test can feed it wrong gradients.
Comparison compare(const std::vector<double>& analytic, const std::vector<double>& numeric,
                   const std::vector<int64_t>& coords) {
  Comparison c;
  for (size_t k = 0; k < coords.size(); ++k) {
    const double a = analytic[k], n = numeric[k];
    const double tol = kRtol * std::max(std::fabs(a), std::fabs(n)) + kAtol;
    const double excess = std::fabs(a - n) - tol;
    ++c.checked;
    if (excess > 0) ++c.failed;
    c.max_abs_numeric = std::max(c.max_abs_numeric, std::fabs(n));
    c.max_abs_analytic = std::max(c.max_abs_analytic, std::fabs(a));
    if (excess > c.worst_excess) {
      c.worst_excess = excess;
      std::ostringstream s;
      s << "coord " << coords[k] << ": analytic " << a << " numeric " << n << " (tol " << tol << ")";
      c.worst = s.str();
    }
  }
  return c;
}

// A graph image -> probe -> body -> [flatten] -> [head linear] -> loss, initialised and fed.
struct Net {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;
  int probe = -1;
  int64_t N = 0;
  std::mt19937 rng{1234};

  // body: builds the op(s) under test on the probe output and returns the value to reduce.
  // head_classes > 0 appends flatten (for 4-D values) + linear "head"; 0 feeds the body's output
  // straight into the loss (it must then be [N, K]).
  Net(int64_t n, int64_t c, int64_t h, int64_t w, const std::function<int(Graph&, int)>& body,
      int64_t head_classes = 5, float label_smoothing = 0.f, uint32_t seed = 1234)
      : N(n), rng(seed) {
    const int x = image_input(g, n, c, h, w);
    const int labels = label_input(g, n);
    Conv2dOptions o;
    o.out_channels = c;
    o.kernel = 1;
    probe = conv2d(g, x, "probe", o);
    int y = body(g, probe);
    if (head_classes > 0) {
      if (g.value(y).shape.ndim == 4) y = flatten(g, y, "head_flatten");
      y = linear(g, y, "head", head_classes);
    }
    softmax_cross_entropy(g, y, labels, "loss", label_smoothing);
    ex = std::make_unique<Executor>(g, *be);
    init_parameters(*ex, seed);
    // Executor::value() of a batched value is a view of the current batch, which is 0 until the
    // first forward: run one so the inputs below are written at full batch.
    ex->forward(n, false);
    // Probe = identity.
    Tensor pw = ex->value(g.find_value("probe.weight"));
    std::fill(pw.f32(), pw.f32() + pw.numel(), 0.f);
    for (int64_t i = 0; i < c; ++i) pw.f32()[i * c + i] = 1.f;
    // BN affine parameters away from their trivial 1 / 0 so their gradients are generic.
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int p : g.params()) {
      Tensor t = ex->value(p);
      if (g.value(p).init == ParamInit::Ones)
        for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = 1.f + 0.5f * u(rng);
      else if (g.value(p).init == ParamInit::Zeros)
        for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = 0.3f * u(rng);
    }
    const int64_t classes = g.value(g.logits).shape[1];
    Tensor lab = ex->value(g.label_input);
    for (int64_t i = 0; i < n; ++i) lab.i32()[i] = int32_t(rng() % uint32_t(classes));
    fill_images_normal();
    ex->set_step_seed(42);
  }

  Tensor images() const { return ex->value(g.image_input); }
  void fill_images_normal(float min_abs = 0.f) {
    std::normal_distribution<float> d(0.f, 1.f);
    Tensor x = images();
    for (int64_t i = 0; i < x.numel(); ++i) {
      float v;
      do v = d(rng); while (std::fabs(v) < min_abs);
      x.f32()[i] = v;
    }
  }
  // Distinct values on a grid of spacing `gap` in random order: no ties within any window, and a
  // perturbation of eps < gap / 2 never changes which element is the maximum.
  void fill_images_distinct(float gap) {
    Tensor x = images();
    std::vector<int64_t> perm(size_t(x.numel()));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const float mid = 0.5f * float(x.numel());
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = (float(perm[size_t(i)]) - mid) * gap;
  }

  float loss() {
    ex->forward(N, true);
    return ex->loss();
  }

  // Finite differences of the loss w.r.t. `target` (data to perturb) against `analytic`.
  Comparison check(Tensor target, const Tensor& analytic_t) {
    REQUIRE(target.numel() == analytic_t.numel());
    std::vector<int64_t> coords(size_t(target.numel()));
    std::iota(coords.begin(), coords.end(), 0);
    if (int64_t(coords.size()) > kMaxCoords) {
      std::shuffle(coords.begin(), coords.end(), rng);
      coords.resize(size_t(kMaxCoords));
      std::sort(coords.begin(), coords.end());
    }
    std::vector<double> analytic, numeric;
    for (int64_t i : coords) analytic.push_back(analytic_t.f32()[i]);
    float* p = target.f32();
    for (int64_t i : coords) {
      const float orig = p[i];
      p[i] = orig + kEps;
      const double lp = loss();
      p[i] = orig - kEps;
      const double lm = loss();
      p[i] = orig;
      numeric.push_back((lp - lm) / (2.0 * double(kEps)));
    }
    return compare(analytic, numeric, coords);
  }

  // Analytic gradients at the current point: copies, since later forwards reuse the arena.
  struct Grads {
    std::deque<std::vector<float>> store;  // deque: earlier elements never move
    Tensor keep(const Tensor& t) {
      store.emplace_back(t.f32(), t.f32() + t.numel());
      Tensor c = t;
      c.data = store.back().data();
      return c;
    }
  };

  // Checks every parameter gradient except the probe's, and the gradient w.r.t. the images
  // (= w.r.t. the probe output). `skip` names parameters whose exact gradient is ~0 by construction.
  void check_all(const std::vector<std::string>& skip = {}, bool check_input = true) {
    ex->forward(N, true);
    ex->backward();
    const double l0 = ex->loss();
    REQUIRE(std::isfinite(l0));
    std::vector<std::pair<std::string, std::pair<Tensor, Tensor>>> targets;
    Grads grads;
    for (int p : g.params()) {
      const std::string& name = g.value(p).name;
      if (name == "probe.weight" || g.value(p).frozen || std::find(skip.begin(), skip.end(), name) != skip.end())
        continue;
      targets.push_back({name, {ex->value(p), grads.keep(ex->grad(p))}});
    }
    if (check_input) targets.push_back({"input (via probe)", {images(), grads.keep(ex->grad(probe))}});
    for (auto& [name, tt] : targets) {
      const Comparison c = check(tt.first, tt.second);
      INFO("d loss / d " << name << ": " << c.checked << " coords, " << c.failed << " failed; max |numeric| "
                         << c.max_abs_numeric << ", max |analytic| " << c.max_abs_analytic << "; worst " << c.worst);
      CHECK(c.failed == 0);
      CHECK(c.max_abs_numeric >= kMinSignal);
    }
  }
};

}  // namespace

TEST_CASE("gradcheck: conv2d", "[gradcheck]") {
  struct Cfg { int64_t c, k, kernel, groups, stride, pad; bool bias; };
  std::vector<Cfg> cfgs;
  for (int64_t groups : {1, 2, 4})
    for (int64_t stride : {1, 2})
      for (int64_t pad : {0, 1})
        for (bool bias : {false, true}) cfgs.push_back({4, groups == 4 ? 4 : 6, 3, groups, stride, pad, bias});
  cfgs.push_back({4, 6, 1, 1, 1, 0, true});   // 1x1 (GEMM on x directly)
  cfgs.push_back({4, 6, 1, 1, 2, 0, false});  // 1x1 stride 2 (a ResNet shortcut)
  cfgs.push_back({4, 8, 3, 4, 1, 1, true});   // grouped with 2 outputs per group (not the depthwise kernel)
  // Where both the GEMM and the direct stride-1 kernels apply, run each (and the automatic choice).
  struct PathGuard {
    ~PathGuard() { cpu::conv_set_path_override(cpu::ConvPathOverride::Auto); }
  } guard;
  const char* path_names[] = {"auto", "gemm", "direct"};
  for (auto path : {cpu::ConvPathOverride::Auto, cpu::ConvPathOverride::Gemm, cpu::ConvPathOverride::Direct}) {
    for (const Cfg& cf : cfgs) {
      for (int64_t hw : {5, 8}) {  // 8x8 maps take the direct (im2col-free) kernels where they apply
        if (path != cpu::ConvPathOverride::Auto && (cf.stride != 1 || cf.groups == cf.c)) continue;
        cpu::conv_set_path_override(path);  // before the executor plans its workspace
        DYNAMIC_SECTION(path_names[int(path)] << " path: C" << cf.c << " K" << cf.k << " k" << cf.kernel << " groups "
                                              << cf.groups << " stride " << cf.stride << " pad " << cf.pad
                                              << (cf.bias ? " bias " : " no bias ") << hw << "x" << hw) {
          Net net(2, cf.c, hw, hw, [&](Graph& g, int x) {
            Conv2dOptions o;
            o.out_channels = cf.k;
            o.kernel = cf.kernel;
            o.stride = cf.stride;
            o.padding = cf.pad;
            o.groups = cf.groups;
            o.bias = cf.bias;
            return conv2d(g, x, "conv", o);
          });
          net.check_all();
        }
      }
    }
  }
}

TEST_CASE("gradcheck: linear", "[gradcheck]") {
  for (bool bias : {false, true}) {
    DYNAMIC_SECTION((bias ? "bias" : "no bias") << ", hidden layer before the head") {
      Net net(3, 2, 3, 3, [&](Graph& g, int x) { return linear(g, flatten(g, x, "flat"), "fc", 7, bias); });
      net.check_all();
    }
    DYNAMIC_SECTION((bias ? "bias" : "no bias") << ", straight into the loss") {
      Net net(3, 2, 3, 3, [&](Graph& g, int x) { return linear(g, flatten(g, x, "flat"), "fc", 6, bias); }, 0);
      net.check_all();
    }
  }
}

TEST_CASE("gradcheck: batchnorm2d (training mode)", "[gradcheck]") {
  // x, gamma and beta; the head sees every BN output element (flatten + linear, not global pooling,
  // which would cancel the x gradient through the mean subtraction).
  Net net(4, 3, 3, 3, [](Graph& g, int x) { return batchnorm2d(g, x, "bn"); });
  net.check_all();
  SECTION("after a conv (the ResNet pattern conv -> bn -> relu)") {
    Net n2(3, 2, 4, 4, [](Graph& g, int x) {
      Conv2dOptions o;
      o.out_channels = 3;
      o.padding = 1;
      return batchnorm2d(g, conv2d(g, x, "conv", o), "bn");
    });
    n2.check_all();
  }
}

TEST_CASE("gradcheck: frozen batchnorm2d (finetune.bn = frozen: running statistics, fixed gamma / beta)",
          "[gradcheck]") {
  Net net(4, 3, 3, 3, [](Graph& g, int x) {
    g.build.frozen_bn = true;
    return batchnorm2d(g, x, "bn");
  });
  REQUIRE(net.g.value(net.g.find_value("bn.weight")).frozen);
  // Running statistics away from 0 / 1, so the scale and shift are generic.
  Tensor rm = net.ex->value(net.g.find_value("bn.running_mean")), rv = net.ex->value(net.g.find_value("bn.running_var"));
  for (int64_t c = 0; c < 3; ++c) rm.f32()[c] = 0.3f * float(c) - 0.2f, rv.f32()[c] = 0.5f + float(c);
  const std::vector<float> rm0(rm.f32(), rm.f32() + 3), rv0(rv.f32(), rv.f32() + 3);
  net.check_all();
  // Training steps leave the running statistics as they were.
  CHECK(std::equal(rm0.begin(), rm0.end(), rm.f32()));
  CHECK(std::equal(rv0.begin(), rv0.end(), rv.f32()));
}

TEST_CASE("gradcheck: batchnorm2d with double mask (memory.double_mask_bn)", "[gradcheck]") {
  // relu -> bn: the BN input is sparse; the masked function y = BN(x) * (x != 0) is differentiable
  // away from the relu kink, and its output is zero wherever x is.
  Net net(4, 3, 3, 3, [](Graph& g, int x) {
    g.build.double_mask_bn = true;
    return batchnorm2d(g, relu(g, x, "relu"), "bn");
  });
  net.fill_images_normal(5 * kEps);
  net.check_all();
  // Right after the BN's forward: a value's buffer may be reused once its last reader has run.
  struct AfterBn : NodeObserver {
    Net& net;
    std::vector<float> in, out;
    explicit AfterBn(Net& n) : net(n) {}
    void after_forward(int node) override {
      if (net.g.node(node).output != net.g.find_value("bn")) return;
      const Tensor x = net.ex->value(net.g.find_value("relu")), y = net.ex->value(net.g.find_value("bn"));
      in.assign(x.f32(), x.f32() + x.numel());
      out.assign(y.f32(), y.f32() + y.numel());
    }
    void after_backward(int) override {}
  } seen(net);
  net.ex->set_observer(&seen);
  net.ex->forward(net.N, true);
  net.ex->set_observer(nullptr);
  const std::vector<float>&in = seen.in, &out = seen.out;
  REQUIRE(!in.empty());
  int64_t zeros = 0, kept = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    zeros += in[i] == 0.f;
    kept += in[i] == 0.f ? out[i] == 0.f : out[i] != 0.f;
  }
  CHECK(zeros > int64_t(in.size()) / 4);
  CHECK(kept == int64_t(in.size()));
}

TEST_CASE("gradcheck: relu", "[gradcheck]") {
  Net net(2, 3, 4, 4, [](Graph& g, int x) { return relu(g, x, "relu"); });
  net.fill_images_normal(5 * kEps);  // no input within 5 eps of the kink
  net.check_all();
}

TEST_CASE("gradcheck: dropout (fixed step seed)", "[gradcheck]") {
  Net net(2, 3, 4, 4, [](Graph& g, int x) { return dropout(g, x, "drop", 0.3f); });
  net.check_all();
  // The mask really drops: some input gradients are exactly zero, most are not.
  net.ex->forward(2, true);
  net.ex->backward();
  const Tensor gx = net.ex->grad(net.probe);
  int64_t zeros = 0;
  for (int64_t i = 0; i < gx.numel(); ++i) zeros += gx.f32()[i] == 0.f;
  CHECK(zeros > gx.numel() / 10);
  CHECK(zeros < gx.numel() / 2);
  // Another step seed, another mask.
  std::vector<float> a(gx.f32(), gx.f32() + gx.numel());
  net.ex->set_step_seed(43);
  net.ex->forward(2, true);
  net.ex->backward();
  const Tensor gb = net.ex->grad(net.probe);
  CHECK(!std::equal(a.begin(), a.end(), gb.f32()));
}

TEST_CASE("gradcheck: maxpool2d", "[gradcheck]") {
  struct Cfg { int64_t k, s, p; };
  for (const Cfg& cf : {Cfg{2, 2, 0}, Cfg{3, 2, 1}, Cfg{3, 1, 1}, Cfg{2, 1, 0}}) {
    DYNAMIC_SECTION("kernel " << cf.k << " stride " << cf.s << " pad " << cf.p) {
      Net net(2, 2, 6, 6, [&](Graph& g, int x) { return maxpool2d(g, x, "pool", cf.k, cf.s, cf.p); });
      net.fill_images_distinct(10 * kEps);
      net.check_all();
    }
  }
}

TEST_CASE("gradcheck: avgpool2d", "[gradcheck]") {
  struct Cfg { int64_t k, s, p; };
  for (const Cfg& cf : {Cfg{2, 2, 0}, Cfg{3, 2, 1}, Cfg{3, 1, 1}, Cfg{2, 2, 1}}) {
    DYNAMIC_SECTION("kernel " << cf.k << " stride " << cf.s << " pad " << cf.p) {
      Net net(2, 2, 5, 5, [&](Graph& g, int x) { return avgpool2d(g, x, "pool", cf.k, cf.s, cf.p); });
      net.check_all();
    }
  }
}

TEST_CASE("gradcheck: global_avgpool", "[gradcheck]") {
  Net net(3, 4, 3, 5, [](Graph& g, int x) { return global_avgpool(g, x, "gap"); });
  net.check_all();
}

TEST_CASE("gradcheck: subsample_pad (option-A shortcut)", "[gradcheck]") {
  SECTION("stride 2, 2 -> 4 channels, odd size") {
    Net net(2, 2, 5, 5, [](Graph& g, int x) { return subsample_pad(g, x, "shortcut", 4, 2); });
    net.check_all();
  }
  SECTION("stride 1, 2 -> 5 channels (uneven padding)") {
    Net net(2, 2, 4, 4, [](Graph& g, int x) { return subsample_pad(g, x, "shortcut", 5, 1); });
    net.check_all();
  }
}

// The forward is F.pad(x[:, :, ::s, ::s], (0, 0, 0, 0, pad, K - C - pad)): checked element by element.
TEST_CASE("subsample_pad forward and backward follow the option-A definition", "[gradcheck]") {
  auto be = make_cpu_backend();
  const int64_t N = 2, C = 3, H = 5, W = 4, K = 7, s = 2, pad = (K - C) / 2, P = 3, Q = 2;
  std::vector<float> xb(size_t(N * C * H * W)), yb(size_t(N * K * P * Q), -1.f), dxb(xb.size(), 5.f);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = float(i) + 0.5f;
  Tensor x = Tensor::contiguous(xb.data(), Shape{N, C, H, W}), y = Tensor::contiguous(yb.data(), Shape{N, K, P, Q});
  Tensor dx = Tensor::contiguous(dxb.data(), Shape{N, C, H, W});
  be->subsample_pad_forward(x, s, pad, y);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = 0; p < P; ++p)
        for (int64_t q = 0; q < Q; ++q) {
          const int64_t c = k - pad;
          const float want = (c < 0 || c >= C) ? 0.f : xb[size_t(((n * C + c) * H + p * s) * W + q * s)];
          REQUIRE(yb[size_t(((n * K + k) * P + p) * Q + q)] == want);
        }
  // Backward of y's values: the sampled positions of x get them back, the rest are zero.
  be->subsample_pad_backward(y, s, pad, dx, false);
  for (int64_t i = 0; i < N * C * H * W; ++i) {
    const int64_t w = i % W, h = i / W % H;
    REQUIRE(dxb[size_t(i)] == ((h % s == 0 && w % s == 0) ? xb[size_t(i)] : 0.f));
  }
}

TEST_CASE("gradcheck: add (residual, gradient accumulation)", "[gradcheck]") {
  SECTION("x consumed by a conv and by the add: y = conv(x) + x") {
    Net net(2, 3, 4, 4, [](Graph& g, int x) {
      Conv2dOptions o;
      o.out_channels = 3;
      o.padding = 1;
      return add(g, conv2d(g, x, "conv", o), x, "add");
    });
    net.check_all();
  }
  SECTION("a BasicBlock without its relus: bn(conv(bn(conv(x)))) + x, x read by two branches") {
    // The relus are left out: perturbing a conv weight moves many BN outputs by ~eps, and some
    // would cross zero (relu is checked on its own above, with inputs away from the kink).
    Net net(2, 3, 4, 4, [](Graph& g, int x) {
      Conv2dOptions o;
      o.out_channels = 3;
      o.padding = 1;
      int y = batchnorm2d(g, conv2d(g, x, "conv1", o), "bn1");
      y = batchnorm2d(g, conv2d(g, y, "conv2", o), "bn2");
      return add(g, y, x, "add");
    });
    net.check_all();
  }
  SECTION("three consumers of one value: (a + x) + x") {
    Net net(2, 2, 3, 3, [](Graph& g, int x) {
      Conv2dOptions o;
      o.out_channels = 2;
      o.padding = 1;
      const int a = conv2d(g, x, "conv", o);
      return add(g, add(g, a, x, "add1"), x, "add2");
    });
    net.check_all();
  }
}

// y = a + a: both gradient requests hit the same value; the second must accumulate.
TEST_CASE("gradcheck: add with the same value as both inputs (y = a + a)", "[gradcheck]") {
  Net net(2, 2, 3, 3, [](Graph& g, int x) {
    Conv2dOptions o;
    o.out_channels = 2;
    o.padding = 1;
    const int a = conv2d(g, x, "conv", o);
    return add(g, a, a, "add");
  });
  net.check_all();
}

TEST_CASE("gradcheck: flatten", "[gradcheck]") {
  // flatten is in most graphs above; here it is the only op between the probe and the head.
  Net net(2, 3, 2, 3, [](Graph& g, int x) { return flatten(g, x, "flat"); }, 4);
  net.check_all();
}

TEST_CASE("gradcheck: softmax cross-entropy", "[gradcheck]") {
  for (float smoothing : {0.f, 0.1f, 0.3f}) {
    DYNAMIC_SECTION("label smoothing " << smoothing) {
      // images [N, K, 1, 1] -> probe -> flatten are the logits themselves: d loss / d images = d loss / d logits.
      const int64_t N = 4, K = 6;
      Net net(N, K, 1, 1, [](Graph& g, int x) { return flatten(g, x, "logits"); }, 0, smoothing);
      net.check_all();
      // The loss value against a float64 evaluation of the definition.
      net.ex->forward(N, true);
      const Tensor z = net.images(), lab = net.ex->value(net.g.label_input);
      double total = 0;
      for (int64_t n = 0; n < N; ++n) {
        double m = -1e30, se = 0;
        for (int64_t k = 0; k < K; ++k) m = std::max(m, double(z.f32()[n * K + k]));
        for (int64_t k = 0; k < K; ++k) se += std::exp(double(z.f32()[n * K + k]) - m);
        const double lse = m + std::log(se);
        for (int64_t k = 0; k < K; ++k) {
          const double t = (k == lab.i32()[n] ? 1.0 - smoothing : 0.0) + smoothing / double(K);
          total += t * (lse - double(z.f32()[n * K + k]));
        }
      }
      CHECK(net.ex->loss() == Approx(total / double(N)).epsilon(1e-6));
    }
  }
}

// ---- The checks can fail.

namespace {

// y = 2 x, but backward claims dx = 2.1 dy: a 5 % error the gradient check must catch.
class WrongScaleOp final : public Op {
 public:
  const char* type() const override { return "wrong_scale"; }
  OpClass op_class() const override { return OpClass::Elementwise; }
  void forward(OpContext& ctx) override {
    const Tensor x = ctx.input(0), y = ctx.output();
    for (int64_t i = 0; i < x.numel(); ++i) y.f32()[i] = 2.f * x.f32()[i];
  }
  void backward(OpContext& ctx) override {
    GradOut dx = ctx.grad_input(0);
    const Tensor dy = ctx.grad_output();
    for (int64_t i = 0; i < dy.numel(); ++i)
      dx.t.f32()[i] = (dx.accumulate ? dx.t.f32()[i] : 0.f) + 2.1f * dy.f32()[i];
  }
};

}  // namespace

TEST_CASE("gradcheck: the comparison rejects wrong gradients", "[gradcheck]") {
  SECTION("an op with a 5% wrong backward fails") {
    Net net(2, 3, 3, 3, [](Graph& g, int x) {
      return g.add_node("wrong", std::make_unique<WrongScaleOp>(), {x}, activation("wrong", g.value(x).shape));
    });
    net.ex->forward(2, true);
    net.ex->backward();
    Net::Grads keep;
    const Comparison c = net.check(net.images(), keep.keep(net.ex->grad(net.probe)));
    INFO(c.worst);
    CHECK(c.failed > c.checked / 2);
    CHECK_FALSE(c.ok());
    // The head's gradients (downstream of the wrong op) are still right.
    const int hw = net.g.find_value("head.weight");
    const Comparison h = net.check(net.ex->value(hw), keep.keep(net.ex->grad(hw)));
    CHECK(h.ok());
  }
  SECTION("correct gradients pass; perturbed copies of them fail") {
    Net net(2, 2, 4, 4, [](Graph& g, int x) {
      Conv2dOptions o;
      o.out_channels = 3;
      o.padding = 1;
      o.bias = true;
      return conv2d(g, x, "conv", o);
    });
    net.ex->forward(2, true);
    net.ex->backward();
    Net::Grads keep;
    const int w = net.g.find_value("conv.weight");
    Tensor gw = keep.keep(net.ex->grad(w));
    CHECK(net.check(net.ex->value(w), gw).ok());
    // One coordinate 3% off (the largest, so the relative tolerance is what is tested).
    int64_t big = 0;
    for (int64_t i = 0; i < gw.numel(); ++i)
      if (std::fabs(gw.f32()[i]) > std::fabs(gw.f32()[big])) big = i;
    gw.f32()[big] *= 1.03f;
    Comparison c = net.check(net.ex->value(w), gw);
    CHECK(c.failed == 1);
    gw.f32()[big] /= 1.03f;
    // A sign error in a small coordinate.
    int64_t small = 0;
    for (int64_t i = 0; i < gw.numel(); ++i)
      if (std::fabs(gw.f32()[i]) > 5 * kAtol && std::fabs(gw.f32()[i]) < std::fabs(gw.f32()[big]) / 4) small = i;
    gw.f32()[small] = -gw.f32()[small];
    c = net.check(net.ex->value(w), gw);
    CHECK(c.failed == 1);
    // All zero: fails the signal floor even where numeric gradients are small.
    const std::vector<double> zeros(3, 0.0);
    CHECK_FALSE(compare(zeros, zeros, {0, 1, 2}).ok());
  }
}
