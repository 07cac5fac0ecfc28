// Depth-first fusion (docs/fusion.md): fused training equal to unfused training bit for bit (the
// fused kernels call the layers' own row and plane functions and keep every reduction order), for
// the shipped models and synthetic stacks with odd sizes, overlapping padded pools and batch 1,
// under the stash formats, recomputation and 4-bit training. The planner: test_fusion_planner.cpp;
// the sweeps done by a stack's reader or handed to the stack before: test_fusion_sweeps.cpp.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <random>

#include "backends/cpu/fused_bn_relu_pool.h"
#include "backends/cpu/fused_common.h"
#include "backends/cpu/pool_planes.h"
#include "engine/check.h"
#include "fusion/fusion.h"
#include "memory/bitmap.h"
#include "layers/layers.h"
#include "tests/fusion_harness.h"
#include "tests/tiny_training.h"

using namespace et;
using namespace et::fusion_test;


TEST_CASE("fusion: the shipped models train bit-identically fused and unfused", "[fusion]") {
  SECTION("resnet8 dense") { check_model("resnet8", 4, 16, stash(StashFormat::DenseF32)); }
  // x read straight from the 16-bit copies (no decode buffer), small planes included
  SECTION("resnet8 dense_fp16") { check_model("resnet8", 4, 16, stash(StashFormat::DenseF16)); }
  SECTION("resnet8 dense_bf16, batch 3") { check_model("resnet8", 3, 16, stash(StashFormat::DenseBF16)); }
  SECTION("resnet8 bitmap, batch 1") { check_model("resnet8", 1, 16, stash(StashFormat::Auto)); }
  SECTION("resnet20 bitmap_fp32") { check_model("resnet20", 2, 16, stash(StashFormat::BitmapF32)); }
  SECTION("vgg11_bn dense") { check_model("vgg11_bn", 3, 32, stash(StashFormat::DenseF32)); }
  SECTION("vgg11_bn bitmap") { check_model("vgg11_bn", 2, 32, stash(StashFormat::Auto)); }
  // A last-level cache of 1 KiB: every stack writes y (and dx after a pool) by streaming stores.
  SECTION("vgg11_bn dense, streaming") { check_model("vgg11_bn", 3, 32, stash(StashFormat::DenseF32), {}, 1); }
  SECTION("vgg11_bn bitmap_fp32, streaming") { check_model("vgg11_bn", 2, 32, stash(StashFormat::BitmapF32), {}, 1); }
  SECTION("resnet8 dense_fp16, streaming") { check_model("resnet8", 4, 16, stash(StashFormat::DenseF16), {}, 1); }
  SECTION("resnet8 dense, streaming") { check_model("resnet8", 4, 16, stash(StashFormat::DenseF32), {}, 1); }
  SECTION("vgg11 (no BN) dense") { check_model("vgg11", 3, 32, stash(StashFormat::DenseF32)); }
  SECTION("vgg11 (no BN) bitmap, batch 1") { check_model("vgg11", 1, 32, stash(StashFormat::Auto)); }
  SECTION("vgg11 (no BN) recompute") { check_model("vgg11", 2, 32, stash(StashFormat::BitmapF32, 2)); }
  SECTION("mobilenetv2") { check_model("mobilenetv2", 2, 16, stash(StashFormat::DenseF32)); }
  SECTION("resnet8 recompute") { check_model("resnet8", 4, 16, stash(StashFormat::Auto, 1)); }
  SECTION("vgg11_bn recompute") { check_model("vgg11_bn", 2, 32, stash(StashFormat::BitmapF32, 2)); }
  SECTION("resnet8 LUQ") { check_model("resnet8", 4, 16, stash(StashFormat::DenseF32), test::luq(2)); }
  SECTION("resnet8 LUQ bitmap_int4") { check_model("resnet8", 4, 16, stash(StashFormat::BitmapI4), test::luq()); }
}

