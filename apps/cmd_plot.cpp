// `edgetrain plot RUN_DIR...`: several runs' curves on one chart (engine/train/curves.h).
#include <cstdio>
#include <filesystem>

#include "apps/commands.h"
#include "engine/check.h"
#include "engine/train/curves.h"

namespace et::app {
namespace fs = std::filesystem;

int cmd_plot(const PlotArgs& a) {
  const std::string out = a.out.empty() ? default_run_dir("plot") + ".svg" : a.out;
  if (fs::exists(out)) user_error("'", out, "' exists; choose another --out");
  std::vector<RunCurves> runs;
  std::string title;
  for (const std::string& dir : a.runs) {
    runs.push_back(read_run_curves((fs::path(dir) / "metrics.jsonl").string(), run_name(dir)));
    title += (title.empty() ? "" : " vs ") + run_name(dir);
  }
  if (!fs::path(out).parent_path().empty()) {
    std::error_code ec;
    fs::create_directories(fs::path(out).parent_path(), ec);
  }
  write_atomically(out, curves_svg(runs, title));
  std::printf("wrote %s (%zu runs)\n", out.c_str(), runs.size());
  return 0;
}

}  // namespace et::app
