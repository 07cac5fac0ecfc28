// Depth-first fusion (docs/fusion.md): tiles smaller than a plane (bands of rows, their pools'
// halos recomputed) and dropout as a stage, each training bit-identically to the layers one by one.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "tests/fusion_harness.h"

using namespace et;
using namespace et::fusion_test;

namespace {
// Plans `g` fused with a cache of `cache_kb` KiB (0: this machine's) and the stacks in `disable` left
// unfused, and rewrites it; returns how many stacks go by bands of rows, and in *unfused the stacks
// left unfused. Every fused stack's tile fits the cache; a stack left unfused says why.
int fuse_with_cache(Graph& g, int64_t cache_kb, std::vector<std::string>* unfused = nullptr,
                    const std::vector<std::string>& disable = {}) {
  FusionSpec spec;
  spec.enabled = true;
  spec.disable = disable;
  spec.cache_kb = cache_kb;
  const fusion::Plan p = fusion::plan(g, spec);
  int banded = 0;
  for (const fusion::StackPlan& sp : p.stacks) {
    if (!sp.fused) {
      CHECK(sp.why_not.find(disable.empty() ? "exceeds the cache" : "") != std::string::npos);
      if (unfused) unfused->push_back(sp.name);
      continue;
    }
    CHECK(sp.tile_bytes <= p.cache_bytes);
    if (sp.stack.band_rows > 0) {
      ++banded;
      CHECK(sp.stack.band_rows < sp.stack.stages[0].H);
      CHECK(sp.stack.band_rows * sp.stack.stages[0].W % 16 == 0);  // whole vectors: BN's sums carry over bands
    }
  }
  fusion::apply(g, p);
  return banded;
}
}  // namespace

TEST_CASE("fusion: planes larger than the cache go by bands of rows, halos recomputed, bit-identically",
          "[fusion]") {
  struct Case {
    int64_t batch, h, w, k, s, p, channels;
  };
  // Overlapping padded pools (3/1/1, 3/2/1, 5/3/2: halos above and below every band), windows that
  // tile the plane (2/2/0), windows with gaps between them (2/3/0: rows in no window), odd sizes, a
  // 40-wide plane (bands of 2-row units) and a 7-wide one (16-row units). The stacks: BN, ReLU, the
  // pool; BN, add, ReLU (no halo); BN, 2x2 stride-1 average pool with padding.
  for (const Case c : {Case{2, 20, 20, 3, 1, 1, 3}, Case{1, 40, 17, 3, 2, 1, 2}, Case{2, 16, 24, 2, 2, 0, 2},
                       Case{1, 37, 12, 5, 3, 2, 2}, Case{1, 26, 12, 2, 3, 0, 2}, Case{1, 9, 40, 3, 1, 1, 2},
                       Case{1, 40, 7, 3, 1, 1, 2}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " pool " << c.k << "/" << c.s << "/" << c.p) {
      int banded = 0;
      for (int64_t cache_kb : {2, 3, 5, 8, 10, 12, 16}) {
        INFO("fusion.cache_kb " << cache_kb);
        Graph plain, fused, whole;
        synthetic(plain, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels);
        synthetic(fused, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels);
        synthetic(whole, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels);
        std::vector<std::string> unfused;
        const int b = fuse_with_cache(fused, cache_kb, &unfused);
        banded += b;
        if (b == 0) continue;
        check_trains_alike(plain, fused, c.batch);
        // A 16-bit x: the element-wise stacks leave their paths in registers for the bands, and the
        // pooled ones differ from the unfused layers (the lossy formats' rule), so against whole planes
        // (the stacks the small cache left unfused unfused there too).
        REQUIRE(fuse_with_cache(whole, 0, nullptr, unfused) == 0);
        const auto w = train(whole, c.batch, stash(StashFormat::DenseF16)),
                   d = train(fused, c.batch, stash(StashFormat::DenseF16));
        CHECK(differing(w, d) == 0);
      }
      CHECK(banded > 0);
    }
  }
  SECTION("stacks after stacks (sums from the producer) and a conv output read by two stacks") {
    for (int64_t cache_kb : {6, 8}) {
      INFO("fusion.cache_kb " << cache_kb);
      Graph plain, fused;
      chain(plain, 2, 24, 20, 3);
      chain(fused, 2, 24, 20, 3);
      CHECK(fuse_with_cache(fused, cache_kb) > 0);
      CHECK(differing(train(plain, 2, stash(StashFormat::Auto)), train(fused, 2, stash(StashFormat::Auto))) == 0);
      for (bool pool : {false, true}) {
        Graph plain2, fused2;
        two_readers(plain2, 2, 24, pool);
        two_readers(fused2, 2, 24, pool);
        CHECK(fuse_with_cache(fused2, cache_kb) == 2);
        CHECK(differing(train(plain2, 2, stash(StashFormat::DenseF32)), train(fused2, 2, stash(StashFormat::DenseF32))) ==
              0);
      }
    }
  }
}