TEST_CASE("fusion: lossy stash formats stay close (the stack recomputes from the stored x)", "[fusion]") {
  // Under fp16 the unfused max-pool finds its maximum in the rounded ReLU output, the fused one in
  // a ReLU recomputed from the rounded x: both approximate the same gradient.
  Graph plain, fused;
  build_model(plain, spec_of("vgg11_bn", 2, 32, false));
  build_model(fused, spec_of("vgg11_bn", 2, 32, true));
  const auto a = train(plain, 2, stash(StashFormat::DenseF16)), b = train(fused, 2, stash(StashFormat::DenseF16));
  CHECK(a[0][0] == b[0][0]);  // the first loss: forwards are exact
  CHECK(std::abs(a.back()[0] - b.back()[0]) < 0.05f * (1.f + std::abs(a.back()[0])));
}



TEST_CASE("fusion: two stacks reading one conv output (dx accumulates) train bit-identically", "[fusion]") {
  for (bool pool : {false, true})
    for (int64_t tile : {0, 2}) {
      DYNAMIC_SECTION((pool ? "BN, ReLU, 2x2 max-pool" : "BN, ReLU") << " tile " << tile) {
        Graph plain, fused;
        two_readers(plain, 2, 16, pool);
        two_readers(fused, 2, 16, pool);
        FusionSpec spec;
        spec.enabled = true;
        spec.tile = tile;
        fusion::apply(fused, fusion::plan(fused, spec));
        REQUIRE(fused_nodes(fused) == 2);
        check_trains_alike(plain, fused, 2);
      }
    }
}

TEST_CASE("fusion: an add of a BN's output and the BN's own input trains bit-identically", "[fusion]") {
  for (bool relu_first : {false, true})
    for (bool whole : {false, true}) {
      DYNAMIC_SECTION((relu_first ? "x + relu(BN(x))" : "relu(x + BN(x))") << (whole ? ", whole tensors" : ", tiles")) {
        Graph plain, fused;
        add_own_input(plain, 2, 8, relu_first);
        add_own_input(fused, 2, 8, relu_first);
        FusionSpec spec;
        spec.enabled = true;
        spec.whole_tensors = whole;
        const fusion::Plan p = fusion::plan(fused, spec);
        // BN -> ReLU a stack, the add a layer (x's two gradients add up there); BN alone no stack.
        REQUIRE(p.stacks.size() == (relu_first ? 1u : 0u));
        for (const fusion::StackPlan& sp : p.stacks) CHECK(sp.side < 0);
        fusion::apply(fused, p);
        check_trains_alike(plain, fused, 2);
      }
    }
}

