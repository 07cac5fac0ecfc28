// The CUDA backend's fused stacks (BN -> ReLU [-> pool], BN -> add [-> ReLU], a projection
// shortcut's BN folded into its add's stack: fusion::plan
// with FusionSpec::whole_tensors, backends/cuda/cuda_batchnorm.cu) against its own layers. Each
// pass runs the layers' kernels' arithmetic in their order, BN's output and its gradient in
// registers instead of memory, so fused and unfused steps agree bit for bit: in the stashes that
// give the stacks the ReLU's mask differently (y kept dense, the bitmap stash, y recomputed or
// computed by its readers), in evaluation, under 4-bit training, and with the step recorded as a
// CUDA graph.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>
#include <optional>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "engine/executor.h"
#include "engine/fused_stack.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/step_replay.h"
#include "engine/train/optimizer.h"
#include "models/models.h"
#include "tests/cuda/device_bytes.h"
#include "tests/cuda/scoped_env.h"

using namespace et;

namespace {

// The backend of every case here, its conv passes on its own kernels. The cases compare executors
// whose convs read a value in other forms (f32, as the stash keeps it, computed from a stack's x)
// with other workspaces. cuDNN's algorithm is measured per geometry for f32 operands and for
// decoded ones apart, and a workspace smaller than the choice's falls back to the own kernels, so
// on a GPU two such executors may run algorithms that round differently. The fused kernels are
// what these cases compare; the conv paths' own cases are in test_cuda_ops.cpp and
// test_cuda_stored_reads.cpp.
std::unique_ptr<Backend> own_convs_backend() {
  const test::ScopedEnv own("EDGETRAIN_CUDA_CONV", "im2col");
  return make_cuda_backend(0);
}

// A model at batch 8 on a shared backend (both runs then take the same measured conv choices),
// fused (the CUDA stacks) or not.
struct FusedRun {
  Graph g;
  std::unique_ptr<Executor> ex;
  Backend* be;
  int64_t batch = 8;
  FusedRun(Backend& backend, const StashOptions& so, const std::string& model, bool fused,
           const QuantOptions& quant = QuantOptions{})
      : be(&backend) {
    ModelSpec spec;
    spec.name = model;
    spec.batch = batch;
    spec.fusion.enabled = fused;
    spec.fusion.whole_tensors = true;
    build_model(g, spec);
    ex = std::make_unique<Executor>(g, *be, so, quant);
    init_parameters(*ex, 5);
  }
  void fill(int k) {
    const HostView x(*be, ex->value(g.image_input).with_batch(batch), HostView::Write),
        y(*be, ex->value(g.label_input).with_batch(batch), HostView::Write);
    for (int64_t i = 0; i < batch * 3 * 32 * 32; ++i) x.f32()[i] = float((i + k) * 7 % 23) / 11.f - 1.f;
    for (int64_t i = 0; i < batch; ++i) y.i32()[i] = int32_t((i + k) * 3 % 10);
  }
  int fused_nodes() const {
    int n = 0;
    for (int i = 0; i < g.num_nodes(); ++i) n += std::string(g.node(i).op->type()) == "fused_stack";
    return n;
  }
  // Stacks ending in a global average pool: their output is [N, C] (MobileNet-V2's last).
  int global_pool_stacks() const {
    int n = 0;
    for (int i = 0; i < g.num_nodes(); ++i)
      n += std::string(g.node(i).op->type()) == "fused_stack" && g.value(g.node(i).output).shape.ndim == 2;
    return n;
  }
  // Stacks ending in a max-pool, whose output planes are smaller than their input's (VGG-16-BN's
  // five; the only ones that run PooledOut / PooledGrad).
  int pooled_stacks() const {
    int n = 0;
    for (int i = 0; i < g.num_nodes(); ++i) {
      const Node& node = g.node(i);
      n += std::string(node.op->type()) == "fused_stack" && g.value(node.output).shape.ndim == 4 &&
           g.value(node.output).shape[2] < g.value(node.inputs[0]).shape[2];
    }
    return n;
  }
};

// Parameters, their gradients and the BN buffers, as bytes.
std::vector<char> state_bytes(FusedRun& r) {
  std::vector<Tensor> kept;
  for (int p : r.g.params()) kept.push_back(r.ex->value(p));
  for (int p : r.ex->params()) kept.push_back(r.ex->grad(p));
  for (int b : r.g.buffers()) kept.push_back(r.ex->value(b));
  return host_bytes(*r.be, kept);
}

// Three SGD steps of both runs on the same batches, the loss and the whole state (parameters,
// gradients, BN buffers) bit for bit after each; with `evaluate`, then an evaluation batch of 5
// images (the running statistics) with the same loss.
void check_steps_alike(FusedRun& a, FusedRun& b, bool evaluate) {
  for (int s = 0; s < 3; ++s) {
    for (FusedRun* r : {&a, &b}) {
      r->fill(s);
      r->ex->forward(r->batch, true);
      r->ex->backward();
    }
    CHECK(b.ex->loss() == a.ex->loss());
    CHECK((state_bytes(b) == state_bytes(a)));  // (( )): no byte-by-byte expansion
    for (FusedRun* r : {&a, &b}) REQUIRE(sgd_update(*r->ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
  }
  if (!evaluate) return;
  a.ex->forward(5, false);
  b.ex->forward(5, false);
  CHECK(b.ex->loss() == a.ex->loss());
}

}  // namespace

TEST_CASE("cuda: fused stacks train bit-identically to the layers", "[cuda][fusion]") {
  // ResNet-20 (BN -> ReLU, BN -> add -> ReLU), MobileNet-V2 (BN -> add, and its last stack BN ->
  // ReLU -> global average pool), VGG-16-BN (BN -> ReLU -> max-pool, its dropout a layer).
  for (const char* model : {"resnet20", "mobilenetv2", "vgg16_bn"}) {
    const std::unique_ptr<Backend> be = own_convs_backend();
    for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32, StashFormat::Auto}) {
      for (int every : {0, 1}) {
        INFO(model << ", stash " << stash_format_name(f) << ", checkpoint_every " << every);
        StashOptions so;
        so.format = f;
        so.checkpoint_every = every;
        FusedRun plain(*be, so, model, false), fused(*be, so, model, true);
        REQUIRE(fused.fused_nodes() > 0);
        if (std::string(model) == "vgg16_bn") REQUIRE(fused.pooled_stacks() == 5);
        check_steps_alike(plain, fused, true);
      }
    }
  }
}

