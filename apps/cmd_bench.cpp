// `edgetrain bench step`: times full training steps (forward, backward, SGD) on synthetic data
// after a warm-up. The last line of output is one JSON object.
#include <omp.h>

#include <algorithm>
#include <map>
#include <chrono>
#include <random>

#include "apps/commands.h"
#include "backends/backend.h"
#include "engine/config.h"
#include "engine/data/auto.h"
#include "engine/executor.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/step_replay.h"
#include "engine/train/divergence.h"
#include "engine/train/optimizer.h"
#include "engine/train/trainer.h"
#include "memory/uss.h"

namespace et::app {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Milliseconds per step by op type, forward and backward, largest first; with `nodes`, per node.
void print_profile(const Executor& ex, int steps, bool nodes) {
  std::map<std::string, std::pair<double, double>> by_type;
  const Graph& g = ex.graph();
  double total = 0;
  for (int n = 0; n < g.num_nodes(); ++n) {
    auto& e = by_type[g.node(n).op->type()];
    e.first += ex.forward_seconds()[size_t(n)] * 1e3 / steps;
    e.second += ex.backward_seconds()[size_t(n)] * 1e3 / steps;
    total += (ex.forward_seconds()[size_t(n)] + ex.backward_seconds()[size_t(n)]) * 1e3 / steps;
  }
  std::vector<std::pair<std::string, std::pair<double, double>>> rows(by_type.begin(), by_type.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.second.first + a.second.second > b.second.first + b.second.second;
  });
  std::printf("%-24s %10s %10s %7s\n", "op", "fwd ms", "bwd ms", "share");
  for (const auto& [type, t] : rows)
    std::printf("%-24s %10.2f %10.2f %6.1f%%\n", type.c_str(), t.first, t.second, 100.0 * (t.first + t.second) / total);
  if (!nodes) return;
  std::printf("%-28s %-22s %10s %10s\n", "node", "op", "fwd ms", "bwd ms");
  for (int n = 0; n < g.num_nodes(); ++n)
    std::printf("%-28.28s %-22s %10.3f %10.3f\n", g.node(n).name.c_str(), g.node(n).op->type(),
                ex.forward_seconds()[size_t(n)] * 1e3 / steps, ex.backward_seconds()[size_t(n)] * 1e3 / steps);
}

// Per stashed value: how its last push stored it (StashEncodingInfo::display) and its size;
// "recomputed": pushed by a recompute in backward, alive only until its reader's backward.
void print_stash(const Executor& ex) {
  const Graph& g = ex.graph();
  std::printf("%-26s %-18s %10s %10s\n", "stashed value", "stored as", "stored MB", "dense MB");
  for (int n = 0; n < g.num_nodes(); ++n)
    for (int id : ex.stashed_by(n)) {
      const StashRecord& r = ex.stash().record(id);
      const auto& rec = ex.recomputed_by(n);
      const bool recomputed = std::find(rec.begin(), rec.end(), id) != rec.end();
      std::printf("%-26.26s %-18s %10.3f %10.3f%s\n", g.value(id).name.c_str(), r.stored_as, r.bytes / 1048576.0,
                  double(r.numel) * 4 / 1048576.0, recomputed ? "  recomputed" : "");
    }
}

// USS in MB, or null where it could not be read (never 0).
json mb_or_null(std::optional<size_t> b) { return b ? json(double(*b) / 1048576.0) : json(); }

}  // namespace

