// memory.budget_mb on CUDA (engine/budget.h): the budget bounds the device's memory as its driver
// counts it (DeviceMemory::usage, cudaMemGetInfo), not the process's USS: the arena, the stash
// region (fitted to what its entries keep, memory/stash.h) and the backend's own allocations. A
// budget between the smallest and the fastest plan is met, the step then holds no more of the
// device than the budget, and the exact choices train as the fastest plan does, bit for bit.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "engine/budget.h"
#include "engine/check.h"
#include "engine/executor.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "models/models.h"
#include "tests/cuda/scoped_env.h"

using namespace et;

namespace {

constexpr double kMB = 1048576.0;
constexpr int64_t kBatch = 16;

size_t device_used(Backend& be) {
  size_t used = 0, total = 0;
  REQUIRE(be.memory().usage(&used, &total));
  return used;
}

struct Budgeted {
  Graph g;
  Budgeted() {
    ModelSpec spec;
    spec.name = "resnet8";
    spec.batch = kBatch;
    build_model(g, spec);
  }
  BudgetPlan plan(Backend& be, double mb) {
    BudgetOptions o;
    o.budget_mb = mb;
    return plan_memory_budget(g, be, QuantOptions{}, o, [](Executor& ex) { init_parameters(ex, 5); });
  }
};

// Three steps in `so`, with the stash's room fitted after each backward as the trainer does: the
// losses, the parameters, and what the executor added to the device's memory.
struct Trained {
  std::vector<float> losses;
  std::vector<char> params;
  double device_mb = 0, arena_and_region_mb = 0;
};
Trained train(Backend& be, Graph& g, const StashOptions& so) {
  Trained r;
  const size_t before = device_used(be);
  Executor ex(g, be, so);
  init_parameters(ex, 5);
  for (int s = 0; s < 3; ++s) {
    {
      const HostView x(be, ex.value(g.image_input), HostView::Write), y(be, ex.value(g.label_input), HostView::Write);
      for (int64_t i = 0; i < kBatch * 3 * 32 * 32; ++i) x.f32()[i] = float((i + s) * 7 % 23) / 11.f - 1.f;
      for (int64_t i = 0; i < kBatch; ++i) y.i32()[i] = int32_t((i + s) * 3 % 10);
    }
    for (int attempt = 0;; ++attempt) {  // again on the same batch where the room grew (the trainer's rule)
      ex.set_repeating(attempt > 0);
      ex.forward(kBatch, true);
      ex.backward();
      if (!ex.fit_stash_room()) break;
    }
    ex.set_repeating(false);
    r.losses.push_back(ex.loss());
    REQUIRE(sgd_update(ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
  }
  r.device_mb = double(device_used(be) - before) / kMB;
  r.arena_and_region_mb = double(ex.memory().total + ex.stash().region_bytes()) / kMB;
  for (int p : g.params()) {
    const Tensor v = ex.value(p);
    const HostView h(be, v, HostView::Read);
    const char* b = reinterpret_cast<const char*>(h.f32());
    r.params.insert(r.params.end(), b, b + v.nbytes());
  }
  return r;
}

}  // namespace

TEST_CASE("cuda: a plan-only executor takes none of the device's memory", "[cuda][budget]") {
  // The budget weighs its candidates as plans (Executor::PlanOnly): the fastest may not fit.
  const std::unique_ptr<Backend> be = make_cuda_backend(0);
  Budgeted b;
  StashOptions so;
  so.format = StashFormat::BitmapF32;
  const size_t before = device_used(*be);
  const Executor planned(b.g, *be, so, QuantOptions{}, Executor::PlanOnly{});
  CHECK(device_used(*be) == before);
  CHECK(planned.memory().total > 0);
  CHECK(planned.stash().region_bytes() > 0);
  const Executor real(b.g, *be, so);
  CHECK(device_used(*be) >= before + real.memory().total + real.stash().region_bytes());
  CHECK(real.memory().total == planned.memory().total);
}

TEST_CASE("cuda: a memory budget plans the device's memory: met, and the step holds no more of it",
          "[cuda][budget]") {
  // The conv passes on the backend's own kernels: the budget's plan keeps values in other forms
  // than the fastest plan (its convs then read them decoded, with another workspace), and with
  // cuDNN such passes may take algorithms that round differently (test_cuda_fused.cpp says why).
  const test::ScopedEnv own_convs("EDGETRAIN_CUDA_CONV", "im2col");
  const std::unique_ptr<Backend> be = make_cuda_backend(0);
  Budgeted b;
  const BudgetPlan fastest = b.plan(*be, 1e6);
  CHECK(fastest.device);
  CHECK(fastest.options.layers.empty());
  CHECK(fastest.summary()[0].find("device memory") != std::string::npos);
  // The smallest exact plan, from the error of a budget none meets (it names the device's memory).
  double smallest = 0;
  try {
    b.plan(*be, 0.01);
    FAIL("a 0.01 MB budget was met");
  } catch (const UserError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("device memory outside arena and stash") != std::string::npos);
    const size_t at = msg.find("predicted at ");
    REQUIRE(at != std::string::npos);
    smallest = std::stod(msg.substr(at + 13));
  }
  REQUIRE(smallest < fastest.fastest_mb);
  const double budget = 0.5 * (smallest + fastest.fastest_mb);
  const BudgetPlan p = b.plan(*be, budget);
  INFO("fastest " << fastest.fastest_mb << " MB, smallest " << smallest << " MB, budget " << budget
                  << " MB, predicted " << p.predicted_mb << " MB (device memory outside arena and stash "
                  << p.overhead_mb << " MB)");
  REQUIRE(p.predicted_mb <= budget);
  CHECK((!p.options.layers.empty() || p.segments > 0));  // something had to move
  {  // a run folder's memory_plan.json says what it budgets
    const std::string path = (std::filesystem::temp_directory_path() / "edgetrain_cuda_budget_plan.json").string();
    std::ofstream(path) << budget_plan_json(p);
    CHECK(read_budget_plan(path, b.g).device);
    std::remove(path.c_str());
  }

  const Trained fast = train(*be, b.g, StashOptions{}), lean = train(*be, b.g, p.options);
  INFO("device memory added: fastest plan " << fast.device_mb << " MB, budget's " << lean.device_mb
                                             << " MB; arena + stash region " << fast.arena_and_region_mb << " / "
                                             << lean.arena_and_region_mb << " MB");
  // The arena and the fitted region within the prediction (less what calibration measured outside
  // them, which the backend keeps from then on), within the headroom the fit adds to each entry.
  CHECK(lean.arena_and_region_mb <= p.predicted_mb - p.overhead_mb + 0.05);
  CHECK(lean.device_mb <= budget);
  CHECK(lean.arena_and_region_mb < fast.arena_and_region_mb);
  // Exact formats and recomputation: the same numbers.
  CHECK(lean.losses == fast.losses);
  CHECK((lean.params == fast.params));
}
