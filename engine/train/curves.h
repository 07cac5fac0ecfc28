// Training curves as SVG: train / test loss and accuracy, learning rate and peak USS per epoch
// (and a GPU run's device memory), from runs' metrics.jsonl. The trainer rewrites <run>/curves.svg
// after every epoch (a run on a device can be watched from a browser); `edgetrain plot RUN_DIR...`
// draws several runs on one chart to compare them.
#pragma once
#include <string>
#include <vector>

namespace et {

struct RunCurves {
  std::string name;  // legend label
  std::vector<double> epoch, train_loss, test_loss, train_acc, test_acc, lr, peak_uss_mb;
  std::vector<double> device_mb;  // a GPU run's device memory (NaN elsewhere)
};

// The epoch records of `metrics_path` (metrics.jsonl; event lines and unreadable lines skipped).
// Throws UserError if the file cannot be read.
RunCurves read_run_curves(const std::string& metrics_path, const std::string& name);

// A 2x2 panel chart (loss, accuracy, learning rate, peak USS) of every run; train dashed, test solid.
std::string curves_svg(const std::vector<RunCurves>& runs, const std::string& title);

// A run's name for legends: its folder's name ("runs/a/" -> "a").
std::string run_name(const std::string& run_dir);

// Rewrites <run_dir>/curves.svg from its metrics.jsonl (through a temporary file and a rename).
void write_run_curves(const std::string& run_dir, const std::string& title);

}  // namespace et
