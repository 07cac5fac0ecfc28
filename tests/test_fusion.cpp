// Depth-first fusion (docs/fusion.md): the planner's stacks and limits, and fused training equal to
// unfused training bit for bit (the fused kernels call the layers' own row and plane functions and
// keep every reduction order), for the shipped models and synthetic stacks with odd sizes,
// overlapping padded pools and batch 1, under the stash formats, recomputation and 4-bit training.
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
#include "tests/tiny_training.h"

using namespace et;

namespace {

int fused_nodes(const Graph& g) {
  int n = 0;
  for (const Node& node : g.nodes()) n += std::strcmp(node.op->type(), "fused_stack") == 0;
  return n;
}

std::vector<float> copy_of(const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); }

// Inputs: N(0,1)-like deterministic images, labels i % classes.
void fill(Executor& ex, int64_t batch) {
  const Graph& g = ex.graph();
  ex.forward(batch, false);  // sets the batch, so the input views span it
  Tensor x = ex.value(g.image_input), y = ex.value(g.label_input);
  const int64_t classes = g.value(g.logits).shape[1];
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float((i * 2654435761u) % 2001) / 1000.f - 1.f;
  for (int64_t i = 0; i < y.numel(); ++i) y.i32()[i] = int32_t(i % classes);
}

// Three SGD steps and an evaluation: the losses, logits, and every parameter, gradient and buffer.
std::vector<std::vector<float>> train(Graph& g, int64_t batch, const StashOptions& stash,
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

ModelSpec spec_of(const std::string& model, int64_t batch, int64_t side, bool fused, int64_t llc_kb = 0) {
  ModelSpec s;
  s.fusion.llc_kb = llc_kb;
  s.name = model;
  s.batch = batch;
  s.height = s.width = side;
  s.fusion.enabled = fused;
  return s;
}

size_t differing(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
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

void check_model(const std::string& model, int64_t batch, int64_t side, const StashOptions& stash,
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

StashOptions stash(StashFormat f, int checkpoint_every = 0) {
  StashOptions o;
  o.format = f;
  o.checkpoint_every = checkpoint_every;
  return o;
}

}  // namespace

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

namespace {
// The synthetic graphs' common ends: a 3-channel image and labels in; flatten, a linear layer of 4
// classes and the loss out. Their convs are 3x3 with padding 1.
struct TestNet {
  int x, labels;
};
TestNet open_net(Graph& g, int64_t batch, int64_t h, int64_t w) {
  g.set_batch_size(int(batch));
  return {image_input(g, batch, 3, h, w), label_input(g, batch)};
}
void close_net(Graph& g, const TestNet& net, int y) {
  g.logits = linear(g, flatten(g, y, "flat"), "fc", 4);
  g.loss = softmax_cross_entropy(g, g.logits, net.labels, "loss");
  g.image_input = net.x;
  g.label_input = net.labels;
}
Conv2dOptions conv3x3(int64_t channels) {
  Conv2dOptions o;
  o.out_channels = channels;
  o.kernel = 3;
  o.padding = 1;
  return o;
}

// image -> conv -> BN -> ReLU -> pool (overlapping, padded) -> conv -> BN -> add(side) -> ReLU ->
// conv -> BN -> avgpool -> flatten -> linear: every stage kind, odd plane sizes.
void synthetic(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t pool_k, int64_t pool_s, int64_t pool_p,
               int64_t channels) {
  const TestNet net = open_net(g, batch, h, w);
  const Conv2dOptions o = conv3x3(channels);
  int y = relu(g, batchnorm2d(g, conv2d(g, net.x, "c1", o), "b1"), "r1");
  y = maxpool2d(g, y, "p1", pool_k, pool_s, pool_p);
  const int side = y;
  y = relu(g, add(g, batchnorm2d(g, conv2d(g, y, "c2", o), "b2"), side, "a2"), "r2");
  y = avgpool2d(g, batchnorm2d(g, conv2d(g, y, "c3", o), "b3"), "p3", 2, 1, 1);
  close_net(g, net, y);
}
}  // namespace

namespace {
// A conv output read by two stacks: the second backward adds into the first one's dx (the stack's
// dx accumulates), so sweep 2 rebuilds dz rather than finding it parked in dx.
void two_readers(Graph& g, int64_t batch, int64_t side, bool pool) {
  const TestNet net = open_net(g, batch, side, side);
  const Conv2dOptions o = conv3x3(3);
  const int y = conv2d(g, net.x, "c1", o);
  int a = relu(g, batchnorm2d(g, y, "b1"), "r1"), b = relu(g, batchnorm2d(g, y, "b2"), "r2");
  if (pool) a = maxpool2d(g, a, "p1", 2, 2, 0), b = maxpool2d(g, b, "p2", 2, 2, 0);
  close_net(g, net, add(g, conv2d(g, a, "c2", o), conv2d(g, b, "c3", o), "a3"));
}
}  // namespace

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
        for (StashFormat f : {StashFormat::DenseF32, StashFormat::Auto}) {
          const auto a = train(plain, 2, stash(f)), b = train(fused, 2, stash(f));
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, b) == 0);
        }
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
  // its planes are whole vectors; the sysfs one (MiBs) streams none of these small tensors.
  for (const Case c : {Case{1, 7, 5, 3, 1, 1, 5}, Case{3, 9, 11, 3, 2, 1, 5}, Case{2, 8, 8, 2, 2, 0, 5},
                       Case{1, 13, 6, 3, 1, 0, 5}, Case{2, 4, 4, 2, 2, 0, 20}, Case{3, 3, 5, 3, 1, 1, 7},
                       Case{1, 2, 2, 2, 2, 0, 40}, Case{1, 32, 32, 2, 2, 0, 3}, Case{2, 16, 16, 2, 2, 0, 3},
                       Case{2, 16, 12, 2, 2, 0, 3}}) {
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
          for (StashFormat f : {StashFormat::DenseF32, StashFormat::Auto}) {
            const auto a = train(plain, c.batch, stash(f)), b = train(fused, c.batch, stash(f));
            REQUIRE(std::isfinite(a[0][0]));
            CHECK(differing(a, b) == 0);
          }
        }
    }
  }
}

