// What the fusion tests share (test_fusion*.cpp): training a graph fused and unfused and comparing
// every loss, gradient, parameter and buffer bit for bit, and the synthetic graphs they train.
#pragma once
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "fusion/fusion.h"
#include "layers/layers.h"
#include "tests/tiny_training.h"

namespace et {
namespace fusion_test {

inline int fused_nodes(const Graph& g) {
  int n = 0;
  for (const Node& node : g.nodes()) n += std::strcmp(node.op->type(), "fused_stack") == 0;
  return n;
}

inline std::vector<float> copy_of(const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); }

// Inputs: N(0,1)-like deterministic images, labels i % classes.
inline void fill(Executor& ex, int64_t batch) {
  const Graph& g = ex.graph();
  ex.forward(batch, false);  // sets the batch, so the input views span it
  Tensor x = ex.value(g.image_input), y = ex.value(g.label_input);
  const int64_t classes = g.value(g.logits).shape[1];
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float((i * 2654435761u) % 2001) / 1000.f - 1.f;
  for (int64_t i = 0; i < y.numel(); ++i) y.i32()[i] = int32_t(i % classes);
}

// Three SGD steps and an evaluation: the losses, logits, and every parameter, gradient and buffer.
inline std::vector<std::vector<float>> train(Graph& g, int64_t batch, const StashOptions& stash,
                                             const QuantOptions& quant = {}) {
  auto be = make_cpu_backend();
  Executor ex(g, *be, stash, quant);
  init_parameters(ex, 7);
  fill(ex, batch);
  std::vector<std::vector<float>> out;
  for (int s = 0; s < 3; ++s) {
    ex.set_step(s);
    ex.set_step_seed(uint64_t(100 + s));
    ex.forward(batch, true);
    ex.backward();
    out.push_back({ex.loss()});
    for (int p : g.params()) out.push_back(copy_of(ex.grad(p)));
    sgd_update(ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0);
  }
  ex.forward(batch, false);
  out.push_back(copy_of(ex.value(g.logits)));
  for (const Tensor& t : ex.state_tensors()) out.push_back(copy_of(t));
  return out;
}

inline ModelSpec spec_of(const std::string& model, int64_t batch, int64_t side, bool fused, int64_t llc_kb = 0) {
  ModelSpec s;
  s.fusion.llc_kb = llc_kb;
  s.name = model;
  s.batch = batch;
  s.height = s.width = side;
  s.fusion.enabled = fused;
  return s;
}

inline size_t differing(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].size() == b[i].size());
    const bool diff = std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0;
    if (diff && d < 3) {
      float m = 0;
      for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::abs(a[i][j] - b[i][j]));
      WARN("entry " << i << " of " << a.size() << " differs by up to " << m << " (" << a[i][0] << " vs " << b[i][0] << ")");
    }
    d += diff;
  }
  return d;
}

inline void check_model(const std::string& model, int64_t batch, int64_t side, const StashOptions& stash,
                        const QuantOptions& quant = {}, int64_t llc_kb = 0) {
  Graph plain, fused;
  build_model(plain, spec_of(model, batch, side, false));
  build_model(fused, spec_of(model, batch, side, true, llc_kb));
  CHECK(fused_nodes(fused) > 0);
  CHECK(fused.num_nodes() < plain.num_nodes());
  const auto a = train(plain, batch, stash, quant), b = train(fused, batch, stash, quant);
  REQUIRE(std::isfinite(a[0][0]));
  CHECK(differing(a, b) == 0);
}

inline StashOptions stash(StashFormat f, int checkpoint_every = 0) {
  StashOptions o;
  o.format = f;
  o.checkpoint_every = checkpoint_every;
  return o;
}

// The same training, bit for bit, of an unfused graph and its fused rewrite under each of the
// stash options (default: the dense and the automatic stash).
inline void check_trains_alike(Graph& plain, Graph& fused, int64_t batch,
                               std::initializer_list<StashOptions> options = {stash(StashFormat::DenseF32),
                                                                              stash(StashFormat::Auto)},
                               const QuantOptions& quant = {}) {
  for (const StashOptions& o : options) {
    INFO("stash " << stash_format_name(o.format) << ", checkpoint_every " << o.checkpoint_every);
    const auto a = train(plain, batch, o, quant), b = train(fused, batch, o, quant);
    REQUIRE(std::isfinite(a[0][0]));
    CHECK(differing(a, b) == 0);
  }
}

