// 4-bit training through the executor (docs/quant.md): the quantized step trains, is reproducible,
// keeps codes instead of f32 inputs, handles depthwise layers and SMP, and reports non-finite
// values with the layer and the step.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "models/models.h"

using namespace et;

namespace {

struct QuantRun {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;

  QuantRun(const std::string& model, int64_t batch, const QuantOptions& q, const StashOptions& s = {}) {
    ModelSpec spec;
    spec.name = model;
    spec.batch = batch;
    build_model(g, spec);
    ex = std::make_unique<Executor>(g, *be, s, q);
    init_parameters(*ex, 5);
    Tensor x = ex->value(g.image_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float((i * 2654435761u) % 2001) / 1000.f - 1.f;
    for (int64_t i = 0; i < batch; ++i) ex->value(g.label_input).i32()[i] = int32_t(i * 3 % 10);
  }
  float step(int s, float lr) {
    ex->set_step_seed(uint64_t(s) * 7919);
    ex->set_step(s);
    ex->forward(g.batch_size(), true);
    const float loss = ex->loss();
    ex->backward();
    sgd_update(*ex, SgdOptions{0.9f, 5e-4f, false}, lr, s == 0);
    return loss;
  }
};

QuantOptions luq(int smp = 1) {
  QuantOptions q;
  q.forward = ForwardQuant::Int4;
  q.backward = BackwardQuant::LuqFp4;
  q.smp_samples = smp;
  return q;
}

}  // namespace

TEST_CASE("LUQ training fits a fixed batch and reproduces bit for bit", "[quant][training]") {
  QuantRun a("resnet8", 16, luq()), b("resnet8", 16, luq());
  float first = 0, last = 0;
  for (int s = 0; s < 30; ++s) {
    const float la = a.step(s, 0.05f), lb = b.step(s, 0.05f);
    REQUIRE(std::isfinite(la));
    CHECK(la == lb);
    if (s == 0) first = la;
    last = la;
  }
  CHECK(last < 0.5f * first);
}

TEST_CASE("the quantized step plans codes: the first and last layers stay FP32, the rest keep INT4 inputs",
          "[quant][training]") {
  StashOptions bitmap;
  bitmap.format = StashFormat::BitmapF32;
  QuantRun fp("resnet8", 8, QuantOptions{}, bitmap), q("resnet8", 8, luq(), bitmap);
  int quantized = 0, convs = 0;
  for (int n = 0; n < q.g.num_nodes(); ++n) {
    const Op& op = *q.g.node(n).op;
    if (op.op_class() != OpClass::Compute) continue;
    ++convs;
    quantized += q.ex->layer_quant(n).int4_forward;
  }
  CHECK(quantized == convs - 2);
  // Inputs of the quantized convs are no longer saved in f32: their ReLU keeps only its mask.
  CHECK(q.ex->memory().stash_region < fp.ex->memory().stash_region);
  CHECK(q.ex->memory().quant_operands > 0);
  CHECK(fp.ex->memory().quant_operands == 0);
  // Post-ReLU inputs get unsigned codes.
  for (int n = 0; n < q.g.num_nodes(); ++n)
    if (q.g.node(n).name == "layer1.0.conv1") CHECK(q.ex->layer_quant(n).input_unsigned);
}

TEST_CASE("SMP, the round-to-nearest ablation, FP32-backward and depthwise layers train", "[quant][training]") {
  QuantOptions rdn = luq();
  rdn.backward = BackwardQuant::Fp4Rdn;
  QuantOptions fwd_only = luq();
  fwd_only.backward = BackwardQuant::Fp32;
  QuantOptions bwd_only = luq();
  bwd_only.forward = ForwardQuant::Fp32;
  for (const QuantOptions& o : {luq(2), rdn, fwd_only, bwd_only}) {
    QuantRun r("resnet8", 8, o);
    for (int s = 0; s < 3; ++s) CHECK(std::isfinite(r.step(s, 0.02f)));
  }
  QuantRun one("resnet8", 8, luq(1)), two("resnet8", 8, luq(2));
  one.step(0, 0.02f);
  two.step(0, 0.02f);
  CHECK(one.step(1, 0.02f) != two.step(1, 0.02f));  // the second sample changes the weight gradient
  QuantRun m("mobilenetv2", 2, luq());               // depthwise convs: dequantised codes, float kernels
  for (int s = 0; s < 2; ++s) CHECK(std::isfinite(m.step(s, 0.01f)));
}

TEST_CASE("non-finite values in a quantized layer are errors naming the layer and the step", "[quant][training]") {
  {
    QuantRun r("resnet8", 4, luq());
    r.ex->value(r.g.find_value("layer1.0.conv2.weight")).f32()[5] = NAN;
    try {
      r.step(3, 0.01f);
      FAIL("no error");
    } catch (const UserError& e) {
      const std::string m = e.what();
      CHECK(m.find("layer1.0.conv2") != std::string::npos);
      CHECK(m.find("step 3") != std::string::npos);
      CHECK(m.find("non-finite weight") != std::string::npos);
    }
  }
  {
    QuantOptions q = luq();
    q.forward = ForwardQuant::Fp32;  // FP32 forward: the NaN reaches the loss, then the FP4 gradient
    QuantRun r("resnet8", 4, q);
    r.ex->value(r.g.find_value("linear.bias")).f32()[1] = NAN;  // NaN logits, loss and gradients
    try {
      r.step(7, 0.01f);
      FAIL("no error");
    } catch (const UserError& e) {
      const std::string m = e.what();
      CHECK(m.find("non-finite output gradient") != std::string::npos);
      CHECK(m.find("step 7") != std::string::npos);
    }
  }
}

TEST_CASE("quant options naming unknown layers are user errors", "[quant]") {
  QuantOptions q = luq();
  q.keep_fp32 = {"first", "layer9.conv"};
  CHECK_THROWS_WITH(QuantRun("resnet8", 2, q), Catch::Contains("quant.keep_fp32") && Catch::Contains("layer9.conv"));
  q.keep_fp32 = {};
  q.layers = {{"nope", ForwardQuant::Int4, BackwardQuant::LuqFp4}};
  CHECK_THROWS_WITH(QuantRun("resnet8", 2, q), Catch::Contains("quant.layers.nope"));
}
