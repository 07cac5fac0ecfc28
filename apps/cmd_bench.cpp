// `edgetrain bench step`: times full training steps (forward, backward, SGD) on synthetic data
// after a warm-up; with --against, interleaved with the steps of the same config under other
// settings. The last line of output is one JSON object.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include "apps/bench_model.h"
#include "apps/commands.h"
#include "engine/check.h"
#include "engine/config.h"
#include "engine/data/auto.h"
#include "engine/executor.h"
#include "engine/step_replay.h"
#include "memory/uss.h"

namespace et::app {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Milliseconds per step by op type: forward, backward.
std::map<std::string, std::pair<double, double>> ms_by_type(const Executor& ex, int steps) {
  std::map<std::string, std::pair<double, double>> by_type;
  const Graph& g = ex.graph();
  for (int n = 0; n < g.num_nodes(); ++n) {
    auto& e = by_type[g.node(n).op->type()];
    e.first += ex.forward_seconds()[size_t(n)] * 1e3 / steps;
    e.second += ex.backward_seconds()[size_t(n)] * 1e3 / steps;
  }
  return by_type;
}

// The op types a fused stack takes the place of (fusion/planner.cpp), and the stacks themselves:
// the layers whose time fusion is meant to cut (docs/fusion.md, "Measurements").
bool fusion_layer(const std::string& type) {
  return type == "batchnorm2d" || type == "relu" || type == "add" || type == "maxpool2d" || type == "avgpool2d" ||
         type == "dropout" || type == "fused_stack";
}

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

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// --against: the config with these overrides as a second model, its steps interleaved with the
// first's (A B, then B A, ...) in this one process, so that a drift of the host's speed (sittings
// differ by up to a quarter on the shared hosts, docs/fusion.md) falls on both alike. Reports each
// median and the median of the per-pair ratios.
// With --profile, both models' ops are timed, and their times per op type are printed side by side
// (the steps still in pairs), with the layers fusion replaces (fusion_layer) summed in each; with
// --profile-nodes also every node of the first model beside the node of that name in the second
// (fusion renames nothing it keeps: the convs pair up).
Config against_config(const BenchStepArgs& a) {
  std::vector<std::string> sets = a.sets;
  sets.insert(sets.end(), a.against.begin(), a.against.end());
  Config cfg = load_config(a.config, sets);
  resolve_data_shape(cfg, true);
  return cfg;
}

int bench_against(const BenchStepArgs& a, BenchModel& first, const Config& against) {
  BenchModel second(against, a.profile);
  BenchModel* m[2] = {&first, &second};
  for (int s = 0; s < a.warmup; ++s)
    for (BenchModel* x : m) x->step(s);
  if (a.profile)
    for (BenchModel* x : m) x->ex->set_timing(true);
  std::vector<double> ms[2], ratio;
  for (int s = 0; s < a.steps; ++s) {
    double t[2];
    for (int k = 0; k < 2; ++k) {
      const int which = s % 2 == 0 ? k : 1 - k;
      const auto t0 = Clock::now();
      m[which]->step(a.warmup + s);
      t[which] = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
    ms[0].push_back(t[0]);
    ms[1].push_back(t[1]);
    ratio.push_back(t[1] / t[0]);
  }
  const double med0 = median_of(ms[0]), med1 = median_of(ms[1]), r = median_of(ratio);
  std::string overrides;
  for (const std::string& o : a.against) overrides += (overrides.empty() ? "" : " ") + o;
  std::printf("%s batch %lld, %d threads, %d interleaved pairs of steps:\n", first.cfg.model.name.c_str(),
              (long long)first.n, omp_get_max_threads(), a.steps);
  std::printf("  as configured:  median step %.2f ms (min %.2f, max %.2f)\n", med0,
              *std::min_element(ms[0].begin(), ms[0].end()), *std::max_element(ms[0].begin(), ms[0].end()));
  std::printf("  with %s:  median step %.2f ms (min %.2f, max %.2f)\n", overrides.c_str(), med1,
              *std::min_element(ms[1].begin(), ms[1].end()), *std::max_element(ms[1].begin(), ms[1].end()));
  std::printf("  the configured step is %.3fx as fast (median of the pairs' ratios; %.3fx from the medians)\n", r,
              med1 / med0);
  json op_ms[2] = {json::object(), json::object()};
  if (a.profile) {
    const auto t0 = ms_by_type(*first.ex, a.steps), t1 = ms_by_type(*second.ex, a.steps);
    std::map<std::string, double> total;  // both models' fwd + bwd, for the order of the rows
    for (const auto* t : {&t0, &t1})
      for (const auto& [type, v] : *t) total[type] += v.first + v.second;
    std::vector<std::string> types;
    for (const auto& [type, v] : total) types.push_back(type);
    std::sort(types.begin(), types.end(), [&](const std::string& x, const std::string& y) { return total[x] > total[y]; });
    std::printf("%-24s %21s   %21s  (ms per step, fwd / bwd)\n", "op", "as configured", ("with " + overrides).c_str());
    double layers[2] = {0, 0};
    for (const std::string& type : types) {
      const auto f0 = t0.count(type) ? t0.at(type) : std::pair<double, double>{0, 0};
      const auto f1 = t1.count(type) ? t1.at(type) : std::pair<double, double>{0, 0};
      std::printf("%-24s %10.2f %10.2f   %10.2f %10.2f\n", type.c_str(), f0.first, f0.second, f1.first, f1.second);
      op_ms[0][type] = f0.first + f0.second;
      op_ms[1][type] = f1.first + f1.second;
      if (fusion_layer(type)) layers[0] += f0.first + f0.second, layers[1] += f1.first + f1.second;
    }
    std::printf("BN / ReLU / add / pool / dropout and fused stacks: %.2f ms as configured, %.2f ms with %s (%+.1f %%)\n",
                layers[0], layers[1], overrides.c_str(), layers[1] > 0 ? 100.0 * (layers[0] / layers[1] - 1) : 0.0);
    if (a.profile_nodes) {
      const Graph &g0 = first.ex->graph(), &g1 = second.ex->graph();
      std::map<std::string, int> in_second;
      for (int n = 0; n < g1.num_nodes(); ++n) in_second[g1.node(n).name] = n;
      std::printf("%-28s %-14s %21s   %21s\n", "node", "op", "as configured", "with the overrides");
      for (int n = 0; n < g0.num_nodes(); ++n) {
        const double f0 = first.ex->forward_seconds()[size_t(n)] * 1e3 / a.steps;
        const double b0 = first.ex->backward_seconds()[size_t(n)] * 1e3 / a.steps;
        std::printf("%-28.28s %-14.14s %10.3f %10.3f", g0.node(n).name.c_str(), g0.node(n).op->type(), f0, b0);
        const auto it = in_second.find(g0.node(n).name);
        if (it != in_second.end())
          std::printf("   %10.3f %10.3f", second.ex->forward_seconds()[size_t(it->second)] * 1e3 / a.steps,
                      second.ex->backward_seconds()[size_t(it->second)] * 1e3 / a.steps);
        std::printf("\n");
      }
    }
  }
  std::printf("peak USS not measured: both models are resident (run each alone for it)\n");
  if (first.diverged || second.diverged)
    std::printf("note: the synthetic steps diverged (the divergence guard would have stopped training)\n");
  json j = {{"model", first.cfg.model.name},
                  {"batch", first.n},
                  {"threads", omp_get_max_threads()},
                  {"steps", a.steps},
                  {"step_ms_median", med0},
                  {"against", a.against},
                  {"against_step_ms_median", med1},
                  {"speedup_median", r},
                  {"speedup_of_medians", med1 / med0}};
  if (a.profile) {
    j["op_ms"] = op_ms[0];
    j["against_op_ms"] = op_ms[1];
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

int cmd_bench_step(const BenchStepArgs& a) {
  Config cfg = load_config(a.config, a.sets);
  // Synthetic inputs: only the shape matters ("auto": from the data, 3x32x32 where there is none).
  if (const std::string line = resolve_data_shape(cfg, true); !line.empty()) std::fprintf(stderr, "%s\n", line.c_str());
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  const std::optional<Config> against = a.against.empty() ? std::nullopt : std::optional<Config>(against_config(a));
  const std::optional<size_t> uss_before = read_uss_bytes();
  BenchModel bm(cfg, a.profile);
  for (const std::string& line : bm.budget.budget_mb > 0 ? bm.budget.summary() : std::vector<std::string>{})
    std::printf("%s\n", line.c_str());
  if (against) return bench_against(a, bm, *against);
  Executor& ex = *bm.ex;
  const Graph& g = bm.g;
  const int64_t n = bm.n;
  const BudgetPlan& budget = bm.budget;
  const StepReplay& replay = *bm.replay;
  UssPeak& uss = bm.uss;
  for (int s = 0; s < a.warmup; ++s) bm.step(s);
  bm.guard_s = 0;
  if (a.profile) ex.set_timing(true);
  ex.stash().reset_peak();
  std::vector<double> ms;
  for (int s = 0; s < a.steps; ++s) {
    const auto t0 = Clock::now();
    bm.step(a.warmup + s);
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
    std::printf("divergence guard: gradient check %.3f ms per step (%.2f%%)\n", bm.guard_s * 1e3 / a.steps,
                100.0 * bm.guard_s * 1e3 / a.steps / median);
    if (cfg.quant.forward != "fp32" || cfg.quant.backward != "fp32") {
      const double q = ex.quantize_seconds() * 1e3 / a.steps;
      std::printf("quantizing (statistics, codes, dequantised copies; forward %s, backward %s): %.2f ms per step (%.1f%%)\n",
                  cfg.quant.forward.c_str(), cfg.quant.backward.c_str(), q, 100.0 * q / median);
    }
  }
  if (cfg.train.cuda_graph)
    std::printf("train.cuda_graph: %s\n", replay.replaying() ? "the timed steps replayed a recorded CUDA graph"
                                                              : ("op by op: " + replay.why_not()).c_str());
  if (bm.diverged) std::printf("note: the synthetic steps diverged (the divergence guard would have stopped training)\n");
  const MemoryReport& m = ex.memory();
  if (ex.stash().fixed_layout())  // a GPU's: the region is allocated whole (memory/stash.h)
    std::printf("stash region %.1f MB allocated (entries' room fitted to what they kept, +%.0f%%; %d steps ran again "
                "for more room); packed peak %.1f MB\n",
                double(ex.stash().region_bytes()) / 1048576.0, 100.0 * cfg.memory.stash_headroom, ex.stash_room_grown(),
                double(ex.stash().peak_bytes()) / 1048576.0);
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
            {"activations_mb", m.activations_planned / 1048576.0},
            {"stash", cfg.memory.stash},
            {"cuda_graph", replay.replaying()},
            {"stash_peak_mb", double(ex.stash().peak_bytes()) / 1048576.0},
            {"stash_region_peak_mb", double(ex.stash().region_peak_bytes()) / 1048576.0},
            {"stash_region_mb", double(ex.stash().region_bytes()) / 1048576.0},
            {"stash_room_grown", ex.stash_room_grown()},
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
    j["guard_ms"] = bm.guard_s * 1e3 / a.steps;
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
