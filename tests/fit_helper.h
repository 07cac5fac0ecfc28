// Test helper: whole `fit` runs of the trainer, quietly, in a temporary folder, and their
// metrics.jsonl records (the trainer tests of the CPU, the copying backend and CUDA).
#pragma once
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/train/trainer.h"

namespace et::test {

// resnet8 at batch 8, fusion off, `epochs` epochs on `device`, lr 0.05, 2 threads.
inline Config small_fit_config(int epochs, const std::string& device = "cpu") {
  return parse_config({{"model", {{"name", "resnet8"}}},
                       {"data", {{"format", "cifar10_binary"}, {"root", "x"}}},
                       {"train", {{"epochs", epochs}, {"batch_size", 8}, {"lr", 0.05}, {"threads", 2}, {"device", device}}},
                       {"fusion", {{"enabled", false}}}},
                      "<test>");
}

// Runs t.fit into a fresh temporary folder named after `tag` and returns metrics.jsonl's records.
// The folder is removed, unless `keep` is given: it then receives the folder's path (the caller
// removes it).
inline std::vector<nlohmann::json> fit_quietly(Trainer& t, const std::string& tag,
                                               std::filesystem::path* keep = nullptr) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("edgetrain_fit_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::FILE* null = std::fopen("/dev/null", "w");
  Progress quiet(null);
  t.fit(dir.string(), false, quiet);
  std::fclose(null);
  std::vector<nlohmann::json> records;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  if (keep) *keep = dir;
  else std::filesystem::remove_all(dir);
  return records;
}

}  // namespace et::test
