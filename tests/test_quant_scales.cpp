// 4-bit scales kept in the backend's memory (Backend::quant_scales_in_memory), as a recordable GPU
// step needs them: no statistics read back by the layers, the scales written to floats of the
// backend's memory and read from there by the kernels (Tensor::scale_at), a non-finite operand
// flagged there and thrown after the forward or backward (Executor::check_quant_finite). On the
// CPU, whose kernels read Tensor::host_scale(), training must give the bits of the layers' own
// path, and a non-finite operand the same error.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "engine/init.h"
#include "engine/train/divergence.h"
#include "engine/train/trainer.h"
#include "models/models.h"
#include "tests/fit_helper.h"
#include "tests/synthetic_data.h"
#include "tests/tiny_training.h"

using namespace et;

namespace {

// The CPU backend with its scales in its memory (CpuBackend::int4_scale_to ... write them);
// `staged`: host code reads and writes its memory through copies, as a GPU's.
class ScalesInMemoryCpu final : public CpuBackend {
 public:
  explicit ScalesInMemoryCpu(bool staged = false) : staged_(staged) {}
  int scales = 0, alphas = 0, divisions = 0;
  bool quant_scales_in_memory() const override { return true; }
  bool host_addressable() const override { return !staged_; }
  void int4_scale_to(const Tensor& x, bool is_unsigned, float* scale, uint32_t* flag, uint32_t code) override {
    ++scales;
    CpuBackend::int4_scale_to(x, is_unsigned, scale, flag, code);
  }
  void fp4_alpha_to(const Tensor& g, int levels, float* alpha, uint32_t* flag, uint32_t code) override {
    ++alphas;
    CpuBackend::fp4_alpha_to(g, levels, alpha, flag, code);
  }
  void divide_scale_to(const float* scale, int divisor, float* out) override {
    ++divisions;
    CpuBackend::divide_scale_to(scale, divisor, out);
  }

 private:
  bool staged_;
};

struct Fit {
  std::vector<std::string> metrics;
  int scales = 0, alphas = 0, divisions = 0;
};

Fit fit_on(std::unique_ptr<Backend> be, const Config& cfg) {
  Trainer t(cfg, test::synthetic_dataset(24, 1), test::synthetic_dataset(10, 2), std::move(be));
  Fit f;
  for (const nlohmann::json& j : test::fit_quietly(t, "scales"))
    f.metrics.push_back(j["train_loss"].dump() + " " + j["test_loss"].dump() + " " + j["test_acc"].dump());
  if (const auto* s = dynamic_cast<const ScalesInMemoryCpu*>(&t.executor().backend()))
    f.scales = s->scales, f.alphas = s->alphas, f.divisions = s->divisions;
  return f;
}

}  // namespace

TEST_CASE("4-bit scales in the backend's memory: the layers' own training, bit for bit", "[quant][scales][training]") {
  // Each 4-bit variant the layers have: LUQ and round-to-nearest FP4 gradients, SMP samples (alpha
  // / smp), bitmap_int4 (the stash keeps the codes and their scale's place), recomputation (the
  // first forward's codes and scales), FNT (INT4 weights only), and a staged memory (copies).
  struct Case {
    const char* name;
    const char* backward;
    int smp, checkpoint_every, fnt_epochs;
    const char* stash;
    bool staged;
  };
  for (const Case c : {Case{"luq", "luq_fp4", 1, 0, 0, "dense_fp32", false},
                       Case{"fp4_rdn, 2 samples", "fp4_rdn", 2, 0, 0, "dense_fp32", false},
                       Case{"luq, bitmap_int4", "luq_fp4", 1, 0, 0, "bitmap_int4", false},
                       Case{"luq, recomputed", "luq_fp4", 1, 2, 0, "dense_fp32", false},
                       Case{"luq, FNT last epoch", "luq_fp4", 1, 0, 1, "dense_fp32", false},
                       Case{"luq, staged, 2 samples", "luq_fp4", 2, 0, 0, "bitmap_int4", true}}) {
    INFO(c.name);
    Config cfg = test::small_fit_config(3);
    cfg.quant.forward = "int4";
    cfg.quant.backward = c.backward;
    cfg.quant.smp_samples = c.smp;
    cfg.quant.fnt_epochs = c.fnt_epochs;
    cfg.memory.checkpoint_every = c.checkpoint_every;
    cfg.memory.stash = c.stash;
    const Fit cpu = fit_on(make_cpu_backend(), cfg), mem = fit_on(std::make_unique<ScalesInMemoryCpu>(c.staged), cfg);
    REQUIRE(cpu.metrics.size() == 3);
    CHECK(mem.metrics == cpu.metrics);
    CHECK(mem.scales > 0);
    CHECK(mem.alphas > 0);
    CHECK((mem.divisions > 0) == (c.smp > 1));
  }
}

