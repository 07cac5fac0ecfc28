// Depth-first fusion (docs/fusion.md): a global average pool ending a stack, so that neither the
// plane before it nor that plane's gradient (dy / HW in every element) travels to memory, trained
// bit-identically to the layers one by one; and where the planner leaves it to the layer.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "tests/fusion_harness.h"
#include "tests/tiny_training.h"

using namespace et;
using namespace et::fusion_test;

namespace {
enum class Head { Bn, BnRelu, BnDropoutRelu, AfterPoolStack };
const char* head_name(Head h) {
  switch (h) {
    case Head::Bn: return "BN";
    case Head::BnRelu: return "BN, ReLU";
    case Head::BnDropoutRelu: return "BN, dropout, ReLU";
    default: return "BN, ReLU after BrainSlug's block";
  }
}

// image -> conv -> conv -> (BN -> ReLU -> 3x3 stride-1 max-pool) -> BN -> (dropout) -> (ReLU) ->
// global average pool -> linear -> loss. After BrainSlug's block the last stack hands its second
// backward sweep on to the block (StackPlan::sweep_to_producer), as in `bench fusion`. The second
// conv is a middle layer, which 4-bit training quantizes.
void gap_net(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t channels, Head head) {
  const TestNet net = open_net(g, batch, h, w);
  int y = conv2d(g, conv2d(g, net.x, "c0", conv3x3(channels)), "c1", conv3x3(channels));
  if (head == Head::AfterPoolStack) y = maxpool2d(g, relu(g, batchnorm2d(g, y, "b0.bn"), "b0.relu"), "b0.pool", 3, 1, 1);
  y = batchnorm2d(g, y, "b1.bn");
  if (head == Head::BnDropoutRelu) y = dropout(g, y, "b1.drop", 0.25f);
  if (head != Head::Bn) y = relu(g, y, "b1.relu");
  g.logits = linear(g, global_avgpool(g, y, "gap"), "fc", 4);
  g.loss = softmax_cross_entropy(g, g.logits, net.labels, "loss");
  g.image_input = net.x;
  g.label_input = net.labels;
}

fusion::Plan plan_with(Graph& g, int64_t cache_kb, int64_t tile, int64_t llc_kb = 0) {
  FusionSpec spec;
  spec.enabled = true;
  spec.cache_kb = cache_kb;
  spec.tile = tile;
  spec.llc_kb = llc_kb;
  return fusion::plan(g, spec);
}

// The stack headed by BN `name` in the plan.
const fusion::StackPlan& stack_named(const fusion::Plan& p, const std::string& name) {
  for (const fusion::StackPlan& sp : p.stacks)
    if (sp.name == name) return sp;
  FAIL("no stack " << name);
  return p.stacks.front();
}
}  // namespace

TEST_CASE("fusion: a global average pool ends a stack, bit-identically", "[fusion]") {
  struct Case {
    int64_t batch, h, w, channels;
  };
  // 7x5: planes that are no whole vectors; 32x32: CIFAR's, as in `bench fusion`; batch 1. A last-
  // level cache of 1 KiB: dz parked in dx by streaming stores (FusedStack::stream_dx).
  for (const Case c : {Case{3, 7, 5, 4}, Case{1, 8, 8, 3}, Case{2, 32, 32, 5}}) {
    for (Head head : {Head::Bn, Head::BnRelu, Head::BnDropoutRelu, Head::AfterPoolStack})
    for (int64_t llc_kb : {0, 1}) {
      DYNAMIC_SECTION(head_name(head) << " on " << c.h << "x" << c.w << ", batch " << c.batch << ", llc " << llc_kb) {
        Graph plain, fused;
        gap_net(plain, c.batch, c.h, c.w, c.channels, head);
        gap_net(fused, c.batch, c.h, c.w, c.channels, head);
        const fusion::Plan p = plan_with(fused, 0, 0, llc_kb);
        if (llc_kb > 0) CHECK(stack_named(p, "b1.bn").stack.stream_dx);
        const fusion::StackPlan& last = stack_named(p, "b1.bn");
        REQUIRE(last.fused);
        CHECK(last.stack.ends_in_global_pool());
        CHECK(last.stack.last().P * last.stack.last().Q == 1);
        CHECK(fused.value(last.output).name == "gap");
        CHECK(last.sweep_to_producer == (head == Head::AfterPoolStack));
        fusion::apply(fused, p);
        check_trains_alike(plain, fused, c.batch,
                           {stash(StashFormat::DenseF32), stash(StashFormat::Auto), stash(StashFormat::BitmapF32),
                            stash(StashFormat::Auto, 1)});
        // LUQ 4-bit training (the second conv quantized), with the dense stash and with bitmap_int4
        // (x recomputed from the codes).
        INFO("LUQ");
        check_trains_alike(plain, fused, c.batch, {stash(StashFormat::DenseF32), stash(StashFormat::BitmapI4)},
                           test::luq(2));
      }
    }
  }
}

TEST_CASE("fusion: the planner leaves a global pool to the layer off whole planes in memory order", "[fusion]") {
  // Small planes (4x4: channel blocks), an explicit fusion.tile (channel slabs), and a cache that
  // needs bands of rows: the stack ends before the pool, and trains bit-identically all the same.
  struct Case {
    int64_t side, cache_kb, tile;
    const char* what;
  };
  for (const Case c : {Case{4, 0, 0, "small planes"}, Case{16, 0, 2, "fusion.tile 2"}, Case{32, 8, 0, "bands"}}) {
    DYNAMIC_SECTION(c.what) {
      Graph plain, fused;
      gap_net(plain, 2, c.side, c.side, 3, Head::BnRelu);
      gap_net(fused, 2, c.side, c.side, 3, Head::BnRelu);
      const fusion::Plan p = plan_with(fused, c.cache_kb, c.tile);
      const fusion::StackPlan& last = stack_named(p, "b1.bn");
      REQUIRE(last.fused);
      CHECK(last.stack.stages.size() == 2);
      CHECK(last.stack.last().kind == FusedKind::Relu);
      CHECK(last.stack.saves_output_mask);
      if (c.cache_kb > 0) CHECK(last.stack.band_rows > 0);
      fusion::apply(fused, p);
      check_trains_alike(plain, fused, 2);
    }
  }
}

TEST_CASE("fusion: MobileNet-V2's last stack takes its global pool on planes above the small ones", "[fusion]") {
  // 40x40 images: the last BN -> ReLU runs on 5x5 planes (25 elements) and ends in the pool.
  Graph fused;
  build_model(fused, spec_of("mobilenetv2", 2, 40, true));
  bool found = false;
  for (const Node& n : fused.nodes()) found |= n.name == "bn2" && std::string(n.op->type()) == "fused_stack";
  REQUIRE(found);
  for (int id = 0; id < fused.num_values(); ++id) CHECK(fused.value(id).name != "relu2");
  check_model("mobilenetv2", 2, 40, stash(StashFormat::DenseF32));
}
