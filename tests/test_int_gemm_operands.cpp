// The CUDA backend's integer products read their operands in place through
// backends/cuda/int_gemm_operands.h (host and device code). Without a GPU, this checks the index
// mapping of every pass: C = A x B summed naively over those views, written where the views say,
// equals the CPU backend's integer conv / linear kernels bit for bit (power-of-two scales: the
// float arithmetic after the integer sums is exact, so no rounding can hide an index error).
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "tests/code_samples.h"
#include "backends/cuda/int_gemm_operands.h"
#include "backends/cuda/index_math.h"

using namespace et;

namespace {

using test::codes;
using test::fp4_codes;
using test::lcg;

// C[m][n] = sum_k A(m, k) B(k, n) in int64, handed to out(m, n, value).
template <class A, class B, class Out>
void naive_gemm(int64_t M, int64_t N, int64_t K, const A& a, const B& b, Out out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int64_t(a.at(m, k)) * b.at(k, n);
      out(m, n, s);
    }
}

}  // namespace

TEST_CASE("CUDA integer-product operands: every conv pass maps as the CPU's integer kernels", "[quant][cuda_operands]") {
  auto be = make_cpu_backend();
  struct Case {
    int64_t N, C, H, W, K, R, stride, pad;
  };
  for (const Case& c : {Case{2, 16, 8, 8, 16, 3, 1, 1}, Case{3, 5, 7, 9, 6, 3, 2, 1}, Case{1, 8, 6, 6, 12, 1, 1, 0},
                        Case{4, 12, 5, 5, 8, 1, 2, 0}, Case{1, 3, 11, 11, 5, 5, 1, 2}, Case{2, 4, 9, 10, 7, 3, 2, 0},
                        Case{2, 3, 13, 11, 4, 5, 3, 2}, Case{1, 4, 8, 8, 6, 3, 2, 2}, Case{2, 5, 10, 9, 3, 2, 2, 0}}) {
    Conv2dGeom g;
    g.N = c.N, g.C = c.C, g.H = c.H, g.W = c.W, g.K = c.K, g.R = g.S = c.R;
    g.stride_h = g.stride_w = c.stride, g.pad_h = g.pad_w = c.pad;
    g.infer_output();
    INFO("N" << g.N << " C" << g.C << " " << g.H << "x" << g.W << " K" << g.K << " R" << g.R << " stride " << c.stride
              << " pad " << c.pad);
    const int64_t nx = g.N * g.C * g.H * g.W, nw = g.K * g.C * g.R * g.S, ny = g.N * g.K * g.P * g.Q;
    const int64_t RS = g.R * g.S, PQ = g.P * g.Q, HW = g.H * g.W;
    auto xc = codes(size_t(nx), 0, 15, 11), wc = codes(size_t(nw), -7, 7, 12);
    auto gc = fp4_codes(size_t(ny), 13);
    Tensor xq = Tensor::contiguous(xc.data(), Shape{g.N, g.C, g.H, g.W}, DType::U4);
    Tensor wq = Tensor::contiguous(wc.data(), Shape{g.K, g.C, g.R, g.S}, DType::I4);
    Tensor gq = Tensor::contiguous(gc.data(), Shape{g.N, g.K, g.P, g.Q}, DType::F4);
    xq.scale = wq.scale = gq.scale = 1.f;
    size_t wsb = 0;
    for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
      wsb = std::max(wsb, be->conv2d_q_workspace_bytes(g, p));
    std::vector<uint8_t> wsv(wsb);
    const Workspace ws{wsv.data(), wsb};
    std::vector<float> y(static_cast<size_t>(ny)), dx(static_cast<size_t>(nx)), dw(static_cast<size_t>(nw)), db(static_cast<size_t>(g.K));
    Tensor yt = Tensor::contiguous(y.data(), gq.shape), dxt = Tensor::contiguous(dx.data(), xq.shape);
    Tensor dwt = Tensor::contiguous(dw.data(), wq.shape), dbt = Tensor::contiguous(db.data(), Shape{g.K});
    be->conv2d_forward_q(g, xq, wq, Tensor{}, yt, ws);
    be->conv2d_backward_data_q(g, gq, wq, dxt, false, ws);
    be->conv2d_backward_weight_q(g, xq, gq, dwt, dbt, false, ws);

    const int_gemm::ConvShape s = int_gemm::conv_shape_of(g);
    std::vector<float> got(static_cast<size_t>(ny), -1.f);
    const int_gemm::PlanesOut y_at{g.K, PQ};
    naive_gemm(g.K, g.N * PQ, g.C * RS, int_gemm::Dense{wc.data(), g.C * RS, 1}, int_gemm::ConvInputByTaps{xc.data(), s},
               [&](int64_t m, int64_t n, int64_t v) { got[size_t(y_at.at(m, n))] = float(v); });
    CHECK(got == y);

    got.assign(size_t(nx), -1.f);
    const int_gemm::PlanesOut dx_at{g.C, HW};
    naive_gemm(g.C, g.N * HW, g.K * RS, int_gemm::WeightsByInputChannel{wc.data(), s}, int_gemm::GradByTaps{gc.data(), s},
               [&](int64_t m, int64_t n, int64_t v) { got[size_t(dx_at.at(m, n))] = float(v); });
    CHECK(got == dx);
    // ... and by phase (the CUDA backend's form at stride > 1; one phase at stride 1): every dx
    // element written once, by its phase's product over the phase's taps alone.
    got.assign(size_t(nx), -1.f);
    int64_t products = 0;
    for (int a = 0; a < s.stride_h; ++a)
      for (int b = 0; b < s.stride_w; ++b) {
        const int_gemm::DataGradPhase ph = int_gemm::data_grad_phase(s, a, b);
        if (ph.positions() == 0) continue;
        const int_gemm::PhaseOut at{g.C, s, ph};
        naive_gemm(g.C, g.N * ph.positions(), g.K * ph.taps(), int_gemm::WeightsByPhaseTaps{wc.data(), s, ph},
                   int_gemm::GradByPhaseTaps{gc.data(), s, ph}, [&](int64_t m, int64_t n, int64_t v) {
                     CHECK(got[size_t(at.at(m, n))] == -1.f);
                     got[size_t(at.at(m, n))] = float(v);
                   });
        products += g.C * g.N * ph.positions() * g.K * ph.taps();
      }
    CHECK(got == dx);
    // The phases multiply stride_h * stride_w times fewer codes (up to the edges' rounding).
    CAPTURE(products, g.C * g.N * HW * g.K * RS);
    CHECK(products * c.stride * c.stride <= g.C * g.N * HW * g.K * RS * 2);

    got.assign(size_t(nw), -1.f);
    const int_gemm::RowsOut dw_at{g.C * RS};
    naive_gemm(g.K, g.C * RS, g.N * PQ, int_gemm::GradByPositions{gc.data(), s},
               int_gemm::ConvInputByPositions{int_gemm::ConvInputByTaps{xc.data(), s}},
               [&](int64_t m, int64_t n, int64_t v) { got[size_t(dw_at.at(m, n))] = float(v); });
    CHECK(got == dw);
  }
}