namespace {
// image -> conv -> <BN, ReLU, max-pool 3x3 stride 1> x 2 -> BN, ReLU -> flatten -> linear: stacks that
// follow a conv and stacks that follow a stack (BrainSlug's micro-benchmark), each taking BN's
// per-plane sums from x's producer.
void chain(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t channels) {
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
}  // namespace

TEST_CASE("fusion: BN statistics from x's producer (a conv's epilogue, the stack before)", "[fusion]") {
  struct Case {
    int64_t batch, h, w, channels;
  };
  // 32x32: the direct conv takes the sums in its epilogue; 9x7 and 5x4 (odd, and 20 elements, just
  // above the small planes): other conv paths, by plane_sums after the kernel.
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
        for (const StashOptions& o :
             {stash(StashFormat::DenseF32), stash(StashFormat::Auto), stash(StashFormat::Auto, 1)}) {
          INFO("stash format " << int(o.format) << ", checkpoint_every " << o.checkpoint_every);
          const auto a = train(plain, c.batch, o), b = train(fused, c.batch, o);
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, b) == 0);
        }
      }
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
        for (StashFormat f : {StashFormat::DenseF32, StashFormat::Auto}) {
          INFO(stash_format_name(f));
          const auto a = train(plain, c.batch, stash(f)), d = train(fused, c.batch, stash(f));
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, d) == 0);
        }
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
          for (StashFormat f : {StashFormat::DenseF32, StashFormat::Auto}) {
            const auto a = train(plain, c.batch, stash(f)), b = train(fused, c.batch, stash(f));
            REQUIRE(std::isfinite(a[0][0]));
            CHECK(differing(a, b) == 0);
          }
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
      for (StashFormat f : {StashFormat::DenseF32, StashFormat::Auto}) {
        const auto a = train(plain, c.batch, stash(f)), b = train(fused, c.batch, stash(f));
        REQUIRE(std::isfinite(a[0][0]));
        CHECK(differing(a, b) == 0);
      }
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

