// Stash formats through whole training steps: the exact formats (bitmap_fp32, auto) give losses
// and gradients bit-identical to dense_fp32; lossy ones stay close and keep the forward exact;
// pruning drops small saved values; per-layer overrides are checked against the graph.
#include <catch2/catch.hpp>

#include <cstring>

#include "memory/bitmap.h"
#include "memory/half.h"
#include "tests/tiny_training.h"

using namespace et;

namespace {

struct Run {
  std::vector<float> losses;
  std::vector<std::vector<float>> grads;  // last step, per parameter
  std::vector<int> grad_rank;             // per parameter: 1 BN / bias, 2 linear, 4 conv
  size_t stash_peak = 0, stash_dense = 0;
  size_t decode_bytes = 0;  // planned f32 decode buffers (values some reader cannot read as stored)
  std::vector<std::pair<std::string, std::string>> stored;  // (value, how its last push stored it)
};

Run train(const std::string& model, const StashOptions& opt, int steps = 3, const FusionSpec& fusion = {}) {
  test::TinyTraining t(model, 6, opt, 11, model.rfind("vgg", 0) == 0 ? 32 : 16, 3, {}, fusion);  // VGG pools 5 times
  Executor& ex = *t.ex;
  Run r;
  for (int s = 0; s < steps; ++s) {
    ex.set_step_seed(uint64_t(s));
    ex.forward(6, true);
    r.losses.push_back(ex.loss());
    ex.backward();
    t.sgd(0.05f, s == 0);
  }
  for (int p : t.g.params()) {
    r.grads.emplace_back(ex.grad(p).f32(), ex.grad(p).f32() + ex.grad(p).numel());
    r.grad_rank.push_back(t.g.value(p).shape.ndim);
  }
  for (int id = 0; id < t.g.num_values(); ++id)
    if (*ex.stash().record(id).stored_as) r.stored.emplace_back(t.g.value(id).name, ex.stash().record(id).stored_as);
  r.stash_peak = ex.stash().peak_bytes();
  r.stash_dense = ex.memory().stash_dense_bytes;
  r.decode_bytes = ex.memory().unpack;
  return r;
}

StashOptions with(StashFormat f, float prune = 0.f) {
  StashOptions o;
  o.format = f;
  o.prune_threshold = prune;
  return o;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0, d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, double(std::fabs(a[i])));
    d = std::max(d, double(std::fabs(a[i] - b[i])));
  }
  return m > 0 ? d / m : d;
}

}  // namespace

TEST_CASE("exact stash formats are bit-identical to dense fp32", "[stash]") {
  for (const char* model : {"resnet20", "vgg16_bn", "vgg16", "mobilenetv2"}) {
    INFO(model);
    const Run dense = train(model, with(StashFormat::DenseF32));
    for (StashFormat f : {StashFormat::BitmapF32, StashFormat::Auto}) {
      INFO(stash_format_name(f));
      const Run r = train(model, with(f));
      CHECK(std::memcmp(r.losses.data(), dense.losses.data(), r.losses.size() * 4) == 0);
      bool same = r.grads.size() == dense.grads.size();
      for (size_t i = 0; same && i < r.grads.size(); ++i) same = r.grads[i] == dense.grads[i];
      CHECK(same);
      CHECK(r.stash_peak < dense.stash_peak);  // ReLU outputs are ~half zeros
      // Convs (depthwise too) and max-pools read the bitmaps as stored: the only decode buffer is
      // the classifier's input (N x features).
      CHECK(r.decode_bytes * 100 < r.stash_dense);
    }
  }
}

