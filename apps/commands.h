// Sub-commands of the edgetrain CLI. Each returns the process exit code; user errors propagate
// as et::UserError to main(), which prints them and exits non-zero.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace et::app {

// Writes `text` to `path` through a temporary file and a rename (UserError naming the file).
void write_atomically(const std::filesystem::path& path, const std::string& text);
// runs/<prefix>-<local time>: where a command writes when no --out is given.
std::string default_run_dir(const std::string& prefix);

struct TrainArgs {
  std::string config, out;
  std::vector<std::string> sets;
  bool resume = false;
  int stop_after = 0;  // epochs to run in this invocation; 0 = to the end
};
int cmd_train(const TrainArgs& a);

struct EvalArgs {
  std::string config, checkpoint, predictions;
  std::vector<std::string> sets;
};
int cmd_eval(const EvalArgs& a);

struct ExportArgs {
  std::string checkpoint, format, out;  // format "" = by --out's extension (.onnx: onnx, else safetensors)
  std::string config;                   // onnx: the run's config (default: config.json beside the checkpoint)
  std::vector<std::string> sets;
  bool keep_bn = false;                 // onnx: BatchNormalization nodes instead of BN folded into the convs
};
int cmd_export(const ExportArgs& a);

struct PlotArgs {
  std::vector<std::string> runs;
  std::string out;  // default runs/plot-<time>.svg
};
int cmd_plot(const PlotArgs& a);

struct BenchStepArgs {
  std::string config;
  std::vector<std::string> sets;
  int steps = 20, warmup = 3;
  bool profile = false;
  bool profile_nodes = false;  // --profile-nodes: also one row per node
  std::vector<std::string> against;  // --against: dotted.key=value overrides of a second model, interleaved
};
int cmd_bench_step(const BenchStepArgs& a);

struct MemProfileArgs {
  std::string config, checkpoint, out;
  std::vector<std::string> sets;
  int steps = 2;            // the last one is profiled
  bool synthetic = false;   // N(0,1) images instead of a batch of the config's data
  bool keep_pages = false;  // do not set memory.release_pages (USS then keeps the step's high water)
};
int cmd_memprofile(const MemProfileArgs& a);

struct PlanArgs {
  std::string config;
  std::vector<std::string> sets;
};
int cmd_plan(const PlanArgs& a);

struct BenchFusionArgs {
  int depth = 8, reps = 5, warmup = 2;
  int64_t batch = 128, channels = 64, size = 32;
  bool no_pool = false;  // <BN, ReLU> blocks: the element-wise part alone
  int64_t cache_kb = 0;  // fusion.cache_kb: 0 = this core's L2 (planes beyond it go by bands of rows)
  int64_t llc_kb = 0;    // fusion.llc_kb: 0 = the last-level cache from sysfs or CPUID (unknown: nothing streams)
};
int cmd_bench_fusion(const BenchFusionArgs& a);

struct BenchBitmapArgs {
  int reps = 15, threads = 0;  // threads 0 = the codec default (OpenMP threads)
  uint64_t seed = 1;
  bool fp16 = false;
};
int cmd_bench_bitmap(const BenchBitmapArgs& a);

}  // namespace et::app
