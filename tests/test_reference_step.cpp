// One full training step of a CIFAR ResNet-8 against PyTorch (tests/data/ref_resnet8_step.bin,
// written by bench/make_reference.py; no Python needed here).
//
// The reference is PyTorch's float64 step (stored as float32) on the same weights, BN running
// statistics, input and labels: training-mode forward (BN batch statistics, running statistics
// updated with momentum 0.1, unbiased variance), softmax cross-entropy with label smoothing 0.1,
// backward, then SGD (lr 0.1, momentum 0.9, weight decay 5e-4, PyTorch formulation, first step).
// The engine runs in float32. Tolerances, per tensor T with reference R:
//   loss:                          |loss - R| <= 1e-5 * |R|
//   every parameter gradient,
//   every BN running mean / var,
//   every parameter after SGD:     max |T - R| <= 1e-4 * max |R|   (relative to the tensor's max abs)
// For scale: PyTorch's own float32 step differs from its float64 one by at most ~1.2e-6 of the
// tensor's max abs (the file records this per tensor as "f32err:<name>"), so 1e-4 leaves room for a
// different summation order but not for a wrong formula (a missing term or a wrong factor is off by
// far more than 1e-4 of the tensor's scale).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/optimizer.h"
#include "layers/layers.h"
#include "models/models.h"

using namespace et;

namespace {

struct RefTensor {
  std::vector<int64_t> dims;
  std::vector<float> data;
};

std::map<std::string, RefTensor> load_reference(const std::string& path) {
  std::map<std::string, RefTensor> out;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE(f != nullptr);
  auto read = [&](void* p, size_t n) { REQUIRE(std::fread(p, 1, n, f) == n); };
  char magic[8];
  read(magic, 8);
  REQUIRE(std::memcmp(magic, "ETREF001", 8) == 0);
  uint32_t count = 0;
  read(&count, 4);
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t len = 0, ndim = 0;
    read(&len, 4);
    std::string name(len, '\0');
    read(name.data(), len);
    read(&ndim, 4);
    REQUIRE(ndim <= 8);
    RefTensor t;
    t.dims.resize(ndim);
    if (ndim) read(t.dims.data(), 8 * ndim);
    int64_t n = 1;
    for (int64_t d : t.dims) n *= d;
    t.data.resize(size_t(n));
    read(t.data.data(), 4 * size_t(n));
    out.emplace(name, std::move(t));
  }
  std::fclose(f);
  return out;
}

struct Diff {
  double max_abs_err = 0, ref_max = 0;
  double rel() const { return ref_max > 0 ? max_abs_err / ref_max : max_abs_err; }
};

Diff diff(const Tensor& t, const RefTensor& r) {
  REQUIRE(t.numel() == int64_t(r.data.size()));
  Diff d;
  for (int64_t i = 0; i < t.numel(); ++i) {
    d.max_abs_err = std::max(d.max_abs_err, std::fabs(double(t.f32()[i]) - double(r.data[size_t(i)])));
    d.ref_max = std::max(d.ref_max, std::fabs(double(r.data[size_t(i)])));
  }
  return d;
}

bool same_shape(const Shape& s, const RefTensor& r) {
  if (s.ndim != int(r.dims.size())) return false;
  for (int i = 0; i < s.ndim; ++i)
    if (s[i] != r.dims[size_t(i)]) return false;
  return true;
}

constexpr double kTensorRtol = 1e-4, kLossRtol = 1e-5;

}  // namespace