TEST_CASE("bitmap formats apply where zeros come by construction, overrides force them anywhere", "[stash]") {
  const Run dense = train("resnet8", with(StashFormat::DenseF32), 2);
  const Run global = train("resnet8", with(StashFormat::BitmapF32), 2);
  const Run global16 = train("resnet8", with(StashFormat::BitmapF16), 1);
  int convs = 0, relus = 0;
  for (const auto& [name, how] : global.stored) {
    INFO(name << ": " << how);
    const bool is_conv = name.find("conv") != std::string::npos || name.find("shortcut") != std::string::npos;
    const bool is_relu = name.find("relu") != std::string::npos;
    if (is_conv) CHECK(how == std::string("fp32 (zero copy)"));  // BN inputs: no zeros to drop
    if (is_relu) CHECK((how == std::string("bitmap+fp32") || how == std::string("bits (mask)")));
    convs += is_conv;
    relus += is_relu;
  }
  CHECK(convs >= 3);
  CHECK(relus >= 3);
  for (const auto& [name, how] : global16.stored)
    if (name.find("conv") != std::string::npos) CHECK(how == std::string("fp16"));
  // Every conv output forced to a bitmap: still exact, and stored as one.
  StashOptions forced = with(StashFormat::BitmapF32);
  for (const auto& [name, how] : global.stored)
    if (name.find("conv") != std::string::npos) forced.layers.emplace_back(name, StashFormat::BitmapF32);
  const Run r = train("resnet8", forced, 2);
  for (const auto& [name, how] : r.stored)
    if (name.find("conv") != std::string::npos) CHECK(how == std::string("bitmap+fp32"));
  CHECK(std::memcmp(r.losses.data(), dense.losses.data(), r.losses.size() * 4) == 0);
  CHECK(r.grads == dense.grads);
  CHECK(global.grads == dense.grads);
}

TEST_CASE("lossy stash formats keep the forward exact and the gradients close", "[stash]") {
  const Run dense = train("resnet8", with(StashFormat::DenseF32), 1);
  for (StashFormat f : {StashFormat::DenseF16, StashFormat::DenseBF16, StashFormat::BitmapF16}) {
    INFO(stash_format_name(f));
    const Run r = train("resnet8", with(f), 1);
    CHECK(r.losses[0] == dense.losses[0]);  // the stash is only read by backward
    double worst = 0, any = 0;
    for (size_t i = 0; i < r.grads.size(); ++i) {
      worst = std::max(worst, max_rel_diff(dense.grads[i], r.grads[i]));
      any += r.grads[i] != dense.grads[i];
    }
    CHECK(any > 0);                                          // it really is lossy
    CHECK(worst < (f == StashFormat::DenseBF16 ? 0.1 : 0.02));  // relative to each tensor's max
    CHECK(r.stash_peak < dense.stash_peak * 0.6);
    // BN and convs read the 16-bit / bitmap storage; a ReLU mask reads a bitmap, but decodes a
    // dense 16-bit copy; the classifier decodes its (small) input.
    if (f == StashFormat::BitmapF16) CHECK(r.decode_bytes * 100 < r.stash_dense);  // the classifier's input
    else CHECK(r.decode_bytes * 100 > r.stash_dense);
  }
}

TEST_CASE("activation pruning shrinks the stash and perturbs only the gradients", "[stash]") {
  const Run exact = train("resnet8", with(StashFormat::BitmapF32), 1);
  const Run pruned = train("resnet8", with(StashFormat::BitmapF32, 0.5f), 1);
  CHECK(pruned.losses[0] == exact.losses[0]);
  CHECK(pruned.stash_peak < exact.stash_peak);
  double worst = 0;
  for (size_t i = 0; i < exact.grads.size(); ++i) worst = std::max(worst, max_rel_diff(exact.grads[i], pruned.grads[i]));
  CHECK(worst > 0);
}