TEST_CASE("fusion: synthetic stacks with odd sizes, overlapping pools and batch 1", "[fusion]") {
  struct Case {
    int64_t batch, h, w, k, s, p, channels;
  };
  // Planes of 16 elements or fewer run channel blocks (fused_blocks.cpp): 4x4 and 2x2 with pools that
  // tile the plane (pooled as one tall plane), 3x5 with an overlapping pool (plane by plane), more
  // channels than one block, and blocks that end early. 2x2 pools of 8x8, 16x16 and 32x32 planes
  // build the BN -> ReLU -> pool stack's dz in registers (fused_bn_relu_pool.h); 16x12 does not (Q = 6).
  // A last-level cache of 1 KiB makes every stack stream y (and dx after a pool) past the cache where
  // its planes are whole vectors; the sysfs one (MiBs) streams none of these small tensors. 16x16
  // and 32x32 with 3x3 stride-1 pools: rows of whole vectors, so on AVX-512 the pool sums y for the
  // next BN as it writes it (SummedY, fused.cpp), and streams it with the small cache.
  for (const Case c : {Case{1, 7, 5, 3, 1, 1, 5}, Case{3, 9, 11, 3, 2, 1, 5}, Case{2, 8, 8, 2, 2, 0, 5},
                       Case{1, 13, 6, 3, 1, 0, 5}, Case{2, 4, 4, 2, 2, 0, 20}, Case{3, 3, 5, 3, 1, 1, 7},
                       Case{1, 2, 2, 2, 2, 0, 40}, Case{1, 32, 32, 2, 2, 0, 3}, Case{2, 16, 16, 2, 2, 0, 3},
                       Case{2, 16, 12, 2, 2, 0, 3}, Case{2, 16, 16, 3, 1, 1, 3}, Case{1, 32, 32, 3, 1, 1, 2}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " pool " << c.k << "/" << c.s << "/" << c.p
                             << " channels " << c.channels) {
      for (int64_t tile : {0, 1, 3})
        for (int64_t llc_kb : {0, 1}) {
          INFO("tile " << tile << ", fusion.llc_kb " << llc_kb);
          Graph plain, fused;
          synthetic(plain, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels);
          synthetic(fused, c.batch, c.h, c.w, c.k, c.s, c.p, c.channels);
          FusionSpec spec;
          spec.enabled = true;
          spec.tile = tile;
          spec.llc_kb = llc_kb;
          const fusion::Plan p = fusion::plan(fused, spec);
          REQUIRE(p.stacks.size() == 3);
          const FusedStage& add = p.stacks[1].stack.stages[0];  // x and y of the BN, add, ReLU stack: 1 KiB or more?
          CHECK(p.stacks[1].stack.stream_y == (llc_kb == 1 && 2 * 4 * c.batch * c.channels * add.H * add.W >= 1024));
          const FusedStage& pool = p.stacks[0].stack.last();
          CHECK(p.stacks[0].stack.stream_dx == (llc_kb == 1 && pool.P * pool.Q < pool.H * pool.W));  // dx of its own
          CHECK(p.stacks[0].stack.stages.size() == 3);  // bn, relu, maxpool
          CHECK(p.stacks[1].stack.stages.size() == 3);  // bn, add, relu
          CHECK(p.stacks[1].side >= 0);
          CHECK(p.stacks[2].stack.stages.size() == 2);  // bn, avgpool
          fusion::apply(fused, p);
          CHECK(fused_nodes(fused) == 3);
          check_trains_alike(plain, fused, c.batch);
        }
    }
  }
}


TEST_CASE("fusion: BN statistics from x's producer (a conv's epilogue, the stack before)", "[fusion]") {
  struct Case {
    int64_t batch, h, w, channels;
  };
  // 32x32: the direct conv takes the sums in its epilogue; 9x7 and 5x4 (odd, and 20 elements, just
  // above the small planes): other conv paths, by plane_sums after the kernel. (Winograd: below.)
  for (const Case c : {Case{2, 32, 32, 16}, Case{3, 9, 7, 5}, Case{1, 5, 4, 6}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " channels " << c.channels) {
      for (int64_t tile : {0, 2}) {
        INFO("fusion.tile " << tile);
        // Built for one image more than each step runs: the sums tables are [2, batch + 1, C].
        Graph plain, fused;
        chain(plain, c.batch + 1, c.h, c.w, c.channels);
        chain(fused, c.batch + 1, c.h, c.w, c.channels);
        FusionSpec spec;
        spec.enabled = true;
        spec.tile = tile;
        const fusion::Plan p = fusion::plan(fused, spec);
        REQUIRE(p.stacks.size() == 3);
        // Channel slabs (an explicit tile) take their own statistics; memory order takes the producer's.
        for (const fusion::StackPlan& sp : p.stacks) CHECK(sp.sums_from_producer == (tile == 0));
        fusion::apply(fused, p);
        REQUIRE(fused_nodes(fused) == 3);
        int sums = 0;
        for (int id = 0; id < fused.num_values(); ++id) {
          const Value& v = fused.value(id);
          if (!v.forward_only) continue;
          ++sums;
          CHECK(v.kind == ValueKind::Aux);
          CHECK(v.shape == Shape{2, c.batch + 1, c.channels});
          REQUIRE(v.consumers.size() == 1);
          CHECK(std::strcmp(fused.node(v.consumers[0]).op->type(), "fused_stack") == 0);
        }
        CHECK(sums == (tile == 0 ? 3 : 0));
        check_trains_alike(plain, fused, c.batch,
                           {stash(StashFormat::DenseF32), stash(StashFormat::Auto), stash(StashFormat::Auto, 1)});
      }
    }
  }
}

