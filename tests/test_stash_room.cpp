// The stash's room in its fixed layout (memory/stash.h): a GPU allocates its whole stash region,
// so after the first step each bitmap entry gets room for what it kept plus a headroom, and the
// region shrinks to the peak those rooms reach. The codec writes nothing past an entry's room; a
// step that keeps more shows when its counts are settled, and runs again with more room, without
// touching the BN statistics twice: training computes the CPU's numbers bit for bit.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>
#include <vector>

#include "engine/init.h"
#include "tests/tiny_training.h"
#include "engine/train/trainer.h"
#include "memory/bitmap.h"
#include "memory/code_bitmap.h"
#include "memory/stash_codec.h"
#include "memory/stash_format.h"
#include "models/models.h"
#include "tests/counted_memory.h"
#include "tests/counting_codec.h"
#include "tests/fit_helper.h"
#include "tests/synthetic_data.h"

using namespace et;

TEST_CASE("a codec keeps within an entry's room: nothing written past it, the whole count returned",
          "[stash][room]") {
  // Half the elements kept; the room is a quarter of them. The canary after the room's bytes is
  // untouched, and the encoding is a whole one of the first kept elements that fit (the others'
  // bits cleared), so a reader stays within the room too: it decodes to them, zeros elsewhere.
  StashCodec& codec = host_stash_codec();
  const int64_t n = 10000, room = n / 4;
  std::vector<float> x(static_cast<size_t>(n));
  std::vector<int8_t> codes(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    x[size_t(i)] = i % 2 ? float(i % 7) + 1.f : 0.f;
    codes[size_t(i)] = int8_t(i % 2 ? i % 7 + 1 : 0);
  }
  const int64_t kept = n / 2;
  const size_t words = size_t(bitmap::num_words(n));
  for (StashEncoding enc : {StashEncoding::BitmapF32, StashEncoding::BitmapF16, StashEncoding::BitmapI4}) {
    INFO(stash_encoding_info(enc).display);
    const size_t fits = stash_encoding_bytes(enc, n, room), canary = 256;
    std::vector<unsigned char> buf(stash_encoding_bytes(enc, n, n) + canary, 0xAB);
    auto untouched_past = [&](size_t from) {
      for (size_t i = from; i < buf.size(); ++i)
        if (buf[i] != 0xAB) return false;
      return true;
    };
    auto* bits = reinterpret_cast<uint64_t*>(buf.data());
    // x (or its codes) with only the first `first` kept elements.
    auto first_kept = [&](auto v, int64_t first) {
      for (int64_t i = 0, seen = 0; i < n; ++i)
        if (x[size_t(i)] != 0.f && seen++ >= first) v[size_t(i)] = 0;
      return v;
    };
    if (enc == StashEncoding::BitmapI4) {
      CHECK(codec.encode_codes(x.data(), codes.data(), n, 0.f, buf.data(), room, nullptr) == kept);
      CHECK(untouched_past(fits));
      // One block of 10000 elements' nibbles: the room's bytes hold 2 * nibble_bytes(n, room) codes
      // over the 3 blocks (each block starting on a byte).
      std::vector<int8_t> part(codes.size());
      codec.decode_codes(buf.data(), n, true, part.data());
      int64_t decoded = 0;
      for (int8_t c : part) decoded += c != 0;
      CHECK(decoded >= room);
      CHECK(decoded <= 2 * code_bitmap::nibble_bytes(n, room));
      CHECK(part == first_kept(codes, decoded));
      CHECK(bitmap::popcount(bits, n) == decoded);
      // With room for all of them, the whole encoding: it decodes to the codes.
      CHECK(codec.encode_codes(x.data(), codes.data(), n, 0.f, buf.data(), kept, nullptr) == kept);
      std::vector<int8_t> back(codes.size());
      codec.decode_codes(buf.data(), n, true, back.data());
      CHECK(back == codes);
      continue;
    }
    const bool f16 = enc == StashEncoding::BitmapF16;
    std::vector<float> part(static_cast<size_t>(n));
    CHECK(codec.pack(x.data(), n, 0.f, bits, bits + words, f16, room, nullptr) == kept);
    CHECK(untouched_past(fits));
    CHECK(bitmap::popcount(bits, n) == room);
    codec.unpack(bits, bits + words, n, f16, part.data());
    CHECK(part == first_kept(x, room));  // (small integers: exact in fp16)
    CHECK(codec.make_bits(x.data(), n, 0.f, bits, nullptr) == kept);
    codec.pack_values(x.data(), bits, n, bits + words, f16, room);
    CHECK(untouched_past(fits));
    CHECK(bitmap::popcount(bits, n) == room);
    codec.unpack(bits, bits + words, n, f16, part.data());
    CHECK(part == first_kept(x, room));
    // With room enough: the values decode to x.
    CHECK(codec.pack(x.data(), n, 0.f, bits, bits + words, f16, kept, nullptr) == kept);
    std::vector<float> y(static_cast<size_t>(n));
    codec.unpack(bits, bits + words, n, f16, y.data());
    CHECK(y == x);
  }
}