TEST_CASE("activation pruning changes stored values only: ReLU masks stay exact in every format", "[stash]") {
  // The data gradient reaches every layer through ReLU masks, BN backward (its dense input) and
  // conv data gradients (the weights): none reads a pruned value, so the BN and classifier
  // gradients stay bit-identical and only conv weight gradients (their stored inputs) move. With
  // pruned masks, units with 0 < y < t would lose their whole gradient and BN's would change.
  // (Not with recomputation: it reruns a conv on its pruned stored input, so BN's input changes
  // too, as docs/config.md says; the stash-level case below covers the masks there.)
  const float t = 0.5f;
  struct Case {
    StashFormat format;
    int checkpoint_every;
    bool fused;
  };
  for (const Case c : {Case{StashFormat::BitmapF32, 0, false}, Case{StashFormat::BitmapF16, 0, false},
                       Case{StashFormat::Auto, 0, false},
                       Case{StashFormat::BitmapF32, 0, true}, Case{StashFormat::DenseF16, 0, false},
                       Case{StashFormat::DenseBF16, 0, false}, Case{StashFormat::DenseF32, 0, false}}) {
    INFO(stash_format_name(c.format) << ", checkpoint_every " << c.checkpoint_every << ", fused " << c.fused);
    FusionSpec fusion;
    fusion.enabled = c.fused;
    StashOptions exact = with(c.format), pruned = with(c.format, t);
    exact.checkpoint_every = pruned.checkpoint_every = c.checkpoint_every;
    const Run a = train("resnet8", exact, 1, fusion), b = train("resnet8", pruned, 1, fusion);
    CHECK(a.losses == b.losses);  // the forward never reads the stash
    int conv_moved = 0;
    for (size_t i = 0; i < a.grads.size(); ++i) {
      if (a.grad_rank[i] < 4) CHECK(a.grads[i] == b.grads[i]);  // BN, classifier: exact
      else conv_moved += a.grads[i] != b.grads[i];
    }
    const bool bitmap = c.format != StashFormat::DenseF16 && c.format != StashFormat::DenseBF16 &&
                        c.format != StashFormat::DenseF32;
    if (bitmap) {  // the pruned values are what the conv weight gradients read
      CHECK(conv_moved > 0);
      CHECK(b.stash_peak < a.stash_peak);
    } else {  // dense formats store no bitmap of values: pruning does not apply
      CHECK(conv_moved == 0);
      CHECK(b.stash_peak == a.stash_peak);
    }
  }
}

