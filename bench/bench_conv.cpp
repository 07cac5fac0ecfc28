// bench_conv: times the CPU backend's conv2d passes (forward, backward-data, backward-weight) on
// every distinct conv shape of CIFAR ResNet-20, ResNet-18, VGG16-BN and MobileNetV2 at batch 128.
// Median of --reps timed repetitions after one warm-up; GFLOP/s = 2*N*K*P*Q*(C/groups)*R*S / time.
// The per-network total weights each shape by how often it occurs in the network.
//
//   bench_conv [--filter SUBSTR] [--reps N] [--batch N] [--csv] [--cpu] [--int4] [--flat]
//   --flat: the direct kernels' flat form everywhere (cpu::conv_direct_rows(false)), to A/B the row form
//   --int4: also the integer passes on 4-bit codes (4-bit training), and their speed-up over FP32
//   --fused: each pass beside the form it takes after or before a fused BN -> ReLU stack (forward:
//     x computed from the stack's input as staged (DType::AffineRelu, the engine's own stack run) and
//     y's plane sums; data gradient: the stack's first sweep in its epilogue where the stack hands it
//     on; weight gradient: x as AffineRelu), the two
//     alternating repetition by repetition, and the ratio of their medians
//   --against PATH (gemm|direct|implicit|winograd|winograd_rows): each pass under the automatic
//     choice beside the same pass forced onto PATH (where PATH does not apply, conv.cpp's fallback),
//     alternating repetition by repetition, and how many times faster the automatic choice is
//   bench_conv --reps N --gemm     (single-threaded SGEMM vs Eigen on conv-like shapes)
// Compare with PyTorch: python3 bench/conv_pytorch.py --ours <csv from --csv>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <string>
#include <vector>

// Eigen's AVX-512 packet code (pload1 -> _mm512_broadcastss_ps, ptranspose -> _mm512_unpack*_ps, ...)
// inlines GCC 12's unmasked intrinsics, whose _mm512_undefined_*() merge operands give a false
// -Wmaybe-uninitialized in the --gemm reference (GCC bug 105593). Eigen's headers can't be
// changed, so the warning is off for them alone; this file's own code stays checked.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include "backends/backend.h"
#include "backends/cpu/conv_direct.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/gemm.h"
#include "bench/conv_shapes.h"
#include "engine/affine_relu.h"
#include "engine/fused_stack.h"
#include "fusion/fusion.h"

using namespace et;
using et::bench::Shape2;
using et::bench::all_shapes;

namespace {

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// --cpu: process CPU time instead of wall time. On a machine shared with other jobs, wall times of
// 2-thread runs jump by whole scheduler slices; with OMP_NUM_THREADS=1 the CPU time is the work.
bool g_cpu_time = false;
double now_ms() {
  if (!g_cpu_time) return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
}

// --cold: before each timed repetition, stream through 64 MiB so the operands come from memory,
// as in a training step, where the layers between reads evict them (this host's L3 is 32 MiB).
bool g_cold = false;
void evict_caches() {
  static std::vector<float> junk(size_t(16) << 20);
  static float sink = 0.f;
  for (size_t i = 0; i < junk.size(); i += 16) junk[i] += 1.f;
  sink += junk[junk.size() / 2];
}

template <class F>
double time_ms(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    if (g_cold) evict_caches();
    const double a = now_ms();
    f();
    t.push_back(now_ms() - a);
  }
  return median(t);
}

// Medians of a and b over reps, the two alternating (a first, then b, each repetition), after a
// warm-up of each: a drifting machine slows both alike.
template <class A, class B>
std::pair<double, double> time_pair_ms(int reps, A&& a, B&& b) {
  a();
  b();
  std::vector<double> ta, tb;
  for (int i = 0; i < reps; ++i) {
    if (g_cold) evict_caches();
    double t0 = now_ms();
    a();
    ta.push_back(now_ms() - t0);
    if (g_cold) evict_caches();
    t0 = now_ms();
    b();
    tb.push_back(now_ms() - t0);
  }
  return {median(ta), median(tb)};
}