TEST_CASE("resnet8 training step matches PyTorch (loss, gradients, BN running stats, SGD)", "[reference]") {
  const auto ref = load_reference(std::string(EDGETRAIN_SOURCE_DIR) + "/tests/data/ref_resnet8_step.bin");
  auto get = [&](const std::string& name) -> const RefTensor& {
    auto it = ref.find(name);
    INFO("reference tensor " << name);
    REQUIRE(it != ref.end());
    return it->second;
  };
  auto scalar = [&](const std::string& name) { return get(name).data.at(0); };

  const RefTensor& input = get("input");
  REQUIRE(input.dims.size() == 4);
  const int64_t N = input.dims[0];

  Graph g;
  const int x = image_input(g, N, input.dims[1], input.dims[2], input.dims[3]);
  const int labels = label_input(g, N);
  const int logits = build_cifar_resnet(g, x, 8, 10, 'B');
  softmax_cross_entropy(g, logits, labels, "loss", scalar("label_smoothing"));
  auto be = make_cpu_backend();
  Executor ex(g, *be);
  init_parameters(ex, 1);
  ex.forward(N, false);  // sets the executor's batch, so value() views below span the whole batch

  // Inputs.
  std::memcpy(ex.value(x).f32(), input.data.data(), 4 * input.data.size());
  const RefTensor& lab = get("labels");
  REQUIRE(int64_t(lab.data.size()) == N);
  for (int64_t i = 0; i < N; ++i) ex.value(labels).i32()[i] = int32_t(lab.data[size_t(i)]);

  // Every parameter and BN buffer by name; the graph and the file hold the same set.
  size_t params = 0, buffers = 0;
  for (int id = 0; id < g.num_values(); ++id) {
    const Value& v = g.value(id);
    if (v.kind != ValueKind::Param && v.kind != ValueKind::Buffer) continue;
    const RefTensor& r = get(v.name);
    INFO(v.name << ": graph " << v.shape.str());
    REQUIRE(same_shape(v.shape, r));
    std::memcpy(ex.value(id).f32(), r.data.data(), 4 * r.data.size());
    (v.kind == ValueKind::Param ? params : buffers)++;
  }
  size_t ref_params = 0, ref_buffers = 0;
  for (const auto& [name, _] : ref) {
    ref_params += name.rfind("grad:", 0) == 0;
    ref_buffers += name.rfind("after_step:", 0) == 0;
  }
  CHECK(params == ref_params);
  CHECK(buffers == ref_buffers);
  // conv1, bn1 (2) | layer1.0: conv1, bn1(2), conv2, bn2(2) = 6 | layer2.0 / layer3.0: 6 + shortcut conv
  // + BN(2) = 9 each | linear (2): 1 + 2 + 6 + 9 + 9 + 2 = 29
  CHECK(params == 29);

  ex.set_step_seed(0);
  ex.forward(N, true);
  ex.backward();

  const double loss_ref = scalar("loss");
  INFO("loss " << ex.loss() << " reference " << loss_ref);
  CHECK(std::fabs(double(ex.loss()) - loss_ref) <= kLossRtol * std::fabs(loss_ref));

  double worst = 0;
  std::string worst_name;
  auto check = [&](const std::string& label, const Tensor& t, const std::string& ref_name) {
    const Diff d = diff(t, get(ref_name));
    const auto err = ref.find("f32err:" + ref_name);
    INFO(label << ": max |err| " << d.max_abs_err << " = " << d.rel() << " of max |ref| " << d.ref_max
               << " (PyTorch float32: " << (err != ref.end() ? err->second.data[0] : -1.f) << ")");
    CHECK(d.ref_max > 0);
    CHECK(d.rel() <= kTensorRtol);
    if (d.rel() > worst) {
      worst = d.rel();
      worst_name = label;
    }
  };
  for (int p : g.params()) check("grad " + g.value(p).name, ex.grad(p), "grad:" + g.value(p).name);
  for (int b : g.buffers()) check("after step " + g.value(b).name, ex.value(b), "after_step:" + g.value(b).name);

  // One SGD step with the backend's kernel (first step: momentum buffer = gradient + wd * param).
  const float lr = scalar("lr"), momentum = scalar("momentum"), wd = scalar("weight_decay");
  sgd_update(ex, SgdOptions{momentum, wd, false}, lr, true);
  for (int p : g.params()) check("after sgd " + g.value(p).name, ex.value(p), "after_sgd:" + g.value(p).name);
  WARN("resnet8 step vs PyTorch float64: worst tensor " << worst_name << " at " << worst
                                                          << " of its max abs (tolerance " << kTensorRtol << ")");
}
