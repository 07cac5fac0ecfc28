// 4-bit training through the executor (docs/quant.md): the quantized step trains, is reproducible,
// keeps codes instead of f32 inputs, handles depthwise layers and SMP, and reports non-finite
// values with the layer and the step. FNT: its modes, its step against an FP32 reference, its
// learning rate, and the trainer's switch.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "engine/train/schedule.h"
#include "engine/train/trainer.h"
#include "models/models.h"
#include "tests/synthetic_data.h"
#include "tests/tiny_training.h"
#include "quant/scales.h"

using namespace et;

namespace {

using et::test::luq;

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

// --- FNT (quant.fnt_epochs): high precision except the weights --------------------------------

namespace {

QuantOptions fnt_of(QuantOptions q) {
  q.fnt = true;
  return q;
}

std::vector<char> state_bytes(const Executor& ex) {
  std::vector<char> out;
  for (const Tensor& t : ex.state_tensors())
    out.insert(out.end(), static_cast<const char*>(t.data), static_cast<const char*>(t.data) + t.nbytes());
  return out;
}


}  // namespace

TEST_CASE("FNT resolves every quantized layer to INT4 weights only, FP32 layers stay FP32", "[quant][fnt]") {
  QuantOptions o = luq();
  o.layers = {{"layer1.0.conv1", ForwardQuant::Fp32, BackwardQuant::Fp32},    // per-layer FP32: stays FP32
              {"layer2.0.conv1", ForwardQuant::Fp32, BackwardQuant::LuqFp4}};  // backward only: INT4 weights
  StashOptions bitmap;
  bitmap.format = StashFormat::BitmapF32;
  QuantRun main("resnet8", 8, o, bitmap), fnt("resnet8", 8, fnt_of(o), bitmap), fp("resnet8", 8, QuantOptions{}, bitmap);
  int weights_only = 0, computes = 0;
  for (int n = 0; n < fnt.g.num_nodes(); ++n) {
    if (fnt.g.node(n).op->op_class() != OpClass::Compute) continue;
    ++computes;
    const LayerQuant& m = main.ex->layer_quant(n);
    const LayerQuant& f = fnt.ex->layer_quant(n);
    INFO(fnt.g.node(n).name);
    CHECK(f.int4_weights_only == m.on());
    CHECK(!f.int4_forward);
    CHECK(f.backward == BackwardQuant::Fp32);
    CHECK(f.on() == m.on());
    weights_only += f.int4_weights_only;
    if (fnt.g.node(n).name == "layer1.0.conv1" || fnt.g.node(n).name == "conv1" || fnt.g.node(n).name == "linear")
      CHECK(!f.on());
    if (fnt.g.node(n).name == "layer2.0.conv1") CHECK(f.int4_weights_only);
  }
  CHECK(weights_only == computes - 3);
  // The inputs are saved in f32 as in FP32 training; only the weight codes and their f32 copies are added.
  CHECK(fnt.ex->memory().stash_region == fp.ex->memory().stash_region);
  CHECK(fnt.ex->memory().quant_operands > 0);
  CHECK(fnt.ex->memory().quant_operands < main.ex->memory().quant_operands);
}

// The reference: an FP32 executor whose quantized layers' weights are replaced by their dequantised
// INT4 codes (SAWB scale, round to nearest, computed here with the backend's quantizer). The FNT
// step must give the same loss and gradients bit for bit (the same float kernels on the same
// values), and its SGD update of the FP32 master weights must equal that update applied with the
// reference's gradients.
TEST_CASE("an FNT step equals an FP32 step on the dequantised INT4 weights, updating the master weights",
          "[quant][fnt]") {
  for (const char* model : {"resnet8", "mobilenetv2"}) {  // mobilenetv2: depthwise convs too
    INFO(model);
    const int64_t batch = std::string(model) == "resnet8" ? 8 : 2;
    QuantRun fnt(model, batch, fnt_of(luq(2))), ref(model, batch, QuantOptions{});
    const std::vector<int>& params = fnt.ex->params();
    std::vector<std::vector<float>> master;  // the reference's weights before the swap
    int swapped = 0;
    for (int p : params) {
      Tensor w = ref.ex->value(p);
      master.emplace_back(w.f32(), w.f32() + w.numel());
    }
    for (int n = 0; n < fnt.g.num_nodes(); ++n) {
      if (!fnt.ex->layer_quant(n).int4_weights_only) continue;
      Tensor w = ref.ex->value(fnt.g.node(n).inputs[1]);
      std::vector<int8_t> codes(size_t(w.numel()));
      Tensor q = Tensor::contiguous(codes.data(), w.shape, DType::I4);
      q.scale = quant::sawb_scale(ref.be->tensor_stats(w), w.numel(), false);
      ref.be->quantize_int4(w, q);
      ref.be->dequantize(q, w);
      ++swapped;
    }
    REQUIRE(swapped > 0);
    for (QuantRun* r : {&fnt, &ref}) {
      r->ex->set_step_seed(11);
      r->ex->set_step(0);
      r->ex->forward(batch, true);
      r->ex->backward();
    }
    CHECK(fnt.ex->loss() == ref.ex->loss());
    for (size_t i = 0; i < params.size(); ++i) {
      INFO(fnt.g.value(params[i]).name);
      const Tensor ga = fnt.ex->grad(params[i]), gb = ref.ex->grad(params[i]);
      CHECK(std::memcmp(ga.data, gb.data, ga.nbytes()) == 0);
    }
    // The update goes to the master weights, not to the dequantised ones the forward used.
    for (size_t i = 0; i < params.size(); ++i)
      std::copy(master[i].begin(), master[i].end(), ref.ex->value(params[i]).f32());
    for (QuantRun* r : {&fnt, &ref}) sgd_update(*r->ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, true);
    for (size_t i = 0; i < params.size(); ++i) {
      INFO(fnt.g.value(params[i]).name);
      const Tensor a = fnt.ex->value(params[i]), b = ref.ex->value(params[i]);
      CHECK(std::memcmp(a.data, b.data, a.nbytes()) == 0);
      CHECK(std::memcmp(fnt.ex->opt_slot(params[i], 0).data, ref.ex->opt_slot(params[i], 0).data, a.nbytes()) == 0);
    }
  }
}

TEST_CASE("FNT with recomputation and a bitmap stash trains bit-identically to FNT without", "[quant][fnt]") {
  StashOptions rec;
  rec.format = StashFormat::BitmapF32;
  rec.checkpoint_every = 1;  // the conv forwards run again: their weight codes are written again
  QuantRun a("resnet8", 8, fnt_of(luq())), b("resnet8", 8, fnt_of(luq()), rec);
  for (int s = 0; s < 3; ++s) CHECK(a.step(s, 0.05f) == b.step(s, 0.05f));
  CHECK(state_bytes(*a.ex) == state_bytes(*b.ex));
}

TEST_CASE("FNT learning rate: the main schedule over epochs - fnt_epochs, then a triangle", "[quant][fnt][config]") {
  TrainConfig t;
  t.lr = 0.1f;
  t.epochs = 10;
  t.schedule.type = "cosine";
  t.schedule.min_lr = 0.001f;
  QuantConfig q;
  q.fnt_peak_lr = 0.01f;
  for (double e : {0.0, 3.3, 7.5, 9.99}) CHECK(learning_rate(t, q, e) == learning_rate(t, e));  // fnt_epochs 0
  q.fnt_epochs = 2;
  CHECK(learning_rate(t, q, 0) == Approx(0.1));
  CHECK(learning_rate(t, q, 4) == Approx(0.0505));           // the cosine's middle over 8 epochs
  CHECK(learning_rate(t, q, 7.999) == Approx(0.001).epsilon(1e-3));
  CHECK(learning_rate(t, q, 8) == Approx(0.001));            // FNT starts at the main schedule's final rate
  CHECK(learning_rate(t, q, 8.5) == Approx(0.0055));         // rising linearly
  CHECK(learning_rate(t, q, 9) == Approx(0.01));             // the peak in the middle of the FNT steps
  CHECK(learning_rate(t, q, 9.5) == Approx(0.0055));
  CHECK(learning_rate(t, q, 10) == Approx(0.001));           // back to the final rate at the end
  // Per step, as the trainer asks: 1 FNT epoch of 4 steps after a 3-epoch multistep schedule.
  t.epochs = 4;
  t.schedule = ScheduleConfig{};
  t.schedule.milestones = {2};
  q.fnt_epochs = 1;
  q.fnt_peak_lr = 0.05f;
  const double want[] = {0.01, 0.03, 0.05, 0.03};
  for (int i = 0; i < 4; ++i) CHECK(learning_rate(t, q, 3 + i / 4.0) == Approx(want[i]));
  // The default peak is 0.01 * train.lr; it is written back with the resolved config.
  const Config c = parse_config({{"data", {{"root", "x"}}},
                                 {"train", {{"epochs", 3}, {"lr", 0.2}}},
                                 {"quant", {{"forward", "int4"}, {"fnt_epochs", 1}}}},
                                "<test>");
  CHECK(c.quant.fnt_peak_lr == Approx(0.002));
  CHECK(c.resolved()["quant"]["fnt_peak_lr"].get<float>() == c.quant.fnt_peak_lr);
  CHECK(c.quant_options(true).fnt);
  CHECK(!c.quant_options().fnt);
}

TEST_CASE("an FNT run switches at its last epoch, carries the state bit for bit and trains", "[quant][fnt][training]") {
  const Config cfg = parse_config(
      {{"model", {{"name", "resnet8"}}},
       {"data", {{"format", "cifar10_binary"}, {"root", "x"}}},
       {"train", {{"epochs", 3}, {"batch_size", 32}, {"lr", 0.05}, {"threads", 2}, {"schedule", {{"type", "cosine"}}}}},
       {"quant", {{"forward", "int4"}, {"backward", "luq_fp4"}, {"fnt_epochs", 1}}}},
      "<test>");
  const auto train = et::test::synthetic_dataset(256, 1), test = et::test::synthetic_dataset(64, 2);
  {  // enter_phase moves params, gradients, momentum and BN statistics exactly, both ways.
    Trainer t(cfg, train, test);
    for (const Tensor& m : t.executor().state_tensors())
      for (int64_t i = 0; i < m.numel(); ++i) m.f32()[i] += float(i % 7) * 1e-3f;  // non-trivial momentum etc.
    const std::vector<char> before = state_bytes(t.executor());
    CHECK(!t.enter_phase(1));
    CHECK(t.enter_phase(2));
    CHECK(t.fnt());
    CHECK(state_bytes(t.executor()) == before);
    CHECK(t.enter_phase(0));
    CHECK(state_bytes(t.executor()) == before);
  }
  Trainer t(cfg, train, test);
  const std::string dir = (std::filesystem::temp_directory_path() / ("edgetrain_fnt_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::FILE* null = std::fopen("/dev/null", "w");
  Progress quiet(null);
  t.fit(dir, false, quiet);
  std::fclose(null);
  std::vector<nlohmann::json> m;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) m.push_back(nlohmann::json::parse(line));
  std::filesystem::remove_all(dir);
  REQUIRE(m.size() == 3);
  CHECK(t.fnt());
  CHECK(!m[0]["fnt"].get<bool>());
  CHECK(!m[1]["fnt"].get<bool>());
  CHECK(m[2]["fnt"].get<bool>());
  INFO(m[0].dump() << " / " << m[2].dump());
  CHECK(m[2]["train_loss"].get<double>() < m[0]["train_loss"].get<double>());
  CHECK(std::isfinite(m[2]["test_loss"].get<double>()));
}
