// The CUDA backward passes that read a saved input as the stash keeps it (cuda_stored_x.h: fp16,
// bf16, a bitmap with f32 / fp16 values) instead of from an f32 decode buffer: the conv weight
// gradient (dense and grouped), the max-pool backward, BN's backward and the fused stacks'. Each
// must give the bits of the same pass over x decoded to f32, and the CPU's stored read (exact or
// within the tolerance stated). The conv weight gradient also computes a fused stack's output
// that nothing keeps from the stack's x as stored (DType::AffineRelu), and the stack's backward its
// ReLU's mask. Then the plans: the executor plans on CUDA the decode buffers it plans on the CPU
// (none where a pass reads the encoding or computes the value), so the stash saves the same memory.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "engine/affine_relu.h"
#include "engine/executor.h"
#include "engine/fused_stack.h"
#include "memory/bitmap.h"
#include "memory/half.h"
#include "models/models.h"
#include "tests/cuda/op_tensors.h"
#include "tests/cuda/scoped_env.h"

using namespace et;
using namespace et::cuda_test;

namespace {

// The host values of x encoded as the stash would keep them in `dtype` (on the host and a copy on
// the device), and the f32 values that encoding stands for.
struct Stored {
  std::vector<uint64_t> enc;
  std::vector<float> decoded;
  void* dptr = nullptr;
  Tensor cpu, dev;
  Stored(const std::vector<float>& x, const Shape& shape, DType dtype)
      : enc(x.size() + 16, 0), decoded(x.size()) {
    const int64_t n = int64_t(x.size());
    if (dtype == DType::F16 || dtype == DType::BF16) {
      uint16_t* h = reinterpret_cast<uint16_t*>(enc.data());
      if (dtype == DType::F16) {
        f32_to_f16(x.data(), n, h);
        f16_to_f32(h, n, decoded.data());
      } else {
        f32_to_bf16(x.data(), n, h);
        bf16_to_f32(h, n, decoded.data());
      }
    } else {
      const bitmap::ValueType vt = dtype == DType::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
      uint64_t* bits = enc.data();
      bitmap::pack(x.data(), n, 0.f, bits, bits + bitmap::num_words(n), vt);
      bitmap::unpack(bits, bits + bitmap::num_words(n), n, vt, decoded.data());
    }
    REQUIRE(cudaMalloc(&dptr, enc.size() * 8) == cudaSuccess);
    REQUIRE(cudaMemcpy(dptr, enc.data(), enc.size() * 8, cudaMemcpyHostToDevice) == cudaSuccess);
    dev = Tensor::contiguous(dptr, shape, dtype, Device::CUDA);
    cpu = Tensor::contiguous(enc.data(), shape, dtype);
  }
  ~Stored() { cudaFree(dptr); }
  Stored(const Stored&) = delete;
  // x on the device holds the decoded values (the f32 pass's input).
  void decode_into(const Both& x) const {
    REQUIRE(cudaMemcpy(x.dptr, decoded.data(), decoded.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  }
};

void upload(const Both& t) {
  REQUIRE(cudaMemcpy(t.dptr, t.host.data(), t.host.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
}

// A conv case: x [N, C, H, W], K filters of R x R, stride, padding, groups.
struct ConvCase {
  int64_t N, C, H, W, K, R, stride, pad, groups;
  Conv2dGeom geom() const {
    Conv2dGeom g;
    g.N = N, g.C = C, g.H = H, g.W = W, g.K = K, g.R = g.S = R, g.stride_h = g.stride_w = stride;
    g.pad_h = g.pad_w = pad;
    g.groups = groups;
    g.infer_output();
    return g;
  }
};

// A CUDA backend whose f32 weight gradient takes its own im2col path (not cuDNN): the pass a
// stored read is compared with, on the same kernels.
std::unique_ptr<Backend> im2col_backend() {
  const test::ScopedEnv own("EDGETRAIN_CUDA_CONV", "im2col");
  return make_cuda_backend(0);
}
// One whose passes take cuDNN wherever a candidate fits (a stored x: decoded into the workspace's
// front, where it fits; without cuDNN in the build, the own kernels).
std::unique_ptr<Backend> cudnn_backend() {
  const test::ScopedEnv forced("EDGETRAIN_CUDA_CONV", "cudnn");
  return make_cuda_backend(0);
}

const DType kStoredTypes[] = {DType::F16, DType::BF16, DType::BitmapF32, DType::BitmapF16};

}  // namespace

// The conv weight gradient (CudaBackend::conv2d_weight_reads), each element as im2col or the
// grouped kernel gathers it (a bitmap's value index from the codec's chunk offsets and the bits
// before it); against the CPU's stored read within 1e-4 (scaled with the products each element
// sums). Geometries: several 256-element chunks per image and not (7 x 9 planes), images split
// over chunks of the workspace (N = 40 at 32 x 32 x 16 with a 3x3 window), a 1x1 at stride 2, and
// depthwise (groups = C) at strides 1 and 2.
// cuDNN (where the build has it) over x decoded into the workspace's front: within 1e-4 of the CPU
// too; each case's workspace leaves room for that copy, but for the 1x1 at stride 2, whose pass
// gets its own workspace alone (less than x: the own kernels read x in place).
TEST_CASE("cuda: the conv weight gradient reads x as the stash keeps it", "[cuda][stash]") {
  Backends b;
  for (const bool on_cudnn : {false, true}) {
    INFO((on_cudnn ? "cuDNN where it fits" : "the own kernels"));
    // The pass over f32 x on the same path (the own kernels: the same bits).
    const std::unique_ptr<Backend> dev = on_cudnn ? cudnn_backend() : im2col_backend();
    for (const ConvCase& k : {ConvCase{3, 16, 8, 8, 8, 3, 1, 1, 1}, ConvCase{2, 5, 7, 9, 6, 3, 2, 1, 1},
                              ConvCase{40, 16, 32, 32, 16, 3, 1, 1, 1}, ConvCase{3, 24, 9, 7, 40, 1, 2, 0, 1},
                              ConvCase{3, 12, 9, 7, 12, 3, 1, 1, 12}, ConvCase{2, 8, 8, 8, 8, 3, 2, 1, 8}}) {
      const Conv2dGeom g = k.geom();
      const Shape xs{g.N, g.C, g.H, g.W};
      Both x(xs, 71, 0.45f), dy({g.N, g.K, g.P, g.Q}, 72), dw({g.K, g.C / g.groups, g.R, g.S}, 73), db({g.K}, 74);
      const size_t x_room = on_cudnn && g.R > 1 ? size_t(xs.numel()) * 4 + (2 << 20) : 0;
      Scratch ws(b.cpu->conv2d_workspace_bytes(g, ConvPass::BackwardWeight),
                 dev->conv2d_workspace_bytes(g, ConvPass::BackwardWeight) + x_room);
      for (DType t : kStoredTypes) {
        INFO("conv " << g.N << "x" << g.C << "x" << g.H << "x" << g.W << " -> " << g.K << ", " << g.R << "x" << g.S
                     << " stride " << k.stride << ", groups " << g.groups << ", x as " << dtype_name(t));
        REQUIRE(dtype_in(t, dev->conv2d_weight_reads(g)));
        const Stored st(x.host, xs, t);
        st.decode_into(x);
        for (bool acc : {false, true}) {
          dev->conv2d_backward_weight(g, x.dev, dy.dev, dw.dev, db.dev, acc, ws.dev);  // over the decoded f32
          const std::vector<float> want = dw.device_values(), want_db = db.device_values();
          upload(dw);  // the same start (dw, db as the test made them)
          upload(db);
          dev->conv2d_backward_weight(g, st.dev, dy.dev, dw.dev, db.dev, acc, ws.dev);
          // cuDNN's choices for f32 and for decoded x are measured apart, with other workspaces.
          if (!on_cudnn) CHECK(same_bits(dw.device_values(), want));
          CHECK(same_bits(db.device_values(), want_db));
          std::vector<float> host_dw = dw.host, host_db = db.host;
          Tensor cdw = Tensor::contiguous(host_dw.data(), dw.cpu.shape), cdb = Tensor::contiguous(host_db.data(), db.cpu.shape);
          b.cpu->conv2d_backward_weight(g, st.cpu, dy.cpu, cdw, cdb, acc, ws.cpu);
          // Each dw element sums N * P * Q products, in another order on each backend: 1e-4, and
          // proportionally more past 8192 products (the 40-image case: 40 960, 2.6e-4 seen).
          CHECK(max_rel(dw.device_values(), host_dw) < 1e-4 * std::max(1.0, double(g.N * g.P * g.Q) / 8192));
          upload(dw);
          upload(db);
        }
      }
    }
  }
}

// y = relu(x * scale[c] + shift[c]) as a fused BN -> ReLU stack's forward computes it (one FMA,
// then relu_forward's rule), from the f32 values x's encoding stands for.
std::vector<float> affine_relu_reference(const std::vector<float>& x, const std::vector<float>& scale,
                                         const std::vector<float>& shift, int64_t C, int64_t HW) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t c = size_t(int64_t(i) / HW % C);
    const float v = std::fma(x[i], scale[c], shift[c]);
    y[i] = v > 0.f ? v : 0.f;
  }
  return y;
}

// A fused stack's output that nothing keeps (DType::AffineRelu, memory.recompute_stack_outputs):
// the weight gradient computes y from the stack's x as stored (cuda_stored_x.h's AffineReluX) as
// it gathers it. The bits of the same pass over y computed on the host and given in f32, for x
// in every stash encoding; dense (several chunks of the workspace) and depthwise. With cuDNN (where
// the build has it), over y computed into the workspace's front: within 1e-4 of that pass.
TEST_CASE("cuda: the conv weight gradient computes a stack's output from its x as stored", "[cuda][stash][fusion]") {
  for (const bool on_cudnn : {false, true}) {
    INFO((on_cudnn ? "cuDNN over y decoded into the workspace" : "the own kernels"));
    // The pass over f32 y on the same path (the own kernels: the same bits).
    const std::unique_ptr<Backend> dev = on_cudnn ? cudnn_backend() : im2col_backend();
    for (const ConvCase& k : {ConvCase{3, 16, 8, 8, 8, 3, 1, 1, 1}, ConvCase{40, 16, 32, 32, 16, 3, 1, 1, 1},
                              ConvCase{3, 12, 9, 7, 12, 3, 2, 1, 12}, ConvCase{2, 6, 5, 5, 6, 5, 1, 2, 6}}) {
      const Conv2dGeom g = k.geom();
      REQUIRE(dtype_in(DType::AffineRelu, dev->conv2d_weight_reads(g)));
      const Shape xs{g.N, g.C, g.H, g.W};
      Both x(xs, 81, 0.3f), y(xs, 82), dy({g.N, g.K, g.P, g.Q}, 83), dw({g.K, g.C / g.groups, g.R, g.S}, 84),
          coef({2 * g.C}, 85);
      const std::vector<float> scale(coef.host.begin(), coef.host.begin() + g.C), shift(coef.host.begin() + g.C, coef.host.end());
      const size_t y_room = on_cudnn ? size_t(xs.numel()) * 4 + (2 << 20) : 0;
      Scratch ws(0, dev->conv2d_workspace_bytes(g, ConvPass::BackwardWeight) + y_room);
      Tensor none;
      for (DType t : {DType::F32, DType::F16, DType::BF16, DType::BitmapF32, DType::BitmapF16}) {
        INFO("conv " << g.N << "x" << g.C << "x" << g.H << "x" << g.W << " -> " << g.K << ", " << g.R << "x" << g.S
                     << " stride " << k.stride << ", groups " << g.groups << ", the stack's x as " << dtype_name(t));
        std::unique_ptr<Stored> st;
        if (t != DType::F32) st = std::make_unique<Stored>(x.host, xs, t);
        y.host = affine_relu_reference(st ? st->decoded : x.host, scale, shift, g.C, g.H * g.W);
        upload(y);
        AffineReluSource src;
        src.x = st ? st->dev : x.dev;
        src.scale = coef.dev.f32();
        src.shift = coef.dev.f32() + g.C;
        for (bool acc : {false, true}) {
          dev->conv2d_backward_weight(g, y.dev, dy.dev, dw.dev, none, acc, ws.dev);
          const std::vector<float> want = dw.device_values();
          upload(dw);
          dev->conv2d_backward_weight(g, affine_relu_tensor(src), dy.dev, dw.dev, none, acc, ws.dev);
          if (on_cudnn)  // cuDNN's choices for f32 and decoded operands are measured apart
            CHECK(max_rel(dw.device_values(), want) < 1e-4 * std::max(1.0, double(g.N * g.P * g.Q) / 8192));
          else
            CHECK(same_bits(dw.device_values(), want));
          upload(dw);
        }
      }
    }
  }
}

// The max-pool backward (maxpool2d_backward_reads: every stash encoding), each window's first
// maximum found again from the stored values: the bits of the pass over the decoded x, and the
// CPU's stored read (exact but for the order of overlapping windows' sums: 1e-6).
TEST_CASE("cuda: the max-pool backward reads x as the stash keeps it", "[cuda][stash]") {
  Backends b;
  CHECK(b.dev->maxpool2d_backward_reads() == b.cpu->maxpool2d_backward_reads());
  struct Case {
    int64_t R, stride, pad;
  };
  for (const Case& k : {Case{2, 2, 0}, Case{3, 2, 1}, Case{3, 1, 1}}) {
    Conv2dGeom g;
    g.N = 3, g.C = 5, g.H = 18, g.W = 15, g.K = 5, g.R = g.S = k.R, g.stride_h = g.stride_w = k.stride;
    g.pad_h = g.pad_w = k.pad;
    g.infer_output();
    const Shape xs{g.N, g.C, g.H, g.W};
    Both x(xs, 81, 0.5f), dy({g.N, g.C, g.P, g.Q}, 82), dx(xs, 83);
    Scratch ws(b.cpu->maxpool2d_workspace_bytes(g), b.dev->maxpool2d_workspace_bytes(g));
    for (DType t : kStoredTypes) {
      INFO(k.R << "x" << k.R << " windows, stride " << k.stride << ", pad " << k.pad << ", x as " << dtype_name(t));
      REQUIRE(dtype_in(t, b.dev->maxpool2d_backward_reads()));
      const Stored st(x.host, xs, t);
      st.decode_into(x);
      for (bool acc : {false, true}) {
        b.dev->maxpool2d_backward(g, dy.dev, x.dev, dx.dev, acc, ws.dev);
        const std::vector<float> want = dx.device_values();
        upload(dx);
        b.dev->maxpool2d_backward(g, dy.dev, st.dev, dx.dev, acc, ws.dev);
        CHECK(same_bits(dx.device_values(), want));
        std::vector<float> host_dx = dx.host;
        Tensor cdx = Tensor::contiguous(host_dx.data(), xs);
        b.cpu->maxpool2d_backward(g, dy.cpu, st.cpu, cdx, acc, ws.cpu);
        CHECK(max_rel(dx.device_values(), host_dx) < 1e-6);
        upload(dx);
      }
    }
  }
}

// BN's backward (batchnorm_backward_reads: f32, fp16, bf16, as the CPU's): both sweeps read the
// stored x; the bits of the pass over the decoded x, and the CPU's stored read within 1e-5.
TEST_CASE("cuda: batch norm's backward reads x as the stash keeps it", "[cuda][stash]") {
  Backends b;
  CHECK(b.dev->batchnorm_backward_reads() == b.cpu->batchnorm_backward_reads());
  const Shape s{6, 4, 9, 5}, c{4};
  Both x(s, 91), dy(s, 92), dx(s, 93), gamma(c, 94), mean(c, 95), invstd(c, 96), dg(c, 97), dbeta(c, 98);
  for (float& v : invstd.host) v = std::fabs(v) + 0.5f;
  upload(invstd);
  for (DType t : {DType::F16, DType::BF16}) {
    INFO("x as " << dtype_name(t));
    REQUIRE(dtype_in(t, b.dev->batchnorm_backward_reads()));
    const Stored st(x.host, s, t);
    st.decode_into(x);
    for (bool acc : {false, true}) {
      b.dev->batchnorm_backward(dy.dev, x.dev, gamma.dev, mean.dev, invstd.dev, dx.dev, acc, dg.dev, dbeta.dev, acc);
      const std::vector<float> want_dx = dx.device_values(), want_dg = dg.device_values(), want_db = dbeta.device_values();
      for (Both* t2 : {&dx, &dg, &dbeta}) upload(*t2);
      b.dev->batchnorm_backward(dy.dev, st.dev, gamma.dev, mean.dev, invstd.dev, dx.dev, acc, dg.dev, dbeta.dev, acc);
      CHECK(same_bits(dx.device_values(), want_dx));
      CHECK(same_bits(dg.device_values(), want_dg));
      CHECK(same_bits(dbeta.device_values(), want_db));
      std::vector<float> hdx = dx.host, hdg = dg.host, hdb = dbeta.host;
      Tensor cdx = Tensor::contiguous(hdx.data(), s), cdg = Tensor::contiguous(hdg.data(), c),
             cdb = Tensor::contiguous(hdb.data(), c);
      b.cpu->batchnorm_backward(dy.cpu, st.cpu, gamma.cpu, mean.cpu, invstd.cpu, cdx, acc, cdg, cdb, acc);
      CHECK(max_rel(dx.device_values(), hdx) < 1e-5);
      CHECK(max_rel(dg.device_values(), hdg) < 1e-5);
      CHECK(max_rel(dbeta.device_values(), hdb) < 1e-5);
      for (Both* t2 : {&dx, &dg, &dbeta}) upload(*t2);
    }
  }
}

// The fused stacks' backward (fused_backward_reads): BN -> ReLU -> max-pool finds each window's
// maximum again from the stored x, BN -> add -> ReLU reads it in both sweeps. The forward runs on
// f32 x (the training forward's input); the backward on the decoded x and on the stored one: the
// same bits in dx, dgamma, dbeta and the side gradient.
TEST_CASE("cuda: the fused stacks' backward reads x as the stash keeps it", "[cuda][stash][fusion]") {
  const std::unique_ptr<Backend> dev = make_cuda_backend(0);
  const int64_t N = 4, C = 6, H = 10, W = 9;
  const Shape xs{N, C, H, W}, c{C};
  auto stage = [&](FusedKind kind, int64_t P, int64_t Q) {
    FusedStage st = fused_stage(kind);
    st.H = H, st.W = W, st.P = P, st.Q = Q;
    st.eps = 1e-5f, st.momentum = 0.1f;
    return st;
  };
  for (bool pooled : {true, false}) {
    FusedStack s;
    s.C = C;
    if (pooled) {  // BN -> ReLU -> 3x3 / 2 max-pool, padding 1
      FusedStage pool = stage(FusedKind::MaxPool, 5, 5);
      pool.pool.R = pool.pool.S = 3, pool.pool.stride_h = pool.pool.stride_w = 2, pool.pool.pad_h = pool.pool.pad_w = 1;
      s.stages = {stage(FusedKind::BatchNorm, H, W), stage(FusedKind::Relu, H, W), pool};
    } else {  // BN -> add -> ReLU, y's mask saved
      s.stages = {stage(FusedKind::BatchNorm, H, W), stage(FusedKind::Add, H, W), stage(FusedKind::Relu, H, W)};
      s.saves_output_mask = true;
    }
    const Shape ys{N, C, s.last().P, s.last().Q};
    Both x(xs, 101), side(xs, 102), y(ys, 103), gamma(c, 104), beta(c, 105), rm(c, 106), rv(c, 107), mean(c, 108),
        invstd(c, 109), dy(ys, 110), dx(xs, 111), dside(xs, 112), dg(c, 113), db(c, 114);
    for (float& v : rv.host) v = std::fabs(v) + 0.5f;
    upload(rv);
    const int64_t words = bitmap::num_words(ys.numel());
    void* bits = nullptr;
    REQUIRE(cudaMalloc(&bits, size_t(words) * 8) == cudaSuccess);
    FusedTensors ft;
    ft.x = x.dev, ft.side = side.dev, ft.y = y.dev, ft.gamma = gamma.dev, ft.beta = beta.dev;
    ft.running_mean = rm.dev, ft.running_var = rv.dev, ft.mean = mean.dev, ft.invstd = invstd.dev;
    MaskOut mask{static_cast<uint64_t*>(bits), 0.f};
    dev->fused_forward(s, ft, true, pooled ? nullptr : &mask, Workspace{});
    for (DType t : {DType::F16, DType::BF16}) {
      INFO((pooled ? "BN -> ReLU -> max-pool" : "BN -> add -> ReLU") << ", x as " << dtype_name(t));
      REQUIRE(dtype_in(t, dev->fused_backward_reads()));
      const Stored st(x.host, xs, t);
      st.decode_into(x);
      FusedGrads g;
      g.dy = dy.dev, g.dx = dx.dev, g.dgamma = dg.dev, g.dbeta = db.dev;
      if (!pooled) {
        g.dside = dside.dev;
        g.y_mask.bits = static_cast<const uint64_t*>(bits);
        g.y_mask.numel = ys.numel();
      }
      std::vector<std::vector<float>> want;
      for (int run = 0; run < 2; ++run) {
        for (Both* t2 : {&dx, &dside, &dg, &db}) upload(*t2);
        ft.x = run == 0 ? x.dev : st.dev;
        dev->fused_backward(s, ft, g, Workspace{});
        std::vector<std::vector<float>> got;
        for (Both* t2 : {&dx, &dside, &dg, &db}) got.push_back(t2->device_values());
        if (run == 0) want = got;
        for (size_t i = 0; i < got.size() && run == 1; ++i) CHECK(same_bits(got[i], want[i]));
      }
    }
    cudaFree(bits);
  }
}

// A BN -> ReLU stack whose output its readers compute keeps nothing of y, not even the ReLU's
// mask: its backward finds the mask from x as stored, as the readers find y (y > 0 of relu(x *
// scale + shift), the forward's coefficients). The bits of the backward given y computed so on the
// host, and where x is exact, of the backward given the forward's own bitmap.
TEST_CASE("cuda: a BN -> ReLU stack's backward finds its ReLU's mask from x when nothing of y is kept",
          "[cuda][stash][fusion]") {
  const std::unique_ptr<Backend> dev = make_cuda_backend(0);
  const int64_t N = 4, C = 6, H = 10, W = 9;
  const Shape xs{N, C, H, W}, c{C};
  FusedStack s;
  s.C = C;
  for (FusedKind kind : {FusedKind::BatchNorm, FusedKind::Relu}) {
    FusedStage st = fused_stage(kind);
    st.H = st.P = H, st.W = st.Q = W;
    st.eps = 1e-5f, st.momentum = 0.1f;
    s.stages.push_back(st);
  }
  s.saves_output_mask = true;
  REQUIRE(dev->fused_output_is_affine_relu(s));
  Both x(xs, 121), y(xs, 122), yref(xs, 123), gamma(c, 124), beta(c, 125), rm(c, 126), rv(c, 127), mean(c, 128),
      invstd(c, 129), dy(xs, 130), dx(xs, 131), dg(c, 132), db(c, 133);
  for (float& v : rv.host) v = std::fabs(v) + 0.5f;
  upload(rv);
  void* bits = nullptr;
  REQUIRE(cudaMalloc(&bits, size_t(bitmap::num_words(xs.numel())) * 8) == cudaSuccess);
  FusedTensors ft;
  ft.x = x.dev, ft.y = y.dev, ft.gamma = gamma.dev, ft.beta = beta.dev;
  ft.running_mean = rm.dev, ft.running_var = rv.dev, ft.mean = mean.dev, ft.invstd = invstd.dev;
  MaskOut mask{static_cast<uint64_t*>(bits), 0.f};
  dev->fused_forward(s, ft, true, &mask, Workspace{});
  // The forward's coefficients, as train_coefficients computes them.
  const std::vector<float> m = mean.device_values(), is = invstd.device_values();
  std::vector<float> scale(static_cast<size_t>(C)), shift(static_cast<size_t>(C));
  for (size_t k = 0; k < size_t(C); ++k) {
    scale[k] = gamma.host[k] * is[k];
    shift[k] = std::fma(-m[k], scale[k], beta.host[k]);
  }
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    INFO("x as " << dtype_name(t));
    std::unique_ptr<Stored> st;
    if (t != DType::F32) st = std::make_unique<Stored>(x.host, xs, t);
    ft.x = st ? st->dev : x.dev;
    yref.host = affine_relu_reference(st ? st->decoded : x.host, scale, shift, C, H * W);
    upload(yref);
    std::vector<std::vector<float>> want;
    for (int run = 0; run < 3; ++run) {  // y given, nothing given, the forward's bitmap (x exact)
      if (run == 2 && st) break;
      FusedGrads g;
      g.dy = dy.dev, g.dx = dx.dev, g.dgamma = dg.dev, g.dbeta = db.dev;
      if (run == 0) g.y_mask.dense = yref.dev;
      if (run == 2) g.y_mask.bits = static_cast<const uint64_t*>(bits);
      g.y_mask.numel = xs.numel();
      for (Both* t2 : {&dx, &dg, &db}) upload(*t2);
      dev->fused_backward(s, ft, g, Workspace{});
      std::vector<std::vector<float>> got;
      for (Both* t2 : {&dx, &dg, &db}) got.push_back(t2->device_values());
      if (run == 0) want = got;
      for (size_t i = 0; i < got.size() && run > 0; ++i) CHECK(same_bits(got[i], want[i]));
    }
  }
  cudaFree(bits);
}

// The plans: on CUDA the executor plans the decode buffers it plans on the CPU (the passes read
// the same encodings in place), for every stash format, on models with each kind of reader (dense
// and depthwise convs, BN, max-pools, linear layers).
TEST_CASE("cuda: the backward passes need the decode buffers the CPU's need, no more", "[cuda][stash]") {
  const std::unique_ptr<Backend> cpu = make_cpu_backend(), dev = make_cuda_backend(0);
  for (const char* model : {"resnet20", "vgg11_bn", "mobilenetv2"}) {
    for (StashFormat f : {StashFormat::DenseF16, StashFormat::DenseBF16, StashFormat::BitmapF32,
                          StashFormat::BitmapF16, StashFormat::Auto}) {
      StashOptions so;
      so.format = f;
      size_t unpack[2];
      for (int on_dev = 0; on_dev < 2; ++on_dev) {
        Graph g;
        ModelSpec spec;
        spec.name = model;
        spec.batch = 4;
        build_model(g, spec);
        const Executor ex(g, on_dev ? *dev : *cpu, so);
        unpack[on_dev] = ex.memory().unpack;
      }
      INFO(model << ", stash " << stash_format_name(f) << ": decode buffers CPU " << unpack[0] << " bytes, CUDA "
                 << unpack[1]);
      CHECK(unpack[1] == unpack[0]);
    }
  }
}

// The same with the fused stacks a GPU runs (FusionSpec::whole_tensors) and their outputs computed
// by their readers (memory.recompute_stack_outputs): the values the readers compute, and the decode
// buffers, are the CPU's.
TEST_CASE("cuda: fused stacks' outputs are computed by their readers where the CPU's are", "[cuda][stash][fusion]") {
  const std::unique_ptr<Backend> cpu = make_cpu_backend(), dev = make_cuda_backend(0);
  for (const char* model : {"resnet20", "vgg11_bn", "mobilenetv2"}) {
    for (StashFormat f : {StashFormat::DenseF32, StashFormat::DenseF16, StashFormat::BitmapF32,
                          StashFormat::BitmapF16, StashFormat::Auto}) {
      StashOptions so;
      so.format = f;
      so.recompute_stack_outputs = true;
      size_t unpack[2];
      std::vector<int> by_readers[2];
      for (int on_dev = 0; on_dev < 2; ++on_dev) {
        Graph g;
        ModelSpec spec;
        spec.name = model;
        spec.batch = 4;
        spec.fusion.enabled = true;
        spec.fusion.whole_tensors = true;
        build_model(g, spec);
        const Executor ex(g, on_dev ? *dev : *cpu, so);
        unpack[on_dev] = ex.memory().unpack;
        for (const SavedValue& sv : ex.stash().saved())
          if (sv.affine_relu) by_readers[on_dev].push_back(sv.value);
      }
      INFO(model << ", stash " << stash_format_name(f) << ": decode buffers CPU " << unpack[0] << " bytes, CUDA "
                 << unpack[1] << "; computed by readers CPU " << by_readers[0].size() << ", CUDA "
                 << by_readers[1].size());
      CHECK(unpack[1] == unpack[0]);
      CHECK(by_readers[1] == by_readers[0]);
      CHECK(!by_readers[1].empty());
    }
  }
}
