// Depth-first fusion's backward sweeps done outside the stack (docs/fusion.md, "Backward"): the
// first sweep in the data gradient of the conv reading y (BN -> ReLU stacks, the residual blocks'
// add stacks with y's bitmap for the mask, MobileNet-V2's add stacks), and the second sweep handed
// on to the stack before. Each trains bit-identically fused and unfused; the aux values' flags
// say the sweep was taken where it should be.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <string>

#include "engine/check.h"
#include "fusion/fusion.h"
#include "layers/layers.h"
#include "tests/fusion_harness.h"
#include "tests/tiny_training.h"

using namespace et;
using namespace et::fusion_test;
namespace {
bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Whether node n reads a value whose name ends in `suffix`.
bool takes_input(const Graph& g, const Node& n, const char* suffix) {
  for (int id : n.inputs)
    if (ends_with(g.value(id).name, suffix)) return true;
  return false;
}

// After each node's backward: how many of its inputs are named `suffix` and how many of those
// start with the flag 1.f. ".dy_coef": the stack handed its second sweep on to the stack before
// (FusedGrads::dx_coef). ".dz_sums": the conv's data gradient took the first sweep of the stack
// before it (FusedGrads::dz_sums; the stack spends the flag later). ".y_bits": the stack wrote
// y's bitmap for its reader.

struct FlagAfterBackward : NodeObserver {
  Executor& ex;
  const char* suffix;
  int linked = 0, set = 0;
  FlagAfterBackward(Executor& e, const char* sfx) : ex(e), suffix(sfx) {}
  void after_forward(int) override {}
  void after_backward(int node) override {
    for (int id : ex.graph().node(node).inputs) {
      if (!ends_with(ex.graph().value(id).name, suffix)) continue;
      ++linked;
      set += ex.value(id).f32()[0] == 1.f;
    }
  }
};

// `steps` training steps of ex (parameters and inputs as train() sets them) with a FlagAfterBackward
// on each suffix watching: their counts, in the suffixes' order.
struct FlagCounts {
  int linked = 0, set = 0;
};
std::vector<FlagCounts> steps_watching(Executor& ex, int64_t batch, const std::vector<const char*>& suffixes,
                                       int steps = 1) {
  init_parameters(ex, 7);
  fill(ex, batch);
  std::vector<FlagAfterBackward> flags;
  for (const char* sfx : suffixes) flags.emplace_back(ex, sfx);
  struct All : NodeObserver {
    std::vector<FlagAfterBackward>& flags;
    explicit All(std::vector<FlagAfterBackward>& f) : flags(f) {}
    void after_forward(int) override {}
    void after_backward(int node) override {
      for (FlagAfterBackward& f : flags) f.after_backward(node);
    }
  } all(flags);
  ex.set_observer(&all);
  for (int step = 0; step < steps; ++step) {
    ex.forward(batch, true);
    ex.backward();
  }
  ex.set_observer(nullptr);
  std::vector<FlagCounts> counts;
  for (const FlagAfterBackward& f : flags) counts.push_back({f.linked, f.set});
  return counts;
}

// image -> conv -> <BN, ReLU> -> conv (with a bias) -> <BN, ReLU> -> conv -> flatten -> linear: two
// stacks whose only reader is a conv.
void conv_stacks(Graph& g, int64_t batch, int64_t h, int64_t w, int64_t channels) {
  const TestNet net = open_net(g, batch, h, w);
  Conv2dOptions o = conv3x3(channels);
  int y = relu(g, batchnorm2d(g, conv2d(g, net.x, "c0", o), "b0"), "r0");
  o.bias = true;
  y = relu(g, batchnorm2d(g, conv2d(g, y, "c1", o), "b1"), "r1");
  o.bias = false;
  close_net(g, net, conv2d(g, y, "c2", o));
}
}  // namespace

