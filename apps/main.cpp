// edgetrain command line: train / eval / export / plot / memprofile / plan / bench step / bench bitmap / bench fusion.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>

#include "apps/commands.h"
#include "engine/check.h"

int main(int argc, char** argv) {
  using namespace et::app;
  CLI::App app{"edgetrain: memory-frugal CNN training for edge devices"};
  app.require_subcommand(1);

  TrainArgs train;
  auto* t = app.add_subcommand("train", "train a model from a JSON config");
  t->add_option("--config", train.config, "config file (JSON)")->required();
  t->add_option("--set", train.sets, "override a config key: dotted.key=value (repeatable)");
  t->add_option("--out", train.out, "run folder (default runs/<model>-<time>)");
  t->add_flag("--resume", train.resume, "continue the run in --out from its last checkpoint");
  t->add_option("--stop-after", train.stop_after, "stop after N epochs of this invocation (continue later with --resume)")
      ->check(CLI::Range(1, 1000000));

  EvalArgs eval;
  auto* e = app.add_subcommand("eval", "evaluate a checkpoint (or model.weights) on the test split");
  e->add_option("--config", eval.config, "config file (JSON)")->required();
  e->add_option("--checkpoint", eval.checkpoint, "checkpoint file (default: the config's model.weights)");
  e->add_option("--set", eval.sets, "override a config key: dotted.key=value (repeatable)");
  e->add_option("--predictions", eval.predictions, "write each test image's label, prediction and logits (CSV)");

  MemProfileArgs mp;
  auto* m = app.add_subcommand("memprofile", "per-layer memory of a training step: stash formats, sparsity, USS");
  m->add_option("--config", mp.config, "config file (JSON)")->required();
  m->add_option("--set", mp.sets, "override a config key: dotted.key=value (repeatable)");
  m->add_option("--checkpoint", mp.checkpoint, "profile these weights (default: the initialisation)");
  m->add_option("--out", mp.out, "folder for memprofile.json and memprofile.svg (default runs/memprofile-<model>-<time>)");
  m->add_option("--steps", mp.steps, "training steps; the last one is profiled")->check(CLI::Range(1, 1000));
  m->add_flag("--synthetic", mp.synthetic, "N(0,1) images instead of a batch of the config's data");
  m->add_flag("--keep-pages", mp.keep_pages, "do not release dead pages during the step (memory.release_pages)");

  ExportArgs ex;
  auto* x = app.add_subcommand("export", "write a checkpoint for other tools: its weights (safetensors) or an ONNX inference graph");
  x->add_option("--checkpoint", ex.checkpoint, "checkpoint file");
  x->add_option("--format", ex.format, "safetensors | onnx (default: onnx for an --out ending in .onnx)")
      ->check(CLI::IsMember({"safetensors", "onnx"}));
  x->add_option("--out", ex.out, "file to write (must not exist)")->required();
  x->add_option("--config", ex.config, "onnx: the run's config (default: config.json beside the checkpoint)");
  x->add_option("--set", ex.sets, "onnx: override a config key: dotted.key=value (repeatable), e.g. model.weights=FILE");
  x->add_flag("--keep-bn", ex.keep_bn, "onnx: BatchNormalization nodes instead of BN folded into the convolutions");

  PlotArgs plot;
  auto* po = app.add_subcommand("plot", "draw runs' curves (loss, accuracy, learning rate, peak USS) on one SVG chart");
  po->add_option("runs", plot.runs, "run folders (each with metrics.jsonl)")->required();
  po->add_option("--out", plot.out, "SVG file to write (default runs/plot-<time>.svg; must not exist)");

  PlanArgs plan;
  auto* pl = app.add_subcommand("plan", "the fusion planner's stacks, tiles and bytes moved for a config");
  pl->add_option("--config", plan.config, "config file (JSON)")->required();
  pl->add_option("--set", plan.sets, "override a config key: dotted.key=value (repeatable)");

  auto* b = app.add_subcommand("bench", "benchmarks");
  b->require_subcommand(1);
  BenchStepArgs step;
  auto* bs = b->add_subcommand("step", "time training steps (after warm-up) on synthetic data");
  bs->add_option("--config", step.config, "config file (JSON)")->required();
  bs->add_option("--set", step.sets, "override a config key: dotted.key=value (repeatable)");
  bs->add_option("--steps", step.steps, "timed steps")->check(CLI::Range(1, 100000));
  bs->add_option("--warmup", step.warmup, "untimed steps first")->check(CLI::Range(0, 1000));
  bs->add_flag("--profile", step.profile, "print time per op type (forward / backward); with --against, both models side by side");
  bs->add_flag("--profile-nodes", step.profile_nodes, "with --profile: also the time of every node, in graph order (with --against: beside the node of that name in the second model)");
  bs->add_option("--against", step.against,
                 "time a second model, the config with this override too (dotted.key=value, repeatable), its "
                 "steps interleaved with the first's; reports both and their ratio");
  BenchBitmapArgs bitmap;
  auto* bb = b->add_subcommand("bitmap", "BitTrain Table 1: bitmap vs dense memory (theory and USS), pack/unpack speed");
  bb->add_option("--reps", bitmap.reps, "timed repetitions per row (median)")->check(CLI::Range(1, 10000));
  bb->add_option("--threads", bitmap.threads, "codec threads (0 = default)")->check(CLI::Range(0, 256));
  bb->add_option("--seed", bitmap.seed, "seed of the non-zero positions");
  bb->add_flag("--fp16", bitmap.fp16, "store the values as FP16");

  BenchFusionArgs bf;
  auto* bfu = b->add_subcommand("fusion", "BrainSlug micro-benchmark: <MaxPool 3x3, BN, ReLU> x depth, fused vs unfused");
  bfu->add_option("--depth", bf.depth, "blocks")->check(CLI::Range(1, 100));
  bfu->add_option("--batch", bf.batch, "batch size")->check(CLI::Range(1, 4096));
  bfu->add_option("--channels", bf.channels, "channels")->check(CLI::Range(1, 4096));
  bfu->add_option("--size", bf.size, "height = width")->check(CLI::Range(1, 1024));
  bfu->add_option("--reps", bf.reps, "timed repetitions (median)")->check(CLI::Range(1, 1000));
  bfu->add_option("--warmup", bf.warmup, "untimed repetitions first")->check(CLI::Range(0, 100));
  bfu->add_flag("--no-pool", bf.no_pool, "<BN, ReLU> blocks (no max-pool): the element-wise part alone");
  bfu->add_option("--cache-kb", bf.cache_kb, "the cache the tiles fit, KiB (fusion.cache_kb; 0: this core's L2)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  bfu->add_option("--llc-kb", bf.llc_kb,
                  "the last-level cache, KiB (fusion.llc_kb; 0: this machine's, from sysfs or CPUID): tensors beyond it are written by "
                  "streaming stores")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));

  CLI11_PARSE(app, argc, argv);
  // A write past the file-size limit (ulimit -f) would otherwise kill the process with SIGXFSZ
  // half-way through a checkpoint; ignored, the write fails with EFBIG and the run stops with a
  // message naming the file, the previous checkpoint intact (docs/reliability.md).
  std::signal(SIGXFSZ, SIG_IGN);
  try {
    if (*t) return cmd_train(train);
    if (*e) return cmd_eval(eval);
    if (*m) return cmd_memprofile(mp);
    if (*x) return cmd_export(ex);
    if (*po) return cmd_plot(plot);
    if (*bs) return cmd_bench_step(step);
    if (*bb) return cmd_bench_bitmap(bitmap);
    if (*pl) return cmd_plan(plan);
    if (*bfu) return cmd_bench_fusion(bf);
  } catch (const et::UserError& err) {
    std::fprintf(stderr, "edgetrain: error: %s\n", err.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "edgetrain: error: out of memory\n");
    return 1;
  }
  return 2;
}