TEST_CASE("fusion: ReLU + pool kernels equal the layers on tied windows with NaN and -0", "[fusion]") {
  // Values from a small set, so windows hold ties (at zero and above), NaN, -0 and negatives; dy
  // holds -0. The layers: relu_forward, the pool forward / backward on r, relu_backward by r > 0.
  auto be = make_cpu_backend();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float values[] = {-1.f, -0.f, 0.f, 0.5f, 1.f, nan, 2.f, 1.f};
  struct Case {
    FusedKind kind;
    int64_t H, W, k, s, p;
  };
  for (const Case c : {Case{FusedKind::MaxPool, 6, 7, 2, 2, 0}, Case{FusedKind::MaxPool, 9, 40, 2, 2, 0},
                       Case{FusedKind::MaxPool, 5, 6, 2, 2, 1}, Case{FusedKind::MaxPool, 7, 8, 3, 3, 1},
                       Case{FusedKind::AvgPool, 6, 7, 2, 2, 0}, Case{FusedKind::AvgPool, 7, 5, 3, 4, 1}}) {
    for (bool accumulate : {false, true}) {
      DYNAMIC_SECTION((c.kind == FusedKind::MaxPool ? "max " : "avg ") << c.H << "x" << c.W << " " << c.k << "/"
                                                                        << c.s << "/" << c.p << (accumulate ? " acc" : "")) {
        Conv2dGeom g;
        g.N = 2; g.C = 3; g.H = c.H; g.W = c.W; g.K = 3; g.R = g.S = c.k;
        g.stride_h = g.stride_w = c.s;
        g.pad_h = g.pad_w = c.p;
        g.infer_output();
        const int64_t n = g.N * g.C * g.H * g.W, m = g.N * g.C * g.P * g.Q;
        std::mt19937 rng(11);
        std::vector<float> x(static_cast<size_t>(n)), r(x.size()), y_ref(static_cast<size_t>(m)), y(y_ref.size()), dy(y_ref.size());
        for (auto& v : x) v = values[rng() % 8];
        for (auto& v : dy) v = rng() % 5 == 0 ? -0.f : float(int(rng() % 9) - 4) * 0.25f;
        std::vector<float> gb(x.size()), dx_ref(x.size(), 0.75f), dx(x.size(), 0.75f);
        const Shape xs{g.N, g.C, g.H, g.W}, ys{g.N, g.C, g.P, g.Q};
        Tensor xt = Tensor::contiguous(x.data(), xs), rt = Tensor::contiguous(r.data(), xs);
        Tensor yt = Tensor::contiguous(y_ref.data(), ys), dyt = Tensor::contiguous(dy.data(), ys);
        Tensor gbt = Tensor::contiguous(gb.data(), xs), dxt = Tensor::contiguous(dx_ref.data(), xs);
        std::vector<float> ws_ref(be->maxpool2d_workspace_bytes(g) / 4 + 16);
        be->relu_forward(xt, rt);
        if (c.kind == FusedKind::MaxPool) {
          be->maxpool2d_forward(g, rt, yt);
          be->maxpool2d_backward(g, dyt, rt, gbt, false, Workspace{ws_ref.data(), ws_ref.size() * 4});
        } else {
          be->avgpool2d_forward(g, rt, yt);
          be->avgpool2d_backward(g, dyt, gbt, false);
        }
        MaskView mask;
        mask.dense = rt;
        mask.numel = n;
        be->relu_backward(gbt, mask, dxt, accumulate);

        FusedStage relu_stage = fused_stage(FusedKind::Relu), pool = fused_stage(c.kind);
        relu_stage.H = relu_stage.P = pool.H = g.H;
        relu_stage.W = relu_stage.Q = pool.W = g.W;
        pool.P = g.P;
        pool.Q = g.Q;
        pool.pool = PoolWindow{g.R, g.S, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
        FusedStack st;
        st.stages = {relu_stage, pool};
        st.C = g.C;
        std::vector<uint64_t> pass(size_t(g.N * g.C * pass_words_per_plane(relu_stage)));
        std::vector<float> ws(be->fused_workspace_bytes(st, g.N) / 4 + 16);
        const Workspace w{ws.data(), ws.size() * 4};
        FusedTensors t;
        t.x = xt;
        t.y = Tensor::contiguous(y.data(), ys);
        t.pass = Tensor::contiguous(pass.data(), Shape{int64_t(pass.size() * 8)}, DType::U8);
        be->fused_forward(st, t, true, nullptr, w);
        CHECK(std::memcmp(y.data(), y_ref.data(), y.size() * 4) == 0);
        FusedGrads fg;
        fg.dy = dyt;
        fg.dx = Tensor::contiguous(dx.data(), xs);
        fg.dx_accumulate = accumulate;
        t.x = Tensor{};
        be->fused_backward(st, t, fg, w);
        CHECK(std::memcmp(dx.data(), dx_ref.data(), dx.size() * 4) == 0);
      }
    }
  }
}

#if defined(__AVX512F__)
TEST_CASE("fusion: BN -> ReLU -> 2x2 max-pool in registers equals the layers on tied windows", "[fusion]") {
  // x from a small set, so windows hold ties (at zero and above), NaN, -0, +inf and negatives; dy
  // holds -0. The register kernels (fused_bn_relu_pool.h), plane by plane and by blocks, against
  // BN's FMA, relu_forward's rule, the pool's reference loops and relu_backward's rule.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float values[] = {-1.f, -0.f, 0.f, 0.5f, 1.f, nan, 2.f, 1.f, inf, 0.5f};
  struct Coefficients {
    float scale, shift;
  };
  for (const int64_t Q : {1, 2, 4, 8, 16})
    for (const Coefficients k : {Coefficients{1.f, 0.f}, Coefficients{1.5f, -0.5f}}) {
      DYNAMIC_SECTION("Q " << Q << ", scale " << k.scale << ", shift " << k.shift) {
        const int64_t W = 2 * Q, H = 256 / W, HW = H * W;  // four 64-float blocks
        std::mt19937 rng{static_cast<unsigned>(Q)};
        alignas(64) float x[256], y[64], y_ref[64], dy[64], dz[256], dz_ref[256], scale[256], shift[256];
        for (float& v : x) v = values[rng() % 10];
        for (float& v : dy) v = rng() % 5 == 0 ? -0.f : float(int(rng() % 9) - 4) * 0.25f;
        for (int64_t i = 0; i < HW; ++i) scale[i] = k.scale, shift[i] = k.shift;
        float r[256];
        for (int64_t i = 0; i < HW; ++i) {
          const float z = std::fma(x[i], k.scale, k.shift);
          r[i] = z > 0.f ? z : 0.f;
        }
        FusedStage pool = fused_stage(FusedKind::MaxPool);
        pool.H = H, pool.W = W, pool.P = H / 2, pool.Q = Q;
        pool.pool = PoolWindow{2, 2, 2, 2, 0, 0};
        const pool_planes::Plane g = pool_planes::of(pool);
        pool_planes::max_forward_reference(g, r, y_ref);
        float dr[256] = {};
        pool_planes::max_backward_reference(g, r, dy, dr);
        for (int64_t i = 0; i < HW; ++i) dz_ref[i] = r[i] > 0.f ? dr[i] : 0.f;

        const fused_bn_relu_pool::Layout layout(Q);
        for (bool stream : {false, true}) {
          std::fill(y, y + 64, 7.f);
          fused_bn_relu_pool::forward(layout, x, fused_bn_relu_pool::ChannelBn(k.scale, k.shift), HW, y, stream);
          _mm_sfence();
          CHECK(std::memcmp(y, y_ref, sizeof y) == 0);
        }
        std::fill(y, y + 64, 7.f);
        fused_bn_relu_pool::forward(layout, x, fused_bn_relu_pool::ElementBn{scale, shift}, HW, y, false);
        CHECK(std::memcmp(y, y_ref, sizeof y) == 0);

        fused_bn_relu_pool::PlaneDz d(layout, x, dy, k.scale, k.shift);
        for (int64_t i = 0; i < HW; i += 16) _mm512_storeu_ps(dz + i, d(i, 0xFFFF));
        CHECK(std::memcmp(dz, dz_ref, sizeof dz) == 0);
        std::fill(dz, dz + 256, 7.f);
        fused_bn_relu_pool::backward_dz(layout, x, fused_bn_relu_pool::ElementBn{scale, shift}, dy, HW, dz);
        CHECK(std::memcmp(dz, dz_ref, sizeof dz) == 0);
      }
    }
}
#endif

TEST_CASE("fusion: the planner's stacks, cache limit and bad settings", "[fusion]") {
  Graph g;
  build_model(g, spec_of("resnet20", 8, 32, false));
  FusionSpec spec;
  spec.enabled = true;
  const fusion::Plan p = fusion::plan(g, spec);
  // stem + 9 blocks x 2 stacks; the two projection shortcuts' BNs feed an add's side: lone BNs.
  CHECK(p.stacks.size() == 19);
  for (const fusion::StackPlan& sp : p.stacks) {
    CHECK(sp.fused);
    CHECK(sp.tile_bytes <= p.cache_bytes);  // batch 8: a channel's slab of x and dz is 64 KiB at most
    CHECK(sp.stack.tile_channels == 1);
    CHECK(sp.bytes_fused < sp.bytes_unfused);
  }
  CHECK(p.cache_bytes > 0);

  SECTION("a cache too small for one plane's scratch: bands of rows, or with channel slabs unfused") {
    spec.cache_kb = 12;  // 32x32 planes: 4 KiB, 4 or 5 of them in the scratch; 16x16: 1 KiB
    const fusion::Plan small = fusion::plan(g, spec);
    int banded = 0;
    for (const fusion::StackPlan& sp : small.stacks) {
      REQUIRE(sp.fused);
      CHECK(sp.tile_bytes <= small.cache_bytes);
      const FusedStage& bn = sp.stack.stages[0];
      CHECK((sp.stack.band_rows > 0) == (bn.H == 32));  // the 16x16 and 8x8 stages fit whole
      if (sp.stack.band_rows == 0) continue;
      ++banded;
      // the most rows that fit: 5 or 6 buffers of 32-float rows
      const int64_t buffers = int64_t(sp.stack.stages.size()) + 3;
      CHECK(sp.stack.band_rows == 12 * 1024 / (buffers * 32 * 4));
      CHECK(sp.bytes_fused < sp.bytes_unfused);
    }
    CHECK(banded == 7);  // the stem's stack and layer1's six
    CHECK(fusion::describe(g, small).find("rows") != std::string::npos);
    spec.tile = 1;  // channel slabs take no bands: layer2's slabs (16 KiB) do not fit
    CHECK_THROWS_WITH(fusion::plan(g, spec), Catch::Contains("fusion.tile"));
    // Not even one band fits: unfused, with the reason.
    Graph wide;
    synthetic(wide, 1, 6, 200, 3, 1, 1, 2);  // 200-wide rows: bands of 2-row units, 8 KiB or more of scratch
    FusionSpec tiny;
    tiny.enabled = true;
    tiny.cache_kb = 4;
    const fusion::Plan none = fusion::plan(wide, tiny);
    for (const fusion::StackPlan& sp : none.stacks) {
      CHECK(!sp.fused);
      CHECK(sp.why_not.find("exceeds the cache, and so does one band of 2 rows") != std::string::npos);
    }
  }
  SECTION("an explicit tile that cannot fit is an error naming the key and the stack") {
    spec.cache_kb = 256;
    spec.tile = 4;  // 4 channels x 8 images x 4 KiB x 2 = 256 KiB, plus the scratch
    CHECK_THROWS_WITH(fusion::plan(g, spec), Catch::Contains("fusion.tile") && Catch::Contains("stack bn1"));
    spec.tile = 2;
    CHECK_NOTHROW(fusion::plan(g, spec));
  }
  SECTION("streaming stores where x and y (or x and dx) fill the last-level cache") {
    spec.llc_kb = 4 * 1024;  // batch 8: the 16-channel 32x32 stacks' x and y are 0.5 MiB each
    const fusion::Plan s = fusion::plan(g, spec);
    CHECK(s.llc_bytes == size_t(4) << 20);
    for (const fusion::StackPlan& sp : s.stacks) CHECK(!sp.stack.stream_y);
    spec.llc_kb = 1024;
    for (const fusion::StackPlan& sp : fusion::plan(g, spec).stacks) {
      CHECK(sp.stack.stream_y == (sp.stack.stages[0].H == 32));  // 32x32 x 16 channels x 8 images x 4 B x 2 = 1 MiB
      CHECK(!sp.stack.stream_dx);  // element-wise stacks write dx in dy's place
    }
    spec.llc_kb = -1;
    CHECK_THROWS_WITH(fusion::plan(g, spec), Catch::Contains("fusion.llc_kb"));
  }
  SECTION("fusion.disable names stacks; an unknown one is an error") {
    spec.disable = {"layer1.0.bn2"};
    const fusion::Plan d = fusion::plan(g, spec);
    for (const fusion::StackPlan& sp : d.stacks) CHECK(sp.fused == (sp.name != "layer1.0.bn2"));
    spec.disable = {"layer9.bn"};
    CHECK_THROWS_WITH(fusion::plan(g, spec), Catch::Contains("fusion.disable") && Catch::Contains("layer9.bn"));
  }
  SECTION("the rewrite keeps parameter order and names, and drops the intermediates") {
    Graph f;
    build_model(f, spec_of("resnet20", 8, 32, true));
    const auto pa = g.params(), pb = f.params();
    REQUIRE(pa.size() == pb.size());
    for (size_t i = 0; i < pa.size(); ++i) CHECK(g.value(pa[i]).name == f.value(pb[i]).name);
    CHECK(f.find_value("layer1.0.bn1") < 0);    // BN output: tile scratch only
    CHECK(f.find_value("layer1.0.relu1") >= 0);  // the stack's output keeps its name
    CHECK(f.find_value("layer1.0.bn1.running_mean") >= 0);
  }
}

TEST_CASE("fusion: fused stacks plan no more activation memory, less where saves vanish", "[fusion]") {
  // VGG: the max-pools' saved inputs (ReLU outputs) are gone, recomputed from BN's x or (without
  // BN) replaced by one bit per element. ResNet: the
  // BN outputs vanish, but they were transient; the arena's packing may move by a few buffers.
  for (const char* model : {"resnet20", "vgg11_bn", "vgg11"}) {
    DYNAMIC_SECTION(model) {
      Graph plain, fused;
      build_model(plain, spec_of(model, 16, 32, false));
      build_model(fused, spec_of(model, 16, 32, true));
      auto be = make_cpu_backend();
      Executor a(plain, *be), b(fused, *be);
      const MemoryReport &ma = a.memory(), &mb = b.memory();
      if (std::string(model) != "resnet20") {
        CHECK(mb.stash_dense_bytes < ma.stash_dense_bytes);
        CHECK(mb.activations_planned < ma.activations_planned);
      } else {
        CHECK(mb.stash_dense_bytes == ma.stash_dense_bytes);
        CHECK(double(mb.activations_planned) <= 1.02 * double(ma.activations_planned));
      }
      CHECK(mb.activations_unplanned < ma.activations_unplanned);
    }
  }
}

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
                        {"vgg11_bn", 2, 32, StashFormat::Auto}};
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
      for (const SavedValue& sv : ea.stash().saved()) CHECK_FALSE(sv.recomputed);
      // dense_fp32 keeps y in the arena (zero copy), the other formats in the stash region; the
      // decode buffer y now takes lives in backward only, below the arena's peak here.
      CHECK(eb.memory().activations_planned <= ea.memory().activations_planned);
      CHECK(eb.memory().activations_planned + eb.stash().region_bytes() <
            ea.memory().activations_planned + ea.stash().region_bytes());
    }
  }
}