TEST_CASE("fusion: BN statistics from a pooling layer before the stack", "[fusion]") {
  // image -> conv -> max-pool or average pool -> <BN, ReLU> -> conv: the pool writes the plane sums
  // of its output as it pools (BrainSlug's block after an unfused first pool), the stack reads x
  // once. Odd planes, batch 1 and 3; 2x2 stride-2 windows pool runs of planes as one tall plane.
  struct Case {
    int64_t batch, h, w, channels, k, stride, pad;
    bool max;
  };
  for (const Case c : {Case{3, 32, 32, 4, 3, 1, 1, true}, Case{1, 11, 9, 5, 3, 2, 1, true},
                       Case{3, 13, 10, 3, 3, 2, 1, false}, Case{2, 12, 12, 6, 2, 2, 0, true},
                       Case{2, 12, 8, 5, 2, 2, 0, false}}) {
    DYNAMIC_SECTION((c.max ? "max" : "avg") << " pool " << c.k << "/" << c.stride << " on " << c.h << "x" << c.w
                                            << ", batch " << c.batch) {
      Graph plain, fused;
      for (Graph* g : {&plain, &fused}) {
        const TestNet net = open_net(*g, c.batch + 1, c.h, c.w);
        int y = conv2d(*g, net.x, "c0", conv3x3(c.channels));
        y = c.max ? maxpool2d(*g, y, "pool", c.k, c.stride, c.pad) : avgpool2d(*g, y, "pool", c.k, c.stride, c.pad);
        y = relu(*g, batchnorm2d(*g, y, "b0.bn"), "b0.relu");
        close_net(*g, net, conv2d(*g, y, "c1", conv3x3(c.channels)));
      }
      FusionSpec spec;
      spec.enabled = true;
      const fusion::Plan p = fusion::plan(fused, spec);
      REQUIRE(p.stacks.size() == 1);
      CHECK(p.stacks[0].sums_from_producer);
      fusion::apply(fused, p);
      int sums = 0;
      for (int id = 0; id < fused.num_values(); ++id) {
        const Value& v = fused.value(id);
        if (!v.forward_only) continue;
        ++sums;
        REQUIRE(v.producer >= 0);
        CHECK(std::string(fused.node(v.producer).op->type()) == (c.max ? "maxpool2d" : "avgpool2d"));
      }
      CHECK(sums == 1);
      check_trains_alike(plain, fused, c.batch,
                         {stash(StashFormat::DenseF32), stash(StashFormat::Auto), stash(StashFormat::Auto, 1)});
    }
  }
}

