#include "apps/bench_model.h"

#include <omp.h>

#include <chrono>
#include <random>

#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/train/divergence.h"
#include "engine/train/trainer.h"

namespace et::app {

BenchModel::BenchModel(const Config& config, bool prof) : cfg(config), profile(prof) {
  build_model(g, cfg.model);
  backend = make_backend(cfg.train.device);
  const StashOptions stash = plan_stash_options(cfg, g, *backend, &budget);
  ex = std::make_unique<Executor>(g, *backend, stash, cfg.quant_options());
  init_parameters(*ex, cfg.train.seed);
  n = cfg.train.batch_size;
  std::mt19937_64 rng(cfg.train.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  {  // written through the backend's copies where the host cannot address its memory
    const HostView x(*backend, ex->value(g.image_input), HostView::Write);
    const HostView y(*backend, ex->value(g.label_input), HostView::Write);
    for (int64_t i = 0; i < ex->value(g.image_input).numel(); ++i) x.f32()[i] = normal(rng);
    for (int64_t i = 0; i < n; ++i) y.i32()[i] = int32_t(rng() % uint64_t(cfg.model.num_classes));
  }
  sgd = sgd_options(cfg.train);
  replay = std::make_unique<StepReplay>(*ex, cfg.train.cuda_graph && !profile, 2, cfg.train.cuda_graph_auto);
}

// The trainer's divergence guard runs the same checks (engine/train/divergence.h), so this is a
// training step's time; with a profile the gradient check is timed on its own (guard_s).
void BenchModel::step(int64_t s) {
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  ex->set_step_seed(uint64_t(s));
  uss.begin_step();  // the peak over the whole step (memory/uss.h)
  // As the trainer: a step that outgrew the stash's room runs again (Executor::fit_stash_room).
  for (bool again = false;; again = true) {
    ex->set_repeating(again);
    const bool replayed = !again && replay->try_step(n);  // forward and backward together
    if (!replayed) ex->forward(n, true);
    uss.phase();
    diverged |= check_loss(ex->loss(), cfg.train.divergence_loss) != DivergenceCause::None;
    if (!replayed) ex->backward();
    uss.phase();
    try {
      ex->check_quant_finite();  // 4-bit scales in the backend's memory
    } catch (const NonFiniteError&) {
      diverged = true;
    }
    if (!ex->fit_stash_room()) break;
  }
  ex->set_repeating(false);
  if (profile) backend->synchronize();  // the backward's queued work is not the guard's
  const auto t0 = profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  diverged |= !gradients_finite(*ex);
  if (profile) guard_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  diverged |= !sgd_update(*ex, sgd, 0.01f, s == 0);
  uss.end_step();
}

}  // namespace et::app