namespace {

// The region resnet8 at batch 8 gets in the fixed layout with every entry at its worst case.
size_t worst_case_region(const Config& cfg) {
  Graph g;
  ModelSpec spec;
  spec.name = "resnet8";
  spec.batch = 8;
  build_model(g, spec);
  test::DeferringCpu be;
  StashOptions so = cfg.stash_options(false);
  so.first_room = -1;
  const Executor fresh(g, be, so, cfg.quant_options(false));
  return fresh.stash().region_bytes();
}

class PeakDeferringCpu final : public test::DeferringCpu {
 public:
  test::CountedHostMemory mem;  // (its peak: the most held at once, arena and stash region)
  DeviceMemory& memory() override { return mem; }
};

struct RoomRun {
  std::vector<std::string> metrics;  // per epoch: losses and accuracies, as printed (bits)
  size_t region = 0, packed_region = 0, arena = 0;
  size_t allocated_peak = 0;  // PeakDeferringCpu: the most the backend's memory held at once
  int grown = 0;
  bool fixed = false;
};

RoomRun fit_with(std::unique_ptr<Backend> backend, const Config& cfg) {
  Trainer t(cfg, test::synthetic_dataset(40, 1), test::synthetic_dataset(10, 2), std::move(backend));
  RoomRun r;
  for (const nlohmann::json& j : test::fit_quietly(t, "room"))
    r.metrics.push_back(j["train_loss"].dump() + " " + j["test_loss"].dump() + " " + j["test_acc"].dump());
  const Stash& s = t.executor().stash();
  r.region = s.region_bytes();
  r.arena = t.executor().memory().total;
  if (const auto* peak = dynamic_cast<const PeakDeferringCpu*>(&t.executor().backend())) r.allocated_peak = peak->mem.peak;
  r.packed_region = s.region_peak_bytes();
  r.grown = t.executor().stash_room_grown();
  r.fixed = s.fixed_layout();
  return r;
}

}  // namespace

TEST_CASE("the stash's room: fitted to what entries kept, grown when a step keeps more, the CPU's training "
          "bit for bit", "[stash][room][training]") {
  // resnet8, 5 steps an epoch for 3 epochs, on the CPU (compact layout) and on a backend that
  // defers its counts (fixed layout, as CUDA). The first step has room for half of each entry,
  // then its counts. Headroom 0: a later batch that keeps more of some value than any before it
  // overflows that value's room, so steps run again. The epochs' losses and accuracies (which read
  // the BN running statistics) must be the CPU's, bit for bit, and the memory allocated never
  // reaches the arena and the worst-case region together.
  struct Case {
    const char* stash;
    float prune;
    bool luq;
  };
  for (const Case c : {Case{"bitmap_fp32", 0.f, false}, Case{"bitmap_fp16", 0.05f, false}, Case{"auto", 0.f, false},
                       Case{"bitmap_int4", 0.f, true}}) {
    INFO("stash " << c.stash << ", prune " << c.prune << ", luq " << c.luq);
    Config cfg = test::small_fit_config(3);
    cfg.memory.stash = c.stash;
    cfg.memory.prune_threshold = c.prune;
    cfg.memory.stash_headroom = 0.f;
    if (c.luq) cfg.quant.forward = "int4", cfg.quant.backward = "luq_fp4";
    const RoomRun cpu = fit_with(make_cpu_backend(), cfg), own = fit_with(std::make_unique<PeakDeferringCpu>(), cfg);
    CHECK_FALSE(cpu.fixed);
    REQUIRE(own.fixed);
    REQUIRE(cpu.metrics.size() == 3);
    CHECK(own.metrics == cpu.metrics);
    CHECK(own.grown > 0);  // some step ran again
    CHECK(cpu.grown == 0);
    // The region: fitted, so near the packed peak (the CPU's top) rather than at its worst case.
    const size_t worst = worst_case_region(cfg);
    CAPTURE(own.region, worst, cpu.packed_region, own.allocated_peak, own.arena);
    CHECK(own.region < worst);
    CHECK(own.region >= cpu.packed_region);
    CHECK(own.allocated_peak > own.arena);
    CHECK(own.allocated_peak < own.arena + worst);
  }
}