namespace {
// After each fused stack's training forward: where the stack packed its output's values itself,
// the stash holds the bytes its own pack of y would write (the bitmap, then the values).
struct PackedInPass : NodeObserver {
  Executor& ex;
  int checked = 0, wrong = 0;
  explicit PackedInPass(Executor& e) : ex(e) {}
  void after_forward(int node) override {
    const int id = ex.graph().node(node).output;
    if (std::strcmp(ex.graph().node(node).op->type(), "fused_stack") != 0) return;  // (training forwards only)
    const StashRecord& r = ex.stash().record(id);
    if (!r.packed_by_producer) return;
    const Tensor y = ex.value(id), stored = ex.stash().get_stored(id);
    const bitmap::ValueType t = stored.dtype == DType::BitmapF16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32;
    const int64_t n = y.numel();
    std::vector<uint64_t> want(size_t(bitmap::num_words(n) + n));  // room for n f32 values after the words
    const int64_t kept = bitmap::pack(y.f32(), n, 0.f, want.data(), want.data() + bitmap::num_words(n), t);
    const size_t bytes = bitmap::bitmap_bytes(n, kept, t);
    ++checked;
    wrong += kept != r.nonzero || r.bytes != bytes || std::memcmp(stored.data, want.data(), bytes) != 0;
  }
  void after_backward(int) override {}
};

// image -> conv -> <BN, ReLU> -> conv -> <BN, ReLU> -> conv -> <BN, ReLU> -> flatten -> linear: each
// stack saves its output's mask, and the conv after it the output in full, so the stack pushes it.
void relu_chain(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t channels) {
  const TestNet net = open_net(g, batch, h, w);
  const Conv2dOptions o = conv3x3(channels);
  int y = conv2d(g, net.x, "c0", o);
  for (int i = 0; i < 3; ++i) {
    const std::string b = "b" + std::to_string(i);
    y = relu(g, batchnorm2d(g, y, b + ".bn"), b + ".relu");
    if (i < 2) y = conv2d(g, y, "c" + std::to_string(i + 1), o);
  }
  close_net(g, net, y);
}
}  // namespace

// image -> conv (3 -> 16) -> <BN, ReLU> -> conv (16 -> 32: 3x3 stride 2, or 1x1) -> <BN, ReLU> -> linear
void second_conv_chain(Graph& g, int64_t batch, int64_t side, bool pointwise) {
  const TestNet net = open_net(g, batch, side, side);
  int y = relu(g, batchnorm2d(g, conv2d(g, net.x, "c0", conv3x3(16)), "b0.bn"), "b0.relu");
  Conv2dOptions o = conv3x3(32);
  if (pointwise)
    o.kernel = 1, o.padding = 0;
  else
    o.stride = 2;
  y = relu(g, batchnorm2d(g, conv2d(g, y, "c1", o), "b1.bn"), "b1.relu");
  close_net(g, net, y);
}

TEST_CASE("fusion: BN statistics from Winograd / implicit-GEMM / GEMM convs, per chunk of images", "[fusion]") {
  // conv2d's forward path (backends/cpu/conv.cpp, choose()): 64 -> 64 channels on 6x6 maps by
  // Winograd F(2x2, 3x3) (every instruction set), on 8x8 maps by Winograd by rows of tiles (AVX-512;
  // elsewhere the same Winograd); a 3x3 stride-2 conv with 16 -> 32 channels by the implicit GEMM;
  // a 1x1 conv by the GEMM path. Each takes the planes' sums after each chunk of images (by rows:
  // each plane), and the stacks reading them take them; fused and unfused train alike.
  for (const char* path : {"winograd", "winograd rows", "implicit GEMM", "GEMM"})
    for (const int64_t batch : {1, 5}) {
      DYNAMIC_SECTION(path << ", batch " << batch) {
        const bool rows = std::strcmp(path, "winograd rows") == 0;
        const bool winograd = rows || std::strcmp(path, "winograd") == 0;
        Graph plain, fused;
        if (winograd) {
          relu_chain(plain, batch, rows ? 8 : 6, rows ? 8 : 6, 64);
          relu_chain(fused, batch, rows ? 8 : 6, rows ? 8 : 6, 64);
        } else {
          const bool pointwise = std::strcmp(path, "GEMM") == 0;
          second_conv_chain(plain, batch, pointwise ? 10 : 18, pointwise);
          second_conv_chain(fused, batch, pointwise ? 10 : 18, pointwise);
        }
        FusionSpec spec;
        spec.enabled = true;
        const fusion::Plan p = fusion::plan(fused, spec);
        REQUIRE(p.stacks.size() == (winograd ? 3u : 2u));
        for (const fusion::StackPlan& sp : p.stacks) CHECK(sp.sums_from_producer);
        fusion::apply(fused, p);
        for (const StashOptions& o : {stash(StashFormat::DenseF32), stash(StashFormat::Auto)}) {
          INFO("stash format " << int(o.format));
          const auto a = train(plain, batch, o), b = train(fused, batch, o);
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, b) == 0);
        }
      }
    }
}

