// The divergence guard's detection (engine/train/divergence.h): a non-finite loss, a loss above
// train.divergence_loss, a non-finite gradient or parameter after the SGD step, a quantizer's
// non-finite value; each names the step and the first layer where a non-finite value appeared.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>

#include "engine/train/optimizer.h"
#include "tests/fit_helper.h"
#include "tests/synthetic_data.h"
#include "engine/train/trainer.h"

using namespace et;
using nlohmann::json;

namespace {


Config config(const json& train_extra = json::object(), const json& quant = json::object(), bool fused = false) {
  json train = {{"epochs", 1}, {"batch_size", 8}, {"lr", 0.05}, {"threads", 2}};
  train.update(train_extra);
  return parse_config({{"model", {{"name", "resnet8"}}},
                       {"data", {{"format", "cifar10_binary"}, {"root", "x"}}},
                       {"train", train},
                       {"quant", quant},
                       {"fusion", {{"enabled", fused}}}},
                      "<test>");
}

// A trainer with one batch of its training data in the executor's inputs (normalised like the loader's).
struct Guarded {
  Trainer t;
  explicit Guarded(const Config& c) : t(c, test::synthetic_dataset(16, 1), test::synthetic_dataset(8, 2)) {
    Executor& ex = t.executor();
    const Dataset& d = *t.train_data();
    Tensor x = ex.value(ex.graph().image_input), y = ex.value(ex.graph().label_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(d.pixels[size_t(i)]) / 255.f - 0.5f;
    for (int64_t i = 0; i < 8; ++i) y.i32()[i] = d.labels[size_t(i)];
  }
  float* param(const std::string& name) {
    const int id = t.executor().graph().find_value(name);
    REQUIRE(id >= 0);
    return t.executor().value(id).f32();
  }
};

}  // namespace

TEST_CASE("the loss check: NaN, infinities, the bound", "[divergence]") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  CHECK(check_loss(2.3f, 230.f) == DivergenceCause::None);
  CHECK(check_loss(230.f, 230.f) == DivergenceCause::None);
  CHECK(check_loss(230.1f, 230.f) == DivergenceCause::LossAboveBound);
  CHECK(check_loss(nan, 230.f) == DivergenceCause::NonFiniteLoss);
  CHECK(check_loss(inf, 230.f) == DivergenceCause::NonFiniteLoss);
  CHECK(check_loss(-inf, 230.f) == DivergenceCause::NonFiniteLoss);
  // The default bound: 100 x the loss of a uniform prediction.
  CHECK(config().train.divergence_loss == Approx(100 * std::log(10.0)));
  CHECK(parse_config({{"model", {{"num_classes", 100}}}, {"data", {{"root", "x"}}}}, "<t>").train.divergence_loss ==
        Approx(100 * std::log(100.0)));
}

TEST_CASE("a finite step passes the guard", "[divergence]") {
  Guarded g(config());
  for (int s = 0; s < 3; ++s) REQUIRE(g.t.train_step(8, 0.05f));
  CHECK(g.t.progress_state().step == 3);
}

TEST_CASE("a non-finite loss is detected before the backward and traced to its layer", "[divergence]") {
  Guarded g(config());
  REQUIRE(g.t.train_step(8, 0.05f));
  g.param("linear.bias")[2] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(g.t.train_step(8, 0.05f));
  const Divergence& d = g.t.divergence();
  CHECK(d.cause == DivergenceCause::NonFiniteLoss);
  CHECK(d.step == 1);
  CHECK(d.loss_known);
  CHECK(std::isnan(d.loss));
  CHECK(d.layer == "linear");
  CHECK_THAT(d.where, Catch::Contains("output in the forward") && Catch::Contains("'linear.bias' is non-finite"));
  CHECK_THAT(d.describe(), Catch::Contains("loss nan (non-finite)") && Catch::Contains("layer 'linear'"));
  CHECK(g.t.progress_state().step == 1);  // the step did not count
}

TEST_CASE("the first layer in forward order with a non-finite value is named, even when the loss is finite",
          "[divergence]") {
  Guarded g(config());
  REQUIRE(g.t.train_step(8, 0.05f));
  // Every value after it goes non-finite in the forward, but ReLU may turn NaN into 0 and leave
  // the loss finite: then the gradients (checked before the update) catch it.
  g.param("layer2.0.conv1.weight")[3] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(g.t.train_step(8, 0.05f));
  const Divergence& d = g.t.divergence();
  INFO(d.describe());
  CHECK((d.cause == DivergenceCause::NonFiniteLoss || d.cause == DivergenceCause::NonFiniteGradient));
  CHECK(d.layer == "layer2.0.conv1");
  CHECK_THAT(d.where, Catch::Contains("output in the forward") && Catch::Contains("'layer2.0.conv1.weight' is non-finite"));
}

