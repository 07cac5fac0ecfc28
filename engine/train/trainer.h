// Trainer: the data path from a validated Config to optimizer steps. Owns the data sets, the
// graph, the backend and the executor; runs epochs (train, then evaluate on the test split),
// writes metrics.jsonl and an atomic checkpoint after every epoch, and resumes from one.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "engine/config.h"
#include "engine/budget.h"
#include "engine/data/dataset.h"
#include "engine/executor.h"
#include "engine/train/checkpoint.h"
#include "engine/train/divergence.h"
#include "engine/train/progress.h"
#include "memory/uss.h"

namespace et {

class InputFeed;  // engine/train/input_feed.h
class StepReplay;   // engine/step_replay.h

struct EpochResult {
  int epoch = 0;  // 1-based
  double train_loss = 0, train_acc = 0, test_loss = 0, test_acc = 0;
  double img_per_s = 0, epoch_s = 0, lr = 0;
  double peak_uss_mb = -1;  // over the epoch's steps and its evaluation; < 0: USS unavailable
  double stash_peak_mb = 0;
  // A GPU backend's memory the run holds at the epoch's end (the driver's count, beyond what was
  // in use before the model: the arena, the stash region as fitted, the backend's scratch); < 0: none.
  double device_mb = -1;
  bool fnt = false;       // an FNT epoch (quant.fnt_epochs)
  bool diverged = false;  // ended early: Trainer::divergence() describes the step
};

struct EvalResult {
  double loss = 0, acc = 0;
  int64_t images = 0;
  std::vector<float> logits;    // [images, classes] in test-set order, when asked for
  std::vector<int32_t> labels;  // [images], with the logits
};

class Trainer {
 public:
  // Loads the splits it needs and builds the model. Throws UserError on bad data or config.
  // The config's "auto" data keys are resolved from the data (engine/data/auto.h): config()
  // holds the numbers, notes() says what they came from. data.mean / std = auto load the
  // training split also without need_train_split (eval), and release it after.
  Trainer(const Config& cfg, bool need_train_split);
  // With data sets already in memory (tests, benchmarks); data.train_subset / test_subset apply.
  // An auto shape is that of `train` (else `test`); auto mean / std need `train`.
  // `backend`: instead of the config's train.device (tests: a CPU backend the host must copy to).
  Trainer(const Config& cfg, std::shared_ptr<const Dataset> train, std::shared_ptr<const Dataset> test,
          std::unique_ptr<Backend> backend = nullptr);
  ~Trainer();

  // Trains into `out_dir` (which the caller has created). With `resume`, continues from
  // out_dir/checkpoint_last.ckpt and reproduces the numbers of an uninterrupted run; without that
  // file (a run stopped during its first epoch) it starts from the beginning, unless metrics.jsonl
  // records finished epochs (the checkpoint was lost). `max_epochs` > 0 stops after that many
  // epochs in this call (as an interruption would).
  // A divergence (train.on_divergence) is logged in metrics.jsonl, then either throws UserError
  // (stop, or too many rollbacks; the last checkpoint stays as it was) or rolls back to the last
  // checkpoint at a lower learning rate.
  void fit(const std::string& out_dir, bool resume, Progress& progress, int max_epochs = 0);
  // Test-split loss and accuracy; `keep_logits`: also every image's logits and label.
  EvalResult evaluate(bool keep_logits = false);
  // One optimizer step on the images / labels already in the executor's inputs, at `lr`. Returns
  // false when the divergence guard fires (divergence() says why and where); the step counter
  // does not advance and the training state is unusable until restored (fit rolls back or stops).
  // `prefetch`: a feed whose next batch the host fetches while this step's forward runs on a
  // device that computes apart from it (InputFeed::prefetch, called once the forward is issued).
  bool train_step(int64_t batch, float lr, InputFeed* prefetch = nullptr);
  const Divergence& divergence() const { return divergence_; }
  // Puts the executor in the mode of 0-based `epoch`: the main phase, or FNT for the last
  // quant.fnt_epochs. A change re-plans it (a new Executor, between steps) with params, gradients,
  // momentum and BN statistics carried over bit for bit; returns whether it changed. fit calls it
  // every epoch; `edgetrain eval` for the checkpoint's last epoch.
  // Also re-plans (returning false) when the layers raised to FP32 (progress_state().fp32_layers,
  // a rollback's or a checkpoint's) differ from the executor's.
  bool enter_phase(int epoch);
  bool fnt() const { return fnt_; }