namespace {
// Dropout inside stacks, in every place the planner takes it: after a ReLU and before a pool,
// before an add, after a pool, and before the ReLU that ends a stack (whose mask the backward
// recomputes through the dropout).
void with_dropout(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t pool_k, int64_t pool_s, int64_t pool_p,
                  int64_t channels, float p) {
  const TestNet net = open_net(g, batch, h, w);
  const Conv2dOptions o = conv3x3(channels);
  int y = dropout(g, relu(g, batchnorm2d(g, conv2d(g, net.x, "c1", o), "b1"), "r1"), "d1", p);
  y = maxpool2d(g, y, "p1", pool_k, pool_s, pool_p);
  const int side = y;
  y = relu(g, add(g, dropout(g, batchnorm2d(g, conv2d(g, y, "c2", o), "b2"), "d2", p), side, "a2"), "r2");
  y = dropout(g, avgpool2d(g, batchnorm2d(g, conv2d(g, y, "c3", o), "b3"), "p3", 2, 1, 1), "d3", p);
  y = relu(g, dropout(g, batchnorm2d(g, conv2d(g, y, "c4", o), "b4"), "d4", p), "r4");
  close_net(g, net, y);
}
}  // namespace

TEST_CASE("fusion: dropout as a stage trains bit-identically (its mask drawn again in the backward)", "[fusion]") {
  struct Case {
    int64_t batch, h, w, k, s, p, channels;
    float drop;
  };
  // Large planes (plane by plane), small ones (4x4 -> 3x3 and 2x2 blocks), bands (a small cache),
  // channel slabs (tile 1), dropout 0 (the layer passes its input on).
  for (const Case c : {Case{2, 24, 16, 3, 1, 1, 3, 0.3f}, Case{1, 9, 7, 3, 2, 1, 2, 0.5f}, Case{3, 4, 4, 2, 2, 0, 5, 0.25f},
                       Case{2, 8, 8, 2, 2, 0, 3, 0.f}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " pool " << c.k << "/" << c.s << "/" << c.p
                             << " dropout " << c.drop) {
      for (int64_t tile : {0, 1})
        for (int64_t cache_kb : {0, 8}) {  // 8 KiB: bands of the 24x16 and 25x17 planes
          INFO("tile " << tile << ", cache " << cache_kb);
          Graph plain, fused;
          with_dropout(plain, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels, c.drop);
          with_dropout(fused, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels, c.drop);
          FusionSpec spec;
          spec.enabled = true;
          spec.tile = tile;
          spec.cache_kb = tile ? 0 : cache_kb;
          const fusion::Plan p = fusion::plan(fused, spec);
          REQUIRE(p.stacks.size() == 4);
          int dropouts = 0;
          for (const fusion::StackPlan& sp : p.stacks) {
            CHECK(sp.fused);
            for (const FusedStage& st : sp.stack.stages) dropouts += st.kind == FusedKind::Dropout;
          }
          CHECK(dropouts == 4);
          if (cache_kb && !tile && c.h == 24) CHECK(p.stacks[0].stack.band_rows > 0);
          CHECK(p.stacks[0].stack.stages.size() == 4);  // bn, relu, dropout, maxpool
          CHECK(p.stacks[1].stack.stages.size() == 4);  // bn, dropout, add, relu
          CHECK(p.stacks[2].stack.stages.size() == 3);  // bn, avgpool, dropout
          CHECK(p.stacks[3].stack.stages.size() == 3);  // bn, dropout, relu
          CHECK(fusion::describe(fused, p).find("bn,dropout,relu") != std::string::npos);
          fusion::apply(fused, p);
          check_trains_alike(plain, fused, c.batch);
        }
    }
  }
  SECTION("one dropout per stack, none after the add") {
    Graph g;
    const TestNet net = open_net(g, 2, 8, 8);
    const int x = conv2d(g, net.x, "c1", conv3x3(3));
    int y = dropout(g, dropout(g, batchnorm2d(g, x, "b1"), "d1", 0.1f), "d2", 0.1f);
    y = dropout(g, add(g, batchnorm2d(g, conv2d(g, y, "c2", conv3x3(3)), "b2"), x, "a2"), "d3", 0.1f);
    close_net(g, net, y);
    FusionSpec spec;
    spec.enabled = true;
    const fusion::Plan p = fusion::plan(g, spec);
    REQUIRE(p.stacks.size() == 2);
    CHECK(p.stacks[0].stack.stages.size() == 2);  // bn, dropout: the second dropout ends it
    CHECK(p.stacks[1].stack.stages.size() == 2);  // bn, add: the dropout after the add ends it
  }
}