TEST_CASE("CUDA integer-product operands: the linear passes map as the CPU's integer kernels", "[quant][cuda_operands]") {
  auto be = make_cpu_backend();
  const int64_t N = 7, I = 33, O = 5;
  auto xc = codes(size_t(N * I), 0, 15, 4), wc = codes(size_t(O * I), -7, 7, 5);
  auto gc = fp4_codes(size_t(N * O), 6);
  Tensor xq = Tensor::contiguous(xc.data(), Shape{N, I}, DType::U4);
  Tensor wq = Tensor::contiguous(wc.data(), Shape{O, I}, DType::I4);
  Tensor gq = Tensor::contiguous(gc.data(), Shape{N, O}, DType::F4);
  xq.scale = wq.scale = gq.scale = 1.f;
  std::vector<uint8_t> wsv(be->linear_q_workspace_bytes(N, I, O));
  const Workspace ws{wsv.data(), wsv.size()};
  std::vector<float> y(static_cast<size_t>(N * O)), dx(static_cast<size_t>(N * I)), dw(static_cast<size_t>(O * I)), db(static_cast<size_t>(O));
  Tensor yt = Tensor::contiguous(y.data(), Shape{N, O}), dxt = Tensor::contiguous(dx.data(), Shape{N, I});
  Tensor dwt = Tensor::contiguous(dw.data(), Shape{O, I}), dbt = Tensor::contiguous(db.data(), Shape{O});
  be->linear_forward_q(xq, wq, Tensor{}, yt, ws);
  be->linear_backward_data_q(gq, wq, dxt, false, ws);
  be->linear_backward_weight_q(xq, gq, dwt, dbt, false, ws);

  std::vector<float> got(y.size());
  naive_gemm(N, O, I, int_gemm::Dense{xc.data(), I, 1}, int_gemm::Dense{wc.data(), 1, I},
             [&](int64_t m, int64_t n, int64_t v) { got[size_t(int_gemm::RowsOut{O}.at(m, n))] = float(v); });
  CHECK(got == y);
  got.assign(dx.size(), 0.f);
  naive_gemm(N, I, O, int_gemm::Dense{gc.data(), O, 1}, int_gemm::Dense{wc.data(), I, 1},
             [&](int64_t m, int64_t n, int64_t v) { got[size_t(int_gemm::RowsOut{I}.at(m, n))] = float(v); });
  CHECK(got == dx);
  got.assign(dw.size(), 0.f);
  naive_gemm(O, I, N, int_gemm::Dense{gc.data(), 1, O}, int_gemm::Dense{xc.data(), I, 1},
             [&](int64_t m, int64_t n, int64_t v) { got[size_t(int_gemm::RowsOut{I}.at(m, n))] = float(v); });
  CHECK(got == dw);
}

TEST_CASE("CUDA index arithmetic: 32-bit divisions where they fit give the 64-bit quotients", "[cuda_operands]") {
  const int64_t big = int64_t(1) << 32;
  for (int64_t a : {int64_t(0), int64_t(1), int64_t(1023), int64_t(1) << 31, big - 1, big, big + 5, int64_t(-7),
                    int64_t(3) << 40})
    for (int64_t b : {int64_t(1), int64_t(3), int64_t(64), int64_t(1000), big - 1, big, big + 3}) {
      CAPTURE(a, b);
      CHECK(cuda_index::idiv(a, b) == a / b);
      CHECK(cuda_index::imod(a, b) == a % b);
    }
}
