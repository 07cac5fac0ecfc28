// The CUDA backend's fused stacks (BN -> ReLU [-> max-pool], BN -> add [-> ReLU], a projection
// shortcut's BN folded into its add's stack: fusion::plan
// with FusionSpec::whole_tensors, backends/cuda/cuda_batchnorm.cu) against its own layers. Each
// pass runs the layers' kernels' arithmetic in their order, BN's output and its gradient in
// registers instead of memory, so fused and unfused steps agree bit for bit: in the stashes that
// give the stacks the ReLU's mask differently (y kept dense, the bitmap stash, y recomputed), in
// evaluation, and with the step recorded as a CUDA graph.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_backend.h"
#include "engine/executor.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/step_replay.h"
#include "engine/train/optimizer.h"
#include "models/models.h"
#include "tests/cuda/device_bytes.h"

using namespace et;

namespace {

// A model at batch 8 on a shared backend (both runs then take the same measured conv choices),
// fused (the CUDA stacks) or not.
struct FusedRun {
  Graph g;
  std::unique_ptr<Executor> ex;
  Backend* be;
  int64_t batch = 8;
  FusedRun(Backend& backend, const StashOptions& so, const std::string& model, bool fused) : be(&backend) {
    ModelSpec spec;
    spec.name = model;
    spec.batch = batch;
    spec.fusion.enabled = fused;
    spec.fusion.whole_tensors = true;
    build_model(g, spec);
    ex = std::make_unique<Executor>(g, *be, so);
    init_parameters(*ex, 5);
  }
  void fill(int k) {
    const HostView x(*be, ex->value(g.image_input).with_batch(batch), HostView::Write),
        y(*be, ex->value(g.label_input).with_batch(batch), HostView::Write);
    for (int64_t i = 0; i < batch * 3 * 32 * 32; ++i) x.f32()[i] = float((i + k) * 7 % 23) / 11.f - 1.f;
    for (int64_t i = 0; i < batch; ++i) y.i32()[i] = int32_t((i + k) * 3 % 10);
  }
  int fused_nodes() const {
    int n = 0;
    for (int i = 0; i < g.num_nodes(); ++i) n += std::string(g.node(i).op->type()) == "fused_stack";
    return n;
  }
  // Stacks ending in a max-pool, whose output planes are smaller than their input's (VGG-16-BN's
  // five; the only ones that run PooledOut / PooledGrad).
  int pooled_stacks() const {
    int n = 0;
    for (int i = 0; i < g.num_nodes(); ++i) {
      const Node& node = g.node(i);
      n += std::string(node.op->type()) == "fused_stack" &&
           g.value(node.output).shape[2] < g.value(node.inputs[0]).shape[2];
    }
    return n;
  }
};

// Parameters, their gradients and the BN buffers, as bytes.
std::vector<char> state_bytes(FusedRun& r) {
  std::vector<Tensor> kept;
  for (int p : r.g.params()) kept.push_back(r.ex->value(p));
  for (int p : r.ex->params()) kept.push_back(r.ex->grad(p));
  for (int b : r.g.buffers()) kept.push_back(r.ex->value(b));
  return host_bytes(*r.be, kept);
}

}  // namespace

TEST_CASE("cuda: fused stacks train bit-identically to the layers", "[cuda][fusion]") {
  // ResNet-20 (BN -> ReLU, BN -> add -> ReLU), MobileNet-V2 (BN -> add), VGG-16-BN (BN -> ReLU ->
  // max-pool, its dropout a layer).
  for (const char* model : {"resnet20", "mobilenetv2", "vgg16_bn"}) {
    const std::unique_ptr<Backend> be = make_cuda_backend(0);  // its conv choices, measured once
    for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32, StashFormat::Auto}) {
      for (int every : {0, 1}) {
        INFO(model << ", stash " << stash_format_name(f) << ", checkpoint_every " << every);
        StashOptions so;
        so.format = f;
        so.checkpoint_every = every;
        FusedRun plain(*be, so, model, false), fused(*be, so, model, true);
        REQUIRE(fused.fused_nodes() > 0);
        if (std::string(model) == "vgg16_bn") REQUIRE(fused.pooled_stacks() == 5);
        for (int s = 0; s < 3; ++s) {
          for (FusedRun* r : {&plain, &fused}) {
            r->fill(s);
            r->ex->forward(r->batch, true);
            r->ex->backward();
          }
          CHECK(fused.ex->loss() == plain.ex->loss());
          CHECK((state_bytes(fused) == state_bytes(plain)));  // (( )): no byte-by-byte expansion
          for (FusedRun* r : {&plain, &fused}) REQUIRE(sgd_update(*r->ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
        }
        // Evaluation (the running statistics): the same logits' loss.
        plain.ex->forward(5, false);
        fused.ex->forward(5, false);
        CHECK(fused.ex->loss() == plain.ex->loss());
      }
    }
  }
}