TEST_CASE("a pruned stash hands out exact masks and pruned values", "[stash]") {
  // y as a ReLU gives it: zeros, values below and above the threshold.
  const int64_t n = 1000;
  std::vector<float> y(static_cast<size_t>(n)), decoded(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[size_t(i)] = i % 3 == 0 ? 0.f : float((i * 37) % 100) / 100.f;
  const float t = 0.3f;
  for (StashFormat f : {StashFormat::BitmapF32, StashFormat::BitmapF16, StashFormat::Auto, StashFormat::DenseF16,
                        StashFormat::DenseBF16}) {
    for (const bool full : {true, false}) {
      INFO(stash_format_name(f) << (full ? ", read in full and as a mask" : ", read as a mask only"));
      Stash stash;
      SavedValue sv;
      sv.value = 0;
      sv.numel = n;
      sv.full = full;
      sv.mask_read = true;
      sv.format = f;
      sv.unpack = Tensor::contiguous(decoded.data(), Shape{n});
      stash.configure({sv}, 1, t);
      // Pushed as the executor does for an op's own output: the ReLU writes the bitmap first.
      MaskOut out = stash.mask_target(0, n);
      if (out.bits) out.kept = bitmap::make_bits(y.data(), n, out.prune_threshold, out.bits);
      stash.push(0, Tensor::contiguous(y.data(), Shape{n}), out);
      const MaskView m = stash.get_mask(0);
      int wrong = 0;
      for (int64_t i = 0; i < n; ++i) {
        const bool on = m.bits ? (m.bits[i / 64] >> (i % 64)) & 1 : m.dense.f32()[i] > 0.f;
        wrong += on != (y[size_t(i)] > 0.f);
      }
      CHECK(wrong == 0);  // the exact > 0 mask, whatever the threshold
      if (full) {
        const Tensor v = stash.get(0);
        int pruned = 0;
        for (int64_t i = 0; i < n; ++i) pruned += y[size_t(i)] > 0.f && v.f32()[i] == 0.f;
        const bool bitmap = f == StashFormat::BitmapF32 || f == StashFormat::BitmapF16 || f == StashFormat::Auto;
        if (bitmap) CHECK(pruned > 0);  // values below t were dropped
        else CHECK(pruned == 0);        // dense formats store no bitmap of values: nothing pruned
      }
      stash.pop(0);
    }
  }
}

// A fused stack packs its output's values in its own pass (backends/cpu/fused.cpp): where the stash
// keeps bitmap + values, mask_target says where they go, and a push then reads nothing of the output.
TEST_CASE("a producer may write the values behind the bitmap itself", "[stash]") {
  const int64_t n = 1000;
  std::vector<float> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[size_t(i)] = i % 3 == 0 ? 0.f : float((i * 37) % 100) / 100.f;
  for (StashFormat f : {StashFormat::BitmapF32, StashFormat::BitmapF16, StashFormat::Auto, StashFormat::DenseF16}) {
    for (const float t : {0.f, 0.3f}) {
      INFO(stash_format_name(f) << ", prune threshold " << t);
      // The reference: the stash packs from the output.
      std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
      std::vector<std::vector<uint8_t>> stored;
      for (const bool producer_packs : {false, true}) {
        Stash stash;
        SavedValue sv;
        sv.value = 0, sv.numel = n, sv.full = true, sv.format = f;
        sv.unpack = Tensor::contiguous((producer_packs ? got : want).data(), Shape{n});
        stash.configure({sv}, 1, t);
        MaskOut out = stash.mask_target(0, n);
        CHECK((out.values != nullptr) == (f != StashFormat::DenseF16));
        std::vector<float> x = y;
        if (out.bits) out.kept = bitmap::make_bits(x.data(), n, out.prune_threshold, out.bits);
        if (producer_packs && out.values) {
          bitmap::pack_values(x.data(), out.bits, n, out.values, out.values_f16 ? bitmap::ValueType::F16 : bitmap::ValueType::F32);
          out.values_written = true;
          std::fill(x.begin(), x.end(), -1.f);  // the stash must not read the output now
        }
        stash.push(0, Tensor::contiguous(x.data(), Shape{n}), out);
        CHECK(stash.record(0).packed_by_producer == out.values_written);
        stash.get(0);  // decodes into sv.unpack
        if (out.bits)
          stored.emplace_back(static_cast<const uint8_t*>(static_cast<void*>(out.bits)),
                              static_cast<const uint8_t*>(static_cast<void*>(out.bits)) + stash.live_bytes());
        stash.pop(0);
      }
      if (stored.size() == 2) CHECK(stored[0] == stored[1]);  // the same bytes in the region
      CHECK(std::memcmp(want.data(), got.data(), sizeof(float) * size_t(n)) == 0);
    }
  }
}

TEST_CASE("per-layer stash formats", "[stash]") {
  StashOptions o;
  o.layers = {{"layer1.0.relu1", StashFormat::BitmapF16}};
  const Run one = train("resnet8", o, 1);
  const Run dense = train("resnet8", with(StashFormat::DenseF32), 1);
  CHECK(one.stash_peak < dense.stash_peak);
  o.layers = {{"layer9.relu", StashFormat::BitmapF16}};
  CHECK_THROWS_WITH(train("resnet8", o, 1), Catch::Contains("memory.layers.layer9.relu"));
  o.layers = {{"layer1.0.conv1.weight", StashFormat::BitmapF16}};
  CHECK_THROWS_WITH(train("resnet8", o, 1), Catch::Contains("memory.layers.layer1.0.conv1.weight"));
}

TEST_CASE("half and bfloat16 conversions", "[stash]") {
  const float in[] = {0.f, -0.f, 1.f, -2.5f, 65504.f, 1e-8f, 3.14159265f, 1e30f};
  uint16_t h[8], b[8];
  float back[8];
  f32_to_f16(in, 8, h);
  f16_to_f32(h, 8, back);
  CHECK(back[2] == 1.f);
  CHECK(back[3] == -2.5f);
  CHECK(back[4] == 65504.f);
  CHECK(back[6] == Approx(3.14159265f).epsilon(1e-3));
  CHECK(std::isinf(back[7]));
  f32_to_bf16(in, 8, b);
  bf16_to_f32(b, 8, back);
  CHECK(back[2] == 1.f);
  CHECK(back[3] == -2.5f);
  CHECK(back[6] == Approx(3.14159265f).epsilon(1e-2));
  CHECK(back[7] == Approx(1e30f).epsilon(1e-2));
  CHECK(std::signbit(back[1]));
}

// bfloat16 of f32 bits x by the definition: the nearest of the two bf16 neighbours, ties to the
// even one (an overflow carries into inf); NaN keeps its upper bits, quieted.
static uint16_t bf16_by_definition(uint32_t x) {
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);
  const uint32_t lo = x & 0xFFFF0000u, r = x & 0xFFFFu;
  return uint16_t((r > 0x8000u || (r == 0x8000u && (lo & 0x10000u)) ? lo + 0x10000u : lo) >> 16);
}

