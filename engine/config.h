// The run configuration: one JSON file, overridable with `--set dotted.key=value`. Every key is
// validated with its dotted path; unknown keys are errors, so typos never pass silently.
// docs/config.md lists every key with its default.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/executor.h"
#include "engine/model_spec.h"

namespace et {

// data.channels / height / width live in Config::model (ModelSpec) and data.mean / std here; each
// may be "auto" (the default): 0, resp. empty, until engine/data/auto.h resolves it from the data
// set (the Trainer does, before it builds the model). A run's config.json holds the resolved values.
struct DataConfig {
  std::string format = "image_folder";  // "image_folder" | "cifar10_binary"
  std::string root;                     // resolved against the config file's folder if relative
  std::string resize = "none";          // image_folder: "none" | "stretch" | "center_crop"
  int crop_padding = 4;                 // random crop of the zero-padded image; 0 = off
  bool hflip = true;
  std::vector<float> mean, std;         // per channel, in pixel / 255 units; empty = "auto"
  int64_t train_subset = 0;  // use only the first n training images (after a seeded shuffle); 0 = all
  int64_t test_subset = 0;
};

struct ScheduleConfig {
  std::string type = "multistep";  // "multistep" | "cosine" | "onecycle" | "constant"
  std::vector<int> milestones;     // multistep: epochs at which lr *= gamma
  float gamma = 0.1f;
  float warmup_epochs = 0.f;       // linear warm-up from warmup_start_factor * lr (multistep, cosine)
  float warmup_start_factor = 0.1f;
  float min_lr = 0.f;              // cosine floor
  float pct_start = 0.3f;          // onecycle: fraction of training spent rising
  float div_factor = 25.f;         // onecycle: start lr = lr / div_factor
  float final_div_factor = 1e4f;   // onecycle: final lr = start lr / final_div_factor
};

struct TrainConfig {
  int epochs = 1;
  int64_t batch_size = 128;
  float lr = 0.1f;
  float momentum = 0.9f;
  bool nesterov = false;
  float weight_decay = 5e-4f;
  float label_smoothing = 0.f;
  uint64_t seed = 1;
  int threads = 0;  // 0 = all cores
  // Where the step runs: "cpu", "cuda" (device 0) or "cuda:N" (backends/backend.h make_backend).
  std::string device = "cpu";
  // CUDA: record the step's forward and backward once and replay them (engine/step_replay.h),
  // where the model and stash allow; the run says when they do not. "auto" (cuda_graph_auto, the
  // default): on for CUDA, off on the CPU.
  bool cuda_graph = false;
  bool cuda_graph_auto = true;
  ScheduleConfig schedule;
  // Divergence guard (engine/train/divergence.h). A step diverged when its loss is non-finite or
  // above divergence_loss (default 100 x the loss of a uniform prediction, 100 ln(num_classes);
  // parse_config derives it), or a gradient / parameter is non-finite.
  float divergence_loss = 230.258509f;  // 100 ln 10
  std::string on_divergence = "stop";  // "stop" | "rollback"
  float divergence_lr_factor = 0.5f;   // rollback: learning-rate factor per rollback, in (0, 1)
  int divergence_max_rollbacks = 3;    // rollback: then give up as `stop` does
};

struct MemoryConfig {
  std::string stash = "dense_fp32";  // stash format for every saved activation (memory/stash.h)
  std::vector<std::pair<std::string, std::string>> layers;  // per-layer format overrides
  float prune_threshold = 0.f;       // BitTrain activation pruning of stashed values (lossy); 0 = exact
  int checkpoint_every = 0;          // recompute segments of this many conv/linear layers; 0 = off
  bool release_pages = false;        // return dead buffers' pages to the OS during the step
  float stash_headroom = 0.02f;      // GPU stash: room over the most a bitmap entry kept; < 0 = worst case
  bool double_mask_bn = false;       // BN output masked by its input's zeros (lossy; layers/batchnorm.cpp)
  // A fused BN -> ReLU stack's output that a later layer reads in backward is not kept: its readers
  // compute it from the stack's saved input (exact; engine/affine_relu.h). "auto" (the default,
  // recompute_stack_outputs_auto): on where it combines (fusion on, no recompute segments, budget
  // or pruning), resolved by parse_config.
  bool recompute_stack_outputs = false;
  bool recompute_stack_outputs_auto = true;
  // A memory budget for the training step's USS (engine/budget.h): the planner chooses stash
  // formats and recompute segments per tensor; 0 = off. budget_lossy allows fp16 formats too.
  float budget_mb = 0;
  bool budget_lossy = false;
};

// 4-bit training (docs/quant.md); the strings are validated by parse_config.
struct QuantConfig {
  std::string forward = "fp32";   // "fp32" | "int4"
  std::string backward = "fp32";  // "fp32" | "luq_fp4" | "fp4_rdn"
  std::vector<std::string> keep_fp32 = {"first", "last"};  // layer names, `first`, `last`
  std::vector<std::pair<std::string, std::string>> layers;  // per layer "FORWARD/BACKWARD"
  int smp_samples = 1;
  // FNT (LUQ Sec. 3.2): the last fnt_epochs of train.epochs train in high precision except the
  // weights, with a triangular learning rate from the main schedule's final rate up to
  // fnt_peak_lr and back (engine/train/schedule.h). Default peak 0.01 * train.lr: docs/quant.md.
  int fnt_epochs = 0;
  float fnt_peak_lr = 0.001f;  // 0.01 * the default train.lr; the parser derives it from train.lr
  int grad_magnitudes = 7;
};

struct Config {
  ModelSpec model;
  // model.weights: initial parameters and buffers from a .safetensors file or an edgetrain
  // checkpoint (engine/train/weights.h), instead of the random initialisation; "" = none.
  std::string weights;
  // Not a key: a run folder's memory_plan.json that `train --resume` hands over, so memory.budget_mb
  // keeps the run's plan instead of planning again (engine/budget.h).
  std::string memory_plan_file;
  DataConfig data;
  TrainConfig train;
  MemoryConfig memory;
  QuantConfig quant;
  std::string source;  // file it came from
  // Every key with its effective value; an unresolved "auto" data key as "auto".
  nlohmann::json resolved() const;
  bool shape_auto() const { return model.channels == 0 || model.height == 0 || model.width == 0; }
  bool stats_auto() const { return data.mean.empty() || data.std.empty(); }
  StashOptions stash_options(bool fnt = false) const;  // fnt: the FNT epochs' (no INT4 codes to keep)
  // The main phase's modes, or with `fnt` those of the FNT epochs (QuantOptions::fnt).
  QuantOptions quant_options(bool fnt = false) const;
};

// Reads `path`, applies `overrides` ("a.b=value"; value parsed as JSON, else taken as a string),
// validates. Throws UserError naming the file and the dotted key.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from the file's text (`path` names it in messages); what the fuzzer drives.
Config load_config_text(const std::string& text, const std::vector<std::string>& overrides, const std::string& path);
Config parse_config(const nlohmann::json& j, const std::string& source);

}  // namespace et
