// memory.budget_mb (engine/budget.h): the planner meets a budget between the smallest exact plan and
// the fastest one, its prediction matches what the stash and arena then take, the exact choices
// change no number of training, and an impossible budget is an error naming the smallest plan.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/budget.h"
#include "engine/check.h"
#include "tests/tiny_training.h"

using namespace et;

namespace {

constexpr double kMB = 1048576.0;

struct Planned {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  BudgetPlan plan;
  explicit Planned(double budget_mb, bool lossy = false, const QuantOptions& quant = {}, bool fused = false) {
    ModelSpec spec;
    spec.name = "resnet8";
    spec.batch = 32;
    spec.fusion.enabled = fused;
    build_model(g, spec);
    BudgetOptions o;
    o.budget_mb = budget_mb;
    o.lossy = lossy;
    plan = plan_memory_budget(g, *be, quant, o, [](Executor& ex) { init_parameters(ex, 5); });
  }
};

struct Trained {
  std::vector<float> losses, params;
  double arena_and_stash_mb = 0;
};

Trained train(const StashOptions& opt, const QuantOptions& quant = {}, int steps = 3, bool fused = false) {
  FusionSpec fusion;
  fusion.enabled = fused;
  test::TinyTraining t("resnet8", 32, opt, 5, 0, 7, quant, fusion);
  Trained r;
  t.ex->stash().reset_peak();
  for (int s = 0; s < steps; ++s) {
    t.ex->set_step_seed(uint64_t(s));
    t.ex->forward(32, true);
    r.losses.push_back(t.ex->loss());
    t.ex->backward();
    t.sgd(0.05f, s == 0);
  }
  for (int p : t.g.params()) {
    const Tensor v = t.ex->value(p);
    r.params.insert(r.params.end(), v.f32(), v.f32() + v.numel());
  }
  r.arena_and_stash_mb = double(t.ex->memory().total + t.ex->stash().region_peak_bytes()) / kMB;
  return r;
}

// The smallest plan, read from the error of a budget no plan meets: its prediction and, within it,
// the USS outside arena and stash that its planning run measured. `core` (arena + stash) is the
// part the plan decides; the overhead moves by a few MB between runs on a loaded machine.
struct Smallest {
  double mb = 0, overhead_mb = 0;
  double core() const { return mb - overhead_mb; }
};

// Both figures from a "no plan fits" message.
Smallest parse_smallest(const std::string& msg) {
  const size_t at = msg.find("predicted at "), over = msg.find("USS outside arena and stash measured at ");
  REQUIRE(at != std::string::npos);
  REQUIRE(over != std::string::npos);
  return Smallest{std::stod(msg.substr(at + 13)), std::stod(msg.substr(over + 40))};
}

Smallest smallest_plan(bool lossy, const QuantOptions& quant = {}) {
  try {
    Planned p(1.0, lossy, quant);
  } catch (const UserError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("memory.budget_mb") != std::string::npos);
    return parse_smallest(msg);
  }
  FAIL("a 1 MB budget was met");
  return {};
}
double smallest(bool lossy, const QuantOptions& quant = {}) { return smallest_plan(lossy, quant).mb; }

// A plan whose arena + stash may be `factor` x the smallest plan's: the budget is that plus the
// overhead. Each planning run measures the overhead again, so the budget is set from the figure of
// the latest run, and the plan is taken again (at most three tries) when its own run measured
// another one by more than 0.25 MB: a drift of 2.6 MB, seen under ctest -j2, would otherwise
// widen the margin enough for a plan of another kind (a no-plan-fits error also gives the figure).
std::unique_ptr<Planned> planned_above_smallest(double factor, const QuantOptions& quant = {}) {
  const Smallest s = smallest_plan(false, quant);
  double overhead_mb = s.overhead_mb;
  for (int attempt = 0;; ++attempt) {
    const double budget = overhead_mb + factor * s.core();
    try {
      auto p = std::make_unique<Planned>(budget, false, quant);
      if (attempt == 2 || std::abs(p->plan.overhead_mb - overhead_mb) <= 0.25) return p;
      overhead_mb = p->plan.overhead_mb;
    } catch (const UserError& e) {
      if (attempt == 2) throw;
      overhead_mb = parse_smallest(e.what()).overhead_mb;
    }
  }
}

}  // namespace

TEST_CASE("a budget above the fastest plan changes nothing", "[budget]") {
  Planned p(1e6);
  CHECK(p.plan.options.layers.empty());
  CHECK(p.plan.options.checkpoint_every == 0);
  CHECK(p.plan.extra_ms == 0);
  CHECK(p.plan.predicted_mb == Approx(p.plan.fastest_mb));
}

