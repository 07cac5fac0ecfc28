#include "engine/train/trainer.h"

#include <omp.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "engine/data/auto.h"
#include "engine/data/loader.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/step_replay.h"
#include "engine/train/curves.h"
#include "engine/train/input_feed.h"
#include "engine/train/optimizer.h"
#include "engine/train/schedule.h"
#include "engine/train/weights.h"

namespace et {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

LoaderOptions loader_options(const Config& c, bool train) {
  LoaderOptions o;
  o.batch_size = c.train.batch_size;
  o.shuffle = train;
  o.drop_last = train;
  o.seed = c.train.seed;
  o.crop_padding = train ? c.data.crop_padding : 0;
  o.hflip = train && c.data.hflip;
  o.mean = c.data.mean;
  o.std = c.data.std;
  return o;
}

void check_dataset(const Dataset& d, const Config& c) {
  if (d.size == 0) user_error(d.source, ": the data set is empty");
  if (d.channels != c.model.channels || d.height != c.model.height || d.width != c.model.width)
    user_error(d.source, ": images are ", d.channels, "x", d.height, "x", d.width, ", the model expects ",
               c.model.channels, "x", c.model.height, "x", c.model.width, " (data.channels / data.height / data.width)");
  for (int32_t l : d.labels)
    if (l < 0 || l >= c.model.num_classes)
      user_error(d.source, ": label ", l, " does not fit model.num_classes = ", c.model.num_classes);
}

}  // namespace

int64_t count_correct(Backend& backend, const Tensor& logits, const Tensor& labels, int64_t n) {
  const HostView zv(backend, logits, HostView::Read), yv(backend, labels, HostView::Read);
  const int64_t K = logits.dim(1);
  int64_t correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* z = zv.f32() + i * K;
    const int64_t arg = std::max_element(z, z + K) - z;
    correct += arg == yv.i32()[i];
  }
  return correct;
}

namespace {

// An input at the graph's whole batch, whatever the last forward's batch was: the loader writes up to
// that many images, and a host copy of value() after a short evaluation batch would be too small.
Tensor whole_batch(const Executor& ex, int id) { return ex.value(id).with_batch(ex.graph().value(id).shape.d[0]); }

}  // namespace

Trainer::Trainer(const Config& cfg, bool need_train_split) : cfg_(cfg) {
  if (cfg_.train.threads > 0) omp_set_num_threads(cfg_.train.threads);
  note(resolve_data_shape(cfg_));
  ImageFolderOptions io;
  io.channels = int(cfg_.model.channels);
  io.height = int(cfg_.model.height);
  io.width = int(cfg_.model.width);
  io.resize = cfg_.data.resize;
  // data.mean / std = auto come from the training split, also when only the test split is used.
  if (need_train_split || cfg_.stats_auto())
    train_ = std::make_shared<Dataset>(load_dataset(cfg_.data.format, cfg_.data.root, Split::Train, io));
  test_ = std::make_shared<Dataset>(load_dataset(cfg_.data.format, cfg_.data.root, Split::Test, io));
  build(need_train_split);
}

Trainer::Trainer(const Config& cfg, std::shared_ptr<const Dataset> train, std::shared_ptr<const Dataset> test,
                 std::unique_ptr<Backend> backend)
    : cfg_(cfg), train_(std::move(train)), test_(std::move(test)), backend_(std::move(backend)) {
  if (cfg_.train.threads > 0) omp_set_num_threads(cfg_.train.threads);
  if (cfg_.shape_auto()) {  // the shape of the data sets given
    const Dataset& d = train_ ? *train_ : *test_;
    if (cfg_.model.channels == 0) cfg_.model.channels = d.channels;
    if (cfg_.model.height == 0) cfg_.model.height = d.height;
    if (cfg_.model.width == 0) cfg_.model.width = d.width;
  }
  build(train_ != nullptr);
}

void Trainer::note(const std::string& line) {
  if (!line.empty()) notes_.push_back(line);
}

