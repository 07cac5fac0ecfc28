// `edgetrain bench fusion`: BrainSlug's micro-benchmark (its Fig. 10 / Tables 1-2 stack) in
// training: `depth` blocks of <MaxPool 3x3 stride 1 pad 1, BN, ReLU> on [batch, channels, size,
// size], then global pooling, a linear layer and the loss. The same graph unfused and fused
// (fusion/), forward and training step (forward + backward) timed in alternation, medians of
// `reps`. The last line of output is one JSON object.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

#include <nlohmann/json.hpp>

#include "apps/commands.h"
#include "backends/backend.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "fusion/fusion.h"
#include "layers/layers.h"

namespace et::app {
using Clock = std::chrono::steady_clock;

namespace {

void build_stack(Graph& g, const BenchFusionArgs& a) {
  const int x = image_input(g, a.batch, a.channels, a.size, a.size);
  const int labels = label_input(g, a.batch);
  int y = x;
  for (int i = 0; i < a.depth; ++i) {
    const std::string p = "block" + std::to_string(i);
    if (!a.no_pool) y = maxpool2d(g, y, p + ".pool", 3, 1, 1);
    y = relu(g, batchnorm2d(g, y, p + ".bn"), p + ".relu");
  }
  g.logits = linear(g, global_avgpool(g, y, "avgpool"), "fc", 10);
  g.loss = softmax_cross_entropy(g, g.logits, labels, "loss");
  g.image_input = x;
  g.label_input = labels;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int cmd_bench_fusion(const BenchFusionArgs& a) {
  Graph plain, fused;
  build_stack(plain, a);
  build_stack(fused, a);
  FusionSpec spec;
  spec.enabled = true;
  spec.cache_kb = a.cache_kb;
  spec.llc_kb = a.llc_kb;
  const fusion::Plan p = fusion::plan(fused, spec);
  fusion::apply(fused, p);
  auto backend = make_cpu_backend();
  Executor ex_plain(plain, *backend), ex_fused(fused, *backend);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (Executor* ex : {&ex_plain, &ex_fused}) {
    init_parameters(*ex, 1);
    ex->forward(a.batch, false);  // sets the batch for the input views
  }
  Tensor xp = ex_plain.value(plain.image_input), xf = ex_fused.value(fused.image_input);
  for (int64_t i = 0; i < xp.numel(); ++i) xp.f32()[i] = xf.f32()[i] = normal(rng);
  for (int64_t i = 0; i < a.batch; ++i)
    ex_plain.value(plain.label_input).i32()[i] = ex_fused.value(fused.label_input).i32()[i] = int32_t(i % 10);

  struct Times {
    std::vector<double> fwd, step;
  } tp, tf;
  auto run = [&](Executor& ex, Times* t) {
    const auto t0 = Clock::now();
    ex.forward(a.batch, true);
    const auto t1 = Clock::now();
    ex.backward();
    const auto t2 = Clock::now();
    if (t) {
      t->fwd.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      t->step.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
    }
  };
  for (int r = 0; r < a.warmup; ++r) {
    run(ex_plain, nullptr);
    run(ex_fused, nullptr);
  }
  for (int r = 0; r < a.reps; ++r) {
    run(ex_plain, &tp);
    run(ex_fused, &tf);
  }
  // The last step's loss and every parameter's gradient, bit for bit (fusion::apply keeps the
  // parameters' order): the forward and the backward both checked.
  bool identical = ex_plain.loss() == ex_fused.loss();
  const std::vector<int> pp = plain.params(), fp_ids = fused.params();
  identical = identical && pp.size() == fp_ids.size();
  for (size_t i = 0; identical && i < pp.size(); ++i) {
    const Tensor a = ex_plain.grad(pp[i]), b = ex_fused.grad(fp_ids[i]);
    identical = a.numel() == b.numel() && std::memcmp(a.f32(), b.f32(), size_t(a.numel()) * sizeof(float)) == 0;
  }
  const double up = median(tp.step), uf = median(tf.step), fp = median(tp.fwd), ff = median(tf.fwd);
  // Each repetition's pair (unfused, then fused, back to back) as a ratio, and their median: on a
  // host whose speed drifts from one second to the next (a shared cloud core) the pairs see the
  // same state, where the medians of the two series may not.
  std::vector<double> step_pairs, fwd_pairs;
  for (size_t i = 0; i < tp.step.size(); ++i) {
    step_pairs.push_back(tp.step[i] / tf.step[i]);
    fwd_pairs.push_back(tp.fwd[i] / tf.fwd[i]);
  }
  const double step_pair_ratio = median(step_pairs), fwd_pair_ratio = median(fwd_pairs);
  std::printf("<%sBN, ReLU> x %d on [%lld, %lld, %lld, %lld], %d threads, median of %d\n",
              a.no_pool ? "" : "MaxPool 3x3 s1 p1, ", a.depth,
              (long long)a.batch, (long long)a.channels, (long long)a.size, (long long)a.size, omp_get_max_threads(),
              a.reps);
  std::printf("%-8s %12s %12s %14s\n", "", "forward ms", "step ms", "activations MB");
  std::printf("%-8s %12.2f %12.2f %14.1f\n", "unfused", fp, up, ex_plain.memory().activations_planned / 1048576.0);
  std::printf("%-8s %12.2f %12.2f %14.1f\n", "fused", ff, uf, ex_fused.memory().activations_planned / 1048576.0);
  std::printf("speedup: forward %.2fx, training step %.2fx (medians of the pairs' ratios: %.2fx, %.2fx); loss and "
              "gradients identical: %s\n",
              fp / ff, up / uf, fwd_pair_ratio, step_pair_ratio, identical ? "yes" : "NO");
  std::printf("bytes moved per step by the %zu stacks (planner's count): %.1f MB unfused, %.1f MB fused\n",
              p.stacks.size(), p.bytes_unfused / 1e6, p.bytes_fused / 1e6);
  // The tiles: whole planes, or bands of rows where a plane's scratch exceeds the cache.
  int fused_stacks = 0;
  int64_t band_rows = 0;
  for (const fusion::StackPlan& sp : p.stacks) {
    fused_stacks += sp.fused;
    if (sp.fused) band_rows = std::max(band_rows, sp.stack.band_rows);
  }
  const std::string tile = band_rows > 0 ? std::to_string(band_rows) + " rows" : "plane";
  std::printf("cache %zu KiB (%s): %d of %zu stacks fused, tile %s\n", p.cache_bytes / 1024, p.cache_source.c_str(),
              fused_stacks, p.stacks.size(), tile.c_str());
  nlohmann::json j = {{"depth", a.depth},
                      {"batch", a.batch},
                      {"channels", a.channels},
                      {"size", a.size},
                      {"pool", a.no_pool ? "none" : "max3x3s1p1"},
                      {"threads", omp_get_max_threads()},
                      {"reps", a.reps},
                      {"fused_ms", uf},
                      {"unfused_ms", up},
                      {"speedup", up / uf},
                      {"speedup_pairs", step_pair_ratio},
                      {"forward_speedup_pairs", fwd_pair_ratio},
                      {"fused_forward_ms", ff},
                      {"unfused_forward_ms", fp},
                      {"forward_speedup", fp / ff},
                      {"bytes_moved_fused", p.bytes_fused},
                      {"bytes_moved_unfused", p.bytes_unfused},
                      {"activations_mb_fused", ex_fused.memory().activations_planned / 1048576.0},
                      {"activations_mb_unfused", ex_plain.memory().activations_planned / 1048576.0},
                      {"cache_kb", p.cache_bytes / 1024},
                      {"llc_kb", p.llc_bytes / 1024},
                      {"stacks_fused", fused_stacks},
                      {"tile", tile},
                      {"identical", identical}};
  std::printf("%s\n", j.dump().c_str());
  return identical ? 0 : 1;
}

}  // namespace et::app