TEST_CASE("a budget between the smallest and the fastest plan is met, exactly", "[budget]") {
  const double fastest = Planned(1e6).plan.fastest_mb;
  const double budget = 0.5 * (smallest(false) + fastest);
  Planned p(budget);
  INFO("fastest " << fastest << " MB, budget " << budget << " MB, predicted " << p.plan.predicted_mb);
  REQUIRE(p.plan.predicted_mb <= budget);
  // Something had to move: a bitmap, or a recomputed segment.
  CHECK((!p.plan.options.layers.empty() || p.plan.segments > 0));
  CHECK(p.plan.extra_ms > 0);

  const Trained fast = train(StashOptions{});
  const Trained lean = train(p.plan.options);
  // The prediction (less the USS measured outside arena and stash) bounds what they take, within
  // the non-zero headroom it adds to bitmaps.
  const double predicted = p.plan.predicted_mb - p.plan.overhead_mb;
  CHECK(lean.arena_and_stash_mb <= predicted + 0.01);
  CHECK(lean.arena_and_stash_mb >= 0.9 * predicted);
  CHECK(lean.arena_and_stash_mb < fast.arena_and_stash_mb);
  // Exact formats and recomputation: every loss and parameter bit-identical.
  CHECK(lean.losses == fast.losses);
  REQUIRE(lean.params.size() == fast.params.size());
  CHECK(std::memcmp(lean.params.data(), fast.params.data(), fast.params.size() * sizeof(float)) == 0);
}

TEST_CASE("with fused stacks the budget keeps no stack output first: free, exact, and what the plan predicts",
          "[budget][fusion]") {
  // memory.recompute_stack_outputs as the budget's lever: a BN -> ReLU stack's output is computed by
  // the conv that reads it in backward, at no predicted time. A budget just under the fastest plan
  // is met by it alone, before any bitmap or segment (which cost time).
  const Planned fastest(1e6, false, {}, true);
  CHECK(fastest.plan.options.recompute_stack_outputs);  // free: taken even where nothing needs it
  CHECK(fastest.plan.predicted_mb < fastest.plan.fastest_mb);
  // 0.5 MB under the fastest plan's arena + stash, plus the overhead (USS outside them) measured by
  // the latest planning run: it drifts between runs (2.6 MB seen under ctest -j2), so the plan is
  // taken again, at most three times, when its run measured another by more than 0.25 MB.
  const double fastest_core = fastest.plan.fastest_mb - fastest.plan.overhead_mb;
  double overhead_mb = fastest.plan.overhead_mb;
  std::unique_ptr<Planned> planned;
  for (int attempt = 0; attempt < 3; ++attempt) {
    planned = std::make_unique<Planned>(overhead_mb + fastest_core - 0.5, false, QuantOptions{}, true);
    if (std::abs(planned->plan.overhead_mb - overhead_mb) <= 0.25) break;
    overhead_mb = planned->plan.overhead_mb;
  }
  const Planned& p = *planned;
  INFO("fastest " << p.plan.fastest_mb << " MB, predicted " << p.plan.predicted_mb);
  REQUIRE(p.plan.predicted_mb <= p.plan.budget_mb);
  CHECK(p.plan.options.recompute_stack_outputs);
  CHECK(p.plan.stack_outputs == 4);  // resnet8: the stem's BN -> ReLU stack and one per block
  CHECK(p.plan.options.layers.empty());
  CHECK(p.plan.segments == 0);
  CHECK(p.plan.extra_ms == 0);
  bool named = false;
  for (const std::string& line : p.plan.summary()) named |= line.find("4 fused stack outputs computed") != std::string::npos;
  CHECK(named);

  const Trained fast = train(StashOptions{}, {}, 3, true);
  const Trained lean = train(p.plan.options, {}, 3, true);
  const double predicted = p.plan.predicted_mb - p.plan.overhead_mb;
  CHECK(lean.arena_and_stash_mb <= predicted + 0.01);
  CHECK(lean.arena_and_stash_mb < fast.arena_and_stash_mb);
  CHECK(lean.losses == fast.losses);
  REQUIRE(lean.params.size() == fast.params.size());
  CHECK(std::memcmp(lean.params.data(), fast.params.data(), fast.params.size() * sizeof(float)) == 0);

  // The choice survives a run folder's memory plan.
  const std::string path = (std::filesystem::temp_directory_path() / "edgetrain_budget_stack_plan.json").string();
  {
    std::ofstream out(path);
    out << budget_plan_json(p.plan);
  }
  CHECK(read_budget_plan(path, p.g).options.recompute_stack_outputs);
  std::remove(path.c_str());
}