TEST_CASE("cuda: fused stacks with a folded side BN train bit-identically to the layers", "[cuda][fusion]") {
  // ResNet-8 with projection shortcuts at 32x32: the shortcut BNs at 16x16 and 8x8 fold into their
  // blocks' add stacks (FusedStack::side_bn): both statistics forward, both BNs' sums from one dz,
  // dx and x2's gradient in one pass. Dense and bitmap masks, x read as fp16, recomputation (not
  // with fp16: there the fused and unfused graphs round different values, on the CPU as well:
  // ResNet-8's fused and unfused steps differ with dense_fp16 and checkpoint_every 1 on both).
  // MobileNet-V2's three (BN -> add, no ReLU), in the dense stash, beside its last stack (BN -> ReLU
  // -> global average pool on 4x4 planes).
  const std::unique_ptr<Backend> be = own_convs_backend();
  for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32, StashFormat::DenseF16}) {
    for (int every : {0, 1, 2}) {
      if (f == StashFormat::DenseF16 && every == 1) continue;
      if (every == 2 && f != StashFormat::DenseF32) continue;
      const char* model = every == 2 ? "mobilenetv2" : "resnet8";
      INFO(model << ", stash " << stash_format_name(f) << ", checkpoint_every " << (every == 2 ? 0 : every));
      StashOptions so;
      so.format = f;
      so.checkpoint_every = every == 2 ? 0 : every;
      FusedRun plain(*be, so, model, false), fused(*be, so, model, true);
      auto shortcut_bns = [](const Graph& g) {  // BN layers of projection shortcuts
        int n = 0;
        for (int i = 0; i < g.num_nodes(); ++i)
          n += std::string(g.node(i).op->type()) == "batchnorm2d" && g.node(i).name.find("shortcut") != std::string::npos;
        return n;
      };
      REQUIRE(shortcut_bns(plain.g) - shortcut_bns(fused.g) == (every == 2 ? 3 : 2));
      REQUIRE(fused.global_pool_stacks() == (every == 2 ? 1 : 0));
      check_steps_alike(plain, fused, true);
    }
  }
}