void Trainer::build(bool keep_train) {
  if (train_) {
    train_ = training_images(train_, cfg_);
    check_dataset(*train_, cfg_);
    note(resolve_data_stats(cfg_, *train_));
    if (!keep_train) {
      train_.reset();
    } else if (train_->size < cfg_.train.batch_size) {
      user_error(train_->source, ": ", train_->size, " training images, fewer than train.batch_size = ",
                 cfg_.train.batch_size);
    }
  } else if (cfg_.stats_auto()) {
    user_error("data.mean / data.std = auto need the training split, and none was given");
  }
  check_data_resolved(cfg_);
  if (cfg_.data.test_subset > 0) test_ = subset_dataset(*test_, cfg_.data.test_subset, cfg_.train.seed + 1);
  check_dataset(*test_, cfg_);

  build_model(graph_, cfg_.model);
  if (!backend_) backend_ = make_backend(cfg_.train.device);
  size_t total = 0;
  device_usage_ = backend_->memory().usage(&device_before_, &total);
  // A budget is planned for training; evaluation keeps the configured plan.
  const StashOptions stash = train_ ? plan_stash_options(cfg_, graph_, *backend_, &budget_) : cfg_.stash_options();
  if (train_ && cfg_.quant.fnt_epochs > 0 && budget_.budget_mb > 0) {
    // The budget holds in both phases: FNT's FP32 activations get a plan of their own, made (or
    // read back) now, so that a budget FNT cannot meet stops the run before its first step.
    Config c = cfg_;
    if (!c.memory_plan_file.empty())
      c.memory_plan_file = (fs::path(c.memory_plan_file).parent_path() / budget_plan_name(true)).string();
    try {
      plan_stash_options(c, graph_, *backend_, &budget_fnt_, true);
    } catch (const UserError& e) {
      user_error("the last quant.fnt_epochs = ", cfg_.quant.fnt_epochs, " epochs (FNT: FP32 activations and gradients) ",
                 "need a memory plan of their own: ", e.what());
    }
  }
  executor_ = std::make_unique<Executor>(graph_, *backend_, stash, cfg_.quant_options());
  replay_ = std::make_unique<StepReplay>(*executor_, cfg_.train.cuda_graph, 2, cfg_.train.cuda_graph_auto);
  init_parameters(*executor_, cfg_.train.seed);
  feed_ = std::make_unique<InputFeed>(*backend_, whole_batch(*executor_, graph_.image_input),
                                      whole_batch(*executor_, graph_.label_input));
  state_.model = cfg_.model.name;
  state_.seed = cfg_.train.seed;
}

Trainer::~Trainer() = default;

namespace {
// A budget plan's formats and recomputation, with the config's keys the plan does not choose
// (page release, the GPU stash's room).
StashOptions with_config_keys(StashOptions planned, const StashOptions& config) {
  planned.release_pages = config.release_pages;
  planned.room_headroom = config.room_headroom;
  planned.first_room = config.first_room;
  return planned;
}
}  // namespace

StashOptions plan_stash_options(const Config& cfg, Graph& g, Backend& backend, BudgetPlan* plan, bool fnt) {
  if (cfg.memory.budget_mb <= 0) return cfg.stash_options(fnt);
  BudgetPlan p;
  if (!cfg.memory_plan_file.empty() && fs::exists(cfg.memory_plan_file)) {
    p = read_budget_plan(cfg.memory_plan_file, g);
  } else {
    BudgetOptions o;
    o.budget_mb = cfg.memory.budget_mb;
    o.lossy = cfg.memory.budget_lossy;
    o.seed = cfg.train.seed;
    p = plan_memory_budget(g, backend, cfg.quant_options(fnt), o, [&](Executor& ex) {
      init_parameters(ex, cfg.train.seed);
      if (!cfg.weights.empty()) load_weights(cfg.weights, ex);  // its sparsity is what training sees
    });
  }
  StashOptions s = with_config_keys(p.options, cfg.stash_options(fnt));
  if (plan) *plan = std::move(p);
  return s;
}

