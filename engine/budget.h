// Memory budget (memory.budget_mb): before the first step, chooses per saved tensor its stash
// format and which recompute segments run again, so that the training step's USS fits the budget
// with the least predicted extra time. On a backend whose memory is a device's (CUDA), the budget
// is of that memory as its driver reports it (DeviceMemory::usage) instead: the arena, the stash
// region and the backend's own allocations, beyond what was in use before (the CUDA context).
//
// 1. Calibration: a few steps of the graph at its batch, on a synthetic batch, in the leanest exact
//    plan (bitmap_fp32 where zeros come by construction, every single-layer segment recomputed),
//    measure per node the forward time (what a recompute costs), per saved tensor the time spent
//    packing and decoding it and its fraction of non-zeros, and the step's USS beyond the arena
//    and the stash (threads, loader: `overhead`). With budget_lossy, a second calibration does the
//    same in fp16 (bitmap_fp16 / dense_fp16).
// 2. Prediction: a candidate plan is planned (Executor's plan, no step runs): arena size, plus the
//    stash's highest top replayed from its push / pop schedule with each tensor's predicted size
//    (bitmaps from the measured non-zeros plus `headroom`), plus the overhead.
// 3. Search, for segments of 1, 2 and 3 layers (checkpoint_every): from the fastest plan (every
//    save dense_fp32 in place, nothing recomputed) apply moves (a tensor to a bitmap format, a
//    segment recomputed; exact ones first, fp16 ones only if allowed and still needed), cheapest
//    measured time per predicted byte saved first, keeping a move only if the predicted USS falls,
//    until the budget is met. Under 4-bit training a further search, without segments, also moves
//    the inputs of INT4 layers to bitmap_int4 (their INT4 codes: exact there, and the BN inputs
//    of those layers are then recomputed from them; a third calibration, in bitmap_int4, times
//    it). A further search, without segments, keeps no fused BN -> ReLU stack output
//    (memory.recompute_stack_outputs: its readers compute it, predicted free). The cheapest plan
//    that meets the budget wins; if none does, the smallest prediction is reported in the error.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/executor.h"

namespace et {

struct BudgetOptions {
  double budget_mb = 0;
  bool lossy = false;       // fp16 formats allowed (after every exact choice)
  uint64_t seed = 1;        // the calibration batch
  int calibration_steps = 2;
  double headroom = 0.05;   // non-zero fraction added to the measured one (sparsity drifts in training)
};

// One saved tensor's choice.
struct BudgetTensor {
  std::string name;         // the layer (value) name
  StashFormat format = StashFormat::DenseF32;
  bool full = true;         // false: read only as a > 0 mask
  bool recomputed = false;  // produced again in backward by its segment, not kept from the forward
  size_t dense_bytes = 0;   // as fp32 at the planned batch
  double nonzero = 1;       // measured fraction (bitmap formats)
  double ms = 0;            // predicted per-step time of its format (pack + decode)
};

struct BudgetPlan {
  StashOptions options;      // what the executor gets
  double budget_mb = 0, predicted_mb = 0;
  double fastest_mb = 0;     // prediction for the plan without any move (dense_fp32, no recompute)
  bool device = false;       // bounds the device's memory (a GPU backend's), not the process's USS
  double overhead_mb = 0;    // measured in calibration: USS (device memory) beyond the arena and the stash
  double arena_mb = 0, stash_mb = 0;  // the prediction's parts: arena size, stash region peak
  double extra_ms = 0;       // predicted time per step above the fastest plan
  double recompute_ms = 0;   // of which recomputation
  int segments = 0;          // recomputed segments (memory.checkpoint_every's)
  int code_segments = 0;     // 4-bit training: BN inputs recomputed from their conv's INT4 codes
  int stack_outputs = 0;     // fused stack outputs computed by their readers (recompute_stack_outputs)
  double calibration_s = 0;  // wall time of calibration and search
  std::vector<BudgetTensor> tensors;
  std::vector<std::string> summary() const;  // lines for the log (one per non-default choice)
};

// A run folder's memory_plan.json: the chosen options, so that a resumed run keeps the plan (a
// lossy one would otherwise be chosen again from new timings) without calibrating again.
std::string budget_plan_json(const BudgetPlan& p);
// Reads one back for `g` (UserError naming the file for anything malformed or not of this model).
BudgetPlan read_budget_plan(const std::string& path, const Graph& g);

// `init` sets the parameters of each calibration executor (random initialisation, or imported
// weights: sparsity depends on them). `quant`: the training's (a plan fits one phase: FNT's FP32
// activations need their own). Errors (user_error): a budget no plan meets, naming the smallest
// prediction.
BudgetPlan plan_memory_budget(Graph& g, Backend& backend, const QuantOptions& quant, const BudgetOptions& o,
                              const std::function<void(Executor&)>& init);

}  // namespace et
