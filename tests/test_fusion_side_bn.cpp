// A BN folded into the stack whose Add reads its output (FusedStack::side_bn: a projection
// shortcut's BN, ResNet's downsampling blocks, MobileNet-V2's widening blocks): the stack applies it
// as it reads x2, and takes its two backward sums and writes dx2 in its own sweeps. Bit-identical
// to the layers: the BN layer's statistics, apply, sums and dx arithmetic, in its order.
#include <catch2/catch.hpp>

#include <string>

#include "fusion/fusion.h"
#include "layers/layers.h"
#include "tests/fusion_harness.h"
#include "tests/tiny_training.h"

using namespace et;
using namespace et::fusion_test;

namespace {
// What reads the block's x and where the main BN's input comes from.
enum class Block { Residual, NoRelu, ImageIntoBn, XReadTwice };

// image -> conv c1 -> y1; BN b2 (conv c2 (y1)) + BN sb (conv sc (y1)) -> ReLU -> conv c3 -> out.
// sb comes first in graph order, so it heads the stack and b2 is the one folded in.
// NoRelu: no ReLU after the add (MobileNet-V2's). ImageIntoBn: b2 normalises the image itself (no
// gradient wanted for its x: dz is not parked, the sweeps rebuild it). XReadTwice: c2's output is
// also added to the block's output (the stack's dx accumulates: dz is not parked either).
void block_net(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t channels, Block shape) {
  const TestNet net = open_net(g, batch, h, w);
  const int64_t c = shape == Block::ImageIntoBn ? 3 : channels;
  const int y1 = conv2d(g, net.x, "c1", conv3x3(c));
  const int x = shape == Block::ImageIntoBn ? net.x : conv2d(g, y1, "c2", conv3x3(c));
  Conv2dOptions one = conv3x3(c);
  one.kernel = 1;
  one.padding = 0;
  const int side = batchnorm2d(g, conv2d(g, y1, "sc", one), "sb");
  int y = add(g, batchnorm2d(g, x, "b2"), side, "a2");
  if (shape != Block::NoRelu) y = relu(g, y, "r2");
  y = conv2d(g, y, "c3", conv3x3(c));
  if (shape == Block::XReadTwice) y = add(g, y, x, "a3");
  close_net(g, net, y);
}

const char* shape_name(Block s) {
  switch (s) {
    case Block::Residual: return "block";
    case Block::NoRelu: return "no relu";
    case Block::ImageIntoBn: return "image into the BN";
    default: return "x read twice";
  }
}

// The stacks of a plan that fold a side BN.
int folded(const fusion::Plan& p) {
  int n = 0;
  for (const fusion::StackPlan& sp : p.stacks) n += sp.fused && sp.stack.side_bn;
  return n;
}
}  // namespace

TEST_CASE("fusion: a shortcut's BN folded into the add stack trains bit-identically", "[fusion]") {
  struct Case {
    int64_t batch, h, w, channels;
  };
  // 32x32 and 16x16 (whole vectors, the bitmap words of y for the mask), 9x7 and 5x4 (odd, and 20
  // elements, just above the small planes), batch 1 to 3.
  for (const Case c : {Case{2, 32, 32, 4}, Case{3, 16, 16, 5}, Case{1, 9, 7, 3}, Case{2, 5, 4, 6}}) {
    for (Block shape : {Block::Residual, Block::NoRelu, Block::ImageIntoBn, Block::XReadTwice}) {
      DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " channels " << c.channels << ", "
                               << shape_name(shape)) {
        Graph plain, fused;
        block_net(plain, c.batch, c.h, c.w, c.channels, shape);
        block_net(fused, c.batch, c.h, c.w, c.channels, shape);
        FusionSpec spec;
        spec.enabled = true;
        const fusion::Plan p = fusion::plan(fused, spec);
        REQUIRE(folded(p) == 1);
        // The BN first in graph order heads the stack (sb, the shortcut's) and b2 folds into it. Its
        // input's producer, conv c2, writes its per-plane sums in its epilogue where the stack
        // alone reads that input; the image has no producer, and c2's output read twice is summed
        // by the stack.
        for (const fusion::StackPlan& sp : p.stacks)
          if (sp.stack.side_bn)
            CHECK(sp.side_sums_from_producer == (shape == Block::Residual || shape == Block::NoRelu));
        const int before = fused.num_nodes();
        fusion::apply(fused, p);
        // BN, add (and ReLU) and the shortcut's BN: one node.
        CHECK(fused.num_nodes() == before - (shape == Block::NoRelu ? 2 : 3));
        check_trains_alike(plain, fused, c.batch,
                           {stash(StashFormat::DenseF32), stash(StashFormat::Auto), stash(StashFormat::BitmapF32),
                            stash(StashFormat::DenseBF16), stash(StashFormat::DenseF32, 1)});
      }
    }
  }
}

TEST_CASE("fusion: a shortcut's BN stays a layer where the stack does not go by whole planes", "[fusion]") {
  Graph g;
  block_net(g, 2, 32, 32, 4, Block::Residual);
  FusionSpec spec;
  spec.enabled = true;
  CHECK(folded(fusion::plan(g, spec)) == 1);
  // A/B runs: fusion.fold_side_bn = false.
  FusionSpec off = spec;
  off.fold_side_bn = false;
  CHECK(folded(fusion::plan(g, off)) == 0);
  // Channel slabs (an explicit fusion.tile) and bands of rows (a plane's scratch above the cache).
  FusionSpec slabs = spec;
  slabs.tile = 2;
  const fusion::Plan by_slabs = fusion::plan(g, slabs);
  CHECK(folded(by_slabs) == 0);
  FusionSpec bands = spec;
  bands.cache_kb = 8;
  const fusion::Plan by_bands = fusion::plan(g, bands);
  CHECK(folded(by_bands) == 0);
  bool banded = false;
  for (const fusion::StackPlan& sp : by_bands.stacks) banded |= sp.fused && sp.stack.band_rows > 0;
  CHECK(banded);
  // Both still train as the layers do, the shortcut's BN a layer of its own.
  for (const FusionSpec& s : {slabs, bands}) {
    Graph plain, fused;
    block_net(plain, 2, 32, 32, 4, Block::Residual);
    block_net(fused, 2, 32, 32, 4, Block::Residual);
    fusion::apply(fused, fusion::plan(fused, s));
    check_trains_alike(plain, fused, 2, {stash(StashFormat::DenseF32)});
  }
}

TEST_CASE("fusion: ResNet-20's downsampling blocks fold their shortcut's BN", "[fusion]") {
  Graph g;
  build_model(g, spec_of("resnet20", 2, 32, false));
  FusionSpec spec;
  spec.enabled = true;
  const fusion::Plan p = fusion::plan(g, spec);
  std::vector<std::string> names;
  for (const fusion::StackPlan& sp : p.stacks)
    if (sp.fused && sp.stack.side_bn) {
      names.push_back(sp.name);
      CHECK(sp.side_sums_from_producer);  // the shortcut's conv writes them
    }
  CHECK(names == std::vector<std::string>{"layer2.0.bn2", "layer3.0.bn2"});
  // The plan's description names the folded BN's stage.
  CHECK(fusion::describe(g, p).find("bn,add(bn),relu") != std::string::npos);
}