TEST_CASE("cuda: fused stacks without a BN (ReLU -> pool) train bit-identically to the layers", "[cuda][fusion]") {
  // VGG-11 without BN: its five ReLU -> 2x2 max-pool stacks keep one pass bit an element of x
  // instead of the ReLU's output. Dense and bitmap stashes (y's bitmap written by the stack),
  // recomputation (the forward, pass bits included, runs again).
  const std::unique_ptr<Backend> be = own_convs_backend();
  for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32}) {
    for (int every : {0, 1}) {
      INFO("stash " << stash_format_name(f) << ", checkpoint_every " << every);
      StashOptions so;
      so.format = f;
      so.checkpoint_every = every;
      FusedRun plain(*be, so, "vgg11", false), fused(*be, so, "vgg11", true);
      REQUIRE(fused.fused_nodes() == 5);
      check_steps_alike(plain, fused, true);
    }
  }
}

TEST_CASE("cuda: a ReLU -> pool stack equals the ReLU and pool layers: max and average, padding, gaps", "[cuda][fusion]") {
  // The kernels on their own, against the CUDA layers (relu_forward, the pool, its backward,
  // relu_backward over the ReLU's output): windows with padding, gaps between windows (stride >
  // window), odd planes, accumulating dx or not.
  const std::unique_ptr<Backend> be = own_convs_backend();
  struct Case {
    FusedKind kind;
    int64_t R, stride, pad, H, W;
  };
  for (const Case& k : {Case{FusedKind::MaxPool, 2, 2, 0, 8, 8}, Case{FusedKind::MaxPool, 2, 3, 1, 11, 7},
                        Case{FusedKind::AvgPool, 2, 2, 0, 9, 8}, Case{FusedKind::AvgPool, 3, 3, 1, 10, 13}}) {
    Conv2dGeom g;
    g.N = 3, g.C = 5, g.H = k.H, g.W = k.W, g.K = 5, g.R = g.S = k.R, g.stride_h = g.stride_w = k.stride;
    g.pad_h = g.pad_w = k.pad;
    g.infer_output();
    const bool max = k.kind == FusedKind::MaxPool;
    INFO((max ? "max" : "average") << " " << k.R << "x" << k.R << " / " << k.stride << ", pad " << k.pad << ", "
                                   << k.H << "x" << k.W);
    FusedStage relu = fused_stage(FusedKind::Relu), pool = fused_stage(k.kind);
    relu.H = relu.P = pool.H = g.H;
    relu.W = relu.Q = pool.W = g.W;
    pool.P = g.P, pool.Q = g.Q;
    pool.pool.R = pool.pool.S = g.R, pool.pool.stride_h = pool.pool.stride_w = g.stride_h;
    pool.pool.pad_h = pool.pool.pad_w = g.pad_h;
    FusedStack s;
    s.C = g.C;
    s.stages = {relu, pool};
    const int64_t nx = g.N * g.C * g.H * g.W, ny = g.N * g.C * g.P * g.Q;
    const int64_t pass_bytes = g.N * g.C * pass_words_per_plane(relu) * 8;
    std::vector<float> hx(static_cast<size_t>(nx)), hdy(static_cast<size_t>(ny)), hdx(static_cast<size_t>(nx));
    for (int64_t i = 0; i < nx; ++i) hx[size_t(i)] = i % 7 == 3 ? 0.f : float((i * 37) % 29) / 7.f - 2.f;  // ties, zeros
    for (int64_t i = 0; i < ny; ++i) hdy[size_t(i)] = float((i * 13) % 17) / 5.f - 1.5f;
    for (int64_t i = 0; i < nx; ++i) hdx[size_t(i)] = float(i % 5) - 2.f;
    float *x, *r, *y, *y2, *dy, *dr, *dx, *dx2;
    void* pass;
    for (float** p : {&x, &r, &dr, &dx, &dx2}) REQUIRE(cudaMalloc(p, size_t(nx) * 4) == cudaSuccess);
    for (float** p : {&y, &y2, &dy}) REQUIRE(cudaMalloc(p, size_t(ny) * 4) == cudaSuccess);
    REQUIRE(cudaMalloc(&pass, size_t(pass_bytes)) == cudaSuccess);
    REQUIRE(cudaMemcpy(x, hx.data(), size_t(nx) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dy, hdy.data(), size_t(ny) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    auto t = [](void* p, const Shape& sh, DType d = DType::F32) { return Tensor::contiguous(p, sh, d, Device::CUDA); };
    const Shape xs{g.N, g.C, g.H, g.W}, ys{g.N, g.C, g.P, g.Q};
    Tensor tx = t(x, xs), tr = t(r, xs), ty = t(y, ys), ty2 = t(y2, ys), tdy = t(dy, ys), tdr = t(dr, xs),
           tdx = t(dx, xs), tdx2 = t(dx2, xs);
    // The layers.
    be->relu_forward(tx, tr);
    if (max) be->maxpool2d_forward(g, tr, ty);
    else be->avgpool2d_forward(g, tr, ty);
    // The stack.
    FusedTensors ft;
    ft.x = tx, ft.y = ty2, ft.pass = t(pass, {g.N, pass_bytes / g.N}, DType::U8);
    be->fused_forward(s, ft, true, nullptr, Workspace{});
    auto values = [](const float* p, int64_t n) {
      std::vector<float> v(static_cast<size_t>(n));
      REQUIRE(cudaMemcpy(v.data(), p, size_t(n) * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      return v;
    };
    CHECK(values(y2, ny) == values(y, ny));
    for (bool acc : {false, true}) {
      REQUIRE(cudaMemcpy(dx, hdx.data(), size_t(nx) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dx2, hdx.data(), size_t(nx) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      if (max) be->maxpool2d_backward(g, tdy, tr, tdr, false, Workspace{});
      else be->avgpool2d_backward(g, tdy, tdr, false);
      MaskView m;
      m.dense = tr;
      m.numel = nx;
      be->relu_backward(tdr, m, tdx, acc);
      FusedGrads fg;
      fg.dy = tdy, fg.dx = tdx2, fg.dx_accumulate = acc;
      FusedTensors bt;
      bt.pass = ft.pass;
      be->fused_backward(s, bt, fg, Workspace{});
      const std::vector<float> a = values(dx2, nx), b = values(dx, nx);
      CHECK(std::memcmp(a.data(), b.data(), size_t(nx) * 4) == 0);
    }
    for (float* p : {x, r, y, y2, dy, dr, dx, dx2}) cudaFree(p);
    cudaFree(pass);
  }
}

TEST_CASE("cuda: a BN -> ReLU -> pool stack equals the BN, ReLU and pool layers: average, global average, max",
          "[cuda][fusion]") {
  // The kernels on their own, against the CUDA layers (batchnorm_forward_train, relu_forward, the
  // pool; its backward, relu_backward over the ReLU's output, batchnorm_backward; the evaluation
  // forward): y, y's bitmap and its count, the batch and running statistics, dx, dgamma and dbeta
  // accumulated or not, bit for bit. Global pools over 4x4 planes (MobileNet-V2's last stack) and
  // odd ones wider than a warp, 350 planes (two block steps of 256 outputs, a last warp in part);
  // average windows with padding and overlap; a max-pool's overlapping windows.
  const std::unique_ptr<Backend> be = own_convs_backend();
  struct Case {
    FusedKind kind;
    int64_t R, stride, pad, H, W;
  };
  for (const Case& k : {Case{FusedKind::GlobalAvgPool, 0, 0, 0, 4, 4}, Case{FusedKind::GlobalAvgPool, 0, 0, 0, 9, 7},
                        Case{FusedKind::AvgPool, 2, 2, 0, 8, 8}, Case{FusedKind::AvgPool, 3, 2, 1, 9, 10},
                        Case{FusedKind::MaxPool, 3, 2, 1, 9, 10}}) {
    const bool global = k.kind == FusedKind::GlobalAvgPool;
    Conv2dGeom g;
    g.N = 5, g.C = 70, g.H = k.H, g.W = k.W, g.K = g.C;
    if (!global) {
      g.R = g.S = k.R, g.stride_h = g.stride_w = k.stride, g.pad_h = g.pad_w = k.pad;
      g.infer_output();
    } else {
      g.P = g.Q = 1;
    }
    INFO((global ? "global average" : k.kind == FusedKind::AvgPool ? "average" : "max")
         << " " << k.R << "x" << k.R << " / " << k.stride << ", pad " << k.pad << ", " << k.H << "x" << k.W);
    FusedStage bn = fused_stage(FusedKind::BatchNorm), relu = fused_stage(FusedKind::Relu), pool = fused_stage(k.kind);
    bn.eps = 1e-5f, bn.momentum = 0.1f;
    bn.H = bn.P = relu.H = relu.P = pool.H = g.H;
    bn.W = bn.Q = relu.W = relu.Q = pool.W = g.W;
    pool.P = g.P, pool.Q = g.Q;
    pool.pool.R = pool.pool.S = g.R, pool.pool.stride_h = pool.pool.stride_w = g.stride_h;
    pool.pool.pad_h = pool.pool.pad_w = g.pad_h;
    FusedStack s;
    s.C = g.C;
    s.stages = {bn, relu, pool};
    const int64_t C = g.C, nx = g.N * C * g.H * g.W, ny = g.N * C * g.P * g.Q;
    const Shape xs{g.N, C, g.H, g.W}, ys = global ? Shape{g.N, C} : Shape{g.N, C, g.P, g.Q}, cs{C};
    std::vector<void*> owned;
    auto tensor = [&](const Shape& sh, const std::vector<float>& v = {}) {
      void* p = nullptr;
      REQUIRE(cudaMalloc(&p, size_t(sh.numel()) * 4) == cudaSuccess);
      owned.push_back(p);
      if (!v.empty()) REQUIRE(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      return Tensor::contiguous(p, sh, DType::F32, Device::CUDA);
    };
    auto filled = [](int64_t n, int a, int m, float d, float o) {
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float((i * a) % m) / d - o;
      return v;
    };
    auto values = [](const Tensor& t) {
      std::vector<float> v(static_cast<size_t>(t.numel()));
      REQUIRE(cudaMemcpy(v.data(), t.data, v.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      return v;
    };
    auto same = [&](const Tensor& a, const Tensor& b) {
      const std::vector<float> va = values(a), vb = values(b);
      return std::memcmp(va.data(), vb.data(), va.size() * 4) == 0;
    };
    const std::vector<float> hx = filled(nx, 37, 29, 7.f, 2.f), hgamma = filled(C, 5, 7, 4.f, 0.5f),
                             hbeta = filled(C, 3, 11, 8.f, 0.6f), hrv = filled(C, 7, 5, 3.f, -0.5f);
    const Tensor x = tensor(xs, hx), gamma = tensor(cs, hgamma), beta = tensor(cs, hbeta), dy = tensor(ys, filled(ny, 13, 17, 5.f, 1.5f));
    Tensor rm1 = tensor(cs, hbeta), rv1 = tensor(cs, hrv), rm2 = tensor(cs, hbeta), rv2 = tensor(cs, hrv);
    Tensor mean1 = tensor(cs), invstd1 = tensor(cs), mean2 = tensor(cs), invstd2 = tensor(cs);
    Tensor z = tensor(xs), r = tensor(xs), y1 = tensor(ys), y2 = tensor(ys), dr = tensor(xs), dz = tensor(xs);
    auto layers_forward = [&](bool training, Tensor& y) {
      if (training) be->batchnorm_forward_train(x, gamma, beta, rm1, rv1, bn.momentum, bn.eps, z, mean1, invstd1);
      else be->batchnorm_forward_eval(x, gamma, beta, rm1, rv1, bn.eps, z);
      be->relu_forward(z, r);
      if (global) be->global_avgpool_forward(r, y);
      else if (k.kind == FusedKind::AvgPool) be->avgpool2d_forward(g, r, y);
      else be->maxpool2d_forward(g, r, y);
    };
    FusedTensors ft;
    ft.x = x, ft.y = y2, ft.gamma = gamma, ft.beta = beta, ft.running_mean = rm2, ft.running_var = rv2;
    ft.mean = mean2, ft.invstd = invstd2;
    // Training: y with its bitmap (whole 64-bit words, the bits past y's end zero) and its count.
    layers_forward(true, y1);
    void* bits = nullptr;
    const int64_t words = (ny + 63) / 64;
    REQUIRE(cudaMalloc(&bits, size_t(words) * 8) == cudaSuccess);
    owned.push_back(bits);
    REQUIRE(cudaMemset(bits, 0xFF, size_t(words) * 8) == cudaSuccess);
    MaskOut mask;
    mask.bits = static_cast<uint64_t*>(bits);
    be->fused_forward(s, ft, true, &mask, Workspace{});
    CHECK(same(y2, y1));
    for (const auto& [a, b] : {std::make_pair(mean2, mean1), std::make_pair(invstd2, invstd1),
                               std::make_pair(rm2, rm1), std::make_pair(rv2, rv1)})
      CHECK(same(a, b));
    const std::vector<float> hy = values(y1);
    std::vector<uint64_t> hbits(static_cast<size_t>(words)), want(static_cast<size_t>(words), 0);
    REQUIRE(cudaMemcpy(hbits.data(), bits, size_t(words) * 8, cudaMemcpyDeviceToHost) == cudaSuccess);
    int64_t positive = 0;
    for (int64_t i = 0; i < ny; ++i)
      if (hy[size_t(i)] > 0.f) want[size_t(i / 64)] |= uint64_t(1) << (i % 64), ++positive;
    CHECK(hbits == want);
    CHECK(mask.kept == positive);
    CHECK(positive > 0);
    CHECK(positive < ny);
    // Backward, into dx, dgamma and dbeta that hold values already (accumulated) or not.
    for (bool acc : {false, true}) {
      Tensor dx1 = tensor(xs, filled(nx, 3, 5, 1.f, 2.f)), dx2 = tensor(xs, filled(nx, 3, 5, 1.f, 2.f));
      Tensor dg1 = tensor(cs, hgamma), db1 = tensor(cs, hbeta), dg2 = tensor(cs, hgamma), db2 = tensor(cs, hbeta);
      if (global) be->global_avgpool_backward(dy, dr, false);
      else if (k.kind == FusedKind::AvgPool) be->avgpool2d_backward(g, dy, dr, false);
      else be->maxpool2d_backward(g, dy, r, dr, false, Workspace{});
      MaskView m;
      m.dense = r;
      m.numel = nx;
      be->relu_backward(dr, m, dz, false);
      be->batchnorm_backward(dz, x, gamma, mean1, invstd1, dx1, acc, dg1, db1, acc);
      FusedGrads fg;
      fg.dy = dy, fg.dx = dx2, fg.dx_accumulate = acc, fg.dgamma = dg2, fg.dbeta = db2, fg.params_accumulate = acc;
      fg.x_exact = fg.x_lossless = true;
      be->fused_backward(s, ft, fg, Workspace{});
      INFO("accumulate " << acc);
      CHECK(same(dx2, dx1));
      CHECK(same(dg2, dg1));
      CHECK(same(db2, db1));
    }
    // Evaluation: the running statistics' coefficients.
    layers_forward(false, y1);
    be->fused_forward(s, ft, false, nullptr, Workspace{});
    CHECK(same(y2, y1));
    for (void* p : owned) cudaFree(p);
  }
}

TEST_CASE("cuda: fused stacks recompute their outputs for their readers' backward, bit for bit",
          "[cuda][fusion]") {
  // memory.recompute_stack_outputs: a BN -> ReLU stack's y is not kept. The conv weight gradients
  // reading it compute it from the x the stack keeps as they read it (DType::AffineRelu,
  // cuda_stored_x.h's AffineReluX), and the stack's backward finds its ReLU's mask from x the same
  // way: no buffer of y's size. With ET_AFFINE_RELU_READS=0 the readers get it recomputed into a
  // buffer instead (CudaBackend::fused_recompute_output). Where x is kept exact (dense_fp32,
  // bitmap_fp32) both equal the steps that keep y, bit for bit.
  const std::unique_ptr<Backend> be = own_convs_backend();
  for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32}) {
    INFO("stash " << stash_format_name(f));
    StashOptions kept, recomputed;
    kept.format = recomputed.format = f;
    recomputed.recompute_stack_outputs = true;
    FusedRun a(*be, kept, "resnet8", true), b(*be, recomputed, "resnet8", true);
    std::optional<test::ScopedEnv> buffer_reads;
    buffer_reads.emplace("ET_AFFINE_RELU_READS", "0");
    FusedRun c(*be, recomputed, "resnet8", true);
    buffer_reads.reset();
    int by_readers = 0;
    for (const SavedValue& sv : b.ex->stash().saved()) {
      by_readers += sv.affine_relu;
      CHECK(sv.affine_relu == sv.recomputed);  // every reader a conv's weight gradient
      if (sv.affine_relu) CHECK_FALSE(sv.unpack.defined());
    }
    CHECK(by_readers > 0);
    for (const SavedValue& sv : c.ex->stash().saved()) CHECK_FALSE(sv.affine_relu);
    CHECK(b.ex->memory().unpack == a.ex->memory().unpack);
    CHECK(c.ex->memory().unpack > a.ex->memory().unpack);  // y's buffer for its readers' backward
    CHECK(b.ex->memory().activations_planned <= c.ex->memory().activations_planned);
    check_steps_alike(a, b, false);
    FusedRun a2(*be, kept, "resnet8", true);  // (a has trained on)
    check_steps_alike(a2, c, false);
  }
}

TEST_CASE("cuda: fused stacks under 4-bit training (LUQ) train bit-identically to the layers", "[cuda][fusion][quant]") {
  // INT4 forward, LUQ FP4 backward: the convs after a stack quantize its output and keep its
  // codes; bitmap_int4 keeps those codes in the stash and recomputes the BN inputs from them.
  // FP32 forward, LUQ backward: the weight gradients read the stacks' outputs in f32, or compute
  // them from the stacks' x where they are not kept (recompute_stack_outputs).
  const std::unique_ptr<Backend> be = own_convs_backend();
  for (auto [fwd, f] : {std::make_pair(ForwardQuant::Int4, StashFormat::DenseF32),
                        std::make_pair(ForwardQuant::Int4, StashFormat::BitmapI4),
                        std::make_pair(ForwardQuant::Fp32, StashFormat::BitmapF32)}) {
    QuantOptions q;
    q.forward = fwd;
    q.backward = BackwardQuant::LuqFp4;
    for (bool recompute : {false, true}) {
      INFO("forward " << forward_quant_name(fwd) << ", stash " << stash_format_name(f) << ", recompute_stack_outputs "
                      << recompute);
      StashOptions so;
      so.format = f;
      so.recompute_stack_outputs = recompute;
      FusedRun layers(*be, so, "resnet8", false, q), fused(*be, so, "resnet8", true, q);
      REQUIRE(fused.fused_nodes() > 0);
      int by_readers = 0;
      for (const SavedValue& sv : fused.ex->stash().saved()) by_readers += sv.affine_relu;
      CHECK((by_readers > 0) == (recompute && fwd == ForwardQuant::Fp32));
      check_steps_alike(layers, fused, true);
    }
  }
}

TEST_CASE("cuda: a recorded step with fused stacks equals the fused step run op by op", "[cuda][fusion][replay]") {
  // Dense: the ReLU's mask is y itself, nothing counted on the host; then with the stacks'
  // outputs recomputed for their readers' backward (memory.recompute_stack_outputs), recorded too.
  const std::unique_ptr<Backend> be = own_convs_backend();
  for (bool recompute : {false, true}) {
    INFO("recompute_stack_outputs " << recompute);
    StashOptions so;
    so.recompute_stack_outputs = recompute;
    FusedRun direct(*be, so, "resnet20", true), rec(*be, so, "resnet20", true);
    REQUIRE(StepReplay::unsupported(*rec.ex) == "");
    StepReplay replay(*rec.ex, true, 1);
    for (int s = 0; s < 4; ++s) {
      direct.fill(s);
      rec.fill(s);
      direct.ex->forward(direct.batch, true);
      direct.ex->backward();
      if (!replay.try_step(rec.batch)) {
        rec.ex->forward(rec.batch, true);
        rec.ex->backward();
      }
      CHECK(replay.why_not() == "");
      CHECK(rec.ex->loss() == direct.ex->loss());
      REQUIRE(sgd_update(*direct.ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
      REQUIRE(sgd_update(*rec.ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
    }
    CHECK(replay.replaying());
    CHECK((state_bytes(rec) == state_bytes(direct)));
  }
}

TEST_CASE("cuda: fused stacks equal the layers with pruned bitmaps and a batch below the planned one",
          "[cuda][fusion]") {
  // Paths the shipped-model test does not reach: a prune threshold (the stack's bitmap keeps
  // |y| >= t; the mask the ReLU's backward reads stays exact; not with pooled stacks, whose window
  // maximum comes from x where the layers' comes from the pruned values: tests/
  // test_fusion_whole_tensors.cpp) and a training step at 5 of the 8 planned images (every index
  // from the tensors' own batch).
  const std::unique_ptr<Backend> be = own_convs_backend();
  for (const char* model : {"resnet20", "vgg16_bn"}) {
    INFO(model);
    StashOptions so;
    so.format = StashFormat::BitmapF32;
    so.prune_threshold = std::string(model) == "resnet20" ? 0.05f : 0.f;
    FusedRun plain(*be, so, model, false), fused(*be, so, model, true);
    REQUIRE(fused.fused_nodes() > 0);
    for (int s = 0; s < 3; ++s) {
      for (FusedRun* r : {&plain, &fused}) {
        r->batch = s == 2 ? 5 : 8;
        r->fill(s);
        r->ex->forward(r->batch, true);
        r->ex->backward();
      }
      INFO("step " << s << ", batch " << fused.batch);
      CHECK(fused.ex->loss() == plain.ex->loss());
      CHECK((state_bytes(fused) == state_bytes(plain)));
      for (FusedRun* r : {&plain, &fused}) REQUIRE(sgd_update(*r->ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
    }
  }
}