TEST_CASE("an impossible budget names the smallest plan", "[budget]") {
  // Arena + stash compared: each figure comes from its own planning run and its own overhead.
  const double exact = smallest_plan(false).core(), lossy = smallest_plan(true).core();
  const Planned fastest(1e6);
  CHECK(exact < fastest.plan.fastest_mb - fastest.plan.overhead_mb);
  CHECK(lossy < exact);
  // ... and a budget 5 % above the smallest exact one is met without fp16.
  const auto p = planned_above_smallest(1.05);
  CHECK(p->plan.predicted_mb <= p->plan.budget_mb);
  for (const auto& [layer, f] : p->plan.options.layers) CHECK((f == StashFormat::BitmapF32 || f == StashFormat::DenseF32));
}

TEST_CASE("4-bit training: the budget keeps INT4 codes where they fit, and its plans train bit-identically",
          "[budget][quant]") {
  const QuantOptions luq = test::luq();
  const double fastest = Planned(1e6, false, luq).plan.fastest_mb;
  const Smallest exact_plan = smallest_plan(false, luq);
  const double exact = exact_plan.mb;
  // Codes (1 + 4 bits a non-zero) and the BN inputs recomputed from them beat bitmap_fp32 and
  // fp32 recompute segments: the smallest 4-bit plan is below the smallest FP32 one.
  CHECK(exact_plan.core() < smallest_plan(false).core());
  for (const bool tight : {false, true}) {
    const auto planned = tight ? planned_above_smallest(1.05, luq) : std::make_unique<Planned>(0.5 * (exact + fastest), false, luq);
    const Planned& p = *planned;
    const double budget = p.plan.budget_mb;
    INFO("fastest " << fastest << " MB, smallest " << exact << " MB, budget " << budget << " MB, predicted "
                    << p.plan.predicted_mb);
    REQUIRE(p.plan.predicted_mb <= budget);
    const Trained fast = train(StashOptions{}, luq);
    const Trained lean = train(p.plan.options, luq);
    CHECK(lean.arena_and_stash_mb <= p.plan.predicted_mb - p.plan.overhead_mb + 0.01);
    CHECK(lean.arena_and_stash_mb < fast.arena_and_stash_mb);
    CHECK(lean.losses == fast.losses);
    REQUIRE(lean.params.size() == fast.params.size());
    CHECK(std::memcmp(lean.params.data(), fast.params.data(), fast.params.size() * sizeof(float)) == 0);
  }
  // Near the smallest plan, codes are what gets there.
  const auto tight = planned_above_smallest(1.05, luq);
  INFO("smallest " << exact_plan.mb << " MB (overhead " << exact_plan.overhead_mb << "), budget " << tight->plan.budget_mb
                   << " MB, predicted " << tight->plan.predicted_mb << " (overhead " << tight->plan.overhead_mb
                   << "), checkpoint_every " << tight->plan.options.checkpoint_every);
  CHECK(std::any_of(tight->plan.options.layers.begin(), tight->plan.options.layers.end(),
                    [](const auto& l) { return l.second == StashFormat::BitmapI4; }));
}

TEST_CASE("a run's memory plan reads back as it was chosen", "[budget]") {
  const double fastest = Planned(1e6).plan.fastest_mb;
  Planned p(0.5 * (smallest(false) + fastest));
  const std::string path = (std::filesystem::temp_directory_path() / "edgetrain_budget_plan_test.json").string();
  {
    std::ofstream out(path);
    out << budget_plan_json(p.plan);
  }
  const BudgetPlan back = read_budget_plan(path, p.g);
  auto sorted = [](std::vector<std::pair<std::string, StashFormat>> v) {  // a set of overrides: any order
    std::sort(v.begin(), v.end());
    return v;
  };
  CHECK(sorted(back.options.layers) == sorted(p.plan.options.layers));
  CHECK(back.options.checkpoint_every == p.plan.options.checkpoint_every);
  CHECK(back.options.segments == p.plan.options.segments);
  CHECK(back.budget_mb == p.plan.budget_mb);
  CHECK_FALSE(back.device);  // a budget of USS (on CUDA, of the device's memory)
  {
    std::ofstream out(path);
    out << R"({"budget_mb": 1, "predicted_mb": 1, "extra_ms": 0, "checkpoint_every": 1, "segments": [1], "layers": {}})";
  }
  CHECK_THROWS_AS(read_budget_plan(path, p.g), UserError);  // resnet8 has more than one segment
  std::remove(path.c_str());
}