// A BN -> ReLU stack over C channels of H x W planes, the one before a conv or after it. The one
// before computes x by the engine's own run (Backend::fused_affine_relu: fused.cpp's bn_relu_run),
// so the fused forms time what a training step runs (session 42; a loop of the bench's own
// before), and the conv's data gradient takes its first sweep only where that stack hands it on
// (Backend::fused_takes_dz_sums: not on the small planes of VGG's last layers).
FusedStack bn_relu_stack(int64_t C, int64_t H, int64_t W) {
  FusedStack s;
  s.C = C;
  for (FusedKind k : {FusedKind::BatchNorm, FusedKind::Relu}) {
    FusedStage st = fused_stage(k);
    st.H = st.P = H;
    st.W = st.Q = W;
    s.stages.push_back(st);
  }
  return s;
}

struct Buf {
  std::vector<float> v;
  Tensor t;
  Buf(const et::Shape& s, float scale, unsigned seed) : v(size_t(s.numel())) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = scale * (float((i * 2654435761u + seed) % 1000) / 500.f - 1.f);
    t = Tensor::contiguous(v.data(), s);
  }
};

// --gemm: single-threaded cpu::sgemm against Eigen (the kernel it replaced) on GEMM shapes the
// conv / linear paths produce (M, N, K, trans_a, trans_b).
void bench_gemm(int reps) {
  struct G { int64_t M, N, K; bool ta, tb; const char* what; };
  const G gs[] = {
      {64, 1024, 576, false, false, "fwd 3x3 64ch 32x32"},   {512, 256, 4608, false, false, "fwd vgg 2x2 x64 img"},
      {96, 1024, 16, false, false, "fwd 1x1 16->96 32x32"},  {16, 1024, 96, false, false, "fwd 1x1 96->16"},
      {576, 256, 64, true, false, "bwd_d 3x3 64ch 16x16"},  {4608, 256, 512, true, false, "bwd_d vgg 2x2"},
      {64, 576, 1024, false, true, "bwd_w 3x3 64ch"},      {512, 4608, 256, false, true, "bwd_w vgg 2x2"},
      {96, 16, 4096, false, true, "bwd_w 1x1 16->96"},     {960, 160, 256, false, true, "bwd_w 1x1 160->960 4x4"},
      {64, 10, 512, false, true, "linear fwd"},            {257, 257, 257, false, false, "odd 257"},
  };
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::printf("%-26s %5s %5s %5s %2s %2s | %8s %8s | %7s %7s (ms | GFLOP/s, 1 thread)\n", "gemm", "M", "N", "K", "tA",
              "tB", "ours", "eigen", "ours", "eigen");
  for (const G& g : gs) {
    std::vector<float> a(size_t(g.M * g.K), 0.5f), b(size_t(g.K * g.N), 0.25f), c(size_t(g.M * g.N), 0.f);
    std::vector<float> scratch(cpu::sgemm_scratch_floats(g.M, g.N, g.K));
    const int64_t lda = g.ta ? g.M : g.K, ldb = g.tb ? g.K : g.N;
    const double to = time_ms(reps, [&] {
      cpu::sgemm(g.ta, g.tb, g.M, g.N, g.K, 1.f, a.data(), lda, b.data(), ldb, 0.f, c.data(), g.N, scratch.data());
    });
    Eigen::Map<RowMat> cm(c.data(), g.M, g.N);
    Eigen::Map<const RowMat> am(a.data(), g.ta ? g.K : g.M, g.ta ? g.M : g.K), bm(b.data(), g.tb ? g.N : g.K, g.tb ? g.K : g.N);
    const double te = time_ms(reps, [&] {
      if (!g.ta && !g.tb) cm.noalias() = am * bm;
      else if (!g.ta) cm.noalias() = am * bm.transpose();
      else if (!g.tb) cm.noalias() = am.transpose() * bm;
      else cm.noalias() = am.transpose() * bm.transpose();
    });
    const double gf = 2.0 * double(g.M * g.N * g.K) * 1e-6;
    std::printf("%-26s %5ld %5ld %5ld %2d %2d | %8.3f %8.3f | %7.1f %7.1f\n", g.what, long(g.M), long(g.N), long(g.K),
                int(g.ta), int(g.tb), to, te, gf / to, gf / te);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string filter;
  int reps = 5;
  int64_t batch = 128;
  bool csv = false, int4 = false, fused = false;
  const char* against = nullptr;
  cpu::ConvPathOverride against_path = cpu::ConvPathOverride::Auto;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) filter = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) batch = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--csv")) csv = true;
    else if (!std::strcmp(argv[i], "--cpu")) g_cpu_time = true;
    else if (!std::strcmp(argv[i], "--int4")) int4 = true;
    else if (!std::strcmp(argv[i], "--fused")) fused = true;
    else if (!std::strcmp(argv[i], "--flat")) cpu::conv_direct_rows(false);
    else if (!std::strcmp(argv[i], "--cold")) g_cold = true;
    else if (!std::strcmp(argv[i], "--against") && i + 1 < argc) {
      against = argv[++i];
      const std::pair<const char*, cpu::ConvPathOverride> names[] = {
          {"gemm", cpu::ConvPathOverride::Gemm},         {"direct", cpu::ConvPathOverride::Direct},
          {"implicit", cpu::ConvPathOverride::Implicit}, {"winograd", cpu::ConvPathOverride::Winograd},
          {"winograd_rows", cpu::ConvPathOverride::WinogradRows}};
      for (const auto& [name, path] : names)
        if (!std::strcmp(against, name)) against_path = path;
      if (against_path == cpu::ConvPathOverride::Auto) {
        std::fprintf(stderr, "bench_conv: --against %s: not a conv path (gemm, direct, implicit, winograd, winograd_rows)\n",
                     against);
        return 2;
      }
    }
    else if (!std::strcmp(argv[i], "--gemm")) {
      bench_gemm(reps);
      return 0;
    }
    else {
      std::fprintf(stderr, "usage: %s [--filter SUBSTR] [--reps N] [--batch N] [--csv] [--cpu] [--int4] [--fused] [--against PATH] [--flat] [--cold] | [--reps N] --gemm\n",
                   argv[0]);
      return 2;
    }
  }
  auto be = make_cpu_backend();
  std::map<std::string, double> totals;
  if (csv) std::printf("net,shape,count,fwd_ms,bwd_data_ms,bwd_weight_ms\n");
  else if (against)
    std::printf("threads %d, batch %ld, median of %d, alternating; each pass: automatic choice ms, forced onto %s "
                "ms, how many times faster the automatic choice is\n",
                omp_get_max_threads(), long(batch), reps, against);
  else if (fused)
    std::printf("threads %d, batch %ld, median of %d, alternating; each pass: plain ms, fused form ms, ratio "
                "(*: x not computed from the stack here; -: no epilogue on this path, or the stack keeps its first sweep; forward: y's plane sums where the stack after takes them)\n",
                omp_get_max_threads(), long(batch), reps);
  else
    std::printf("threads %d, batch %ld, median of %d\n%-12s %-26s %3s | %8s %8s %8s | %7s %7s %7s  (ms | GFLOP/s)\n",
                omp_get_max_threads(), long(batch), reps, "net", "shape", "n", "fwd", "bwd_d", "bwd_w", "fwd", "bwd_d",
                "bwd_w");
  for (const Shape2& s : all_shapes()) {
    const std::string full = s.net + "/" + s.name;
    if (!filter.empty() && full.find(filter) == std::string::npos) continue;
    Conv2dGeom g;
    g.N = batch; g.C = s.C; g.H = s.H; g.W = s.W; g.K = s.K; g.R = g.S = s.R;
    g.stride_h = g.stride_w = s.stride;
    g.pad_h = g.pad_w = s.R / 2;
    g.groups = s.groups;
    g.infer_output();
    Buf x({g.N, g.C, g.H, g.W}, 1.f, 1), w({g.K, g.C / g.groups, g.R, g.S}, 0.1f, 2), y({g.N, g.K, g.P, g.Q}, 0.f, 3);
    Buf dy({g.N, g.K, g.P, g.Q}, 1.f, 4), dx({g.N, g.C, g.H, g.W}, 0.f, 5), dw({g.K, g.C / g.groups, g.R, g.S}, 0.f, 6);
    size_t wsb = 0;
    for (cpu::ConvPathOverride path : {cpu::ConvPathOverride::Auto, against_path}) {
      cpu::conv_set_path_override(path);
      for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
        wsb = std::max(wsb, be->conv2d_workspace_bytes(g, p));
    }
    cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
    std::vector<float> wsv(wsb / sizeof(float) + 16);
    Workspace ws{wsv.data(), wsb};
    Tensor none;
    if (fused) {
      if (g.groups != 1) continue;
      // The stack before the conv: x = relu(xs * scale + shift); the stack after it: BN over y.
      std::vector<float> scale(size_t(g.C), 0.9f), shift(size_t(g.C), 0.05f), mean(size_t(g.C), 0.01f);
      const FusedStack before = bn_relu_stack(g.C, g.H, g.W);
      const AffineReluRun run = be->fused_affine_relu(before);
      ET_CHECK(run, "bench_conv: the backend computes no BN -> ReLU stack output");
      AffineReluSource src{x.t, scale.data(), shift.data(), run};
      const Tensor xa = affine_relu_tensor(src);
      std::vector<float> sums(size_t(2 * g.N * g.K)), dzs(size_t(2 * g.N * g.C));
      Tensor st = Tensor::contiguous(sums.data(), {2, g.N, g.K});
      DzSumsEpilogue e;
      e.x = x.v.data();
      e.scale = scale.data(), e.shift = shift.data(), e.mean = mean.data();
      e.sum1 = dzs.data(), e.sum2 = dzs.data() + g.N * g.C;
      // As in a training step: x computed from the stack where its readers compute it in forward, y's
      // plane sums where the stack after takes them (neither on planes of 16 or fewer elements).
      const FusedStack after = bn_relu_stack(g.K, g.P, g.Q);
      const bool aff = be->fused_forward_by_readers(before) && dtype_in(DType::AffineRelu, be->conv2d_forward_reads(g));
      const bool take_sums = fusion::takes_plane_sums(after);
      const auto f = time_pair_ms(reps, [&] { be->conv2d_forward(g, x.t, w.t, none, y.t, ws); }, [&] {
        if (take_sums) return be->conv2d_forward_sums(g, aff ? xa : x.t, w.t, none, y.t, st, ws);
        be->conv2d_forward(g, aff ? xa : x.t, w.t, none, y.t, ws);
      });
      bool epi = be->fused_takes_dz_sums(before);
      const auto d = time_pair_ms(reps, [&] { be->conv2d_backward_data(g, dy.t, w.t, dx.t, false, ws); }, [&] {
        if (!epi || !(epi = be->conv2d_backward_data_dz_sums(g, dy.t, w.t, dx.t, false, e, ws)))
          be->conv2d_backward_data(g, dy.t, w.t, dx.t, false, ws);
      });
      const bool waff = be->fused_recomputes(before) && dtype_in(DType::AffineRelu, be->conv2d_weight_reads(g));
      const auto wg = time_pair_ms(reps, [&] { be->conv2d_backward_weight(g, x.t, dy.t, dw.t, none, false, ws); },
                                   [&] { be->conv2d_backward_weight(g, waff ? xa : x.t, dy.t, dw.t, none, false, ws); });
      std::printf("%-12s %-26s %3ld | fwd %7.3f %7.3f %5.3fx%s | bwd_d %7.3f %7.3f %5.3fx%s | bwd_w %7.3f %7.3f %5.3fx%s\n",
                  s.net.c_str(), s.name.c_str(), long(s.count), f.first, f.second, f.second / f.first,
                  aff ? "" : "*", d.first, d.second, d.second / d.first, epi ? "" : "-", wg.first, wg.second,
                  wg.second / wg.first, waff ? "" : "*");
      totals[s.net] += double(s.count) * (f.first + d.first + wg.first);
      totals[s.net + " fused forms"] += double(s.count) * (f.second + d.second + wg.second);
      std::fflush(stdout);
      continue;
    }
    if (against) {
      // Each timed call under its own path; the override is a process-wide setting of conv.cpp.
      auto under = [&](cpu::ConvPathOverride path, auto&& call) {
        return [&, path] {
          cpu::conv_set_path_override(path);
          call();
          cpu::conv_set_path_override(cpu::ConvPathOverride::Auto);
        };
      };
      auto pair = [&](auto&& call) {
        return time_pair_ms(reps, under(cpu::ConvPathOverride::Auto, call), under(against_path, call));
      };
      const auto f = pair([&] { be->conv2d_forward(g, x.t, w.t, none, y.t, ws); });
      const auto d = pair([&] { be->conv2d_backward_data(g, dy.t, w.t, dx.t, false, ws); });
      const auto wg = pair([&] { be->conv2d_backward_weight(g, x.t, dy.t, dw.t, none, false, ws); });
      std::printf("%-12s %-26s %3ld | fwd %7.3f %7.3f %5.3fx | bwd_d %7.3f %7.3f %5.3fx | bwd_w %7.3f %7.3f %5.3fx\n",
                  s.net.c_str(), s.name.c_str(), long(s.count), f.first, f.second, f.second / f.first, d.first,
                  d.second, d.second / d.first, wg.first, wg.second, wg.second / wg.first);
      totals[s.net] += double(s.count) * (f.first + d.first + wg.first);
      totals[s.net + " forced onto " + against] += double(s.count) * (f.second + d.second + wg.second);
      std::fflush(stdout);
      continue;
    }
    const double tf = time_ms(reps, [&] { be->conv2d_forward(g, x.t, w.t, none, y.t, ws); });
    const double td = time_ms(reps, [&] { be->conv2d_backward_data(g, dy.t, w.t, dx.t, false, ws); });
    const double tw = time_ms(reps, [&] { be->conv2d_backward_weight(g, x.t, dy.t, dw.t, none, false, ws); });
    const double gf = 2.0 * double(g.N * g.K * g.P * g.Q * (g.C / g.groups) * g.R * g.S) * 1e-6;  // GFLOP per ms
    totals[s.net] += double(s.count) * (tf + td + tw);
    if (csv)
      std::printf("%s,%s,%ld,%.4f,%.4f,%.4f\n", s.net.c_str(), s.name.c_str(), long(s.count), tf, td, tw);
    else
      std::printf("%-12s %-26s %3ld | %8.3f %8.3f %8.3f | %7.1f %7.1f %7.1f\n", s.net.c_str(), s.name.c_str(),
                  long(s.count), tf, td, tw, gf / tf, gf / td, gf / tw);
    if (int4 && g.groups == 1) {  // the same passes on codes: U4 inputs, I4 weights, FP4 gradients
      std::vector<int8_t> xc(size_t(x.t.numel())), wc(size_t(w.t.numel())), gc(size_t(dy.t.numel()));
      uint32_t seed = 5;
      auto rnd = [&] { return (seed = seed * 1664525u + 1013904223u) >> 8; };
      for (auto& c : xc) c = int8_t(rnd() % 16);
      for (auto& c : wc) c = int8_t(int(rnd() % 15) - 7);
      for (auto& c : gc) c = int8_t((rnd() & 1 ? -1 : 1) * (1 << (rnd() % 7)));
      Tensor xq = Tensor::contiguous(xc.data(), x.t.shape, DType::U4), wq = Tensor::contiguous(wc.data(), w.t.shape, DType::I4);
      Tensor gq = Tensor::contiguous(gc.data(), dy.t.shape, DType::F4);
      xq.scale = wq.scale = gq.scale = 1.f;
      size_t qb = 0;
      for (ConvPass p : {ConvPass::Forward, ConvPass::BackwardData, ConvPass::BackwardWeight})
        qb = std::max(qb, be->conv2d_q_workspace_bytes(g, p));
      std::vector<uint8_t> qwsv(qb + 64);
      Workspace qws{qwsv.data(), qb};
      const double qf = time_ms(reps, [&] { be->conv2d_forward_q(g, xq, wq, none, y.t, qws); });
      const double qd = time_ms(reps, [&] { be->conv2d_backward_data_q(g, gq, wq, dx.t, false, qws); });
      const double qw = time_ms(reps, [&] { be->conv2d_backward_weight_q(g, xq, gq, dw.t, none, false, qws); });
      totals[s.net + " int4"] += double(s.count) * (qf + qd + qw);
      if (!csv)
        std::printf("%-12s %-26s %3s | %8.3f %8.3f %8.3f | int4 %5.2fx %5.2fx %5.2fx faster\n", "", "  int4", "", qf, qd, qw,
                    tf / qf, td / qd, tw / qw);
    }
    std::fflush(stdout);
  }
  if (!csv)
    for (auto& [net, ms] : totals)
      std::printf("total %-12s %9.2f ms per batch (fwd+bwd_data+bwd_weight, weighted by count)\n", net.c_str(), ms);
  return 0;
}