TEST_CASE("with fusion, the fused stack is named by its BN layer", "[divergence][fusion]") {
  for (bool fused : {false, true}) {
    Guarded g(config(json::object(), json::object(), fused));
    REQUIRE(g.t.train_step(8, 0.05f));
    g.param("layer2.0.bn1.bias")[1] = std::numeric_limits<float>::infinity();
    CHECK_FALSE(g.t.train_step(8, 0.05f));
    INFO("fused " << fused << ": " << g.t.divergence().describe());
    CHECK(g.t.divergence().layer == "layer2.0.bn1");
    CHECK_THAT(g.t.divergence().where, Catch::Contains("'layer2.0.bn1.bias' is non-finite"));
  }
}

TEST_CASE("a finite loss above train.divergence_loss diverges without a layer", "[divergence]") {
  Guarded g(config({{"divergence_loss", 0.5}}));  // a fresh model's loss is about ln 10 = 2.3
  CHECK_FALSE(g.t.train_step(8, 0.05f));
  const Divergence& d = g.t.divergence();
  CHECK(d.cause == DivergenceCause::LossAboveBound);
  CHECK(d.step == 0);
  CHECK(d.loss > 0.5);
  CHECK(std::isfinite(d.loss));
  CHECK(d.layer.empty());
  CHECK_THAT(d.detail, Catch::Contains("every value of the step is finite") && Catch::Contains("largest activation"));
  CHECK_THAT(d.describe(), Catch::Contains("above train.divergence_loss = 0.5") && Catch::Contains("layer: none"));
}

TEST_CASE("non-finite gradients and updates fail the checks around the SGD step, traced to their layer",
          "[divergence]") {
  Guarded g(config());
  Executor& ex = g.t.executor();
  REQUIRE(g.t.train_step(8, 0.05f));
  ex.forward(8, true);
  ex.backward();
  // Gradients of two layers non-finite: the later one (first in backward order) is the origin.
  ex.grad(ex.graph().find_value("layer1.0.bn2.weight")).f32()[1] = std::numeric_limits<float>::quiet_NaN();
  ex.grad(ex.graph().find_value("layer3.0.conv1.weight")).f32()[7] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(gradients_finite(ex));
  CHECK_FALSE(sgd_update(ex, SgdOptions{}, 0.05f, false));
  Divergence d;
  locate_in_update(ex, 0.05f, d);
  CHECK(d.layer == "layer3.0.conv1");
  CHECK_THAT(d.where, Catch::Contains("gradient of its parameter 'layer3.0.conv1.weight'"));
  // Finite gradients, but an update that overflows: the parameter is named.
  Guarded h(config());
  Executor& hx = h.t.executor();
  hx.forward(8, true);
  hx.backward();
  hx.grad(hx.graph().find_value("linear.bias")).f32()[0] = 1e30f;
  CHECK(gradients_finite(hx));
  CHECK_FALSE(sgd_update(hx, SgdOptions{}, 1e30f, true));
  Divergence e;
  locate_in_update(hx, 1e30f, e);
  CHECK(e.layer == "linear");
  CHECK_THAT(e.where, Catch::Contains("'linear.bias'") && Catch::Contains("from finite gradients"));
  // And every parameter finite: the check passes.
  Guarded k(config());
  k.t.executor().forward(8, true);
  k.t.executor().backward();
  CHECK(gradients_finite(k.t.executor()));
  CHECK(sgd_update(k.t.executor(), SgdOptions{}, 0.05f, true));
}

TEST_CASE("train_step: a non-finite update (momentum) is detected in its step", "[divergence]") {
  Guarded g(config());
  REQUIRE(g.t.train_step(8, 0.05f));
  Executor& ex = g.t.executor();
  ex.opt_slot(ex.graph().find_value("layer1.0.conv2.weight"), 0).f32()[0] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(g.t.train_step(8, 0.05f));
  const Divergence& d = g.t.divergence();
  CHECK(d.cause == DivergenceCause::NonFiniteUpdate);
  CHECK(d.step == 1);
  CHECK(std::isfinite(d.loss));
  CHECK(d.layer == "layer1.0.conv2");  // its gradient is finite: the parameter itself went non-finite
  CHECK_THAT(d.where, Catch::Contains("'layer1.0.conv2.weight'"));
}