TEST_CASE("fusion: a conv's data gradient takes the first backward sweep of the stack before it, bit-identically",
          "[fusion]") {
  // The direct data gradient's row form (16x16) and flat form (odd 9x11, 8x8), batch 1-3; with 4
  // channels the GEMM's; 6x6 maps of 16 channels the implicit GEMM's (after each task's planes).
  // Only where the conv computes its input from
  // the stack's x as kept in f32 (not from a bf16 copy, not with recomputation).
  struct Case {
    int64_t batch, h, w, channels;
  };
  for (const Case c : {Case{2, 16, 16, 8}, Case{3, 9, 11, 12}, Case{1, 16, 16, 16}, Case{2, 8, 8, 8},
                       Case{2, 16, 16, 4}, Case{2, 6, 6, 16}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " channels " << c.channels) {
      Graph plain, fused;
      conv_stacks(plain, c.batch, c.h, c.w, c.channels);
      conv_stacks(fused, c.batch, c.h, c.w, c.channels);
      FusionSpec spec;
      spec.enabled = true;
      const fusion::Plan p = fusion::plan(fused, spec);
      REQUIRE(p.stacks.size() == 2);
      CHECK(p.stacks[0].sweep1_to_reader);
      CHECK(p.stacks[1].sweep1_to_reader);
      CHECK(p.stacks[0].bytes_fused < p.stacks[0].bytes_unfused);
      fusion::apply(fused, p);
      REQUIRE(fused_nodes(fused) == 2);
      auto be = make_cpu_backend();
      const bool can = be->fused_takes_dz_sums(p.stacks[0].stack);  // portable builds: no
      for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32, StashFormat::DenseBF16}) {
        for (int every : {0, 1}) {
          INFO("stash format " << stash_format_name(f) << ", checkpoint_every " << every);
          StashOptions o = stash(f, every);
          o.recompute_stack_outputs = true;  // the readers compute y (the configs' default where it combines)
          if (f == StashFormat::DenseF32 && every == 0) {
            // y kept instead: the conv reads the mask from y and the stack's x where the stash holds it
            // in place (OpContext::held_in_place), the same bits.
            StashOptions kept = o;
            kept.recompute_stack_outputs = false;
            Executor ex(fused, *be, kept);
            const FlagCounts check = steps_watching(ex, c.batch, {".dz_sums"})[0];
            CHECK(check.set == (can ? check.linked : 0));
            CHECK(differing(train(plain, c.batch, kept), train(fused, c.batch, kept)) == 0);
          }
          {
            Executor ex(fused, *be, o);
            const FlagCounts check = steps_watching(ex, c.batch, {".dz_sums"}, 2)[0];
            CHECK(check.linked == 4);
            // BN's input x stays f32 under bitmap_fp32 (it compresses the ReLU outputs); a bf16 copy
            // is not the forward's x, and recomputation does not compute y in its readers.
            CHECK(check.set == (can && f != StashFormat::DenseBF16 && every == 0 ? 4 : 0));
          }
          if (f == StashFormat::DenseBF16) continue;  // lossy: "lossy stash formats stay close" above
          const auto a = train(plain, c.batch, o), b = train(fused, c.batch, o);
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, b) == 0);
          if (c.batch < 2) continue;
          // A partial batch (an epoch's last): the sums at the planned batch's stride.
          Executor ep(plain, *be, o), ef(fused, *be, o);
          for (Executor* ex : {&ep, &ef}) {
            init_parameters(*ex, 7);
            fill(*ex, c.batch);
            ex->forward(c.batch - 1, true);
            ex->backward();
          }
          std::vector<std::vector<float>> pa{{ep.loss()}}, pb{{ef.loss()}};
          for (int id : plain.params()) pa.push_back(copy_of(ep.grad(id)));
          for (int id : fused.params()) pb.push_back(copy_of(ef.grad(id)));
          CHECK(differing(pa, pb) == 0);
        }
      }
    }
  }
}

namespace {
// A residual model's stacks ending in an add (BN -> add -> ReLU, BN -> add) are read by the next
// block's first conv and by the next add; the conv's backward comes last, so its data gradient
// completes their dy and takes sweep 1 there (dz from dy with y > 0, or dz = dy), reading the
// stack's x where the stash holds it in place; the stack writes the side gradient in sweep 2. The
// BN -> ReLU stacks whose y is kept (not computed by its readers) take the same way. Strided
// readers (the downsampling blocks) take it too: on AVX-512 the channels-last strided kernel, on
// AVX2 / NEON the implicit GEMM's phases. Batch 2 and 1; ResNet-20 on 32x32 (the direct and
// Winograd data gradients, by rows of tiles), MobileNet-V2 on 16x16 (the GEMM's).
void residual_sweep1_in_reader(const char* model, int64_t side) {
  for (int64_t batch : {2, 1}) {
    DYNAMIC_SECTION(model << " batch " << batch) {
      Graph plain, fused;
      build_model(plain, spec_of(model, batch, side, false));
      build_model(fused, spec_of(model, batch, side, true));
      // The add stacks the planner gives to a reader: every one whose first reader is a stride-1 conv.
      auto be = make_cpu_backend();
      int add_takers = 0;
      bool can = true;  // portable builds: no
      for (const fusion::StackPlan& sp : fusion::plan(plain, spec_of(model, batch, side, true).fusion).stacks)
        if (sp.sweep1_to_reader && sp.stack.add_stage() >= 0) {
          ++add_takers;
          can = can && be->fused_takes_dz_sums(sp.stack);
        }
      CHECK(add_takers > 0);
      for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32}) {
        for (int every : {0, 2}) {
          INFO("stash format " << stash_format_name(f) << ", checkpoint_every " << every);
          const StashOptions o = stash(f, every);
          {
            Executor ex(fused, *be, o);
            const std::vector<FlagCounts> flags = steps_watching(ex, batch, {".dz_sums", ".y_bits"});
            const FlagCounts &check = flags[0], &bits = flags[1];
            CHECK(check.linked > add_takers);
            // The dense stash keeps every stack's x and y in place: every reader takes its sweep.
            if (f == StashFormat::DenseF32 && every == 0) CHECK(check.set == (can ? check.linked : 0));
            // The stacks ending in an add and a ReLU write y's bitmap for their reader's mask where
            // the stash does not keep y as one (ResNet's; MobileNet-V2's end in the add).
            if (f == StashFormat::DenseF32 && std::string(model) != "mobilenetv2") {
              CHECK(bits.linked > 0);
              CHECK(bits.set == bits.linked);
            }
          }
          const auto a = train(plain, batch, o), b = train(fused, batch, o);
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, b) == 0);
        }
      }
    }
  }
}
}  // namespace

