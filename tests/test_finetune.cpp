// Fine-tuning policies (finetune.trainable, finetune.bn; models/freeze.cpp): which parameters a
// policy selects, that frozen ones get no gradient or optimizer state and never change, that the
// trained ones get exactly the gradients full training gives them, and that the planner drops
// the backward and the saved activations of the frozen bottom (less planned memory).
#include <catch2/catch.hpp>

#include <cstring>
#include <random>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "models/models.h"

using namespace et;
using Catch::Matchers::Contains;

namespace {

struct Model {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;
  explicit Model(const std::vector<std::string>& trainable, bool frozen_bn = false, const std::string& name = "resnet20",
                 int64_t batch = 8) {
    ModelSpec s;
    s.name = name;
    s.batch = batch;
    s.finetune.trainable = trainable;
    s.finetune.frozen_bn = frozen_bn;
    build_model(g, s);
    ex = std::make_unique<Executor>(g, *be);
    init_parameters(*ex, 7);
    ex->forward(batch, false);  // views at full batch
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.f, 1.f);
    Tensor x = ex->value(g.image_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = d(rng);
    Tensor l = ex->value(g.label_input);
    for (int64_t i = 0; i < l.numel(); ++i) l.i32()[i] = int32_t(rng() % 10);
  }
  std::vector<std::string> trained() const {
    std::vector<std::string> out;
    for (int p : ex->params()) out.push_back(g.value(p).name);
    return out;
  }
  std::vector<float> copy(int id) const {
    const Tensor t = ex->value(id);
    return std::vector<float>(t.f32(), t.f32() + t.numel());
  }
};

bool all_start_with(const std::vector<std::string>& names, const std::vector<std::string>& prefixes) {
  for (const auto& n : names) {
    bool ok = false;
    for (const auto& p : prefixes) ok |= n.rfind(p, 0) == 0;
    if (!ok) return false;
  }
  return true;
}

std::string build_error(const std::vector<std::string>& trainable, const std::string& name = "resnet20") {
  try {
    Model m(trainable, false, name);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("finetune.trainable selects blocks, layers and patterns", "[finetune]") {
  const Model all({"all"});
  CHECK(all.trained().size() == all.g.params().size());
  const Model head({"head"});
  CHECK(head.trained() == std::vector<std::string>{"linear.weight", "linear.bias"});
  // ResNet-20: stem (conv1 + bn1), 9 blocks, head. last:3 = the last stage and the head.
  const Model last3({"last:3"});
  CHECK(all_start_with(last3.trained(), {"layer3.", "linear."}));
  CHECK(last3.trained().size() == 3 * 6 + 3 + 2);  // 3 blocks, layer3.0's shortcut conv + BN, the head
  const Model last10({"last:10"});
  CHECK(last10.trained().size() == all.trained().size());
  // VGG: a conv and the BN after it are one layer.
  const Model vgg({"last:1"}, false, "vgg11_bn");
  CHECK(vgg.trained() == std::vector<std::string>{"features.25.weight", "features.26.weight", "features.26.bias",
                                                  "classifier.weight", "classifier.bias"});
  // Patterns select whole layers by layer, block or parameter name.
  const Model pat({"layer2.1", "linear*"});
  CHECK(all_start_with(pat.trained(), {"layer2.1.", "linear."}));
  CHECK(pat.trained().size() == 6 + 2);
  const Model by_param({"*.bn2.bias"});
  CHECK(by_param.trained().size() == 9 * 2);  // the layers whose bias matched train whole (weight too)

  CHECK_THAT(build_error({"last:11"}), Contains("finetune.trainable") && Contains("only 10 blocks"));
  CHECK_THAT(build_error({"layer4.*"}), Contains("pattern 'layer4.*' matches no layer"));
}

TEST_CASE("frozen parameters have no gradient or optimizer state and never change", "[finetune]") {
  Model m({"last:3"});
  const MemoryReport& r = m.ex->memory();
  Model full({"all"});
  CHECK(r.params == full.ex->memory().params);
  size_t trained_bytes = 0;  // the last stage holds most of ResNet-20's weights, not all
  for (int p : m.ex->params()) trained_bytes += Arena::align_up(size_t(m.g.value(p).shape.numel()) * 4);
  CHECK(r.grads == trained_bytes);
  CHECK(r.optimizer == trained_bytes);
  CHECK(r.grads < full.ex->memory().grads);

  const int frozen_w = m.g.find_value("layer1.0.conv1.weight"), frozen_bn_mean = m.g.find_value("layer1.0.bn1.running_mean");
  const int trained_w = m.g.find_value("layer3.2.conv2.weight");
  CHECK(m.g.value(frozen_w).frozen);
  const auto w0 = m.copy(frozen_w), rm0 = m.copy(frozen_bn_mean), t0 = m.copy(trained_w);
  for (int step = 0; step < 2; ++step) {
    m.ex->forward(8, true);
    m.ex->backward();
    sgd_update(*m.ex, SgdOptions{}, 0.1f, step == 0);
  }
  CHECK(m.copy(frozen_w) == w0);
  CHECK(m.copy(frozen_bn_mean) != rm0);  // finetune.bn = train: frozen blocks' BN still track statistics
  CHECK(m.copy(trained_w) != t0);

  SECTION("finetune.bn = frozen: running statistics fixed, BN parameters not trained") {
    Model fb({"last:3"}, true);
    for (const auto& n : fb.trained()) CHECK(n.find(".bn") == std::string::npos);
    const auto rm = fb.copy(fb.g.find_value("layer3.2.bn2.running_var"));
    fb.ex->forward(8, true);
    fb.ex->backward();
    sgd_update(*fb.ex, SgdOptions{}, 0.1f, true);
    CHECK(fb.copy(fb.g.find_value("layer3.2.bn2.running_var")) == rm);
  }
}

TEST_CASE("trained layers get exactly the gradients full training gives them", "[finetune]") {
  for (const std::string policy : {"head", "last:3", "last:5"}) {
    DYNAMIC_SECTION("finetune.trainable = " << policy) {
      Model part({policy}), full({"all"});
      for (Model* m : {&part, &full}) {
        m->ex->forward(8, true);
        m->ex->backward();
      }
      CHECK(part.ex->loss() == full.ex->loss());
      for (int p : part.ex->params()) {
        const Tensor a = part.ex->grad(p), b = full.ex->grad(full.g.find_value(part.g.value(p).name));
        INFO(part.g.value(p).name);
        CHECK(std::memcmp(a.data, b.data, a.nbytes()) == 0);
      }
    }
  }
}

TEST_CASE("the frozen bottom keeps no saved activations: planned memory falls with the policy", "[finetune]") {
  const size_t full = Model({"all"}, false, "resnet20", 32).ex->memory().activations_planned;
  const size_t last3 = Model({"last:3"}, false, "resnet20", 32).ex->memory().activations_planned;
  const size_t head = Model({"head"}, false, "resnet20", 32).ex->memory().activations_planned;
  const size_t dense_full = Model({"all"}, false, "resnet20", 32).ex->memory().stash_dense_bytes;
  const size_t dense_last3 = Model({"last:3"}, false, "resnet20", 32).ex->memory().stash_dense_bytes;
  INFO("planned activations: full " << full << ", last:3 " << last3 << ", head " << head);
  CHECK(last3 < full / 2);
  CHECK(head < last3);
  // Last stage: 3 of 9 blocks at a quarter of the first stage's size each: well under 1/6 saved.
  CHECK(dense_last3 * 6 < dense_full);
}
