// memory.checkpoint_every: recomputing segments in backward changes no number (losses, every
// parameter gradient and the BN running statistics are bit-identical to keeping everything), in
// every exact stash format, while the stash peak drops. Releasing dead pages changes no number either.
#include <catch2/catch.hpp>

#include <cstring>

#include "tests/tiny_training.h"

using namespace et;

namespace {

struct Run {
  std::vector<float> losses;
  std::vector<std::vector<float>> grads, buffers;  // last step, per parameter / BN statistic
  size_t stash_peak = 0;
  int segments = 0, rerun_nodes = 0, convs = 0;
};

Run train(const std::string& model, StashFormat format, int checkpoint_every, int steps = 3, bool release = false) {
  StashOptions opt;
  opt.format = format;
  opt.checkpoint_every = checkpoint_every;
  opt.release_pages = release;
  test::TinyTraining t(model, 6, opt, 5, model.rfind("vgg", 0) == 0 ? 32 : 16, 7);  // VGG pools 5 times
  Executor& ex = *t.ex;
  const Graph& g = t.g;
  Run r;
  for (int s = 0; s < steps; ++s) {
    ex.set_step_seed(uint64_t(s));
    ex.forward(s == steps - 1 ? 5 : 6, true);  // the last step has a partial batch
    r.losses.push_back(ex.loss());
    ex.backward();
    t.sgd(0.05f, s == 0);
  }
  for (int p : g.params()) r.grads.emplace_back(ex.grad(p).f32(), ex.grad(p).f32() + ex.grad(p).numel());
  for (int b : g.buffers()) r.buffers.emplace_back(ex.value(b).f32(), ex.value(b).f32() + ex.value(b).numel());
  r.stash_peak = ex.stash().peak_bytes();
  r.segments = ex.memory().recompute_segments;
  r.rerun_nodes = ex.memory().recompute_nodes;
  for (int n = 0; n < g.num_nodes(); ++n) r.convs += std::string(g.node(n).op->type()) == "conv2d";
  return r;
}

}  // namespace

TEST_CASE("recomputed segments give bit-identical training", "[stash][recompute]") {
  for (const char* model : {"resnet8", "vgg11_bn", "mobilenetv2"}) {
    const Run base = train(model, StashFormat::DenseF32, 0);
    for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32}) {
      for (int m : {1, 2, 3}) {
        INFO(model << " " << stash_format_name(f) << " checkpoint_every " << m);
        const Run r = train(model, f, m);
        CHECK(r.segments > 0);
        CHECK(std::memcmp(r.losses.data(), base.losses.data(), r.losses.size() * 4) == 0);
        CHECK(r.grads == base.grads);
        CHECK(r.buffers == base.buffers);  // running statistics updated once per step, not twice
        CHECK(r.stash_peak < base.stash_peak);
      }
    }
  }
}

TEST_CASE("recomputation drops the dense BN inputs from the stash", "[stash][recompute]") {
  const Run bitmap = train("resnet8", StashFormat::BitmapF32, 0, 1);
  const Run rec = train("resnet8", StashFormat::BitmapF32, 1, 1);
  // What remains are the sparse conv inputs (ReLU outputs) as bitmaps.
  CHECK(double(rec.stash_peak) < 0.75 * double(bitmap.stash_peak));
  const Run f16 = train("resnet8", StashFormat::BitmapF16, 1, 1);
  CHECK(f16.losses[0] == rec.losses[0]);
  CHECK(f16.stash_peak < rec.stash_peak);
}

TEST_CASE("a recompute reruns only what backward reads again", "[stash][recompute]") {
  // ResNet with m = 1: each conv's output (a BN input) is recomputed; BN, ReLU and add outputs
  // are kept from the forward (ReLU outputs are conv inputs, saved anyway), so only convs rerun,
  // except the last block's shortcut BN, add and ReLU: only the pooling in their segment reads it.
  const Run r = train("resnet8", StashFormat::BitmapF32, 1, 1);
  CHECK(r.convs > 0);
  CHECK(r.rerun_nodes == r.convs + 3);
  // VGG: a max-pool reads its ReLU's output, which reads BN's output: the whole chain reruns.
  const Run v = train("vgg11_bn", StashFormat::BitmapF32, 1, 1);
  CHECK(v.rerun_nodes > v.convs);
}

TEST_CASE("checkpoint_every beyond the model's layers is an error naming the key", "[stash][recompute]") {
  CHECK_THROWS_WITH(train("resnet8", StashFormat::DenseF32, 500, 1), Catch::Contains("memory.checkpoint_every"));
}

TEST_CASE("release_pages returns dead pages without changing a number", "[stash][recompute]") {
  for (const char* model : {"resnet8", "vgg11_bn"}) {
    INFO(model);
    const Run base = train(model, StashFormat::DenseF32, 0);
    for (int m : {0, 1})
      for (StashFormat f : {StashFormat::DenseF32, StashFormat::BitmapF32}) {
        INFO(stash_format_name(f) << " checkpoint_every " << m);
        const Run r = train(model, f, m, 3, true);
        CHECK(std::memcmp(r.losses.data(), base.losses.data(), r.losses.size() * 4) == 0);
        CHECK(r.grads == base.grads);
        CHECK(r.buffers == base.buffers);
      }
  }
}