TEST_CASE("fusion: a residual block's output stack takes its first sweep from the next block's conv, bit-identically",
          "[fusion]") {
  residual_sweep1_in_reader("resnet20", 32);
}

// The same on ResNet-8 (one block a stage), small enough for the NEON run under qemu in CI (y's
// bitmap for the reader's mask). At 32x32: NEON's readers run the rows kernels, the direct ones and
// the implicit GEMM's phases there.
TEST_CASE("fusion: ResNet-8's block outputs take their first sweep from the next block's conv, bit-identically",
          "[fusion]") {
  residual_sweep1_in_reader("resnet8", 32);
}

// The same for MobileNet-V2's BN -> add stacks (no ReLU: dz = dy), small enough for the NEON run
// under qemu in CI.
TEST_CASE("fusion: MobileNet-V2's add stacks take their first sweep from the next block's conv, bit-identically",
          "[fusion]") {
  residual_sweep1_in_reader("mobilenetv2", 16);
}

TEST_CASE("fusion: under bitmap_int4 a conv taking a stack's first sweep still recomputes its output", "[fusion]") {
  // The conv's extra inputs (the stack's mean and sums, aux values) do not stop bitmap_int4 from
  // recomputing the stack's x from the conv's codes (Executor::plan_code_segments).
  Graph fused;
  build_model(fused, spec_of("resnet8", 4, 16, true));
  auto be = make_cpu_backend();
  Executor ex(fused, *be, stash(StashFormat::BitmapI4), test::luq());
  int takers = 0, rerun = 0;
  for (int n = 0; n < fused.num_nodes(); ++n) {
    if (!takes_input(fused, fused.node(n), ".dz_sums")) continue;
    ++takers;
    rerun += ex.reruns(n);
  }
  CHECK(takers > 0);
  CHECK(rerun == takers);
}

TEST_CASE("fusion: a stack after a stack hands its second backward sweep on, bit-identically", "[fusion]") {
  // chain(): conv -> <BN, ReLU, max-pool 3x3 s1> x 2 -> <BN, ReLU>: the second and third stacks read
  // x from the stack before alone. 32x32 and 9x7 planes (odd, rows cut inside a vector), batch 1-3.
  struct Case {
    int64_t batch, h, w, channels;
  };
  for (const Case c : {Case{2, 32, 32, 16}, Case{3, 9, 7, 5}, Case{1, 12, 40, 3}}) {
    DYNAMIC_SECTION("batch " << c.batch << " " << c.h << "x" << c.w << " channels " << c.channels) {
      Graph plain, fused;
      chain(plain, c.batch, c.h, c.w, c.channels);
      chain(fused, c.batch, c.h, c.w, c.channels);
      FusionSpec spec;
      spec.enabled = true;
      const fusion::Plan p = fusion::plan(fused, spec);
      REQUIRE(p.stacks.size() == 3);
      CHECK_FALSE(p.stacks[0].sweep_to_producer);  // x from a conv
      CHECK(p.stacks[1].sweep_to_producer);
      CHECK(p.stacks[2].sweep_to_producer);
      CHECK(p.stacks[2].producer_stack == 1);
      // The planner's count: the second sweep of each reader is gone.
      CHECK(p.stacks[1].bytes_fused < p.stacks[0].bytes_fused);
      fusion::apply(fused, p);
      REQUIRE(fused_nodes(fused) == 3);
      auto be = make_cpu_backend();
      const bool can = be->fused_reads_dy_affine(p.stacks[0].stack);  // AVX2, NEON: yes; AVX-512: not built
      for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32, StashFormat::DenseBF16}) {
        INFO("stash format " << stash_format_name(f));
        {
          Executor ex(fused, *be, stash(f));
          const FlagCounts check = steps_watching(ex, c.batch, {".dy_coef"}, 2)[0];
          CHECK(check.linked == 4);
          // Only where the reader's x is kept exactly (a 16-bit copy keeps its own sweep).
          CHECK(check.set == (can && f != StashFormat::DenseBF16 ? 4 : 0));
          // dx in dy's buffer: the element-wise stack always, the pool stacks where the backend's
          // backward reads each plane's dy before it writes its dx (the results above are the
          // layers' bits either way).
          int shared = 0, want = 0;
          for (int n = 0, k = 0; n < fused.num_nodes(); ++n) {
            const Node& node = fused.node(n);
            if (std::strcmp(node.op->type(), "fused_stack") != 0) continue;
            shared += ex.grad(node.inputs[0]).data == ex.grad(node.output).data;
            want += k == 2 || be->fused_pool_grad_in_place(p.stacks[size_t(k)].stack);
            ++k;
          }
          CHECK(shared == want);
          if (can && c.h == 32) CHECK(want == 3);
        }
        if (f == StashFormat::DenseBF16) continue;  // lossy: "lossy stash formats stay close" above
        for (int every : {0, 1}) {
          INFO("checkpoint_every " << every);
          const auto a = train(plain, c.batch, stash(f, every)), b = train(fused, c.batch, stash(f, every));
          REQUIRE(std::isfinite(a[0][0]));
          CHECK(differing(a, b) == 0);
        }
      }
    }
  }
}

