// The optimizer step of training: SGD with momentum (PyTorch's formulation, optional Nesterov, L2
// weight decay) over every parameter of an executor: one Backend::sgd_steps_deferred over the
// executor's SgdSlots (one launch on a GPU) and one finiteness answer (Backend::sgd_finite).
// Allocates nothing.
#pragma once

#include "engine/executor.h"

namespace et {

struct TrainConfig;

struct SgdOptions {
  float momentum = 0.9f;
  float weight_decay = 5e-4f;
  bool nesterov = false;
};
SgdOptions sgd_options(const TrainConfig& train);

// `first_step`: the momentum buffers start from this step's gradients (they hold nothing yet).
// Returns false if a parameter became non-finite (a non-finite gradient, or an overflow): the
// training diverged, and the parameters are no longer usable.
bool sgd_update(Executor& ex, const SgdOptions& options, float lr, bool first_step);

}  // namespace et