// The synthetic graphs' common ends: a 3-channel image and labels in; flatten, a linear layer of 4
// classes and the loss out. Their convs are 3x3 with padding 1.
struct TestNet {
  int x, labels;
};
inline TestNet open_net(Graph& g, int64_t batch, int64_t h, int64_t w) {
  g.set_batch_size(int(batch));
  return {image_input(g, batch, 3, h, w), label_input(g, batch)};
}
inline void close_net(Graph& g, const TestNet& net, int y) {
  g.logits = linear(g, flatten(g, y, "flat"), "fc", 4);
  g.loss = softmax_cross_entropy(g, g.logits, net.labels, "loss");
  g.image_input = net.x;
  g.label_input = net.labels;
}
inline Conv2dOptions conv3x3(int64_t channels) {
  Conv2dOptions o;
  o.out_channels = channels;
  o.kernel = 3;
  o.padding = 1;
  return o;
}

// image -> conv -> BN -> ReLU -> pool (overlapping, padded) -> conv -> BN -> add(side) -> ReLU ->
// conv -> BN -> avgpool -> flatten -> linear: every stage kind, odd plane sizes.
inline void synthetic(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t pool_k, int64_t pool_s,
                      int64_t pool_p, int64_t channels) {
  const TestNet net = open_net(g, batch, h, w);
  const Conv2dOptions o = conv3x3(channels);
  int y = relu(g, batchnorm2d(g, conv2d(g, net.x, "c1", o), "b1"), "r1");
  y = maxpool2d(g, y, "p1", pool_k, pool_s, pool_p);
  const int side = y;
  y = relu(g, add(g, batchnorm2d(g, conv2d(g, y, "c2", o), "b2"), side, "a2"), "r2");
  y = avgpool2d(g, batchnorm2d(g, conv2d(g, y, "c3", o), "b3"), "p3", 2, 1, 1);
  close_net(g, net, y);
}

// A conv output read by two stacks: the second backward adds into the first one's dx (the stack's
// dx accumulates), so sweep 2 rebuilds dz rather than finding it parked in dx.
inline void two_readers(Graph& g, int64_t batch, int64_t side, bool pool) {
  const TestNet net = open_net(g, batch, side, side);
  const Conv2dOptions o = conv3x3(3);
  const int y = conv2d(g, net.x, "c1", o);
  int a = relu(g, batchnorm2d(g, y, "b1"), "r1"), b = relu(g, batchnorm2d(g, y, "b2"), "r2");
  if (pool) a = maxpool2d(g, a, "p1", 2, 2, 0), b = maxpool2d(g, b, "p2", 2, 2, 0);
  close_net(g, net, add(g, conv2d(g, a, "c2", o), conv2d(g, b, "c3", o), "a3"));
}

// y = relu(x + BN(x)), or x + relu(BN(x)), after a conv: the add's other operand is the BN's own
// input, so x's gradient has two parts, BN's dx and the add's share (the planner leaves that add a
// layer).
inline void add_own_input(Graph& g, int64_t batch, int64_t side, bool relu_first) {
  const TestNet net = open_net(g, batch, side, side);
  const int x = conv2d(g, net.x, "c1", conv3x3(3));
  const int bn = batchnorm2d(g, x, "b1");
  const int y = relu_first ? add(g, relu(g, bn, "r1"), x, "a1") : relu(g, add(g, bn, x, "a1"), "r1");
  close_net(g, net, conv2d(g, y, "c2", conv3x3(3)));
}

// image -> conv -> <BN, ReLU, max-pool 3x3 stride 1> x 2 -> BN, ReLU -> flatten -> linear: stacks that
// follow a conv and stacks that follow a stack (BrainSlug's micro-benchmark), each taking BN's
// per-plane sums from x's producer.
inline void chain(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t channels) {
  const TestNet net = open_net(g, batch, h, w);
  const Conv2dOptions o = conv3x3(channels);
  int y = conv2d(g, net.x, "c0", o);
  for (int i = 0; i < 2; ++i) {
    const std::string b = "b" + std::to_string(i);
    y = maxpool2d(g, relu(g, batchnorm2d(g, y, b + ".bn"), b + ".relu"), b + ".pool", 3, 1, 1);
  }
  y = relu(g, batchnorm2d(g, y, "b2.bn"), "b2.relu");
  close_net(g, net, y);
}

}  // namespace fusion_test
}  // namespace et
