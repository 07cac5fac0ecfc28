// `edgetrain train` and `edgetrain eval`.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "apps/commands.h"
#include "engine/data/auto.h"
#include "engine/train/trainer.h"
#include "engine/train/weights.h"

namespace et::app {
namespace fs = std::filesystem;
using json = nlohmann::json;

std::string default_run_dir(const std::string& prefix) {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M%S", std::localtime(&now));
  return "runs/" + prefix + "-" + buf;
}

void write_atomically(const fs::path& path, const std::string& text) { write_file_durably(path.string(), text); }

namespace {

// Keys a resumed run may change: the number of epochs (extend a run), the thread count (bit-exact
// reproduction needs the same count, the training itself is the same), the device (a checkpoint
// holds host values: a run moves between devices) and the CUDA graph (the same numbers), the data
// root (the run moved to another machine), the fusion section (fused and unfused training are bit-identical)
// and the divergence guard's (they decide only what happens once a step has diverged: a run
// stopped by the guard continues with on_divergence = rollback; a rollback's lower learning rate
// is in the checkpoint, not in these keys). Older runs' config.json lack the guard's and the
// fusion keys: skipped here, they do not count as differences either.
bool resumable_key(const std::string& key) {
  static const char* const keys[] = {"train.epochs",
                                     "train.threads",
                                     "train.device",
                                     "train.cuda_graph",
                                     "data.root",
                                     "fusion",
                                     "train.on_divergence",
                                     "train.divergence_loss",
                                     "train.divergence_lr_factor",
                                     "train.divergence_max_rollbacks"};
  for (const char* k : keys)
    if (key == k) return true;
  return false;
}

// The dotted keys where two resolved configs differ, all of them (a derived default such as
// quant.fnt_peak_lr = 0.1 * train.lr differs along with its source), except resumable_key()s.
void differences(const json& a, const json& b, const std::string& path, std::vector<std::string>* out) {
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string key = path.empty() ? it.key() : path + "." + it.key();
      if (resumable_key(key)) continue;
      if (!b.contains(it.key())) out->push_back(key);
      else differences(*it, b[it.key()], key, out);
    }
    for (auto it = b.begin(); it != b.end(); ++it) {
      const std::string key = path.empty() ? it.key() : path + "." + it.key();
      if (!a.contains(it.key()) && !resumable_key(key)) out->push_back(key);
    }
    return;
  }
  if (a != b) out->push_back(path.empty() ? "<top>" : path);
}

// Holds *.tmp files and nothing else: what a kill while config.json was being written leaves.
bool only_temporary_files(const fs::path& dir) {
  std::error_code ec;
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".tmp") return false;
    ++n;
  }
  return !ec && n > 0;
}

}  // namespace

