// The trainer on CUDA: whole epochs with their evaluation, as `edgetrain train` runs them, against
// the same epochs on the CPU. The test split's last batch is short, so the next epoch starts after
// a forward of fewer images than the planned batch (the first GPU run wrote a whole batch through a
// host view sized for the short one, and crashed in epoch 2).
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "engine/train/trainer.h"
#include "tests/fit_helper.h"
#include "tests/synthetic_data.h"

using namespace et;
using nlohmann::json;

namespace {

// 24 training images (3 steps an epoch), 10 test images: batches of 8 and 2. `graph`: set
// train.cuda_graph (else "auto": on for CUDA).
std::vector<json> fit_metrics(const std::string& device, int graph = -1) {
  Config cfg = test::small_fit_config(3, device);
  if (graph >= 0) cfg.train.cuda_graph = graph == 1, cfg.train.cuda_graph_auto = false;
  Trainer t(cfg, test::synthetic_dataset(24, 1), test::synthetic_dataset(10, 2));
  return test::fit_quietly(t, "cuda_" + device + std::to_string(graph));
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

TEST_CASE("cuda: fit with train.cuda_graph gives the numbers of fit without it", "[cuda][training][replay]") {
  // Steps 3 to 9 replay the recorded step (2 warm-up steps, then the record), with an evaluation of
  // 8 + 2 images after each epoch: the same kernels on the same addresses, so the same numbers.
  const std::vector<json> plain = fit_metrics("cuda", 0), graph = fit_metrics("cuda", 1);
  REQUIRE(plain.size() == 3);
  REQUIRE(graph.size() == 3);
  for (size_t e = 0; e < 3; ++e) {
    INFO("epoch " << e + 1);
    CHECK(graph[e]["train_loss"] == plain[e]["train_loss"]);
    CHECK(graph[e]["test_loss"] == plain[e]["test_loss"]);
    CHECK(graph[e]["test_acc"] == plain[e]["test_acc"]);
  }
}