int cmd_bench_step(const BenchStepArgs& a) {
  Config cfg = load_config(a.config, a.sets);
  // Synthetic inputs: only the shape matters ("auto": from the data, 3x32x32 where there is none).
  if (const std::string line = resolve_data_shape(cfg, true); !line.empty()) std::fprintf(stderr, "%s\n", line.c_str());
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  const std::optional<size_t> uss_before = read_uss_bytes();
  Graph g;
  build_model(g, cfg.model);
  auto backend = make_backend(cfg.train.device);
  BudgetPlan budget;  // memory.budget_mb: planned (calibration steps) before the executor is made
  const StashOptions stash = plan_stash_options(cfg, g, *backend, &budget);
  for (const std::string& line : budget.budget_mb > 0 ? budget.summary() : std::vector<std::string>{})
    std::printf("%s\n", line.c_str());
  Executor ex(g, *backend, stash, cfg.quant_options());
  init_parameters(ex, cfg.train.seed);
  const int64_t n = cfg.train.batch_size;

  // Synthetic batch: N(0,1) images, uniform labels (the cost of a step does not depend on values).
  std::mt19937_64 rng(cfg.train.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  {  // written through the backend's copies where the host cannot address its memory
    const HostView x(*backend, ex.value(g.image_input), HostView::Write);
    const HostView y(*backend, ex.value(g.label_input), HostView::Write);
    for (int64_t i = 0; i < ex.value(g.image_input).numel(); ++i) x.f32()[i] = normal(rng);
    for (int64_t i = 0; i < n; ++i) y.i32()[i] = int32_t(rng() % uint64_t(cfg.model.num_classes));
  }

  const SgdOptions sgd = sgd_options(cfg.train);
  UssPeak uss;
  // The trainer's divergence guard runs the same checks (engine/train/divergence.h), so this is
  // a training step's time; with --profile the gradient check is timed on its own (guard_ms).
  bool diverged = false;
  double guard_s = 0;
  // train.cuda_graph: the trainer's recorded step (a profile times each op, so it runs op by op).
  StepReplay replay(ex, cfg.train.cuda_graph && !a.profile);
  auto step = [&](int64_t s) {
    ex.set_step_seed(uint64_t(s));
    uss.begin_step();  // the peak over the whole step (memory/uss.h)
    const bool replayed = replay.try_step(n);  // forward and backward together
    if (!replayed) ex.forward(n, true);
    uss.phase();
    diverged |= check_loss(ex.loss(), cfg.train.divergence_loss) != DivergenceCause::None;
    if (!replayed) ex.backward();
    uss.phase();
    if (a.profile) backend->synchronize();  // the backward's queued work is not the guard's
    const auto t0 = a.profile ? Clock::now() : Clock::time_point{};
    diverged |= !gradients_finite(ex);
    if (a.profile) guard_s += std::chrono::duration<double>(Clock::now() - t0).count();
    diverged |= !sgd_update(ex, sgd, 0.01f, s == 0);
    uss.end_step();
  };
  for (int s = 0; s < a.warmup; ++s) step(s);
  guard_s = 0;
  if (a.profile) ex.set_timing(true);
  ex.stash().reset_peak();
  std::vector<double> ms;
  for (int s = 0; s < a.steps; ++s) {
    const auto t0 = Clock::now();
    step(a.warmup + s);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  if (a.profile) {
    print_profile(ex, a.steps, a.profile_nodes);
    print_stash(ex);
    const double pack = ex.stash().pack_seconds() * 1e3 / a.steps, unpack = ex.stash().unpack_seconds() * 1e3 / a.steps;
    const double rec = ex.recompute_seconds() * 1e3 / a.steps;
    std::printf("stash %s: pack %.2f ms, unpack %.2f ms per step (%.1f%% of the median step); recompute %.2f ms (%.1f%%)\n",
                cfg.memory.stash.c_str(), pack, unpack, 100.0 * (pack + unpack) / median, rec, 100.0 * rec / median);
    std::printf("divergence guard: gradient check %.3f ms per step (%.2f%%)\n", guard_s * 1e3 / a.steps,
                100.0 * guard_s * 1e3 / a.steps / median);
    if (cfg.quant.forward != "fp32" || cfg.quant.backward != "fp32") {
      const double q = ex.quantize_seconds() * 1e3 / a.steps;
      std::printf("quantizing (statistics, codes, dequantised copies; forward %s, backward %s): %.2f ms per step (%.1f%%)\n",
                  cfg.quant.forward.c_str(), cfg.quant.backward.c_str(), q, 100.0 * q / median);
    }
  }
  if (cfg.train.cuda_graph)
    std::printf("train.cuda_graph: %s\n", replay.replaying() ? "the timed steps replayed a recorded CUDA graph"
                                                              : ("op by op: " + replay.why_not()).c_str());
  if (diverged) std::printf("note: the synthetic steps diverged (the divergence guard would have stopped training)\n");
  const MemoryReport& m = ex.memory();
  std::printf("%s batch %lld, %d threads: median step %.2f ms (min %.2f, max %.2f) over %d steps, loss %.4f\n",
              cfg.model.name.c_str(), (long long)n, omp_get_max_threads(), median, sorted.front(), sorted.back(),
              a.steps, ex.loss());
  std::printf("arena %.1f MB: params %.1f, grads %.1f, optimizer %.1f, activations %.1f (unplanned %.1f), workspace %.1f\n",
              m.total / 1048576.0, m.params / 1048576.0, m.grads / 1048576.0, m.optimizer / 1048576.0,
              m.activations_planned / 1048576.0, m.activations_unplanned / 1048576.0, m.workspace / 1048576.0);
  // Peak over the steps less the USS before the model was built: what training this model adds.
  const std::optional<size_t> step_uss =
      uss.peak() && uss_before ? std::optional<size_t>(*uss.peak() - std::min(*uss.peak(), *uss_before)) : std::nullopt;
  if (uss.peak())
    std::printf("peak USS %.1f MB (step %.1f MB), %s\n", double(*uss.peak()) / 1048576.0,
                double(step_uss.value_or(0)) / 1048576.0, uss_method_name(uss.method()));
  else
    std::printf("peak USS unavailable (/proc/self/smaps_rollup and /proc/self/smaps cannot be read)\n");
  json j = {{"model", cfg.model.name},
            {"batch", n},
            {"threads", omp_get_max_threads()},
            {"steps", a.steps},
            {"step_ms_median", median},
            {"img_per_s", double(n) * 1000.0 / median},
            {"peak_uss_mb", mb_or_null(uss.peak())},
            {"step_uss_mb", mb_or_null(step_uss)},
            {"uss_method", uss_method_name(uss.method())},
            {"arena_mb", m.total / 1048576.0},
            {"stash", cfg.memory.stash},
            {"cuda_graph", replay.replaying()},
            {"stash_peak_mb", double(ex.stash().peak_bytes()) / 1048576.0},
            {"stash_region_peak_mb", double(ex.stash().region_peak_bytes()) / 1048576.0},
            {"stash_dense_mb", double(m.stash_dense_bytes) / 1048576.0},
            {"checkpoint_every", cfg.memory.checkpoint_every}};
  if (budget.budget_mb > 0) {
    j["budget_mb"] = budget.budget_mb;
    j["budget_predicted_mb"] = budget.predicted_mb;
    j["budget_predicted_arena_mb"] = budget.arena_mb;
    j["budget_predicted_stash_mb"] = budget.stash_mb;
    j["budget_overhead_mb"] = budget.overhead_mb;
    j["budget_extra_ms"] = budget.extra_ms;
    j["budget_segments"] = budget.segments;
    j["budget_code_segments"] = budget.code_segments;
  }
  if (a.profile) {
    j["stash_pack_ms"] = ex.stash().pack_seconds() * 1e3 / a.steps;
    j["stash_unpack_ms"] = ex.stash().unpack_seconds() * 1e3 / a.steps;
    j["recompute_ms"] = ex.recompute_seconds() * 1e3 / a.steps;
    j["quantize_ms"] = ex.quantize_seconds() * 1e3 / a.steps;
    j["guard_ms"] = guard_s * 1e3 / a.steps;
    json ops = json::object();  // forward + backward ms per step, by op type
    for (int k = 0; k < g.num_nodes(); ++k) {
      const std::string type = g.node(k).op->type();
      const double t = (ex.forward_seconds()[size_t(k)] + ex.backward_seconds()[size_t(k)]) * 1e3 / a.steps;
      ops[type] = ops.value(type, 0.0) + t;
    }
    j["op_ms"] = ops;
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace et::app