// A residual block's output stack that makes its own first sweep (sweep 1 not in the reader) reads
// the ReLU's mask from the bitmap of y its forward wrote (`<stack>.y_bits`), 1 bit an element,
// not y's floats: bit-identical to the layers, and the bitmap is what the backward reads (zeroed
// after the forward, it zeroes the stack's dz, so its BN's beta gradient).
TEST_CASE("fusion: a residual block's output stack reads y's bitmap in its own first sweep", "[fusion]") {
  const int64_t batch = 2;
  ModelSpec plain_spec = spec_of("resnet8", batch, 32, false), fused_spec = spec_of("resnet8", batch, 32, true);
  fused_spec.fusion.sweep1_in_reader = false;
  Graph plain, fused;
  build_model(plain, plain_spec);
  build_model(fused, fused_spec);
  std::vector<int> stacks, bits_aux;  // the stacks with y's bitmap, and that aux value
  for (int n = 0; n < fused.num_nodes(); ++n)
    for (int id : fused.node(n).aux)
      if (ends_with(fused.value(id).name, ".y_bits")) stacks.push_back(n), bits_aux.push_back(id);
  REQUIRE(stacks.size() == 3);  // one block a stage
  for (int every : {0, 2}) {
    INFO("checkpoint_every " << every);
    const auto a = train(plain, batch, stash(StashFormat::DenseF32, every)),
               b = train(fused, batch, stash(StashFormat::DenseF32, every));
    REQUIRE(std::isfinite(a[0][0]));
    CHECK(differing(a, b) == 0);
  }
  auto be = make_cpu_backend();
  for (bool zero_bits : {false, true}) {
    INFO("bitmap zeroed after the forward: " << zero_bits);
    Executor ex(fused, *be, stash(StashFormat::DenseF32));
    struct ZeroBits : NodeObserver {
      Executor& ex;
      const std::vector<int>&nodes, &aux;
      bool on;
      std::vector<int> written;  // the nodes whose forward wrote the bitmap (flag 1)
      ZeroBits(Executor& e, const std::vector<int>& n, const std::vector<int>& a, bool z)
          : ex(e), nodes(n), aux(a), on(z) {}
      void after_forward(int node) override {
        for (size_t i = 0; i < nodes.size(); ++i) {
          if (nodes[i] != node) continue;
          Tensor bits = ex.value(aux[i]);
          if (bits.f32()[0] == 1.f) written.push_back(node);
          if (on) std::memset(bits.f32() + 2, 0, sizeof(float) * size_t(bits.numel() - 2));
        }
      }
      void after_backward(int) override {}
    } watch(ex, stacks, bits_aux, zero_bits);
    init_parameters(ex, 7);
    fill(ex, batch);
    ex.set_observer(&watch);
    ex.forward(batch, true);
    ex.backward();
    ex.set_observer(nullptr);
    // The last block's y has one reader, the global pool, and the stash keeps its mask as a
    // bitmap itself: that stack writes none and reads the stash's.
    CHECK(watch.written.size() == 2);
    for (int n : stacks) {
      const Tensor dbeta = ex.grad(fused.node(n).inputs[2]);
      bool any = false;
      for (int64_t c = 0; c < dbeta.numel(); ++c) any = any || dbeta.f32()[c] != 0.f;
      const bool own = std::count(watch.written.begin(), watch.written.end(), n) > 0;
      CHECK(any == !(zero_bits && own));
    }
  }
}