bool Trainer::train_step(int64_t batch, float lr, InputFeed* prefetch) {
  Executor& ex = *executor_;
  ex.set_step_seed(mix(cfg_.train.seed, uint64_t(state_.step)));
  ex.set_step(state_.step);
  // The peak USS over the whole step (memory/uss.h): the kernel's high-water mark from here to the
  // end of the update, or, where it cannot be reset, samples after each phase.
  uss_.begin_step();
  // A step that kept more of a value than the stash had room for (its fixed layout, a GPU's:
  // memory/stash.h) runs again on the same batch, with more room, before its update; that run
  // leaves the BN running statistics as the first one left them.
  bool prefetched = false;  // (a first run that threw before it leaves it to the run again)
  for (bool again = false;; again = true) {
    ex.set_repeating(again);
    bool have_loss = false;
    try {
      // train.cuda_graph: forward and backward replayed together, so the loss is checked after both.
      const bool replayed = !again && replay_->try_step(batch);
      if (!replayed) ex.forward(batch, true);
      if (prefetch && !prefetched) {  // before the loss's readback waits for the forward
        prefetch->prefetch();
        prefetched = true;
      }
      uss_.phase();
      have_loss = true;
      // Checked before the backward, so the parameters are still the step's and the guard can run
      // it again to find where the first non-finite value appeared.
      if (const DivergenceCause c = check_loss(ex.loss(), cfg_.train.divergence_loss); c != DivergenceCause::None) {
        // 4-bit scales in the backend's memory: what a quantizer would have thrown comes first.
        ex.check_quant_finite();
        ex.fit_stash_room();  // (the forward reads nothing back from the stash)
        ex.set_repeating(false);
        return diverged(c, batch, nullptr, true, lr);
      }
      if (!replayed) ex.backward();
      ex.check_quant_finite();  // one read of the flag, forward and backward together
      uss_.phase();
    } catch (const NonFiniteError& e) {  // a quantizer's input, weight or output gradient
      if (ex.fit_stash_room()) continue;  // maybe from values the stash had no room for
      ex.set_repeating(false);
      // (a forward operand's, found after the pass: as the layers' own check, before the loss)
      return diverged(DivergenceCause::NonFiniteValue, batch, &e, have_loss && !e.forward, lr);
    }
    if (!ex.fit_stash_room()) break;
  }
  ex.set_repeating(false);
  // Gradients before the update, so the parameters stay the step's; then the update's own check.
  if (!gradients_finite(ex)) return diverged(DivergenceCause::NonFiniteGradient, batch, nullptr, true, lr);
  if (!sgd_update(ex, sgd_options(cfg_.train), lr, state_.step == 0))
    return diverged(DivergenceCause::NonFiniteUpdate, batch, nullptr, true, lr);
  uss_.end_step();
  ++state_.step;
  return true;
}

QuantOptions Trainer::quant_options(bool fnt) const {
  QuantOptions q = cfg_.quant_options(fnt);
  q.raise_to_fp32(state_.fp32_layers);
  return q;
}

StashOptions Trainer::stash_options(bool fnt) const {
  StashOptions stash = cfg_.stash_options(fnt);
  const BudgetPlan& plan = fnt ? budget_fnt_ : budget_;
  if (plan.budget_mb > 0) stash = with_config_keys(plan.options, stash);
  // A layer raised to FP32 saves its input in f32, so no INT4 codes of it: bitmap_int4 there
  // becomes bitmap_fp32 (exact as well).
  for (auto& [value, format] : stash.layers)
    for (const std::string& layer : state_.fp32_layers)
      for (int n = 0; n < graph_.num_nodes(); ++n)
        if (format == StashFormat::BitmapI4 && graph_.node(n).name == layer &&
            graph_.value(graph_.node(n).inputs[0]).name == value)
          format = StashFormat::BitmapF32;
  return stash;
}

