// The config sections' parsers (engine/config_reader.h): read, default, check, name the key.
#include <algorithm>
#include <cmath>
#include <filesystem>

#include "engine/config_reader.h"
#include "memory/stash.h"

namespace et {
namespace config_detail {

namespace fs = std::filesystem;

// model: the network and its weights.
void parse_model(ObjectReader& top, Config& c) {
  ObjectReader m = top.child("model");
  m.get("name", c.model.name);
  m.get("num_classes", c.model.num_classes);
  m.get("dropout", c.model.dropout);
  std::string shortcut = "B";
  m.get("shortcut", shortcut);
  m.get("weights", c.weights);
  m.finish();
  require(shortcut == "A" || shortcut == "B", m, "shortcut", shortcut, "must be \"A\" or \"B\"");
  c.model.shortcut = shortcut[0];
  if (c.model.shortcut == 'A' && c.model.name.rfind("resnet", 0) != 0)
    m.fail("model.shortcut", "= \"A\": only the ResNets have shortcuts (model.name = " + c.model.name + ")");
  const auto names = model_names();
  if (std::find(names.begin(), names.end(), c.model.name) == names.end()) {
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    m.fail("model.name", "= \"" + c.model.name + "\": unknown model (known: " + known + ")");
  }
  require(c.model.num_classes >= 2, m, "num_classes", c.model.num_classes, "must be at least 2");
  require(c.model.dropout >= 0.f && c.model.dropout < 1.f, m, "dropout", c.model.dropout, "must be in [0, 1)");
}

// data: where the images are and how they are shaped and normalised ("auto" keys: engine/data/auto.h).
void parse_data(ObjectReader& top, Config& c, const std::string& source) {
  ObjectReader d = top.child("data");
  d.get("format", c.data.format);
  d.get("root", c.data.root);
  // "auto" (absent or "auto"): 0 channels / height / width, empty mean / std (engine/data/auto.h).
  const bool auto_channels = d.get_or_auto("channels", c.model.channels, "1 or 3");
  const bool auto_height = d.get_or_auto("height", c.model.height, "an integer");
  const bool auto_width = d.get_or_auto("width", c.model.width, "an integer");
  d.get("resize", c.data.resize);
  d.get("crop_padding", c.data.crop_padding);
  d.get("hflip", c.data.hflip);
  const bool auto_mean = d.get_or_auto("mean", c.data.mean, "an array of numbers");
  const bool auto_std = d.get_or_auto("std", c.data.std, "an array of numbers");
  d.get("train_subset", c.data.train_subset);
  d.get("test_subset", c.data.test_subset);
  d.finish();
  require(c.data.format == "image_folder" || c.data.format == "cifar10_binary", d, "format", c.data.format,
          "must be \"image_folder\" or \"cifar10_binary\"");
  if (c.data.root.empty()) d.fail("data.root", "is required (the folder holding the data set)");
  require(c.data.resize == "none" || c.data.resize == "stretch" || c.data.resize == "center_crop", d, "resize",
          c.data.resize, "must be \"none\", \"stretch\" or \"center_crop\"");
  if (auto_channels) c.model.channels = 0;
  if (auto_height) c.model.height = 0;
  if (auto_width) c.model.width = 0;
  if (auto_mean) c.data.mean.clear();
  if (auto_std) c.data.std.clear();
  const int64_t ch = c.model.channels;
  require(auto_channels || ch == 1 || ch == 3, d, "channels", ch, "must be 1, 3 or \"auto\"");
  for (const char* key : {"height", "width"}) {
    const int64_t v = key[0] == 'h' ? c.model.height : c.model.width;
    require((key[0] == 'h' ? auto_height : auto_width) || (v >= 8 && v <= 1024), d, key, v,
            "must be in 8..1024 or \"auto\"");
  }
  require(auto_mean || !c.data.mean.empty(), d, "mean", "[]", "needs one value per channel, or \"auto\"");
  require(auto_std || !c.data.std.empty(), d, "std", "[]", "needs one value per channel, or \"auto\"");
  require(c.data.crop_padding >= 0 && c.data.crop_padding <= 64, d, "crop_padding", c.data.crop_padding,
          "must be in 0..64");
  // One value per channel; with data.channels = auto, 1 or 3 (checked against the data once known).
  for (const auto* v : {&c.data.mean, &c.data.std}) {
    const char* key = v == &c.data.mean ? "mean" : "std";
    if (v->empty()) continue;
    if (ch > 0)
      require(v->size() == size_t(ch), d, key, fmt(v->size(), " values"), fmt("needs one per channel (", ch, ")").c_str());
    else
      require(v->size() == 1 || v->size() == 3, d, key, fmt(v->size(), " values"),
              "needs one per channel: 1 or 3 values, or \"auto\"");
  }
  require(c.data.mean.empty() || c.data.std.empty() || c.data.mean.size() == c.data.std.size(), d, "std",
          fmt(c.data.std.size(), " values"), fmt("data.mean has ", c.data.mean.size(), ": one each per channel").c_str());
  for (float s : c.data.std) require(std::isfinite(s) && s > 0.f, d, "std", s, "must be positive");
  for (float m : c.data.mean) require(std::isfinite(m), d, "mean", m, "must be finite");
  require(c.data.train_subset >= 0 && c.data.test_subset >= 0, d, "train_subset", c.data.train_subset,
          "subsets must be >= 0");
  // Relative paths are taken from the working directory first, else from the config's folder.
  for (std::string* path : {&c.data.root, &c.weights}) {
    if (path->empty() || !fs::path(*path).is_relative() || source.empty() || source == "<memory>") continue;
    if (!fs::exists(*path)) {
      const fs::path alt = fs::path(source).parent_path() / *path;
      if (fs::exists(alt)) *path = alt.lexically_normal().string();
    }
  }
}

// train: the optimisation, its schedule and the divergence guard.
void parse_train(ObjectReader& top, Config& c) {
  ObjectReader t = top.child("train");
  TrainConfig& tr = c.train;
  t.get("epochs", tr.epochs);
  t.get("batch_size", tr.batch_size);
  t.get("lr", tr.lr);
  t.get("momentum", tr.momentum);
  t.get("nesterov", tr.nesterov);
  t.get("weight_decay", tr.weight_decay);
  t.get("label_smoothing", tr.label_smoothing);
  t.get("seed", tr.seed);
  t.get("threads", tr.threads);
  t.get("device", tr.device);
  tr.cuda_graph_auto = t.get_or_auto("cuda_graph", tr.cuda_graph, "true or false");
  if (tr.cuda_graph_auto) tr.cuda_graph = tr.device != "cpu";
  tr.divergence_loss = float(100.0 * std::log(double(c.model.num_classes)));  // see TrainConfig
  t.get("divergence_loss", tr.divergence_loss);
  t.get("on_divergence", tr.on_divergence);
  t.get("divergence_lr_factor", tr.divergence_lr_factor);
  t.get("divergence_max_rollbacks", tr.divergence_max_rollbacks);
  ObjectReader s = t.child("schedule");
  ScheduleConfig& sc = tr.schedule;
  s.get("type", sc.type);
  s.get("milestones", sc.milestones);
  s.get("gamma", sc.gamma);
  s.get("warmup_epochs", sc.warmup_epochs);
  s.get("warmup_start_factor", sc.warmup_start_factor);
  s.get("min_lr", sc.min_lr);
  s.get("pct_start", sc.pct_start);
  s.get("div_factor", sc.div_factor);
  s.get("final_div_factor", sc.final_div_factor);
  s.finish();
  t.finish();
  require(tr.epochs >= 1 && tr.epochs <= 100000, t, "epochs", tr.epochs, "must be in 1..100000");
  require(tr.batch_size >= 1 && tr.batch_size <= 65536, t, "batch_size", tr.batch_size, "must be in 1..65536");
  require(tr.lr > 0.f && tr.lr < 100.f, t, "lr", tr.lr, "must be in (0, 100)");
  require(tr.momentum >= 0.f && tr.momentum < 1.f, t, "momentum", tr.momentum, "must be in [0, 1)");
  require(!tr.nesterov || tr.momentum > 0.f, t, "nesterov", tr.nesterov, "needs momentum > 0");
  require(tr.weight_decay >= 0.f && tr.weight_decay < 1.f, t, "weight_decay", tr.weight_decay, "must be in [0, 1)");
  require(tr.label_smoothing >= 0.f && tr.label_smoothing < 1.f, t, "label_smoothing", tr.label_smoothing,
          "must be in [0, 1)");
  require(tr.threads >= 0 && tr.threads <= 1024, t, "threads", tr.threads, "must be in 0..1024 (0 = all cores)");
  const bool cuda_index = tr.device.size() > 5 && tr.device.size() <= 8 && tr.device.compare(0, 5, "cuda:") == 0 &&
                          tr.device.find_first_not_of("0123456789", 5) == std::string::npos;
  require(tr.device == "cpu" || tr.device == "cuda" || cuda_index, t, "device", tr.device,
          "must be \"cpu\", \"cuda\" or \"cuda:N\" (N: the device index)");
  require(!tr.cuda_graph || tr.device != "cpu", t, "cuda_graph", tr.cuda_graph,
          "records the step as a CUDA graph: it needs train.device = \"cuda\"");
  require(std::isfinite(tr.divergence_loss) && tr.divergence_loss > 0.f, t, "divergence_loss", tr.divergence_loss,
          "must be finite and > 0 (the loss above which a step counts as diverged)");
  require(tr.on_divergence == "stop" || tr.on_divergence == "rollback", t, "on_divergence", tr.on_divergence,
          "must be \"stop\" or \"rollback\"");
  require(tr.divergence_lr_factor > 0.f && tr.divergence_lr_factor < 1.f, t, "divergence_lr_factor",
          tr.divergence_lr_factor, "must be in (0, 1)");
  require(tr.divergence_max_rollbacks >= 1 && tr.divergence_max_rollbacks <= 100, t, "divergence_max_rollbacks",
          tr.divergence_max_rollbacks, "must be in 1..100");
  require(sc.type == "multistep" || sc.type == "cosine" || sc.type == "onecycle" || sc.type == "constant", s, "type",
          sc.type, "must be \"multistep\", \"cosine\", \"onecycle\" or \"constant\"");
  for (size_t i = 0; i < sc.milestones.size(); ++i)
    require(sc.milestones[i] >= 1 && (i == 0 || sc.milestones[i] > sc.milestones[i - 1]), s, "milestones",
            sc.milestones[i], "milestones must be increasing epochs >= 1");
  require(sc.gamma > 0.f && sc.gamma <= 1.f, s, "gamma", sc.gamma, "must be in (0, 1]");
  require(sc.warmup_epochs >= 0.f && sc.warmup_epochs < float(tr.epochs), s, "warmup_epochs", sc.warmup_epochs,
          "must be in [0, train.epochs)");
  require(sc.warmup_start_factor > 0.f && sc.warmup_start_factor <= 1.f, s, "warmup_start_factor",
          sc.warmup_start_factor, "must be in (0, 1]");
  require(sc.min_lr >= 0.f && sc.min_lr <= tr.lr, s, "min_lr", sc.min_lr, "must be in [0, train.lr]");
  require(sc.pct_start > 0.f && sc.pct_start < 1.f, s, "pct_start", sc.pct_start, "must be in (0, 1)");
  require(sc.div_factor >= 1.f, s, "div_factor", sc.div_factor, "must be >= 1");
  require(sc.final_div_factor >= 1.f, s, "final_div_factor", sc.final_div_factor, "must be >= 1");
}

// memory: stash formats, recomputation, the budget.
void parse_memory(ObjectReader& top, Config& c) {
  ObjectReader mem = top.child("memory");
  mem.get("stash", c.memory.stash);
  mem.get("prune_threshold", c.memory.prune_threshold);
  mem.get("checkpoint_every", c.memory.checkpoint_every);
  mem.get("release_pages", c.memory.release_pages);
  mem.get("stash_headroom", c.memory.stash_headroom);
  mem.get("double_mask_bn", c.memory.double_mask_bn);
  c.memory.recompute_stack_outputs_auto =
      mem.get_or_auto("recompute_stack_outputs", c.memory.recompute_stack_outputs, "true or false");
  mem.get_string_map("layers", c.memory.layers);
  mem.get("budget_mb", c.memory.budget_mb);
  mem.get("budget_lossy", c.memory.budget_lossy);
  mem.finish();
  StashFormat sf;
  require(parse_stash_format(c.memory.stash, &sf), mem, "stash", c.memory.stash,
          ("unknown stash format (known: " + stash_format_names() + ")").c_str());
  for (const auto& [layer, f] : c.memory.layers)
    if (!parse_stash_format(f, &sf))
      mem.fail("memory.layers." + layer, "= \"" + f + "\": unknown stash format (known: " + stash_format_names() + ")");
  require(c.memory.prune_threshold >= 0.f && c.memory.prune_threshold <= 1.f, mem, "prune_threshold",
          c.memory.prune_threshold, "must be in [0, 1]");
  require(std::isfinite(c.memory.stash_headroom) && c.memory.stash_headroom <= 10, mem, "stash_headroom",
          c.memory.stash_headroom, "must be a fraction <= 10 (0.02 = 2 % more room than the most kept; < 0 = worst case)");
  require(c.memory.checkpoint_every >= 0, mem, "checkpoint_every", c.memory.checkpoint_every,
          "must be >= 0 (0 = no recomputation, m = keep one layer in m)");
  require(c.memory.budget_mb >= 0 && std::isfinite(c.memory.budget_mb), mem, "budget_mb", c.memory.budget_mb,
          "must be a number of MB >= 0 (0 = no budget)");
  if (c.memory.budget_mb > 0) {
    // The budget's planner chooses these per tensor; a fixed choice would contradict it.
    require(c.memory.stash == "dense_fp32" && c.memory.layers.empty(), mem, "budget_mb", c.memory.budget_mb,
            "chooses the stash format of every tensor: leave memory.stash and memory.layers unset");
    require(c.memory.checkpoint_every == 0, mem, "budget_mb", c.memory.budget_mb,
            "chooses the recompute segments: leave memory.checkpoint_every unset");
    require(c.memory.prune_threshold == 0.f, mem, "budget_mb", c.memory.budget_mb,
            "plans exact and fp16 formats only: it does not combine with memory.prune_threshold");
  }
  if (c.memory.recompute_stack_outputs)
    require(c.memory.checkpoint_every == 0 && c.memory.budget_mb == 0, mem, "recompute_stack_outputs", true,
            "does not combine with memory.checkpoint_every or memory.budget_mb (they choose what is recomputed)");
  // auto: on where it combines; pruning prunes the values the stash keeps, and these it would not.
  if (c.memory.recompute_stack_outputs_auto)
    c.memory.recompute_stack_outputs =
        c.memory.checkpoint_every == 0 && c.memory.budget_mb == 0 && c.memory.prune_threshold == 0.f;
}

// fusion: depth-first stacks (docs/fusion.md).
void parse_fusion(ObjectReader& top, Config& c) {
  ObjectReader fu = top.child("fusion");
  FusionSpec& f = c.model.fusion;
  // auto: fused where the backend's fused stacks are measured and verified (CPU: faster on every
  // shipped model and no more memory, docs/fusion.md). CUDA runs the element-wise stacks only
  // (FusionSpec::whole_tensors), on `true` alone until a GPU has run their tests
  // (docs/cuda.md). train is parsed before this section.
  const bool cuda = c.train.device.compare(0, 4, "cuda") == 0;
  f.automatic = fu.get_or_auto("enabled", f.enabled, "true or false");
  if (f.automatic) f.enabled = !cuda;
  f.whole_tensors = cuda;
  json tile = "auto";
  fu.get("tile", tile);
  if (tile.is_string() && tile.get<std::string>() == "auto") {
    f.tile = 0;
  } else {
    require(tile.is_number_integer() && tile.get<int64_t>() >= 1, fu, "tile", tile.dump(),
            "must be \"auto\" or a channel count >= 1");
    f.tile = tile.get<int64_t>();
  }
  fu.get("disable", f.disable);
  fu.get("cache_kb", f.cache_kb);
  require(f.cache_kb >= 0, fu, "cache_kb", f.cache_kb, "must be > 0 (KiB), or 0 for this core's L2");
  fu.get("llc_kb", f.llc_kb);
  require(f.llc_kb >= 0, fu, "llc_kb", f.llc_kb, "must be > 0 (KiB), or 0 for this machine's last-level cache");
  f.sweep1_in_reader_auto = fu.get_or_auto("sweep1_in_reader", f.sweep1_in_reader, "true or false");
  if (f.sweep1_in_reader_auto) f.sweep1_in_reader = true;  // where the planner's rule says so
  fu.get("fold_side_bn", f.fold_side_bn);
  fu.finish();
  // memory is parsed before this section; its option recomputes fused stacks' outputs only.
  if (c.memory.recompute_stack_outputs_auto) c.memory.recompute_stack_outputs &= f.enabled;
  if (c.memory.recompute_stack_outputs)
    require(f.enabled, fu, "enabled", f.automatic ? "auto (off on " + c.train.device + ")" : std::string("false"),
            "memory.recompute_stack_outputs recomputes fused stacks' outputs: it needs fusion on");
}

// finetune: which parameters train (docs/finetune.md).
void parse_finetune(ObjectReader& top, Config& c) {
  ObjectReader ft = top.child("finetune");
  FinetuneSpec& fs_ = c.model.finetune;
  json trainable = "all";
  ft.get("trainable", trainable);
  std::string bn = "train";
  ft.get("bn", bn);
  ft.finish();
  if (trainable.is_string()) {
    const std::string t = trainable.get<std::string>();
    bool ok = t == "all" || t == "head";
    if (t.rfind("last:", 0) == 0) {
      const std::string n = t.substr(5);
      ok = !n.empty() && n.size() < 6 && n.find_first_not_of("0123456789") == std::string::npos && std::stoi(n) >= 1;
    }
    require(ok, ft, "trainable", trainable.dump(), "must be \"all\", \"head\", \"last:N\" (N >= 1) or an array of name patterns");
    fs_.trainable = {t};
  } else {
    require(trainable.is_array() && !trainable.empty(), ft, "trainable", trainable.dump(),
            "must be \"all\", \"head\", \"last:N\" or a non-empty array of name patterns");
    fs_.trainable.clear();
    for (const json& p : trainable) {
      require(p.is_string() && !p.get<std::string>().empty(), ft, "trainable", p.dump(), "patterns must be non-empty strings");
      fs_.trainable.push_back(p.get<std::string>());
    }
  }
  require(bn == "train" || bn == "frozen", ft, "bn", bn, "must be \"train\" or \"frozen\"");
  fs_.frozen_bn = bn == "frozen";
}

// quant: 4-bit training (docs/quant.md). After train: its defaults and checks read it.
void parse_quant(ObjectReader& top, Config& c) {
  ObjectReader qr = top.child("quant");
  const TrainConfig& tr = c.train;
  const ScheduleConfig& sc = tr.schedule;
  QuantConfig& q = c.quant;
  qr.get("forward", q.forward);
  qr.get("backward", q.backward);
  qr.get("keep_fp32", q.keep_fp32);
  qr.get_string_map("layers", q.layers);
  qr.get("smp_samples", q.smp_samples);
  qr.get("fnt_epochs", q.fnt_epochs);
  q.fnt_peak_lr = 0.01f * tr.lr;  // see QuantConfig
  qr.get("fnt_peak_lr", q.fnt_peak_lr);
  qr.get("grad_magnitudes", q.grad_magnitudes);
  qr.finish();
  ForwardQuant fq;
  BackwardQuant bq;
  require(parse_forward_quant(q.forward, &fq), qr, "forward", q.forward, "unknown mode (known: fp32, int4)");
  require(parse_backward_quant(q.backward, &bq), qr, "backward", q.backward,
          "unknown mode (known: fp32, luq_fp4, fp4_rdn)");
  for (const auto& [layer, modes] : q.layers) {
    const size_t slash = modes.find('/');
    if (slash == std::string::npos || !parse_forward_quant(modes.substr(0, slash), &fq) ||
        !parse_backward_quant(modes.substr(slash + 1), &bq))
      qr.fail("quant.layers." + layer, "= \"" + modes +
                                           "\": expected \"FORWARD/BACKWARD\" with FORWARD fp32 | int4 and BACKWARD fp32 | "
                                           "luq_fp4 | fp4_rdn, e.g. \"int4/luq_fp4\"");
  }
  require(q.smp_samples >= 1 && q.smp_samples <= 16, qr, "smp_samples", q.smp_samples, "must be in 1..16");
  require(q.grad_magnitudes >= 1 && q.grad_magnitudes <= 7, qr, "grad_magnitudes", q.grad_magnitudes,
          "must be in 1..7 (strict FP4 [1,3,0] holds 7 magnitudes and zero)");
  require(q.fnt_epochs >= 0 && q.fnt_epochs < tr.epochs, qr, "fnt_epochs", q.fnt_epochs,
          "must be in 0..train.epochs-1");
  if (q.fnt_epochs > 0) {
    require(c.quant_options().any(), qr, "fnt_epochs", q.fnt_epochs,
            "(FNT: high precision except the weights) fine-tunes a 4-bit run, but quant.forward and "
            "quant.backward are fp32 and no quant.layers entry quantizes, so there are no INT4 weights to fine-tune: "
            "set quant.forward = int4 and / or quant.backward = luq_fp4, or use 0");
    require(sc.warmup_epochs < float(tr.epochs - q.fnt_epochs), qr, "fnt_epochs", q.fnt_epochs,
            "leaves the main schedule no epochs after train.schedule.warmup_epochs");
  }
  require(std::isfinite(q.fnt_peak_lr) && q.fnt_peak_lr > 0.f && q.fnt_peak_lr < 100.f, qr, "fnt_peak_lr",
          q.fnt_peak_lr, "must be in (0, 100) (the FNT learning-rate peak)");
}

}  // namespace config_detail
}  // namespace et