TEST_CASE("4-bit scales in the backend's memory: a non-finite operand throws the quantizer's error after the pass",
          "[quant][scales][divergence]") {
  // A NaN in the second 4-bit layer's weight (the first conv stays FP32). The layers' own path
  // throws there, mid-forward; with the scales in memory the forward runs to its end, and
  // check_quant_finite throws the same error once (the flag is cleared).
  auto run = [](Backend& be, bool* threw_in_forward) {
    Graph g;
    ModelSpec spec;
    spec.name = "resnet8";
    spec.batch = 8;
    spec.fusion.enabled = false;
    build_model(g, spec);
    Executor ex(g, be, StashOptions{}, test::luq());
    init_parameters(ex, 3);
    Tensor x = ex.value(g.image_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(i % 13) / 6.f - 1.f;
    int quantized = 0;
    for (int n = 0; n < g.num_nodes(); ++n)
      if (ex.layer_quant(n).on() && ++quantized == 2) ex.value(g.node(n).inputs[1]).f32()[3] = std::nanf("");
    std::string message, layer;
    *threw_in_forward = false;
    try {
      ex.forward(8, true);
    } catch (const NonFiniteError& e) {
      *threw_in_forward = true;
      message = e.what(), layer = e.layer;
    }
    if (!*threw_in_forward) {
      try {
        ex.check_quant_finite();
      } catch (const NonFiniteError& e) {
        message = e.what(), layer = e.layer;
      }
      CHECK_NOTHROW(ex.check_quant_finite());  // reported once
    }
    return message + " | " + layer;
  };
  auto cpu = make_cpu_backend();
  ScalesInMemoryCpu mem;
  bool cpu_threw = false, mem_threw = true;
  const std::string a = run(*cpu, &cpu_threw), b = run(mem, &mem_threw);
  CHECK(cpu_threw);
  CHECK_FALSE(mem_threw);
  CHECK_THAT(a, Catch::Contains("non-finite weight at training step 0"));
  CHECK(b == a);
}

TEST_CASE("4-bit scales in the backend's memory: a quantizer's non-finite value is the same divergence",
          "[quant][scales][divergence]") {
  // As "a quantizer's non-finite value is a divergence" (tests/test_divergence.cpp) on the CPU's own
  // path: a NaN weight in layer1.0.conv2 at step 1 is a NonFiniteValue divergence naming that
  // layer and the step, and, the weight restored, the next step trains (the flag was cleared).
  Config cfg = test::small_fit_config(1);
  cfg.quant.forward = "int4";
  cfg.quant.backward = "luq_fp4";
  Trainer t(cfg, test::synthetic_dataset(16, 1), test::synthetic_dataset(8, 2), std::make_unique<ScalesInMemoryCpu>());
  Executor& ex = t.executor();
  const Dataset& d = *t.train_data();
  Tensor x = ex.value(ex.graph().image_input), y = ex.value(ex.graph().label_input);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(d.pixels[size_t(i)]) / 255.f - 0.5f;
  for (int64_t i = 0; i < 8; ++i) y.i32()[i] = d.labels[size_t(i)];
  REQUIRE(t.train_step(8, 0.05f));
  float* w = ex.value(ex.graph().find_value("layer1.0.conv2.weight")).f32();
  const float kept = w[5];
  w[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(t.train_step(8, 0.05f));
  const Divergence& dv = t.divergence();
  CHECK(dv.cause == DivergenceCause::NonFiniteValue);
  CHECK(dv.layer == "layer1.0.conv2");
  CHECK_THAT(dv.detail, Catch::Contains("non-finite weight") && Catch::Contains("step 1"));
  CHECK_FALSE(dv.loss_known);  // a forward operand's: reported as the layers' own check does
  w[5] = kept;
  CHECK(t.train_step(8, 0.05f));
  CHECK(std::isfinite(ex.loss()));
}
