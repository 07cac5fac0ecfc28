// The stacks a backend without the CPU's tiled kernels runs (FusionSpec::whole_tensors: the
// CUDA backend's, backends/cuda/cuda_batchnorm.cu): BN -> ReLU [-> pool], BN -> add [-> ReLU],
// each sweep its own, a projection shortcut's BN folded into its add's stack as on the CPU (not on
// small planes); without a BN, ReLU -> pool as on the CPU. The plan's shape here; that such a plan trains
// bit-identically to the layers on the CPU (the graph rewrite and the op's saves, independent of
// the backend); the CUDA kernels against the CUDA layers in tests/cuda/test_cuda_fused.cpp.
#include <catch2/catch.hpp>

#include <string>

#include "engine/check.h"
#include "fusion/fusion.h"
#include "tests/fusion_harness.h"
#include "tests/tiny_training.h"

using namespace et;
using namespace et::fusion_test;

namespace {
ModelSpec whole_tensors_spec(const std::string& model, int64_t batch, int64_t side) {
  ModelSpec s = spec_of(model, batch, side, true);
  s.fusion.whole_tensors = true;
  return s;
}
}  // namespace

TEST_CASE("fusion: the whole-tensor plan holds BN -> ReLU [-> pool] and BN -> add [-> ReLU] stacks, each sweep its own", "[fusion]") {
  // Projection shortcuts' BNs folded into their blocks' adds: ResNet-20's two (16x16 and 8x8, BN ->
  // add -> ReLU), MobileNet-V2's three whose planes are larger than 4x4 (BN -> add); VGG has none.
  for (const char* model : {"resnet20", "vgg16_bn", "mobilenetv2"}) {
    INFO(model);
    Graph g;
    build_model(g, spec_of(model, 4, 32, false));
    FusionSpec spec;
    spec.enabled = true;
    spec.whole_tensors = true;
    spec.cache_kb = 1;  // a cache no plane fits: such a plan has no tiles, bands or limits
    const fusion::Plan p = fusion::plan(g, spec);
    int fused = 0, with_add = 0, pooled = 0, global = 0, folded = 0;
    for (const fusion::StackPlan& sp : p.stacks) {
      CAPTURE(sp.name);
      if (!sp.fused) continue;
      ++fused;
      const FusedStack& s = sp.stack;
      REQUIRE(s.headed_by_bn());
      const size_t n = s.stages.size();
      const bool relu = n == 2 && s.stages[1].kind == FusedKind::Relu,
                 add = n == 2 && s.stages[1].kind == FusedKind::Add,
                 add_relu = n == 3 && s.stages[1].kind == FusedKind::Add && s.stages[2].kind == FusedKind::Relu,
                 relu_pool = n == 3 && s.stages[1].kind == FusedKind::Relu && s.stages[2].kind == FusedKind::MaxPool,
                 relu_global = n == 3 && s.stages[1].kind == FusedKind::Relu && s.ends_in_global_pool();
      CHECK((relu || add || add_relu || relu_pool || relu_global));
      with_add += add || add_relu;
      pooled += relu_pool;
      global += relu_global;
      if (s.side_bn) {
        ++folded;
        CHECK((add || add_relu));
        CHECK(s.stages[0].H * s.stages[0].W > kSmallPlane);
        CHECK_FALSE(sp.side_sums_from_producer);
      }
      CHECK(s.band_rows == 0);
      CHECK_FALSE(s.channel_slabs);
      CHECK_FALSE((s.stream_y || s.stream_dx));
      CHECK_FALSE(sp.sums_from_producer);
      CHECK_FALSE(sp.sweep_to_producer);
      CHECK_FALSE(sp.sweep1_to_reader);
      CHECK_FALSE(sp.y_bits);
    }
    // Every BN -> ReLU of the three, the residual adds of ResNet-20 (9) and MobileNet-V2 (14), and
    // VGG-16-BN's five max-pools, MobileNet-V2's last BN -> ReLU -> global average pool (4x4 planes:
    // the CPU's own plan leaves that pool a layer, below). ResNet-20's global pool follows an add's
    // ReLU, which ends its stack (its mask is saved).
    CHECK(fused > 0);
    CHECK(with_add == (std::string(model) == "resnet20" ? 9 : std::string(model) == "mobilenetv2" ? 14 : 0));
    CHECK(pooled == (std::string(model) == "vgg16_bn" ? 5 : 0));
    CHECK(global == (std::string(model) == "mobilenetv2" ? 1 : 0));
    CHECK(folded == (std::string(model) == "resnet20" ? 2 : std::string(model) == "mobilenetv2" ? 3 : 0));
    // fusion.fold_side_bn = false: those BNs stay layers.
    spec.fold_side_bn = false;
    for (const fusion::StackPlan& sp : fusion::plan(g, spec).stacks) CHECK_FALSE(sp.stack.side_bn);
  }
  // MobileNet-V2's last stack, BN -> ReLU, takes the global pool on 4x4 planes (32x32 images) and
  // 8x8 ones (64x64): CUDA pools any plane whole. The CPU's own plan takes it from 8x8 only (on
  // small planes its blocks could since session 67, but that plan's speed is not measured).
  for (int64_t side : {32, 64}) {
    Graph m;
    build_model(m, spec_of("mobilenetv2", 2, side, false));
    FusionSpec spec;
    spec.enabled = spec.whole_tensors = true;
    int global = 0, cpu_global = 0;
    for (const fusion::StackPlan& sp : fusion::plan(m, spec).stacks) {
      if (!sp.fused || !sp.stack.ends_in_global_pool()) continue;
      ++global;
      REQUIRE(sp.stack.stages.size() == 3);
      CHECK(sp.stack.stages[1].kind == FusedKind::Relu);
      CHECK(sp.stack.stages[2].H * sp.stack.stages[2].W == side * side / 64);
    }
    spec.whole_tensors = false;
    for (const fusion::StackPlan& sp : fusion::plan(m, spec).stacks) cpu_global += sp.fused && sp.stack.ends_in_global_pool();
    CHECK(global == 1);
    CHECK(cpu_global == (side == 64 ? 1 : 0));
  }
  // VGG-11 without BN: its five ReLU -> 2x2 max-pool stacks, as the CPU's plan has them.
  {
    Graph v;
    build_model(v, spec_of("vgg11", 4, 32, false));
    FusionSpec spec;
    spec.enabled = spec.whole_tensors = true;
    int relu_pool = 0;
    for (const fusion::StackPlan& sp : fusion::plan(v, spec).stacks) {
      if (!sp.fused) continue;
      REQUIRE_FALSE(sp.stack.headed_by_bn());
      CHECK(sp.stack.stages.size() == 2);
      CHECK(sp.stack.stages[1].kind == FusedKind::MaxPool);
      ++relu_pool;
    }
    CHECK(relu_pool == 5);
  }
  Graph g;
  build_model(g, spec_of("resnet20", 4, 32, false));
  FusionSpec full;
  full.enabled = true;
  // An explicit tile names its key.
  FusionSpec tiled = full;
  tiled.whole_tensors = true;
  tiled.tile = 4;
  CHECK_THROWS_WITH(fusion::plan(g, tiled), Catch::Contains("fusion.tile"));
}