TEST_CASE("fusion: a stack packs the stash's values in its pass, the stash's own bytes", "[fusion]") {
  struct Case {
    int64_t batch, h, w, channels;
  };
  // Planes of 32x32 and 16x8 (whole bitmap words); 15 and 14 planes, so rounds end unevenly.
  for (const Case c : {Case{3, 32, 32, 5}, Case{2, 16, 8, 7}}) {
    for (const size_t round : {size_t(0), size_t(4096), size_t(1)}) {  // the default; 1 or 8 planes; 1 plane
      DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " channels " << c.channels
                               << ", rounds of " << round << " bytes") {
        fused_planes::set_pack_round_bytes(round);
        Graph plain, fused;
        relu_chain(plain, c.batch, c.h, c.w, c.channels);
        relu_chain(fused, c.batch, c.h, c.w, c.channels);
        FusionSpec spec;
        spec.enabled = true;
        fusion::apply(fused, fusion::plan(fused, spec));
        REQUIRE(fused_nodes(fused) == 3);
        for (StashFormat f : {StashFormat::BitmapF32, StashFormat::BitmapF16, StashFormat::Auto}) {
          INFO("stash format " << stash_format_name(f));
          auto be = make_cpu_backend();
          Executor ex(fused, *be, stash(f));
          init_parameters(ex, 7);
          fill(ex, c.batch);
          PackedInPass check(ex);
          ex.set_observer(&check);
          ex.forward(c.batch, true);
          ex.set_observer(nullptr);
          CHECK(check.checked == 2);  // the first two stacks' outputs (the third's is saved as its mask,
          CHECK(check.wrong == 0);    // the classifier saves the flattened view)
          if (f != StashFormat::BitmapF16) {  // lossless: training equals the unfused layers'
            const auto a = train(plain, c.batch, stash(f)), b = train(fused, c.batch, stash(f));
            REQUIRE(std::isfinite(a[0][0]));
            CHECK(differing(a, b) == 0);
          }
        }
        fused_planes::set_pack_round_bytes(0);
      }
    }
  }
}

namespace {
// image -> conv -> ReLU -> max-pool -> conv -> ReLU -> avg-pool -> flatten -> linear: the stacks
// without a BN (VGG without BN), odd plane sizes, padded windows and windows with gaps between.
struct PoolCfg {
  int64_t k, s, p;
};
void synthetic_no_bn(Graph& g, int64_t batch, int64_t h, int64_t w, PoolCfg maxp, PoolCfg avgp) {
  const TestNet net = open_net(g, batch, h, w);
  const Conv2dOptions o = conv3x3(5);
  int y = maxpool2d(g, relu(g, conv2d(g, net.x, "c1", o), "r1"), "p1", maxp.k, maxp.s, maxp.p);
  y = avgpool2d(g, relu(g, conv2d(g, y, "c2", o), "r2"), "p2", avgp.k, avgp.s, avgp.p);
  close_net(g, net, y);
}
}  // namespace