bool Trainer::enter_phase(int epoch) {
  const bool fnt = cfg_.quant.fnt_epochs > 0 && epoch >= cfg_.train.epochs - cfg_.quant.fnt_epochs;
  const bool changed = fnt != fnt_;
  if (!changed && planned_fp32_ == state_.fp32_layers) return false;
  // The state goes through host memory, so the old arena is gone before the new one is mapped.
  std::vector<size_t> sizes;
  std::vector<char> kept;
  for (const Tensor& t : executor_->state_tensors()) {
    sizes.push_back(t.nbytes());
    const HostView v(*backend_, t, HostView::Read);
    kept.insert(kept.end(), static_cast<const char*>(v.data()), static_cast<const char*>(v.data()) + t.nbytes());
  }
  replay_.reset();
  executor_.reset();
  executor_ = std::make_unique<Executor>(graph_, *backend_, stash_options(fnt), quant_options(fnt));
  replay_ = std::make_unique<StepReplay>(*executor_, cfg_.train.cuda_graph, 2, cfg_.train.cuda_graph_auto);
  const std::vector<Tensor> to = executor_->state_tensors();
  ET_CHECK(to.size() == sizes.size(), "state tensors ", to.size(), " vs ", sizes.size());
  size_t at = 0;
  for (size_t i = 0; i < to.size(); ++i) {
    ET_CHECK(to[i].nbytes() == sizes[i], "state tensor ", i, " changed size across the re-plan");
    Tensor dst = to[i];
    backend_->copy_from_host(kept.data() + at, dst);
    at += sizes[i];
  }
  fnt_ = fnt;
  planned_fp32_ = state_.fp32_layers;
  return changed;
}

EpochResult Trainer::train_epoch(int epoch, Progress& progress) {
  Executor& ex = *executor_;
  BatchLoader loader(*train_, loader_options(cfg_, true));
  loader.start_epoch(epoch);
  const int64_t steps = loader.batches_per_epoch();
  const Tensor images = whole_batch(ex, graph_.image_input), labels = whole_batch(ex, graph_.label_input);
  feed_->start(loader, images, labels);
  // The stash's room (fixed layout) follows this epoch's sparsity, not the largest of every epoch.
  ex.stash().forget_kept();
  EpochResult r;
  r.epoch = epoch + 1;
  r.fnt = fnt_;
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  uss_.reset();
  ex.stash().reset_peak();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t n = feed_->next();
    ET_CHECK(n == cfg_.train.batch_size, "train loader returned ", n);
    // lr_factor is 1 unless the guard rolled back (exact: float(double(x) * 1) == x).
    const float lr = float(double(learning_rate(cfg_.train, cfg_.quant, epoch + double(i) / double(steps))) *
                           state_.lr_factor);
    if (before_step_) before_step_(ex, state_.step);
    // The next batch crosses while this step computes (engine/train/input_feed.h).
    if (!train_step(n, lr, i + 1 < steps ? feed_.get() : nullptr)) {
      divergence_batch_ = i + 1;
      divergence_batches_ = steps;
      r.diverged = true;
      return r;
    }
    r.lr = lr;
    loss_sum += double(ex.loss()) * double(n);
    correct += count_correct(*backend_, ex.value(graph_.logits), labels, n);
    seen += n;
    const double el = std::chrono::duration<double>(Clock::now() - t0).count();
    StepStatus s;
    s.epoch = epoch + 1;
    s.epochs = cfg_.train.epochs;
    s.step = i + 1;
    s.steps = steps;
    s.loss = loss_sum / double(seen);
    s.acc = double(correct) / double(seen);
    s.img_per_s = double(seen) / el;
    s.eta_s = el / double(i + 1) * double(steps - i - 1) +
              el / double(i + 1) * double(steps) * double(cfg_.train.epochs - epoch - 1);
    s.uss_mb = uss_mb_or_negative(uss_.peak());
    s.lr = lr;
    progress.step(s);
  }
  r.epoch_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.img_per_s = double(seen) / r.epoch_s;
  r.train_loss = loss_sum / double(seen);
  r.train_acc = double(correct) / double(seen);
  r.stash_peak_mb = double(ex.stash().peak_bytes()) / 1048576.0;
  return r;
}