TEST_CASE("the stash's room with a negative headroom: every entry keeps its worst case", "[stash][room]") {
  Config cfg = test::small_fit_config(1);
  cfg.memory.stash = "bitmap_fp32";
  cfg.memory.stash_headroom = -1.f;
  const RoomRun own = fit_with(std::make_unique<test::DeferringCpu>(), cfg);
  CHECK(own.region == worst_case_region(cfg));
  CHECK(own.grown == 0);
}

namespace {

// One saved value of n elements in the fixed layout (a codec that defers its counts), room for
// half of it before the first fit; set(kept) writes x with `kept` of its elements non-zero.
struct OneValueStash {
  static constexpr int64_t n = 100000;
  test::CountingCodec codec;
  std::vector<float> x = std::vector<float>(size_t(n)), decoded = std::vector<float>(size_t(n));
  Stash stash;
  OneValueStash(StashFormat format, bool mask_read) {
    codec.defer = true;
    SavedValue sv;
    sv.value = 0, sv.numel = n, sv.full = true, sv.mask_read = mask_read, sv.format = format;
    sv.unpack = Tensor::contiguous(decoded.data(), Shape{n});
    stash.configure({sv}, 1, 0.f, false, host_memory(), codec, 0.5);
  }
  void set(int64_t kept) {
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = i % (n / kept) == 0 && i / (n / kept) < kept ? 1.f + float(i % 7) : 0.f;
  }
};

}  // namespace

TEST_CASE("the stash's room follows the values' sparsity: forgotten counts shrink it, a denser step grows it",
          "[stash][room]") {
  // One bitmap_fp32 value pushed as a step does.
  OneValueStash v(StashFormat::BitmapF32, false);
  const int64_t n = v.n;
  Stash& stash = v.stash;
  std::vector<float>& x = v.x;
  auto step = [&](int64_t kept) {
    v.set(kept);
    stash.clear();
    stash.push(0, Tensor::contiguous(x.data(), Shape{n}));
    const Tensor back = stash.get(0);
    const bool same = std::equal(x.begin(), x.end(), back.f32());
    stash.pop(0);
    return std::make_pair(stash.overflowed(), same);
  };
  const size_t first = stash.region_bytes();  // room for half
  CHECK(first < stash_worst_case_bytes(StashFormat::BitmapF32, n, true));
  CHECK(step(40000) == std::make_pair(-1, true));
  CHECK(stash.fit(0.02));
  const size_t at40 = stash.region_bytes();
  CHECK(at40 < first);
  CHECK(step(30000) == std::make_pair(-1, true));
  CHECK_FALSE(stash.fit(0.02));  // the most kept is still 40000
  CHECK(stash.region_bytes() == at40);
  stash.forget_kept();
  CHECK(stash.wants_fit());
  CHECK(step(20000) == std::make_pair(-1, true));
  CHECK(stash.fit(0.02));  // sized from this step alone
  const size_t at20 = stash.region_bytes();
  CHECK(at20 < at40);
  // Denser than the room: the push kept within it (its values lost), the count tells.
  CHECK(step(30000).first == 0);
  CHECK(stash.fit(0.02));
  CHECK(stash.region_bytes() > at20);
  CHECK(step(30000) == std::make_pair(-1, true));  // the step again: every value back
}