TEST_CASE("fusion: a whole-tensor plan trains bit-identically to the layers", "[fusion]") {
  // ResNet-8 (BN -> ReLU, BN -> add -> ReLU, its first projection shortcut's BN folded at 8x8) and
  // MobileNet-V2 on 16x16 images (BN -> add, small planes, its last BN -> ReLU -> global average
  // pool on 2x2 planes: the CPU's small-plane blocks) and 64x64 ones (that stack on 8x8 planes), VGG-11-BN on 32x32 ones (BN -> ReLU -> max-pool), in the
  // stashes whose masks reach the stacks differently: y kept dense, the bitmap stash's mask,
  // recomputation. VGG-11 without BN (ReLU -> max-pool, the pass bits) too.
  struct Run {
    const char* model;
    int64_t side;
  };
  for (const Run& run : {Run{"resnet8", 16}, Run{"mobilenetv2", 16}, Run{"mobilenetv2", 64}, Run{"vgg11_bn", 32},
                         Run{"vgg11", 32}}) {
    const char* model = run.model;
    const int64_t side = run.side;
    INFO(model << " on " << side << "x" << side);
    Graph plain, fused;
    build_model(plain, spec_of(model, 2, side, false));
    build_model(fused, whole_tensors_spec(model, 2, side));
    CHECK(fused_nodes(fused) > 0);
    if (std::string(model) == "resnet8") {
      FusionSpec ws;
      ws.enabled = ws.whole_tensors = true;
      int folded = 0;
      for (const fusion::StackPlan& sp : fusion::plan(plain, ws).stacks) folded += sp.fused && sp.stack.side_bn;
      CHECK(folded == 1);
    }
    check_trains_alike(plain, fused, 2,
                       {stash(StashFormat::DenseF32), stash(StashFormat::BitmapF32), stash(StashFormat::DenseF32, 1)});
  }
}

TEST_CASE("fusion: a whole-tensor plan trains bit-identically to the layers with pruned bitmaps", "[fusion]") {
  // The CUDA stacks' pruned-bitmap path (tests/cuda/test_cuda_fused.cpp) rests on this plan: the
  // stored values pruned at |y| < t, the ReLU's backward mask exact, as the layers keep them.
  // Not a stack ending in a max-pool: the layers' pool backward finds each window's maximum in the
  // pruned stored values, the stack's in x itself (exact), so pruning trains them differently.
  Graph plain, fused;
  build_model(plain, spec_of("resnet8", 2, 16, false));
  build_model(fused, whole_tensors_spec("resnet8", 2, 16));
  StashOptions pruned = stash(StashFormat::BitmapF32);
  pruned.prune_threshold = 0.05f;
  check_trains_alike(plain, fused, 2, {pruned});
}

TEST_CASE("fusion: a whole-tensor plan trains bit-identically at a batch below the planned one", "[fusion]") {
  // Planned for 4 images, trained on 3 (as the CUDA test's short step): every stack indexes by the
  // tensors' own batch.
  for (const char* model : {"resnet8", "vgg11_bn"}) {
    INFO(model);
    const int64_t side = std::string(model) == "vgg11_bn" ? 32 : 16;
    Graph plain, fused;
    build_model(plain, spec_of(model, 4, side, false));
    build_model(fused, whole_tensors_spec(model, 4, side));
    check_trains_alike(plain, fused, 3, {stash(StashFormat::DenseF32), stash(StashFormat::BitmapF32)});
  }
}