EvalResult Trainer::evaluate(bool keep_logits) {
  Executor& ex = *executor_;
  BatchLoader loader(*test_, loader_options(cfg_, false));
  loader.start_epoch(0);
  const Tensor images = whole_batch(ex, graph_.image_input), labels = whole_batch(ex, graph_.label_input);
  feed_->start(loader, images, labels);
  EvalResult r;
  double loss_sum = 0;
  int64_t correct = 0;
  for (;;) {
    const int64_t n = feed_->next();
    if (n == 0) break;
    uss_.begin_step();
    ex.forward(n, false);
    feed_->prefetch();  // the next batch crosses while this one's forward runs
    ex.check_quant_finite();  // (4-bit scales in the backend's memory: what a quantizer would throw)
    uss_.end_step();
    loss_sum += double(ex.loss()) * double(n);
    correct += count_correct(*backend_, ex.value(graph_.logits), labels, n);
    r.images += n;
    if (keep_logits) {
      const Tensor z = ex.value(graph_.logits);
      const HostView zv(*backend_, z, HostView::Read), yv(*backend_, labels, HostView::Read);
      r.logits.insert(r.logits.end(), zv.f32(), zv.f32() + n * z.dim(1));
      r.labels.insert(r.labels.end(), yv.i32(), yv.i32() + n);
    }
  }
  r.loss = loss_sum / double(r.images);
  r.acc = double(correct) / double(r.images);
  return r;
}