TEST_CASE("auto in the fixed layout: each entry's room chooses bitmap or copy, no count read back in the step",
          "[stash][room]") {
  // One auto value: the compact layout counts each push to choose; here the entry's room decides
  // (Stash::copies), so the step never waits for a count. A denser push than a bitmap's room
  // overflows, and the fit gives it the copy; once sparser again, the fit after forget_kept() gives
  // the bitmap back.
  OneValueStash v(StashFormat::Auto, true);
  const int64_t n = v.n;
  Stash& stash = v.stash;
  std::vector<float>& x = v.x;
  test::CountingCodec& codec = v.codec;
  struct Pushed {
    int overflowed;
    bool same, mask_same;
    std::string stored_as;
    int read_backs_in_step;
  };
  auto step = [&](int64_t kept) {
    v.set(kept);
    stash.clear();
    const int before = codec.read_backs;
    const MaskOut target = stash.mask_target(0, n);
    stash.push(0, Tensor::contiguous(x.data(), Shape{n}));
    const Tensor back = stash.get(0);
    const bool same = std::equal(x.begin(), x.end(), back.f32());
    const MaskView m = stash.get_mask(0);
    bool mask_same = true;
    for (int64_t i = 0; i < n; ++i) {
      const bool bit = m.bits ? (m.bits[i / 64] >> (i % 64)) & 1u : m.dense.f32()[i] > 0.f;
      mask_same = mask_same && bit == (x[size_t(i)] > 0.f);
    }
    const int in_step = codec.read_backs - before;
    stash.pop(0);
    const std::string as = stash.record(0).stored_as;  // settles: one read back
    CHECK((target.bits == nullptr) == (as == "fp32 (copy)"));  // a producer writes only a bitmap's bits
    return Pushed{stash.overflowed(), same, mask_same, as, in_step};
  };
  const size_t first = stash.region_bytes();  // a bitmap with room for half
  CHECK(first < stash_worst_case_bytes(StashFormat::Auto, n, true));
  Pushed p = step(40000);
  CHECK(p.overflowed == -1);
  CHECK(p.same);
  CHECK(p.mask_same);
  CHECK(p.stored_as == "bitmap+fp32");
  CHECK(p.read_backs_in_step == 0);
  CHECK(stash.fit(0.02));
  // Denser than the room: the step runs again with the copy (a bitmap of 99 % takes more).
  p = step(99000);
  CHECK(p.overflowed == 0);
  CHECK(p.stored_as == "bitmap+fp32");
  CHECK(stash.fit(0.02));
  p = step(99000);
  CHECK(p.overflowed == -1);
  CHECK(p.same);
  CHECK(p.mask_same);
  CHECK(p.stored_as == "fp32 (copy)");
  CHECK(p.read_backs_in_step == 0);
  CHECK(stash.record(0).nonzero == n);
  CHECK(stash.record(0).bytes == size_t(n) * 4);
  // A copy never overflows, but its count (left in its slot) still sizes the room.
  stash.forget_kept();
  p = step(20000);
  CHECK(p.stored_as == "fp32 (copy)");  // the room stays until the fit
  CHECK(p.overflowed == -1);
  CHECK(stash.fit(0.02));
  CHECK(stash.region_bytes() < first);
  p = step(20000);
  CHECK(p.stored_as == "bitmap+fp32");
  CHECK(p.same);
  CHECK(p.mask_same);
  CHECK(p.read_backs_in_step == 0);
}

TEST_CASE("the stash's room when a pass throws part way: no abort, the room grows, the step then runs",
          "[stash][room][divergence]") {
  // resnet8 under LUQ with the quantizers' own (host) checks, bitmap_int4 in the fixed layout with
  // room for 1 %
  // of each value: the first forward keeps more than its rooms. A NaN weight in a later layer makes
  // its quantizer throw part way through that forward: the executor abandons the stash (no check
  // that the pushes fit: that may be why it threw), the fit grows the rooms, and with the weight
  // restored the step runs within them and gives the CPU's loss bit for bit.
  Graph g;
  ModelSpec spec;
  spec.name = "resnet8";
  spec.batch = 8;
  build_model(g, spec);
  StashOptions so;
  so.format = StashFormat::BitmapI4;  // (under LUQ only the codes' size follows their count)
  so.first_room = 0.01;
  so.room_headroom = 0.02;
  test::DeferringCpu be;
  const std::unique_ptr<Backend> cpu_be = make_cpu_backend();
  Executor ex(g, be, so, test::luq()), ref(g, *cpu_be, so, test::luq());
  init_parameters(ex, 3);
  init_parameters(ref, 3);
  for (Executor* e : {&ex, &ref}) {
    Tensor x = e->value(g.image_input), y = e->value(g.label_input);
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(i * 7 % 23) / 11.f - 1.f;
    for (int64_t i = 0; i < 8; ++i) y.i32()[i] = int32_t(i % 10);
    e->set_step_seed(5);
  }
  float* w = ex.value(g.find_value("layer3.0.conv2.weight")).f32();
  const float kept = w[3];
  w[3] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(ex.forward(8, true), NonFiniteError);
  CHECK(ex.fit_stash_room());  // the pushes before the throw kept more than 1 %
  w[3] = kept;
  const size_t grown = ex.stash().region_bytes();
  ex.forward(8, true);
  // A fit between the forward and the backward (the divergence guard's, after a diverged loss)
  // never shrinks the region under live entries.
  CHECK_NOTHROW(ex.fit_stash_room());
  CHECK(ex.stash().region_bytes() >= grown);
  ex.backward();
  if (ex.fit_stash_room()) {  // the values after the throw had their first rooms: once more
    ex.set_repeating(true);
    ex.forward(8, true);
    ex.backward();
    ex.set_repeating(false);
  }
  CHECK_FALSE(ex.fit_stash_room());
  ref.forward(8, true);
  ref.backward();
  CHECK(ex.loss() == ref.loss());
  const int wid = g.find_value("layer1.0.conv1.weight");
  const Tensor dw = ex.grad(wid), rw = ref.grad(wid);
  CHECK(std::equal(dw.f32(), dw.f32() + dw.numel(), rw.f32()));
}