// The vector bodies (16 lanes on AVX-512, 8 on AVX2, 4 and 8 on NEON) and their scalar tails, at
// every length up to 70 and every start offset up to 3 (unaligned), against the per-element rule.
TEST_CASE("array half conversions: bfloat16 at every length and offset, against the scalar rule", "[stash]") {
  // Specials first (every one lands in a vector body at some offset), then random patterns.
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFFC00000u,
                               0x7FFFFFFFu, 0x7F7FFFFFu, 0x7F7F8000u, 0x3F808000u, 0x3F818000u, 0x3F807FFFu,
                               0x00000001u, 0x00008000u, 0x00018000u, 0x807FFFFFu, 0x3F800000u, 0xC0200000u};
  std::vector<float> f(80);
  uint32_t s = 7;
  for (size_t i = 0; i < f.size(); ++i) {
    s = s * 1664525u + 1013904223u;
    const uint32_t u = i < std::size(specials) ? specials[i] : s;
    std::memcpy(&f[i], &u, 4);
  }
  bool same = true;
  for (int64_t off = 0; off <= 3; ++off)
    for (int64_t n = 0; n <= 70; ++n) {
      std::vector<uint16_t> b(size_t(n + 1), 0xABCD);
      std::vector<float> back(size_t(n + 1), -1.f);
      f32_to_bf16(f.data() + off, n, b.data());
      bf16_to_f32(b.data(), n, back.data());
      for (int64_t i = 0; i < n; ++i) {
        uint32_t x, u;
        std::memcpy(&x, &f[size_t(off + i)], 4);
        std::memcpy(&u, &back[size_t(i)], 4);
        const uint16_t want = bf16_by_definition(x);
        same &= b[size_t(i)] == want && u == uint32_t(want) << 16;
      }
      same &= b[size_t(n)] == 0xABCD && back[size_t(n)] == -1.f;  // nothing past n written
    }
  CHECK(same);
}

TEST_CASE("array half conversions match the scalar reference on every bit pattern, threaded", "[stash]") {
  // Every fp16 pattern (NaN, denormals, infinities) and an odd length, above the threading cutoff.
  const int64_t n = bitmap::kParallelMinElements + 12345;
  std::vector<uint16_t> h(static_cast<size_t>(n)), h2(static_cast<size_t>(n));
  std::vector<float> f(static_cast<size_t>(n)), f2(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) h[size_t(i)] = uint16_t(i * 40503u);
  f16_to_f32(h.data(), n, f.data());
  bool same = true;
  for (int64_t i = 0; i < n; ++i) {
    const float r = bitmap::f16_to_f32(h[size_t(i)]);
    same &= std::memcmp(&r, &f[size_t(i)], 4) == 0;
  }
  CHECK(same);
  // f32 -> f16: random bit patterns (all exponents), against the scalar rounding.
  uint32_t s = 1;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    std::memcpy(&f2[size_t(i)], &s, 4);
  }
  f32_to_f16(f2.data(), n, h2.data());
  same = true;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t r = bitmap::f32_to_f16(f2[size_t(i)]);
    const bool nan = std::isnan(f2[size_t(i)]);
    same &= nan ? (h2[size_t(i)] & 0x7C00) == 0x7C00 && (h2[size_t(i)] & 0x3FF) != 0 : r == h2[size_t(i)];
  }
  CHECK(same);
  std::vector<uint16_t> b(static_cast<size_t>(n));
  f32_to_bf16(f2.data(), n, b.data());
  f16_to_f32(h2.data(), 0, f.data());  // empty input writes nothing
  bf16_to_f32(b.data(), n, f.data());
  same = true;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u, x;
    std::memcpy(&u, &f[size_t(i)], 4);
    std::memcpy(&x, &f2[size_t(i)], 4);
    same &= std::isnan(f2[size_t(i)]) ? std::isnan(f[size_t(i)]) : u == uint32_t(bf16_by_definition(x)) << 16;
  }
  CHECK(same);
}