int cmd_train(const TrainArgs& a) {
  Config cfg = load_config(a.config, a.sets);
  const std::string out = a.out.empty() ? default_run_dir(cfg.model.name) : a.out;
  if (a.resume) cfg.memory_plan_file = (fs::path(out) / budget_plan_name(false)).string();
  const fs::path dir(out);
  std::error_code ec;
  bool fresh = false;  // --resume of a run that never started
  std::string note;
  std::vector<std::string> adopted;  // auto data keys filled from the run's config.json
  if (a.resume) {
    if (a.out.empty()) user_error("--resume needs --out DIR (the run to continue)");
    if (!fs::is_directory(dir, ec))
      user_error("cannot resume: run folder '", out, "' does not exist (no config.json, no checkpoint_last.ckpt)");
    // config.json is what makes a folder a run: without checkpoint_last.ckpt (stopped during its
    // first epoch) the run starts over (Trainer::fit), after the same comparison. A folder with
    // nothing but temporary files was stopped while writing config.json: it starts afresh.
    if (!fs::exists(dir / "config.json") && only_temporary_files(dir)) {
      fresh = true;
      note = "resuming " + out + ": it has no config.json yet (it stopped before it started), so it starts";
    }
  }
  if (a.resume && !fresh) {
    std::ifstream in(dir / "config.json");
    json saved;
    try {
      saved = json::parse(in);
    } catch (const json::exception&) {
      user_error("cannot resume: '", (dir / "config.json").string(), "' is missing or malformed",
                 fs::exists(dir / "checkpoint_last.ckpt") ? "" : " (and there is no checkpoint_last.ckpt)");
    }
    // Keys added after a run was written have their then-implied values.
    if (saved.contains("model") && saved["model"].is_object()) {
      if (!saved["model"].contains("shortcut")) saved["model"]["shortcut"] = "B";
      if (!saved["model"].contains("weights")) saved["model"]["weights"] = "";
    }
    if (saved.contains("memory") && saved["memory"].is_object()) {
      if (!saved["memory"].contains("budget_mb")) saved["memory"]["budget_mb"] = 0;
      if (!saved["memory"].contains("budget_lossy")) saved["memory"]["budget_lossy"] = false;
    }
    if (!saved.contains("finetune")) saved["finetune"] = {{"trainable", "all"}, {"bn", "train"}};
    // "auto" data keys take the numbers the run's start resolved them to (engine/data/auto.h).
    adopted = adopt_saved_data(cfg, saved);
    std::vector<std::string> diff;
    differences(cfg.resolved(), saved, "", &diff);
    if (!diff.empty()) {
      std::string keys;
      for (const std::string& k : diff) keys += (keys.empty() ? "'" : ", '") + k + "'";
      user_error("cannot resume: config key", diff.size() > 1 ? "s " : " ", keys, diff.size() > 1 ? " differ" : " differs",
                 " from the run's ", (dir / "config.json").string());
    }
  } else if (!a.resume && fs::exists(dir) && !fs::is_empty(dir, ec)) {
    user_error("output folder '", out, "' already holds files; choose another --out or add --resume");
  }

  const bool folder_existed = fs::exists(dir, ec);
  // Load data and build the model before creating anything on disk.
  Trainer trainer(cfg, true);
  fs::create_directories(dir, ec);
  if (ec) user_error("cannot create output folder '", out, "': ", ec.message());
  write_atomically(dir / "config.json", trainer.config().resolved().dump(2) + "\n");

  Progress progress;
  if (!note.empty()) progress.line(note);
  for (const std::string& line : trainer.notes()) progress.line(line);
  if (!adopted.empty()) {
    std::string keys;
    for (const std::string& k : adopted) keys += (keys.empty() ? "" : ", ") + k;
    progress.line(fmt(keys, " = auto: the run's values from ", (dir / "config.json").string()));
    // The run keeps its normalisation; say so if the training images now give other numbers.
    const Config& rc = trainer.config();
    const bool mean_auto = std::count(adopted.begin(), adopted.end(), "data.mean") > 0;
    const bool std_auto = std::count(adopted.begin(), adopted.end(), "data.std") > 0;
    if ((mean_auto || std_auto) && trainer.train_data()->channels == rc.model.channels) {
      const ChannelStats st = channel_stats(*trainer.train_data());
      bool same = true;
      for (size_t c = 0; c < st.mean.size(); ++c)
        same &= (!mean_auto || float(st.mean[c]) == rc.data.mean[c]) && (!std_auto || float(st.std[c]) == rc.data.std[c]);
      if (!same)
        progress.line("note: the training images now give another data.mean / data.std than the run started with; "
                      "it keeps its own (config.json)");
    }
  }
  progress.line(fmt("run folder ", out, "; ", trainer.train_data()->size, " training images from ", cfg.data.root));
  try {
    trainer.fit(out, a.resume && !fresh, progress, a.stop_after);
  } catch (const UserError&) {
    // Out of device memory in the first step, say: a new run that recorded nothing leaves no folder.
    if ((!a.resume || fresh) && discard_unstarted_run(out, !folder_existed))
      progress.line(fmt("run folder ", out, folder_existed ? " emptied" : " removed",
                        ": the run stopped before it recorded anything"));
    throw;
  }
  return 0;
}

int cmd_eval(const EvalArgs& a) {
  const Config given = load_config(a.config, a.sets);
  if (a.checkpoint.empty() && given.weights.empty())
    user_error("eval needs weights: --checkpoint FILE, or model.weights (--set model.weights=FILE)");
  // "auto" data keys resolve as in training (mean / std over the training split); the run's
  // config.json holds them resolved and reproduces the run's inputs without that pass.
  Trainer trainer(given, false);
  const Config& cfg = trainer.config();
  for (const std::string& line : trainer.notes()) std::printf("%s\n", line.c_str());
  json j = {{"model", cfg.model.name}};
  std::string what;
  if (!a.checkpoint.empty()) {
    const TrainProgress pr = load_checkpoint(a.checkpoint, trainer.executor(), cfg.model.name);
    trainer.progress_state().fp32_layers = pr.fp32_layers;  // layers a rollback raised to FP32
    trainer.enter_phase(pr.epoch);  // a checkpoint from an FNT epoch runs with INT4 weights, FP32 inputs
    what = fmt("after epoch ", pr.epoch + 1);
    j["epoch"] = pr.epoch + 1;
  } else {
    const WeightsReport w = load_weights(cfg.weights, trainer.executor());
    for (const std::string& line : w.lines) std::printf("%s\n", line.c_str());
    what = "with weights " + cfg.weights;
    j["weights"] = cfg.weights;
  }
  const EvalResult r = trainer.evaluate(!a.predictions.empty());
  if (!a.predictions.empty()) {
    // One line per test image, in the data set's order: index, label, predicted class, logits.
    const int64_t K = cfg.model.num_classes;
    std::string csv = "index,label,predicted";
    for (int64_t k = 0; k < K; ++k) csv += ",logit" + std::to_string(k);
    csv += "\n";
    char buf[32];
    for (int64_t i = 0; i < r.images; ++i) {
      const float* z = r.logits.data() + i * K;
      csv += std::to_string(i) + "," + std::to_string(r.labels[size_t(i)]) + "," +
             std::to_string(std::max_element(z, z + K) - z);
      for (int64_t k = 0; k < K; ++k) {
        std::snprintf(buf, sizeof(buf), ",%.9g", double(z[k]));
        csv += buf;
      }
      csv += "\n";
    }
    write_atomically(a.predictions, csv);
  }
  std::printf("%s %s: test loss %.4f, test accuracy %.4f on %lld images\n", cfg.model.name.c_str(), what.c_str(),
              r.loss, r.acc, (long long)r.images);
  j["test_loss"] = r.loss;
  j["test_acc"] = r.acc;
  j["images"] = r.images;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace et::app