TEST_CASE("a quantizer's non-finite value is a divergence, and the executor stays usable", "[divergence][quant]") {
  Guarded g(config(json::object(), {{"forward", "int4"}, {"backward", "luq_fp4"}}));
  REQUIRE(g.t.train_step(8, 0.05f));
  float* w = g.param("layer1.0.conv2.weight");
  const float kept = w[5];
  w[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(g.t.train_step(8, 0.05f));
  const Divergence& d = g.t.divergence();
  CHECK(d.cause == DivergenceCause::NonFiniteValue);
  CHECK_FALSE(d.loss_known);  // the forward stopped at the quantizer
  CHECK(d.layer == "layer1.0.conv2");
  CHECK_THAT(d.detail, Catch::Contains("non-finite weight") && Catch::Contains("step 1"));
  w[5] = kept;  // the run goes on from a good state (what a rollback does)
  CHECK(g.t.train_step(8, 0.05f));
  CHECK(std::isfinite(g.t.executor().loss()));
}

TEST_CASE("a layer raised to FP32 (a rollback's) is re-planned in FP32, and changes the step", "[divergence][quant]") {
  const json luq = {{"forward", "int4"}, {"backward", "luq_fp4"}};
  Guarded plain(config(json::object(), luq)), raised(config(json::object(), luq));
  const Graph& gr = raised.t.executor().graph();
  int conv = -1;
  for (int n = 0; n < gr.num_nodes(); ++n)
    if (gr.node(n).name == "layer2.0.conv1") conv = n;
  REQUIRE(conv >= 0);
  REQUIRE(raised.t.executor().layer_quant(conv).int4_forward);
  raised.t.progress_state().fp32_layers = {"layer2.0.conv1"};
  CHECK_FALSE(raised.t.enter_phase(0));  // the same phase, re-planned
  const LayerQuant& q = raised.t.executor().layer_quant(conv);
  CHECK_FALSE(q.on());
  // The other quantized layers stay in 4 bits.
  int quantized = 0;
  for (int n = 0; n < gr.num_nodes(); ++n) quantized += raised.t.executor().layer_quant(n).int4_forward;
  CHECK(quantized > 0);
  // The state was carried over: the same parameters, and a step now computes another loss.
  const int w = gr.find_value("layer2.0.conv1.weight");
  REQUIRE(w >= 0);
  const Tensor a = plain.t.executor().value(w), b = raised.t.executor().value(w);
  CHECK(std::equal(a.f32(), a.f32() + a.numel(), b.f32()));
  Guarded* both[] = {&plain, &raised};
  for (Guarded* g : both) {  // the re-plan left the inputs behind: load the same batch again
    Executor& ex = g->t.executor();
    const Dataset& d = *g->t.train_data();
    Tensor x = ex.value(ex.graph().image_input), y = ex.value(ex.graph().label_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(d.pixels[size_t(i)]) / 255.f - 0.5f;
    for (int64_t i = 0; i < 8; ++i) y.i32()[i] = d.labels[size_t(i)];
  }
  REQUIRE(plain.t.train_step(8, 0.05f));
  REQUIRE(raised.t.train_step(8, 0.05f));
  CHECK(plain.t.executor().loss() != raised.t.executor().loss());
}

TEST_CASE("fit with rollback: a quantized layer that diverges is raised to FP32, logged and checkpointed",
          "[divergence][quant]") {
  // 2 epochs of 2 steps; a NaN put into layer1.0.conv2's weight before step 3 (epoch 2) makes its
  // quantizer fail; fit rolls back to the checkpoint after epoch 1 and trains epoch 2 again with
  // that layer in FP32. Numerics-independent: the injected value, not a learning rate, diverges.
  Config c = config({{"epochs", 2}, {"on_divergence", "rollback"}}, {{"forward", "int4"}, {"backward", "luq_fp4"}});
  Trainer t(c, test::synthetic_dataset(16, 1), test::synthetic_dataset(8, 2));
  int injected = 0, reached = 0;  // the NaN once; step 3 twice (again after the rollback)
  t.set_before_step([&](Executor& ex, int64_t step) {
    if (step != 3 || reached++) return;
    ++injected;
    ex.value(ex.graph().find_value("layer1.0.conv2.weight")).f32()[5] = std::numeric_limits<float>::quiet_NaN();
  });
  std::filesystem::path dir;  // kept: its checkpoint is read below
  const std::vector<json> m = test::fit_quietly(t, "raise", &dir);
  CHECK(injected == 1);
  CHECK(reached == 2);
  // epoch 1, the rollback, epoch 2 again
  REQUIRE(m.size() == 3);
  INFO(m[1].dump());
  CHECK(m[1]["event"] == "divergence");
  CHECK(m[1]["action"] == "rollback");
  CHECK(m[1]["cause"] == "non_finite_value");
  CHECK(m[1]["layer"] == "layer1.0.conv2");
  CHECK(m[1]["fp32_layer"] == "layer1.0.conv2");
  CHECK(m[2]["epoch"] == 2);
  CHECK(std::isfinite(m[2]["train_loss"].get<double>()));
  // The executor runs that layer in FP32 now, the others still in 4 bits ...
  const Graph& g = t.executor().graph();
  int quantized = 0;
  for (int n = 0; n < g.num_nodes(); ++n) {
    if (g.node(n).name == "layer1.0.conv2") CHECK_FALSE(t.executor().layer_quant(n).on());
    quantized += t.executor().layer_quant(n).int4_forward;
  }
  CHECK(quantized > 0);
  // ... and the last checkpoint says so, for --resume, eval and export.
  Trainer u(c, test::synthetic_dataset(16, 1), test::synthetic_dataset(8, 2));
  const TrainProgress p = load_checkpoint((dir / "checkpoint_last.ckpt").string(), u.executor(), "resnet8");
  CHECK(p.fp32_layers == std::vector<std::string>{"layer1.0.conv2"});
  CHECK(p.rollbacks == 1);
  std::filesystem::remove_all(dir);
}