  Executor& executor() { return *executor_; }
  const Config& config() const { return cfg_; }  // resolved: no "auto" data key
  const std::vector<std::string>& notes() const { return notes_; }  // how auto data keys resolved
  TrainProgress& progress_state() { return state_; }
  const Dataset* train_data() const { return train_.get(); }
  // memory.budget_mb: what its planner chose for the main phase or FNT (budget_mb 0 when there is
  // no budget, or no FNT).
  const BudgetPlan& budget(bool fnt = false) const { return fnt ? budget_fnt_ : budget_; }
  // Where the peak USS per step is read (memory/uss.h); tests point it at missing files.
  void set_proc_files(const ProcFiles& files) { uss_ = UssPeak(files); }
  const UssPeak& uss() const { return uss_; }
  // The training steps' recording (train.cuda_graph; engine/step_replay.h), for tests and reports.
  const StepReplay& step_replay() const { return *replay_; }
  // Fault injection for tests: called in fit before each training step (its batch loaded), with
  // the step's number; it may corrupt the executor's state to provoke the divergence guard.
  void set_before_step(std::function<void(Executor&, int64_t step)> hook) { before_step_ = std::move(hook); }

 private:
  EpochResult train_epoch(int epoch, Progress& progress);
  // Fills divergence_ (locating the first non-finite value) and returns false.
  bool diverged(DivergenceCause cause, int64_t batch, const NonFiniteError* thrown, bool have_loss, float lr);
  // After a divergence in 0-based `epoch`: logs it; stops (throws) or rolls back and returns the
  // last completed epoch to continue after (trainer_divergence.cpp).
  int handle_divergence(int epoch, const std::string& out_dir, Progress& progress);
  void append_metrics(const std::string& out_dir, const nlohmann::json& record) const;

  Config cfg_;
  std::vector<std::string> notes_;
  void note(const std::string& line);
  void build(bool keep_train);

  std::shared_ptr<const Dataset> train_, test_;
  Graph graph_;
  std::unique_ptr<Backend> backend_;
  // The loader's batches into the executor's inputs (staged and prefetched on a GPU).
  std::unique_ptr<InputFeed> feed_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<StepReplay> replay_;  // executor_'s steps recorded and replayed (train.cuda_graph)
  bool fnt_ = false;  // executor_ plans the FNT modes
  std::vector<std::string> planned_fp32_;  // ... and these layers raised to FP32
  // The executor's options for a phase: the config's (or the budget's plan), with the layers a
  // rollback raised to FP32.
  QuantOptions quant_options(bool fnt) const;
  StashOptions stash_options(bool fnt) const;
  // The quantized conv / linear a rollback raises to FP32 for a divergence; "" for none.
  std::string layer_to_raise(const Divergence& d) const;
  TrainProgress state_;
  UssPeak uss_;
  Divergence divergence_;
  BudgetPlan budget_, budget_fnt_;  // the main phase's, FNT's (quant.fnt_epochs)
  bool device_usage_ = false;        // the backend's memory reports its use (a GPU's)
  size_t device_before_ = 0;         // in use then, before the model (the CUDA context)
  int64_t divergence_batch_ = 0, divergence_batches_ = 0;  // where in its epoch (1-based), of how many
  std::function<void(Executor&, int64_t)> before_step_;
};

// The executor's stash options for training in the main phase or FNT (`fnt`): the config's, or, with
// memory.budget_mb, the plan in cfg.memory_plan_file where that exists, else what the budget's
// planner chooses (engine/budget.h: it runs calibration steps on `g` at its batch, with the
// parameters of train.seed / model.weights); `plan` receives it.
StashOptions plan_stash_options(const Config& cfg, Graph& g, Backend& backend, BudgetPlan* plan = nullptr,
                                bool fnt = false);
// The run folder's file for a phase's memory plan: memory_plan.json, memory_plan_fnt.json.
inline const char* budget_plan_name(bool fnt) { return fnt ? "memory_plan_fnt.json" : "memory_plan.json"; }

// Number of samples in [0, n) whose logits argmax equals the label.
int64_t count_correct(Backend& backend, const Tensor& logits, const Tensor& labels, int64_t n);

}  // namespace et
