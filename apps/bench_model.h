// A model set up for timing training steps on a synthetic batch: what `edgetrain bench step` times,
// once per configuration it compares (--against, apps/cmd_bench.cpp).
#pragma once
#include <memory>

#include "backends/backend.h"
#include "engine/budget.h"
#include "engine/config.h"
#include "engine/executor.h"
#include "engine/graph.h"
#include "engine/step_replay.h"
#include "engine/train/optimizer.h"
#include "memory/uss.h"

namespace et::app {

struct BenchModel {
  // Builds the model, plans its memory (memory.budget_mb first, if set), initialises it and fills
  // its inputs with N(0,1) images and uniform labels: the cost of a step does not depend on values.
  BenchModel(const Config& config, bool profile);
  // One training step as the trainer takes it: forward, the divergence guard's checks, backward, SGD.
  void step(int64_t s);

  Config cfg;
  Graph g;
  std::unique_ptr<Backend> backend;
  BudgetPlan budget;
  std::unique_ptr<Executor> ex;
  std::unique_ptr<StepReplay> replay;  // train.cuda_graph (op by op under a profile)
  SgdOptions sgd;
  UssPeak uss;
  int64_t n = 0;              // the batch
  bool profile = false;
  bool diverged = false;
  double guard_s = 0;         // with a profile: the gradient check's time on its own
};

}  // namespace et::app