TEST_CASE("fusion: stacks without a BN (a ReLU and a pool) train bit-identically", "[fusion]") {
  struct Case {
    int64_t batch, h, w;
    PoolCfg maxp, avgp;
  };
  for (const Case& c : {Case{1, 7, 5, {2, 2, 0}, {2, 2, 0}}, Case{3, 9, 11, {3, 3, 1}, {2, 3, 1}},
                       Case{2, 8, 8, {2, 2, 1}, {1, 1, 0}}, Case{1, 13, 6, {3, 4, 0}, {3, 3, 1}}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " max " << c.maxp.k << "/" << c.maxp.s << "/"
                             << c.maxp.p << " avg " << c.avgp.k << "/" << c.avgp.s << "/" << c.avgp.p) {
      Graph plain, fused;
      synthetic_no_bn(plain, c.batch, c.h, c.w, c.maxp, c.avgp);
      synthetic_no_bn(fused, c.batch, c.h, c.w, c.maxp, c.avgp);
      FusionSpec spec;
      spec.enabled = true;
      const fusion::Plan p = fusion::plan(fused, spec);
      REQUIRE(p.stacks.size() == 2);
      CHECK(p.stacks[0].name == "r1");
      CHECK(p.stacks[0].stack.stages[1].kind == FusedKind::MaxPool);
      CHECK(p.stacks[1].stack.stages[1].kind == FusedKind::AvgPool);
      for (const fusion::StackPlan& sp : p.stacks) CHECK((sp.fused && sp.bytes_fused < sp.bytes_unfused));
      fusion::apply(fused, p);
      CHECK(fused_nodes(fused) == 2);
      CHECK(fused.find_value("r1") < 0);  // the ReLU output is gone; one bit per element of x remains
      CHECK(fused.find_value("r1.pass") >= 0);
      check_trains_alike(plain, fused, c.batch);
    }
  }
  SECTION("fusion.disable takes the ReLU's name") {
    Graph g;
    synthetic_no_bn(g, 2, 8, 8, {2, 2, 0}, {2, 2, 0});
    FusionSpec spec;
    spec.enabled = true;
    spec.disable = {"r2"};
    const fusion::Plan p = fusion::plan(g, spec);
    REQUIRE(p.stacks.size() == 2);
    CHECK(p.stacks[0].fused);
    CHECK_FALSE(p.stacks[1].fused);
    CHECK(p.stacks[1].why_not == "fusion.disable");
  }
  SECTION("a pool whose windows overlap keeps the ReLU output: no stack") {
    Graph g;
    synthetic_no_bn(g, 2, 8, 8, {3, 1, 1}, {3, 2, 1});
    FusionSpec spec;
    spec.enabled = true;
    CHECK(fusion::plan(g, spec).stacks.empty());
  }
}

namespace {
// Where a stack's output is computed by its readers in forward, they read the stack's input x as
// it was: count the readers' outputs that share memory with x (a packed stash lets x's forward
// buffer die at the stack unless the plan keeps it for the readers).
int reader_outputs_over_x(const Graph& g, const Executor& ex) {
  int overlaps = 0;
  for (const SavedValue& sv : ex.stash().saved()) {
    if (!ex.computed_by_readers(sv.value)) continue;
    const Tensor x = ex.value(g.node(g.value(sv.value).producer).inputs[0]);
    const char *x0 = static_cast<const char*>(x.data), *x1 = x0 + x.nbytes();
    for (int c : g.value(sv.value).consumers) {
      const Tensor y = ex.value(g.node(c).output);
      const char *y0 = static_cast<const char*>(y.data), *y1 = y0 + y.nbytes();
      overlaps += y0 < x1 && x0 < y1;
    }
  }
  return overlaps;
}
}  // namespace

