// `edgetrain plan --config FILE`: the fusion planner's view of the config's model at its batch
// size (docs/fusion.md): the stacks, their stages, tiles and working sets, the bytes each moves
// per training step fused and unfused, the planned activation memory of both graphs, and each
// plan's peak: the most bytes alive at once and the largest buffers alive then.
#include <algorithm>
#include <cstdio>

#include "apps/commands.h"
#include "backends/backend.h"
#include "engine/config.h"
#include "engine/data/auto.h"
#include "engine/executor.h"
#include "fusion/fusion.h"

namespace et::app {

int cmd_plan(const PlanArgs& a) {
  Config cfg = load_config(a.config, a.sets);
  // Synthetic inputs: only the shape matters ("auto": from the data, 3x32x32 where there is none).
  if (const std::string line = resolve_data_shape(cfg, true); !line.empty()) std::fprintf(stderr, "%s\n", line.c_str());
  ModelSpec unfused_spec = cfg.model;
  unfused_spec.fusion.enabled = false;
  Graph g;
  build_model(g, unfused_spec);
  const fusion::Plan p = fusion::plan(g, cfg.model.fusion);
  std::printf("%s: %s, fusion.enabled = %s\n", cfg.source.c_str(), cfg.model.name.c_str(),
              cfg.model.fusion.enabled ? "true" : "false");
  std::printf("%s", fusion::describe(g, p).c_str());
  auto backend = make_backend(cfg.train.device);
  Executor plain(g, *backend, cfg.stash_options(), cfg.quant_options());
  Graph f;
  build_model(f, unfused_spec);
  fusion::apply(f, p);
  Executor fused(f, *backend, cfg.stash_options(), cfg.quant_options());
  auto row = [](const char* name, const Graph& gr, const Executor& ex) {
    const MemoryReport& m = ex.memory();
    std::printf("%-8s %5d nodes  activations %8.2f MB planned (%8.2f MB before reuse)  stash (dense) %8.2f MB  "
                "workspace %6.2f MB\n",
                name, gr.num_nodes(), m.activations_planned / 1048576.0, m.activations_unplanned / 1048576.0,
                m.stash_dense_bytes / 1048576.0, m.workspace / 1048576.0);
  };
  // The plan's peak: the most bytes alive at once and the largest buffers alive then.
  auto peak = [](const char* name, const Executor& ex) {
    const ActivationPeak& p = ex.activation_peak();
    std::printf("%-8s activations alive at once: at most %.2f MB, in the %s:", name, p.alive_bytes / 1048576.0,
                p.when.c_str());
    const size_t shown = std::min<size_t>(p.buffers.size(), 6);
    for (size_t i = 0; i < shown; ++i)
      std::printf("%s %s (%s) %.2f MB", i ? "," : "", p.buffers[i].value.c_str(), p.buffers[i].role,
                  p.buffers[i].bytes / 1048576.0);
    if (p.buffers.size() > shown) std::printf(", and %zu smaller", p.buffers.size() - shown);
    std::printf("\n");
  };
  row("unfused", g, plain);
  row("fused", f, fused);
  peak("unfused", plain);
  peak("fused", fused);
  return 0;
}

}  // namespace et::app