TEST_CASE("cuda: fused stacks with a folded side BN train bit-identically to the layers", "[cuda][fusion]") {
  // ResNet-8 with projection shortcuts at 32x32: the shortcut BNs at 16x16 and 8x8 fold into their
  // blocks' add stacks (FusedStack::side_bn): both statistics forward, both BNs' sums from one dz,
  // dx and x2's gradient in one pass. Dense and bitmap masks, x read as fp16, recomputation (not
  // with fp16: there the fused and unfused graphs round different values, on the CPU as well:
  // ResNet-8's fused and unfused steps differ with dense_fp16 and checkpoint_every 1 on both).
  // MobileNet-V2's three (BN -> add, no ReLU), in the dense stash.
  const std::unique_ptr<Backend> be = make_cuda_backend(0);
  for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32, StashFormat::DenseF16}) {
    for (int every : {0, 1, 2}) {
      if (f == StashFormat::DenseF16 && every == 1) continue;
      if (every == 2 && f != StashFormat::DenseF32) continue;
      const char* model = every == 2 ? "mobilenetv2" : "resnet8";
      INFO(model << ", stash " << stash_format_name(f) << ", checkpoint_every " << (every == 2 ? 0 : every));
      StashOptions so;
      so.format = f;
      so.checkpoint_every = every == 2 ? 0 : every;
      FusedRun plain(*be, so, model, false), fused(*be, so, model, true);
      auto shortcut_bns = [](const Graph& g) {  // BN layers of projection shortcuts
        int n = 0;
        for (int i = 0; i < g.num_nodes(); ++i)
          n += std::string(g.node(i).op->type()) == "batchnorm2d" && g.node(i).name.find("shortcut") != std::string::npos;
        return n;
      };
      REQUIRE(shortcut_bns(plain.g) - shortcut_bns(fused.g) == (every == 2 ? 3 : 2));
      for (int s = 0; s < 3; ++s) {
        for (FusedRun* r : {&plain, &fused}) {
          r->fill(s);
          r->ex->forward(r->batch, true);
          r->ex->backward();
        }
        CHECK(fused.ex->loss() == plain.ex->loss());
        CHECK((state_bytes(fused) == state_bytes(plain)));
        for (FusedRun* r : {&plain, &fused}) REQUIRE(sgd_update(*r->ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
      }
      plain.ex->forward(5, false);
      fused.ex->forward(5, false);
      CHECK(fused.ex->loss() == plain.ex->loss());
    }
  }
}

TEST_CASE("cuda: a recorded step with fused stacks equals the fused step run op by op", "[cuda][fusion][replay]") {
  const std::unique_ptr<Backend> be = make_cuda_backend(0);
  StashOptions so;  // dense: the ReLU's mask is y itself, nothing counted on the host
  FusedRun direct(*be, so, "resnet20", true), rec(*be, so, "resnet20", true);
  REQUIRE(StepReplay::unsupported(*rec.ex) == "");
  StepReplay replay(*rec.ex, true, 1);
  for (int s = 0; s < 4; ++s) {
    direct.fill(s);
    rec.fill(s);
    direct.ex->forward(direct.batch, true);
    direct.ex->backward();
    if (!replay.try_step(rec.batch)) {
      rec.ex->forward(rec.batch, true);
      rec.ex->backward();
    }
    CHECK(replay.why_not() == "");
    CHECK(rec.ex->loss() == direct.ex->loss());
    REQUIRE(sgd_update(*direct.ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
    REQUIRE(sgd_update(*rec.ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
  }
  CHECK(replay.replaying());
  CHECK((state_bytes(rec) == state_bytes(direct)));
}

TEST_CASE("cuda: fused stacks equal the layers with pruned bitmaps and a batch below the planned one",
          "[cuda][fusion]") {
  // Paths the shipped-model test does not reach: a prune threshold (the stack's bitmap keeps
  // |y| >= t; the mask the ReLU's backward reads stays exact; not with pooled stacks, whose window
  // maximum comes from x where the layers' comes from the pruned values: tests/
  // test_fusion_whole_tensors.cpp) and a training step at 5 of the 8 planned images (every index
  // from the tensors' own batch).
  const std::unique_ptr<Backend> be = make_cuda_backend(0);
  for (const char* model : {"resnet20", "vgg16_bn"}) {
    INFO(model);
    StashOptions so;
    so.format = StashFormat::BitmapF32;
    so.prune_threshold = std::string(model) == "resnet20" ? 0.05f : 0.f;
    FusedRun plain(*be, so, model, false), fused(*be, so, model, true);
    REQUIRE(fused.fused_nodes() > 0);
    for (int s = 0; s < 3; ++s) {
      for (FusedRun* r : {&plain, &fused}) {
        r->batch = s == 2 ? 5 : 8;
        r->fill(s);
        r->ex->forward(r->batch, true);
        r->ex->backward();
      }
      INFO("step " << s << ", batch " << fused.batch);
      CHECK(fused.ex->loss() == plain.ex->loss());
      CHECK((state_bytes(fused) == state_bytes(plain)));
      for (FusedRun* r : {&plain, &fused}) REQUIRE(sgd_update(*r->ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, s == 0));
    }
  }
}
