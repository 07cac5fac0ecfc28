// Test helper shared by the stash, recompute and allocation tests: a model from the registry at a
// small batch on an executor, deterministic inputs, and the SGD update of a training step.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "models/models.h"

namespace et::test {

// 4-bit training as the LUQ paper runs it: INT4 forward, LUQ FP4 backward, `smp` gradient samples.
inline QuantOptions luq(int smp = 1) {
  QuantOptions q;
  q.forward = ForwardQuant::Int4;
  q.backward = BackwardQuant::LuqFp4;
  q.smp_samples = smp;
  return q;
}

struct TinyTraining {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;

  // `side` 0: the model's default input size. Labels are (i * label_step) % 10.
  TinyTraining(const std::string& model, int64_t batch, const StashOptions& opt, uint64_t init_seed,
               int64_t side = 0, int label_step = 3, const QuantOptions& quant = {}, const FusionSpec& fusion = {}) {
    ModelSpec spec;
    spec.fusion = fusion;
    spec.name = model;
    spec.batch = batch;
    if (side > 0) spec.height = spec.width = side;
    build_model(g, spec);
    ex = std::make_unique<Executor>(g, *be, opt, quant);
    init_parameters(*ex, init_seed);
    Tensor x = ex->value(g.image_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float((i * 2654435761u) % 2001) / 1000.f - 1.f;
    for (int64_t i = 0; i < batch; ++i) ex->value(g.label_input).i32()[i] = int32_t(i * label_step % 10);
  }

  // SGD with momentum 0.9, weight decay 5e-4 on every parameter (`first`: momentum starts at 0).
  void sgd(float lr, bool first) {
    sgd_update(*ex, SgdOptions{0.9f, 5e-4f, false}, lr, first);
  }
};

}  // namespace et::test
