// bench_pool: the stride-1 max-pool kernels of BrainSlug's block (backends/cpu/pool_stride1.h) on one
// thread, in nanoseconds an element: forward and backward, each with the plane as it is (the
// unfused layer) and through BN and ReLU from x (the fused stack), the backward also with the dy a
// BN after the pool hands on (DyAffine). Where the row-register form (pool_3x3_rows.h: planes 16 or
// 32 wide) takes the planes, the general kernels are timed beside it.
//
//   bench_pool [--size N] [--planes P] [--reps R]
//     N x N planes, 3x3 windows, pad 1 (default 32); P planes cycled through (default 1: the data
//     stays in L1; 4096 for a set well past the caches); the minimum over R timed rounds of 4000
//     planes each (default 7), so a slow moment of a shared host does not count.
//
// The kernels' correctness is tested against the reference loops ("pooling planes: ..." in
// tests/test_elementwise_kernels.cpp); this prints measurements only.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/pool_planes.h"

int main(int argc, char** argv) {
#if defined(ET_POOL_STRIDE1)
  using namespace et::pool_planes;
  int64_t size = 32, planes = 1, reps = 7;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_pool: %s needs a value\n", argv[i]);
      return 2;
    }
    const int64_t v = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--size") == 0) size = v;
    else if (std::strcmp(argv[i], "--planes") == 0) planes = v;
    else if (std::strcmp(argv[i], "--reps") == 0) reps = v;
    else {
      std::fprintf(stderr, "bench_pool: unknown option %s (--size N, --planes P, --reps R)\n", argv[i]);
      return 2;
    }
  }
  if (size < 1 || size > 200 || planes < 1 || planes > (1 << 20) || reps < 1) {
    std::fprintf(stderr, "bench_pool: --size in [1, 200], --planes in [1, 2^20], --reps >= 1\n");
    return 2;
  }
  Plane g;
  g.H = g.W = g.P = g.Q = size;
  g.R = g.S = 3;
  g.pad_h = g.pad_w = 1;
  const int64_t n = size * size;
  std::vector<float> x(size_t(planes * n)), dy(x.size()), dx(x.size()), y(x.size());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  const BnReluInput bn_relu(1.1f, 0.1f);
  const DyAffine affine(0.5f, 0.2f, 0.1f);
  auto time = [&](auto kernel) {
    double best = 1e30;
    for (int64_t r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < 4000; ++i) kernel(i % planes);
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, ns / 4000.0 / double(n));
    }
    return best;
  };
  const double fwd_plane = time([&](int64_t p) { max_forward_stride1(g, &x[p * n], PlaneInput{}, &y[p * n]); });
  const double fwd_bn = time([&](int64_t p) { max_forward_stride1(g, &x[p * n], bn_relu, &y[p * n]); });
  const double bwd_plane =
      time([&](int64_t p) { max_backward_stride1(g, &x[p * n], PlaneInput{}, &dy[p * n], &dx[p * n], false); });
  const double bwd_bn =
      time([&](int64_t p) { max_backward_stride1(g, &x[p * n], bn_relu, &dy[p * n], &dx[p * n], false); });
  const double bwd_affine = time(
      [&](int64_t p) { max_backward_stride1(g, &x[p * n], bn_relu, &dy[p * n], &dx[p * n], false, &affine); });
  std::printf("stride-1 max-pool 3x3 pad 1, %lldx%lld planes, %lld cycled, %d-lane kernels, 1 thread, ns an element\n",
              static_cast<long long>(size), static_cast<long long>(size), static_cast<long long>(planes), kW);
  std::printf("forward  plane %.3f  BN+ReLU from x %.3f\n", fwd_plane, fwd_bn);
  std::printf("backward plane %.3f  BN+ReLU from x %.3f  with the handed-on dy %.3f\n", bwd_plane, bwd_bn, bwd_affine);
#if defined(ET_POOL_3X3_ROWS)
  if (rows3x3::applies(g)) {  // the general kernels beside them, in the same run
    YRows rows{nullptr, g.Q};
    const double gf_plane = time([&](int64_t p) {
      rows.y = &y[p * n];
      max_forward_stride1_window<3, 3, 1>(g, &x[p * n], PlaneInput{}, rows);
    });
    const double gf_bn = time([&](int64_t p) {
      rows.y = &y[p * n];
      max_forward_stride1_window<3, 3, 1>(g, &x[p * n], bn_relu, rows);
    });
    const double gb_plane = time([&](int64_t p) {
      max_backward_stride1_window<3, 3, 1, PlaneInput, false>(g, &x[p * n], PlaneInput{}, &dy[p * n], &dx[p * n],
                                                              false, nullptr);
    });
    const double gb_bn = time([&](int64_t p) {
      max_backward_stride1_window<3, 3, 1, BnReluInput, false>(g, &x[p * n], bn_relu, &dy[p * n], &dx[p * n], false,
                                                               nullptr);
    });
    const double gb_affine = time([&](int64_t p) {
      max_backward_stride1_window<3, 3, 1, BnReluInput, true>(g, &x[p * n], bn_relu, &dy[p * n], &dx[p * n], false,
                                                              &affine);
    });
    std::printf("the general kernels (pool_stride1.h), which the planes above take without pool_3x3_rows.h:\n");
    std::printf("forward  plane %.3f  BN+ReLU from x %.3f\n", gf_plane, gf_bn);
    std::printf("backward plane %.3f  BN+ReLU from x %.3f  with the handed-on dy %.3f\n", gb_plane, gb_bn, gb_affine);
    std::printf("row-register form's speed-up: forward %.2fx %.2fx, backward %.2fx %.2fx %.2fx\n", gf_plane / fwd_plane,
                gf_bn / fwd_bn, gb_plane / bwd_plane, gb_bn / bwd_bn, gb_affine / bwd_affine);
  }
#endif
  return 0;
#else
  (void)argc, (void)argv;
  std::printf("bench_pool: no stride-1 kernels on this target (they need AVX2, AVX-512 or NEON)\n");
  return 0;
#endif
}