void Trainer::fit(const std::string& out_dir, bool resume, Progress& progress, int max_epochs) {
  const fs::path dir(out_dir);
  const fs::path ckpt = dir / "checkpoint_last.ckpt", metrics = dir / "metrics.jsonl";
  std::vector<std::string> kept_lines;
  bool from_checkpoint = false;
  for (const bool fnt : {false, true}) {
    const BudgetPlan& plan = fnt ? budget_fnt_ : budget_;
    if (plan.budget_mb <= 0) continue;
    // The plan goes into the run folder first: a resumed run keeps it (Config::memory_plan_file).
    const fs::path file = dir / budget_plan_name(fnt);
    if (!fs::exists(file)) write_file_durably(file.string(), budget_plan_json(plan));
    const std::string phase = fnt ? "FNT " : "";
    if (plan.calibration_s > 0)
      for (const std::string& line : plan.summary()) progress.line(phase + line);
    else
      progress.line(phase + "memory budget " + std::to_string(int(plan.budget_mb)) + " MB: the run's plan from " +
                    file.string());
  }
  if (resume && !fs::exists(ckpt)) {
    // A run stopped during its first epoch leaves config.json (the caller compared it) and no
    // checkpoint. Its first steps are all there was to it, so it starts over: the same run. The
    // record of epoch 1 may be there (it is written before the epoch's checkpoint); a later one
    // means checkpoints were written and lost.
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      bool epoch_record = false;
      try {
        const json j = json::parse(line);
        epoch_record = j.contains("train_loss") && !(j.value("epoch", json()) == json(1));
      } catch (const json::exception&) {
      }
      if (epoch_record)
        user_error("cannot resume: '", ckpt.string(), "' does not exist, but '", metrics.string(),
                   "' records finished epochs (the checkpoint was lost); start a new run");
    }
    progress.line(fmt("resuming ", out_dir, ": it has no checkpoint yet (it stopped during its first epoch), so it "
                      "starts from the beginning"));
  } else if (resume) {
    from_checkpoint = true;
    try {
      state_ = load_checkpoint(ckpt.string(), *executor_, cfg_.model.name);
    } catch (const UserError& e) {  // never start over silently: the run's epochs would be lost
      user_error("cannot resume ", out_dir, ": ", e.what(),
                 ". The run folder is left as it is: restore the checkpoint from a copy, or start a new run");
    }
    if (state_.seed != cfg_.train.seed)
      user_error(ckpt.string(), ": checkpoint was trained with train.seed = ", state_.seed, ", the config says ",
                 cfg_.train.seed);
    // Keep the metrics of the epochs the checkpoint covers; drop any written after it.
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      try {
        if (json::parse(line).at("epoch").get<int>() <= state_.epoch + 1) kept_lines.push_back(line);
      } catch (const json::exception&) {
      }
    }
    progress.line(fmt("resuming ", out_dir, " after epoch ", state_.epoch + 1, " (step ", state_.step, ")"));
  }
  // A new run starts from model.weights where given (a resumed one has them in its checkpoint).
  if (!from_checkpoint && !cfg_.weights.empty())
    for (const std::string& line : load_weights(cfg_.weights, *executor_).lines) progress.line(line);
  {
    // Replaced, not rewritten in place: a kill here leaves the old file for the next --resume.
    std::string text;
    for (const auto& l : kept_lines) text += l + "\n";
    write_file_durably(metrics.string(), text);
  }
  const MemoryReport& m = executor_->memory();
  const size_t all_params = executor_->graph().params().size(), trained = executor_->params().size();
  progress.line(fmt("model ", cfg_.model.name, ": ", all_params, " parameter tensors",
                    trained < all_params ? fmt(" (", trained, " trained, ", all_params - trained, " frozen)") : "",
                    ", arena ",
                    m.total / 1048576, " MB (params ", m.params / 1048576.0, " MB, activations planned ",
                    m.activations_planned / 1048576, " MB of ", m.activations_unplanned / 1048576, " MB unplanned)"));
  const int first = state_.epoch + 1;
  const int end = max_epochs > 0 ? std::min(cfg_.train.epochs, first + max_epochs) : cfg_.train.epochs;
  for (int epoch = first; epoch < end; ++epoch) {
    if (enter_phase(epoch) && fnt_) {
      const int fe = cfg_.quant.fnt_epochs, main = cfg_.train.epochs - fe;
      const float low = learning_rate(cfg_.train, cfg_.quant, main);
      progress.line(fmt("epoch ", epoch + 1, ": FNT ", epoch == main ? "starts" : "resumes", " (epochs ", main + 1, "..",
                        cfg_.train.epochs, ", quant.fnt_epochs): FP32 activations and gradients, INT4 weights; lr ",
                        low, " -> ", cfg_.quant.fnt_peak_lr, " -> ", low, "; arena ",
                        executor_->memory().total / 1048576, " MB"));
    }
    EpochResult r = train_epoch(epoch, progress);
    if (cfg_.train.cuda_graph && epoch == first)
      progress.line(replay_->replaying() ? std::string("train.cuda_graph: the steps replay a recorded CUDA graph")
                                         : "train.cuda_graph: the steps run op by op: " + replay_->why_not());
    if (r.diverged) {
      epoch = handle_divergence(epoch, out_dir, progress);  // throws, or rolls back
      continue;
    }
    const EvalResult ev = evaluate();
    r.test_loss = ev.loss;
    r.test_acc = ev.acc;
    r.peak_uss_mb = uss_mb_or_negative(uss_.peak());
    size_t used = 0, total = 0;
    if (device_usage_ && backend_->memory().usage(&used, &total))
      r.device_mb = (double(used) - double(device_before_)) / 1048576.0;
    state_.epoch = epoch;
    state_.best_test_acc = std::max(state_.best_test_acc, r.test_acc);
    json j = {{"epoch", r.epoch},       {"train_loss", r.train_loss}, {"train_acc", r.train_acc},
              {"test_loss", r.test_loss}, {"test_acc", r.test_acc},   {"lr", r.lr},
              {"img_per_s", r.img_per_s}, {"epoch_s", r.epoch_s},     {"peak_uss_mb", r.peak_uss_mb >= 0 ? json(r.peak_uss_mb) : json()},
              {"uss_method", uss_method_name(uss_.method())}, {"stash_peak_mb", r.stash_peak_mb}, {"fnt", r.fnt}};
    if (r.device_mb >= 0) j["device_mb"] = r.device_mb;
    // The record first, then the checkpoint that covers it: a kill between the two leaves a record
    // newer than the checkpoint, which --resume drops (never a checkpoint without its record).
    append_metrics(out_dir, j);
    save_checkpoint(ckpt.string(), *executor_, state_);
    write_run_curves(out_dir, run_name(out_dir) + " (" + cfg_.model.name + ")");
    progress.line(fmt("epoch ", r.epoch, "/", cfg_.train.epochs, ": train loss ", r.train_loss, " acc ", r.train_acc,
                      " | test loss ", r.test_loss, " acc ", r.test_acc, " | ", int(r.img_per_s), " img/s, ",
                      format_duration(r.epoch_s), ", peak USS ",
                      r.peak_uss_mb >= 0 ? fmt(int(r.peak_uss_mb), " MB") : std::string("unavailable"),
                      r.device_mb >= 0 ? fmt(", device memory ", int(r.device_mb), " MB") : std::string(),
                      r.fnt ? " [FNT]" : ""));
  }
}

}  // namespace et
