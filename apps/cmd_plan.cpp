// `edgetrain plan --config FILE`: the fusion planner's view of the config's model at its batch
// size (docs/fusion.md): the stacks, their stages, tiles and working sets, the bytes each moves
// per training step fused and unfused, and the planned activation memory of both graphs.
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
  auto row = [](const char* name, const Graph& gr, const MemoryReport& m) {
    std::printf("%-8s %5d nodes  activations %8.2f MB planned (%8.2f MB before reuse)  stash (dense) %8.2f MB  "
                "workspace %6.2f MB\n",
                name, gr.num_nodes(), m.activations_planned / 1048576.0, m.activations_unplanned / 1048576.0,
                m.stash_dense_bytes / 1048576.0, m.workspace / 1048576.0);
  };
  row("unfused", g, plain.memory());
  row("fused", f, fused.memory());
  return 0;
}

}  // namespace et::app