TEST_CASE("fusion: a BN -> ReLU stack's output recomputed for backward trains bit-identically in less memory",
          "[fusion][stash]") {
  // memory.recompute_stack_outputs: the y a conv reads again in backward is not kept; the conv's
  // backward has the stack write it from its saved x into the decode buffer. Exact formats give the
  // same training bit for bit, with less activation memory planned.
  struct Case {
    const char* model;
    int64_t batch, side;
    StashFormat format;
  };
  const Case cases[] = {{"resnet8", 4, 16, StashFormat::DenseF32},  {"resnet8", 1, 16, StashFormat::Auto},
                        {"resnet20", 2, 16, StashFormat::BitmapF32}, {"vgg11_bn", 3, 32, StashFormat::DenseF32},
                        {"vgg11_bn", 2, 32, StashFormat::Auto},      {"mobilenetv2", 2, 16, StashFormat::DenseF32}};
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.model << " " << stash_format_name(c.format) << " batch " << c.batch) {
      Graph g1, g2;
      build_model(g1, spec_of(c.model, c.batch, c.side, true));
      build_model(g2, spec_of(c.model, c.batch, c.side, true));
      StashOptions kept = stash(c.format), recomputed = kept;
      recomputed.recompute_stack_outputs = true;
      const auto a = train(g1, c.batch, kept), b = train(g2, c.batch, recomputed);
      REQUIRE(std::isfinite(a[0][0]));
      CHECK(differing(a, b) == 0);
      // In forward, the direct convs compute y too as they place x's planes (below); with that
      // off, the stacks write y in forward: the same training, evaluation included.
      {
        Graph g3;
        build_model(g3, spec_of(c.model, c.batch, c.side, true));
        setenv("ET_FORWARD_BY_READERS", "0", 1);
        const auto written = train(g3, c.batch, recomputed);
        unsetenv("ET_FORWARD_BY_READERS");
        CHECK(differing(written, b) == 0);
      }

      auto be = make_cpu_backend();
      Executor ea(g1, *be, kept), eb(g2, *be, recomputed);
      int recomputed_values = 0;
      for (const SavedValue& sv : eb.stash().saved()) {
        recomputed_values += sv.recomputed;
        // every reader is a conv's weight gradient, which computes y as it reads: no decode buffer
        CHECK(sv.affine_relu == sv.recomputed);
        if (sv.recomputed) CHECK_FALSE(sv.unpack.defined());
        // only BN -> ReLU stacks' outputs, each read by a later layer
        if (sv.recomputed) CHECK(std::strcmp(g2.node(g2.value(sv.value).producer).op->type(), "fused_stack") == 0);
      }
      CHECK(recomputed_values > 0);
      // Those the direct convs read in forward have no buffer: the arena's requests shrink by them.
      int64_t by_readers = 0;
      for (const SavedValue& sv : eb.stash().saved())
        if (eb.computed_by_readers(sv.value)) by_readers += int64_t(g2.value(sv.value).shape.numel()) * 4;
      CHECK(by_readers > 0);
      for (int v = 0; v < g1.num_values(); ++v) CHECK_FALSE(ea.computed_by_readers(v));
      CHECK(eb.memory().activations_unplanned + by_readers <= ea.memory().activations_unplanned);
      CHECK(reader_outputs_over_x(g2, eb) == 0);
      for (const SavedValue& sv : ea.stash().saved()) CHECK_FALSE(sv.recomputed);
      // dense_fp32 keeps y in the arena (zero copy), the other formats in the stash region; the
      // decode buffer y now takes lives in backward only, below the arena's peak here.
      CHECK(eb.memory().activations_planned <= ea.memory().activations_planned);
      CHECK(eb.memory().activations_planned + eb.stash().region_bytes() <
            ea.memory().activations_planned + ea.stash().region_bytes());
    }
  }
  // Lossy formats keep x packed: the readers still read its forward values, the same training as
  // with the stacks writing y (bit for bit; a kept y would differ, being stored lossily itself).
  for (const Case& c : {Case{"resnet8", 2, 16, StashFormat::BitmapF16}, Case{"resnet20", 3, 16, StashFormat::DenseBF16}}) {
    DYNAMIC_SECTION(c.model << " " << stash_format_name(c.format) << " batch " << c.batch << ", y written or not") {
      StashOptions o = stash(c.format);
      o.recompute_stack_outputs = true;
      Graph g1, g2;
      build_model(g1, spec_of(c.model, c.batch, c.side, true));
      build_model(g2, spec_of(c.model, c.batch, c.side, true));
      setenv("ET_FORWARD_BY_READERS", "0", 1);
      const auto written = train(g1, c.batch, o);
      unsetenv("ET_FORWARD_BY_READERS");
      const auto computed = train(g2, c.batch, o);
      REQUIRE(std::isfinite(computed[0][0]));
      CHECK(differing(written, computed) == 0);
      auto be = make_cpu_backend();
      Executor ex(g2, *be, o);
      CHECK(reader_outputs_over_x(g2, ex) == 0);
    }
  }
}
