// The trainer on CUDA: whole epochs with their evaluation, as `edgetrain train` runs them, against
// the same epochs on the CPU. The test split's last batch is short, so the next epoch starts after
// a forward of fewer images than the planned batch (the first GPU run wrote a whole batch through a
// host view sized for the short one, and crashed in epoch 2).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/train/trainer.h"
#include "tests/synthetic_data.h"

using namespace et;
using nlohmann::json;

namespace {

std::vector<json> fit_metrics(const std::string& device) {
  const Config c = parse_config({{"model", {{"name", "resnet8"}}},
                                 {"data", {{"format", "cifar10_binary"}, {"root", "x"}}},
                                 {"train", {{"epochs", 3}, {"batch_size", 8}, {"lr", 0.05}, {"threads", 2},
                                            {"device", device}}},
                                 {"fusion", {{"enabled", false}}}},
                                "<test>");
  // 24 training images (3 steps an epoch), 10 test images: batches of 8 and 2.
  Trainer t(c, test::synthetic_dataset(24, 1), test::synthetic_dataset(10, 2));
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("edgetrain_cuda_fit_" + device + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::FILE* null = std::fopen("/dev/null", "w");
  Progress quiet(null);
  t.fit(dir.string(), false, quiet);
  std::fclose(null);
  std::vector<json> m;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) m.push_back(json::parse(line));
  std::filesystem::remove_all(dir);
  return m;
}

}  // namespace

TEST_CASE("cuda: fit trains and evaluates epochs as on the CPU, after short evaluation batches", "[cuda][training]") {
  const std::vector<json> cpu = fit_metrics("cpu"), dev = fit_metrics("cuda");
  REQUIRE(cpu.size() == 3);
  REQUIRE(dev.size() == 3);
  for (size_t e = 0; e < 3; ++e) {
    INFO("epoch " << e + 1);
    // FP32 in other summation orders over 9 steps: a relative 1e-3 (a batch of stale images in the
    // second epoch moves the loss by far more).
    const double a = cpu[e]["train_loss"], d = dev[e]["train_loss"];
    CHECK(std::fabs(a - d) <= 1e-3 * std::fabs(a));
    const double ta = cpu[e]["test_loss"], td = dev[e]["test_loss"];
    CHECK(std::fabs(ta - td) <= 1e-3 * std::fabs(ta));
  }
}
