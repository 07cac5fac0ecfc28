// `edgetrain memprofile`: where the memory of a training step goes, layer by layer. Runs training
// steps on a real batch of the config's data (or synthetic data), and on the last one records after
// each node's forward and backward the process USS, plus what the node stashed for backward
// (format, bytes against dense fp32, measured sparsity). Prints a table, writes memprofile.json and
// an SVG chart of the per-layer stash bytes (dense against stored) into --out.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "apps/commands.h"
#include "engine/config.h"
#include "engine/data/auto.h"
#include "engine/data/loader.h"
#include "engine/executor.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/train/checkpoint.h"
#include "engine/train/trainer.h"
#include "engine/train/weights.h"
#include "engine/train/optimizer.h"
#include "memory/uss.h"

namespace et::app {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr double kMB = 1048576.0;

// USS after every node's forward and backward, on the step being profiled (nullopt: unreadable).
class UssRecorder final : public NodeObserver {
 public:
  explicit UssRecorder(int nodes) : after_fwd(size_t(nodes)), after_bwd(size_t(nodes)) {}
  void after_forward(int n) override { if (active) after_fwd[size_t(n)] = read_uss_bytes(); }
  void after_backward(int n) override { if (active) after_bwd[size_t(n)] = read_uss_bytes(); }
  bool active = false;
  std::vector<std::optional<size_t>> after_fwd, after_bwd;
};

json mb_or_null(std::optional<size_t> b) { return b ? json(double(*b) / kMB) : json(); }

std::string shape_str(const Shape& s, int64_t batch, bool batched) {
  Shape b = s;
  if (batched) b[0] = batch;
  return b.str();
}

// Horizontal bars, one pair per stashed tensor: dense fp32 bytes (grey) and stored bytes (blue).
std::string svg_chart(const json& rows, const std::string& title) {
  std::vector<std::tuple<std::string, double, double, std::string>> bars;
  double max_mb = 1e-9;
  for (const json& r : rows)
    for (const json& s : r["stashed"]) {
      bars.emplace_back(s["value"].get<std::string>(), s["dense_mb"].get<double>(), s["stored_mb"].get<double>(),
                        s["format"].get<std::string>());
      max_mb = std::max(max_mb, s["dense_mb"].get<double>());
    }
  const int label_w = 220, bar_w = 520, row_h = 22, top = 50;
  const int height = top + int(bars.size()) * row_h + 40;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << label_w + bar_w + 190 << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"10\" y=\"20\" font-size=\"14\">" << title << "</text>\n"
    << "<rect x=\"10\" y=\"30\" width=\"10\" height=\"10\" fill=\"#bbbbbb\"/><text x=\"24\" y=\"39\">dense fp32</text>\n"
    << "<rect x=\"100\" y=\"30\" width=\"10\" height=\"10\" fill=\"#3366cc\"/><text x=\"114\" y=\"39\">stored</text>\n";
  for (size_t i = 0; i < bars.size(); ++i) {
    const auto& [name, dense, stored, format] = bars[i];
    const int y = top + int(i) * row_h;
    const double wd = bar_w * dense / max_mb, ws = bar_w * stored / max_mb;
    o << "<text x=\"" << label_w - 6 << "\" y=\"" << y + 14 << "\" text-anchor=\"end\">" << name << "</text>\n"
      << "<rect x=\"" << label_w << "\" y=\"" << y + 2 << "\" width=\"" << wd << "\" height=\"8\" fill=\"#bbbbbb\"/>\n"
      << "<rect x=\"" << label_w << "\" y=\"" << y + 10 << "\" width=\"" << ws << "\" height=\"8\" fill=\"#3366cc\"/>\n";
    char buf[96];
    std::snprintf(buf, sizeof(buf), "%.2f / %.2f MB %s", stored, dense, format.c_str());
    o << "<text x=\"" << label_w + std::max(wd, ws) + 4 << "\" y=\"" << y + 14 << "\">" << buf << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace

int cmd_memprofile(const MemProfileArgs& a) {
  std::vector<std::string> sets = a.sets;
  if (!a.keep_pages) sets.insert(sets.begin(), "memory.release_pages=true");  // --set may still override
  Config cfg = load_config(a.config, sets);
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  const int64_t n = cfg.train.batch_size;
  // "auto" data keys resolve as in training: the shape from the data (with --synthetic, 3x32x32
  // where there is none), mean / std over the training split (not with --synthetic: unused).
  if (const std::string line = resolve_data_shape(cfg, a.synthetic); !line.empty()) std::printf("%s\n", line.c_str());

  // One training batch of real data (the test split: its images are like the training ones and
  // load faster), augmented as in training; sparsity depends on it.
  std::vector<float> images(size_t(n * cfg.model.channels * cfg.model.height * cfg.model.width));
  std::vector<int32_t> labels(static_cast<size_t>(n), 0);
  std::string data_source = "synthetic N(0, 1)";
  if (!a.synthetic) {
    ImageFolderOptions io;
    io.channels = int(cfg.model.channels);
    io.height = int(cfg.model.height);
    io.width = int(cfg.model.width);
    io.resize = cfg.data.resize;
    if (cfg.stats_auto()) {
      auto train = std::make_shared<const Dataset>(load_dataset(cfg.data.format, cfg.data.root, Split::Train, io));
      std::printf("%s\n", resolve_data_stats(cfg, *training_images(train, cfg)).c_str());
    }
    const Dataset d = load_dataset(cfg.data.format, cfg.data.root, Split::Test, io);
    if (d.channels != cfg.model.channels || d.height != cfg.model.height || d.width != cfg.model.width)
      user_error(d.source, ": images are ", d.channels, "x", d.height, "x", d.width, ", the model expects ",
                 cfg.model.channels, "x", cfg.model.height, "x", cfg.model.width);
    if (d.size < n) user_error(d.source, ": ", d.size, " images, fewer than train.batch_size = ", n);
    LoaderOptions lo;
    lo.batch_size = n;
    lo.seed = cfg.train.seed;
    lo.crop_padding = cfg.data.crop_padding;
    lo.hflip = cfg.data.hflip;
    lo.mean = cfg.data.mean;
    lo.std = cfg.data.std;
    BatchLoader loader(d, lo);
    loader.start_epoch(0);
    loader.next(images.data(), labels.data());
    data_source = d.source;
  } else {
    std::mt19937_64 rng(cfg.train.seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (float& v : images) v = normal(rng);
    for (int32_t& l : labels) l = int32_t(rng() % uint64_t(cfg.model.num_classes));
  }

  const fs::path dir = a.out.empty() ? fs::path(default_run_dir("memprofile-" + cfg.model.name)) : fs::path(a.out);

  for (const char* f : {"memprofile.json", "memprofile.svg"})
    if (fs::exists(dir / f)) user_error("'", (dir / f).string(), "' exists; choose another --out");

  const std::optional<size_t> uss_before = read_uss_bytes();
  Graph g;
  build_model(g, cfg.model);
  auto backend = make_backend(cfg.train.device);
  // A GPU's own memory (cudaMemGetInfo) before the model and after the step, beside the host USS.
  size_t dev_before = 0, dev_after = 0, dev_total = 0;
  const bool dev_usage = backend->memory().usage(&dev_before, &dev_total);
  BudgetPlan budget;  // memory.budget_mb: the planner's choice, shown per layer below
  const StashOptions stash = plan_stash_options(cfg, g, *backend, &budget);
  for (const std::string& line : budget.budget_mb > 0 ? budget.summary() : std::vector<std::string>{})
    std::printf("%s\n", line.c_str());
  Executor ex(g, *backend, stash, cfg.quant_options());
  init_parameters(ex, cfg.train.seed);
  if (!a.checkpoint.empty()) load_checkpoint(a.checkpoint, ex, cfg.model.name);
  else if (!cfg.weights.empty())
    for (const std::string& line : load_weights(cfg.weights, ex).lines) std::printf("%s\n", line.c_str());
  {  // the batch into the backend's input buffers (a copy where the host cannot address them)
    const HostView x(*backend, ex.value(g.image_input), HostView::Write);
    const HostView y(*backend, ex.value(g.label_input), HostView::Write);
    std::copy(images.begin(), images.end(), x.f32());
    std::copy(labels.begin(), labels.end(), y.i32());
  }

  UssRecorder uss(g.num_nodes());
  UssPeak step_peak;  // the peak over the whole profiled step (memory/uss.h), between node samples too
  ex.set_observer(&uss);
  ex.stash().set_count_zero_copy(true);
  SgdOptions sgd = sgd_options(cfg.train);
  sgd.weight_decay = 0.f;  // with lr 0 below: the profiled weights stay as loaded
  for (int s = 0; s < a.steps; ++s) {
    const bool last = s == a.steps - 1;
    uss.active = last;
    if (last) {
      ex.stash().reset_peak();
      ex.set_timing(true);
    }
    ex.set_step_seed(uint64_t(s));
    if (last) step_peak.begin_step();
    // As the trainer: a step that outgrew the stash's room (a GPU's) runs again with more room.
    for (bool again = false;; again = true) {
      ex.set_repeating(again);
      ex.forward(n, true);
      if (last) step_peak.phase();
      ex.backward();
      if (last) step_peak.phase();
      if (!ex.fit_stash_room()) break;
    }
    ex.set_repeating(false);
    // lr 0: the profiled weights stay those of the checkpoint (or the initialisation).
    sgd_update(ex, sgd, 0.f, s == 0);
    if (last) step_peak.end_step();
  }
  // The node samples can only add to the peak where the high-water mark was not available.
  std::optional<size_t> peak = step_peak.peak();
  for (const auto* v : {&uss.after_fwd, &uss.after_bwd})
    for (const std::optional<size_t>& u : *v)
      if (u && (!peak || *u > *peak)) peak = u;
  const std::optional<size_t> step_uss =
      peak && uss_before ? std::optional<size_t>(*peak - std::min(*peak, *uss_before)) : std::nullopt;
  ex.set_observer(nullptr);

  // Rows: one per node, with what it stashed.
  json rows = json::array();
  // Recomputed values (pushed by a recompute in backward, one segment's at a time) are counted apart.
  double dense_total = 0, stored_total = 0, recomputed_total = 0;
  std::printf("%-26s %-22s %-18s %10s %10s %8s %10s %10s\n", "layer", "output", "stashed as", "dense MB", "stored MB",
              "zeros", "USS fwd", "USS bwd");
  for (int node = 0; node < g.num_nodes(); ++node) {
    const Node& nd = g.node(node);
    const Value& out = g.value(nd.output);
    json stashed = json::array();
    for (int id : ex.stashed_by(node)) {
      const StashRecord& r = ex.stash().record(id);
      const Value& v = g.value(id);
      const double dense = double(r.numel) * 4 / kMB, stored = double(r.bytes) / kMB;
      const double zeros = r.nonzero >= 0 && r.numel > 0 ? 1.0 - double(r.nonzero) / double(r.numel) : -1.0;
      const auto& rec = ex.recomputed_by(node);
      const bool recomputed = std::find(rec.begin(), rec.end(), id) != rec.end();
      dense_total += dense;
      (recomputed ? recomputed_total : stored_total) += stored;
      stashed.push_back({{"value", v.name}, {"format", r.stored_as}, {"recomputed", recomputed}, {"dense_mb", dense},
                         {"stored_mb", stored}, {"sparsity", zeros}});
    }
    const std::optional<size_t> uf = uss.after_fwd[size_t(node)], ub = uss.after_bwd[size_t(node)];
    char ufs[16] = "-", ubs[16] = "-";  // "-": USS unavailable
    if (uf) std::snprintf(ufs, sizeof(ufs), "%.1f", double(*uf) / kMB);
    if (ub) std::snprintf(ubs, sizeof(ubs), "%.1f", double(*ub) / kMB);
    rows.push_back({{"layer", nd.name},
                    {"type", nd.op->type()},
                    {"output_shape", shape_str(out.shape, n, out.batched)},
                    {"stashed", stashed},
                    {"uss_after_forward_mb", mb_or_null(uf)},
                    {"uss_after_backward_mb", mb_or_null(ub)},
                    {"forward_ms", ex.forward_seconds()[size_t(node)] * 1e3},
                    {"backward_ms", ex.backward_seconds()[size_t(node)] * 1e3}});
    if (stashed.empty()) {
      std::printf("%-26.26s %-22.22s %-18s %10s %10s %8s %10s %10s\n", nd.name.c_str(),
                  shape_str(out.shape, n, out.batched).c_str(), "-", "", "", "", ufs, ubs);
    } else {
      for (size_t i = 0; i < stashed.size(); ++i) {
        const json& s = stashed[i];
        const double z = s["sparsity"].get<double>();
        char zs[16];
        z >= 0 ? std::snprintf(zs, sizeof(zs), "%.1f%%", 100 * z) : std::snprintf(zs, sizeof(zs), "-");
        std::printf("%-26.26s %-22.22s %-18.18s %10.2f %10.2f %8s %10s %10s\n", i ? "" : nd.name.c_str(),
                    i ? "" : shape_str(out.shape, n, out.batched).c_str(),
                    s["recomputed"].get<bool>() ? "recomputed" : s["format"].get<std::string>().c_str(),
                    s["dense_mb"].get<double>(), s["stored_mb"].get<double>(), zs, ufs, ubs);
      }
    }
  }
  const MemoryReport& m = ex.memory();
  json totals = {{"params_mb", m.params / kMB},
                 {"grads_mb", m.grads / kMB},
                 {"optimizer_mb", m.optimizer / kMB},
                 {"inputs_mb", m.inputs / kMB},
                 {"buffers_mb", m.buffers / kMB},
                 {"activations_planned_mb", m.activations_planned / kMB},
                 {"recompute_buffers_mb", m.recompute / kMB},
                 {"unpack_buffers_mb", m.unpack / kMB},
                 {"workspace_mb", m.workspace / kMB},
                 {"arena_mb", m.total / kMB},
                 {"stash_dense_mb", dense_total},
                 {"stash_stored_mb", stored_total},
                 {"stash_recomputed_mb", recomputed_total},
                 {"stash_peak_mb", double(ex.stash().peak_bytes()) / kMB},
                 {"uss_before_model_mb", mb_or_null(uss_before)},
                 {"peak_uss_mb", mb_or_null(peak)},
                 {"step_uss_mb", mb_or_null(step_uss)},
                 {"uss_method", uss_method_name(peak ? step_peak.method() : UssMethod::None)}};
  std::printf("\nparams %.2f MB, grads %.2f, optimizer %.2f, activations (planned) %.2f, workspace %.2f; "
              "stash %.2f MB stored for %.2f MB dense (%.2fx) + %.2f MB recomputed in backward, stash peak %.2f MB\n",
              m.params / kMB, m.grads / kMB, m.optimizer / kMB, m.activations_planned / kMB, m.workspace / kMB,
              stored_total, dense_total, dense_total > 0 ? stored_total / dense_total : 0.0, recomputed_total,
              double(ex.stash().peak_bytes()) / kMB);
  if (dev_usage) {
    backend->memory().usage(&dev_after, &dev_total);
    std::printf("device memory (the driver's count, all processes): %.1f MB in use before the model, %.1f MB after "
                "the step (+%.1f MB; arena %.1f MB as planned, stash region %.1f MB as fitted), of %.1f MB\n",
                double(dev_before) / kMB, double(dev_after) / kMB, (double(dev_after) - double(dev_before)) / kMB,
                m.total / kMB, double(ex.stash().region_bytes()) / kMB, double(dev_total) / kMB);
    totals["device_used_before_mb"] = double(dev_before) / kMB;
    totals["device_used_after_step_mb"] = double(dev_after) / kMB;
    totals["device_total_mb"] = double(dev_total) / kMB;
    totals["stash_region_mb"] = double(ex.stash().region_bytes()) / kMB;
  }
  const double step_mb = double(step_uss.value_or(0)) / kMB;
  if (step_uss)
    std::printf("USS before the model %.1f MB, peak during the step %.1f MB (step %.1f MB; %s)\n",
                double(*uss_before) / kMB, double(*peak) / kMB, step_mb, uss_method_name(step_peak.method()));
  else
    std::printf("USS unavailable (/proc/self/smaps_rollup and /proc/self/smaps cannot be read)\n");
  if (budget.budget_mb > 0 && budget.device) {  // a budget of the device's memory: what the model added to it
    const double dev_mb = (double(dev_after) - double(dev_before)) / kMB;
    std::printf("memory budget %.1f MB: measured device memory %.1f MB (%s), predicted %.1f MB\n", budget.budget_mb,
                dev_mb, dev_mb <= budget.budget_mb ? "within it" : "OVER it", budget.predicted_mb);
    totals["budget_mb"] = budget.budget_mb;
    totals["budget_predicted_mb"] = budget.predicted_mb;
  } else if (budget.budget_mb > 0 && !step_uss) {
    std::printf("memory budget %.1f MB: step USS unavailable, predicted %.1f MB\n", budget.budget_mb,
                budget.predicted_mb);
  } else if (budget.budget_mb > 0) {
    std::printf("memory budget %.1f MB: measured step USS %.1f MB (%s), predicted %.1f MB\n", budget.budget_mb, step_mb,
                step_mb <= budget.budget_mb ? "within it" : "OVER it", budget.predicted_mb);
    totals["budget_mb"] = budget.budget_mb;
    totals["budget_predicted_mb"] = budget.predicted_mb;
  }

  json doc = {{"model", cfg.model.name},
              {"batch", n},
              {"stash", cfg.memory.stash},
              {"checkpoint_every", cfg.memory.checkpoint_every},
              {"prune_threshold", cfg.memory.prune_threshold},
              {"release_pages", cfg.memory.release_pages},
              {"data", data_source},
              {"weights", a.checkpoint.empty() ? "initialisation" : a.checkpoint},
              {"layers", rows},
              {"totals", totals}};
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) user_error("cannot create output folder '", dir.string(), "': ", ec.message());
  write_atomically(dir / "memprofile.json", doc.dump(1) + "\n");
  write_atomically(dir / "memprofile.svg",
             svg_chart(rows, cfg.model.name + " batch " + std::to_string(n) + ": stash per layer, " + cfg.memory.stash));
  std::printf("wrote %s and %s\n", (dir / "memprofile.json").string().c_str(), (dir / "memprofile.svg").string().c_str());
  std::printf("%s\n", json{{"json", (dir / "memprofile.json").string()}, {"totals", totals}}.dump().c_str());
  return 0;
}

}  // namespace et::app