TEST_CASE("fusion: the relu(affine) run a reader computes a stack output with is the forward's arithmetic",
          "[fusion][kernels]") {
  // Backend::fused_affine_relu: what the conv weight gradients apply to x as they read a stack
  // output nobody kept (memory.recompute_stack_outputs). Its bits must be the forward's: one FMA,
  // then relu_forward's rule (NaN and -0 give +0). Runs of every length up to 40 (masked tails) on
  // special values, and on a product whose separate rounding differs from the FMA's; then pieces
  // over planes of 1 to 20 elements of 3 channels, from any start.
  FusedStack s;
  s.C = 1;
  FusedStage bn = fused_stage(FusedKind::BatchNorm), relu = fused_stage(FusedKind::Relu);
  bn.H = relu.H = bn.P = relu.P = 8;
  bn.W = relu.W = bn.Q = relu.Q = 8;
  s.stages = {bn, relu};
  auto be = make_cpu_backend();
  const AffineReluRun run = be->fused_affine_relu(s);
  REQUIRE(run != nullptr);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float fma_x = 1.f + 0x1p-12f;  // fma_x * fma_x - 1: 2^-11 + 2^-24 with one rounding, 2^-11 with two
  std::vector<float> x;
  for (float v : {0.f, -0.f, 1.f, -1.f, inf, -inf, nan, 1e-40f, -1e-40f, 3.5f, -2.25f, fma_x})
    for (int k = 0; k < 4; ++k) x.push_back(v);
  for (int64_t len = 1; len <= 40; ++len)
    for (auto [scale, shift] : std::vector<std::pair<float, float>>{{1.f, 0.f}, {-1.f, 0.f}, {fma_x, -1.f}, {0.5f, -0.f}}) {
      std::vector<float> y(static_cast<size_t>(len) + 1, 7.f), ref(static_cast<size_t>(len));
      for (int64_t i = 0; i < len; ++i) {
        const float v = std::fma(x[size_t(i)], scale, shift);
        ref[size_t(i)] = v > 0.f ? v : 0.f;
      }
      run(x.data(), &scale, &shift, 1, len, 0, len, y.data());
      INFO("len " << len << " scale " << scale << " shift " << shift);
      CHECK(std::memcmp(y.data(), ref.data(), size_t(len) * 4) == 0);
      CHECK(y[size_t(len)] == 7.f);  // nothing past the run
      // In place, as a reader does on a decoded piece in its scratch.
      std::vector<float> z(x.begin(), x.begin() + len);
      run(z.data(), &scale, &shift, 1, len, 0, len, z.data());
      CHECK(std::memcmp(z.data(), ref.data(), size_t(len) * 4) == 0);
    }
  const float scales[3] = {fma_x, -0.5f, 2.f}, shifts[3] = {-1.f, 0.25f, -0.f};
  for (int64_t plane = 1; plane <= 20; ++plane)
    for (int64_t begin : {int64_t(0), int64_t(1), plane - 1, plane, 2 * plane + 1}) {
      const int64_t count = std::min<int64_t>(int64_t(x.size()), 4 * plane + 3);
      std::vector<float> y(static_cast<size_t>(count) + 1, 7.f), ref(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) {
        const int64_t c = (begin + i) / plane % 3;
        const float v = std::fma(x[size_t(i)], scales[c], shifts[c]);
        ref[size_t(i)] = v > 0.f ? v : 0.f;
      }
      run(x.data(), scales, shifts, 3, plane, begin, count, y.data());
      INFO("plane " << plane << " begin " << begin);
      CHECK(std::memcmp(y.data(), ref.data(), size_t(count) * 4) == 0);
      CHECK(y[size_t(count)] == 7.f);
    }
}
