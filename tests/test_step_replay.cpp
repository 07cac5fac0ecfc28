// engine/step_replay.h on the host: which steps are recorded, replayed or run op by op, and which
// executors cannot be replayed (the replay itself, a CUDA graph, is tested in tests/cuda).
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <string>

#include "backends/cpu/cpu_backend.h"
#include "engine/executor.h"
#include "engine/init.h"
#include "engine/step_replay.h"
#include "models/models.h"
#include "tests/counting_codec.h"
#include "tests/tiny_training.h"

using namespace et;

namespace {

// The CPU backend claiming to record steps: its ops still run when called (so a "recorded" step
// runs once), and a replay only counts. `fail` makes the record fail as a GPU's would.
class RecordingCpu final : public CpuBackend {
 public:
  int begun = 0, replays = 0;
  std::string fail;
  bool draws = false;  // its dropout reads the step seed from its memory (as CUDA's)
  std::vector<uint64_t> seeds;  // set_step_seed's
  bool replays_draws() const override { return draws; }
  void set_step_seed(uint64_t s) override { seeds.push_back(s); }
  std::string capture_unsupported() const override { return ""; }
  void begin_capture() override { ++begun; }
  std::string end_capture() override { return fail; }
  void replay() override { ++replays; }
};

// RecordingCpu with a codec that leaves its counts on the "device", as a GPU's: the stash takes
// its fixed layout (memory/stash.h).
class RecordingDeferringCpu final : public test::DeferringCpu {
 public:
  int begun = 0, replays = 0;
  bool scales = false;  // its 4-bit scales in its memory (as CUDA's)
  bool quant_scales_in_memory() const override { return scales; }
  int64_t generation = 0;  // Backend::record_generation: bumped where a record would hold moved memory
  int64_t record_generation() const override { return generation; }
  std::string capture_unsupported() const override { return ""; }
  void begin_capture() override { ++begun; }
  std::string end_capture() override { return ""; }
  void replay() override { ++replays; }
};

struct Model {
  Graph g;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Executor> ex;
  Model(std::unique_ptr<Backend> backend, const std::string& name, const StashOptions& so = {}, float dropout = 0.f)
      : be(std::move(backend)) {
    ModelSpec spec;
    spec.name = name;
    spec.batch = 8;
    spec.dropout = dropout;
    build_model(g, spec);
    ex = std::make_unique<Executor>(g, *be, so);
    init_parameters(*ex, 1);
  }
};

}  // namespace

TEST_CASE("step replay: which executors can be replayed, and why not", "[replay]") {
  // The CPU backend records nothing (its ops run as they are called).
  Model cpu(make_cpu_backend(), "resnet8");
  CHECK_THAT(StepReplay::unsupported(*cpu.ex), Catch::Contains("records no steps"));
  // On a backend that records: dense_fp32 saves the forward buffers themselves (fixed addresses).
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "resnet8").ex) == "");
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "mobilenetv2").ex) == "");
  // A bitmap stash places each entry by a count the step reads back.
  StashOptions bitmap;
  bitmap.format = StashFormat::BitmapF32;
  CHECK_THAT(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "resnet8", bitmap).ex),
             Catch::Contains("bitmap_fp32"));
  // ... unless the stash has its fixed layout (a GPU's codec leaves the counts on the device), where
  // auto's encoding is each entry's (its room decides), not a count's.
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingDeferringCpu>(), "resnet8", bitmap).ex) == "");
  StashOptions bitmap16 = bitmap, automatic = bitmap;
  bitmap16.format = StashFormat::BitmapF16;
  automatic.format = StashFormat::Auto;
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingDeferringCpu>(), "resnet8", bitmap16).ex) == "");
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingDeferringCpu>(), "resnet8", automatic).ex) == "");
  CHECK_THAT(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "resnet8", automatic).ex),
             Catch::Contains("auto"));
  // train.cuda_graph = auto records only what a GPU run has verified: not these yet.
  {
    Model m(std::make_unique<RecordingDeferringCpu>(), "resnet8", bitmap);
    CHECK_THAT(StepReplay(*m.ex, true, 2, true).why_not(),
               Catch::Contains("bitmap_fp32") && Catch::Contains("train.cuda_graph = true"));
    CHECK(StepReplay(*m.ex, true, 2, false).why_not() == "");
    CHECK(StepReplay(*Model(std::make_unique<RecordingDeferringCpu>(), "resnet8").ex, true, 2, true).why_not() == "");
  }
  // dense_bf16: fixed-size halves, and masks stored alone (n bits, counted only for statistics).
  StashOptions bf16;
  bf16.format = StashFormat::DenseBF16;
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "resnet8", bf16).ex) == "");
  // Dropout draws new numbers every step (on this backend); recomputation is recorded with the rest.
  CHECK_THAT(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "vgg11_bn", {}, 0.5f).ex),
             Catch::Contains("dropout") && Catch::Contains("draws new numbers"));
  // ... unless the backend's dropout reads the step seed, set before each step, from its memory.
  {
    auto draws = std::make_unique<RecordingCpu>();
    draws->draws = true;
    RecordingCpu& be = *draws;
    Model m(std::move(draws), "vgg11_bn", {}, 0.5f);
    CHECK(StepReplay::unsupported(*m.ex) == "");
    m.ex->set_step_seed(41);  // the executor hands every step seed to the backend
    m.ex->set_step_seed(42);
    CHECK(be.seeds == std::vector<uint64_t>{41, 42});
  }
  StashOptions segments;
  segments.checkpoint_every = 2;
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "resnet8", segments).ex) == "");
  StashOptions stack_outputs;
  stack_outputs.recompute_stack_outputs = true;
  CHECK(StepReplay::unsupported(*Model(std::make_unique<RecordingCpu>(), "resnet8", stack_outputs).ex) == "");
}

TEST_CASE("step replay: warm-up steps run op by op, then one is recorded and the rest replayed", "[replay]") {
  Model m(std::make_unique<RecordingCpu>(), "resnet8");
  auto& be = static_cast<RecordingCpu&>(*m.be);
  SECTION("off, or on a backend that records nothing: every step is the caller's") {
    StepReplay off(*m.ex, false);
    for (int s = 0; s < 4; ++s) CHECK_FALSE(off.try_step(8));
    CHECK_THAT(off.why_not(), Catch::Contains("train.cuda_graph"));
    Model cpu(make_cpu_backend(), "resnet8");
    StepReplay none(*cpu.ex, true);
    CHECK_FALSE(none.try_step(8));
    CHECK_THAT(none.why_not(), Catch::Contains("records no steps"));
  }
  SECTION("on") {
    StepReplay r(*m.ex, true, 2);
    CHECK_FALSE(r.try_step(8));  // warm-up: the caller runs these
    CHECK_FALSE(r.try_step(8));
    CHECK_FALSE(r.try_step(4));  // not the whole batch: never recorded
    CHECK(be.begun == 0);
    CHECK(r.try_step(8));  // recorded (its ops ran on this CPU) and replayed once
    CHECK(be.begun == 1);
    CHECK(be.replays == 1);
    CHECK(r.replaying());
    // An evaluation batch in between leaves the views at its batch; a replay puts them back.
    m.ex->forward(3, false);
    CHECK(m.ex->value(m.g.logits).dim(0) == 3);
    CHECK(r.try_step(8));
    CHECK(be.begun == 1);  // recorded once
    CHECK(be.replays == 2);
    CHECK(m.ex->value(m.g.logits).dim(0) == 8);
    CHECK(r.why_not().empty());
  }
  SECTION("a record that fails: that step runs op by op, and the later ones too") {
    be.fail = "operation not permitted when stream is capturing";
    StepReplay r(*m.ex, true, 0);
    CHECK(r.try_step(8));  // handled: the record failed, so it ran the step itself
    CHECK(be.replays == 0);
    CHECK_FALSE(r.replaying());
    CHECK_THAT(r.why_not(), Catch::Contains("recording the step failed") && Catch::Contains("capturing"));
    CHECK(std::isfinite(m.ex->loss()));
    CHECK_FALSE(r.try_step(8));
  }
}

TEST_CASE("step replay with the stash's fixed layout: each run's counts settled once, before the next overwrites them",
          "[replay][stash]") {
  // On this CPU a "recorded" step runs once as it is recorded and a replay runs nothing, so the
  // slots keep the recorded run's counts: every settle must give the op-by-op step's numbers. In
  // bitmap_fp32, and in auto, whose encodings the entries' rooms choose: copies at their worst
  // case (no fit), bitmaps in rooms fitted to a step that kept about half.
  struct Case {
    StashFormat format;
    double headroom;  // a fit after the first step; negative: none
    const char* stored_as;  // what auto's full saves store
  };
  for (const Case c : {Case{StashFormat::BitmapF32, -1, "bitmap+fp32"}, Case{StashFormat::Auto, -1, "fp32 (copy)"},
                       Case{StashFormat::Auto, 0.02, "bitmap+fp32"}}) {
    INFO(stash_format_name(c.format) << ", headroom " << c.headroom);
    StashOptions bitmap;
    bitmap.format = c.format;
    Model ref(std::make_unique<test::DeferringCpu>(), "resnet8", bitmap),
        m(std::make_unique<RecordingDeferringCpu>(), "resnet8", bitmap);
    for (Model* x : {&ref, &m}) {  // a batch that keeps about half of each ReLU's output
      Tensor in = x->ex->value(x->g.image_input);
      for (int64_t i = 0; i < in.numel(); ++i) in.f32()[i] = float(i * 7 % 23) / 11.f - 1.f;
    }
    const bool fit = c.headroom >= 0;
    for (int s = 0; s < (fit ? 2 : 1); ++s) {
      ref.ex->forward(8, true);
      ref.ex->backward();
      if (fit && s == 0) ref.ex->stash().fit(c.headroom);
    }
    const size_t want = ref.ex->stash().peak_bytes();
    REQUIRE(want > 0);
    auto& be = static_cast<RecordingDeferringCpu&>(*m.be);
    StepReplay r(*m.ex, true, 1);
    CHECK_FALSE(r.try_step(8));  // warm-up, op by op
    m.ex->forward(8, true);
    m.ex->backward();
    if (fit) {
      m.ex->stash().fit(c.headroom);
      m.ex->forward(8, true);  // (not through r: its warm-up is done)
      m.ex->backward();
    }
    int full_saves = 0;
    for (const SavedValue& s : m.ex->stash().saved()) {
      if (!s.full || s.format == StashFormat::DenseF32) continue;
      ++full_saves;
      CHECK(std::string(m.ex->stash().record(s.value).stored_as) == c.stored_as);
    }
    CHECK(full_saves > 0);
    CHECK(m.ex->stash().peak_bytes() == want);
    const int read_backs = be.codec.read_backs;
    CHECK(r.try_step(8));  // recorded and replayed
    CHECK(r.try_step(8));  // replayed: the last run settled first
    CHECK(be.begun == 1);
    CHECK(be.replays == 2);
    CHECK(be.codec.read_backs == read_backs + 1);  // the recorded run, settled before the second replay
    CHECK(m.ex->stash().peak_bytes() == want);     // the second replay, settled now
    CHECK(be.codec.read_backs == read_backs + 2);
    for (const SavedValue& s : m.ex->stash().saved())
      CHECK(m.ex->stash().record(s.value).bytes == ref.ex->stash().record(s.value).bytes);
    CHECK(be.codec.read_backs == read_backs + 2);  // settled once per run
  }
}

TEST_CASE("step replay records again when the stash's room moves its entries, or the backend's scratch", "[replay][stash][room]") {
  // A recorded step holds the stash entries' places: after Stash::fit moves them (the room fitted
  // after the first step, or grown), the next step is recorded again; a fit that moves nothing
  // keeps the record.
  StashOptions bitmap;
  bitmap.format = StashFormat::BitmapF32;
  Model m(std::make_unique<RecordingDeferringCpu>(), "resnet8", bitmap);
  auto& be = static_cast<RecordingDeferringCpu&>(*m.be);
  Tensor x = m.ex->value(m.g.image_input);  // a batch that keeps about half of each ReLU's output
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = float(i * 7 % 23) / 11.f - 1.f;
  StepReplay r(*m.ex, true, 1);
  CHECK_FALSE(r.try_step(8));  // warm-up, op by op
  m.ex->forward(8, true);
  m.ex->backward();
  const size_t worst = m.ex->stash().region_bytes();
  const int64_t layout = m.ex->stash().layout_generation();
  CHECK_FALSE(m.ex->fit_stash_room());  // no step to run again: the room fitted
  CHECK(m.ex->stash().layout_generation() != layout);
  CHECK(m.ex->stash().region_bytes() < worst);
  CHECK(r.try_step(8));  // recorded with the fitted places
  CHECK(be.begun == 1);
  CHECK_FALSE(m.ex->fit_stash_room());  // the same batch keeps as much: nothing moves
  CHECK(r.try_step(8));
  CHECK(be.begun == 1);
  CHECK(be.replays == 2);
  CHECK(m.ex->stash().fit(1.0));  // more room: entries move
  CHECK(r.try_step(8));
  CHECK(be.begun == 2);
  CHECK(be.replays == 3);
  // The backend moved memory the record uses (its scratch grew) or recorded another step.
  ++be.generation;
  CHECK(r.try_step(8));
  CHECK(be.begun == 3);
  CHECK(r.try_step(8));
  CHECK(be.begun == 3);
  CHECK(be.replays == 5);
}

namespace {
// RecordingCpu with its 4-bit scales in its memory, as CUDA keeps them.
class RecordingScalesCpu final : public CpuBackend {
 public:
  bool quant_scales_in_memory() const override { return true; }
  std::string capture_unsupported() const override { return ""; }
  void begin_capture() override {}
  std::string end_capture() override { return ""; }
  void replay() override {}
};
}  // namespace

TEST_CASE("a 4-bit step is recorded only where the backend keeps its scales in its memory", "[replay][quant]") {
  auto luq_model = [](std::unique_ptr<Backend> be) {
    auto m = std::make_unique<Model>(std::move(be), "resnet8");
    m->ex = std::make_unique<Executor>(m->g, *m->be, StashOptions{}, test::luq());
    return m;
  };
  CHECK_THAT(StepReplay::unsupported(*luq_model(std::make_unique<RecordingCpu>())->ex),
             Catch::Contains("is 4-bit") && Catch::Contains("reads its scales back"));
  const auto m = luq_model(std::make_unique<RecordingScalesCpu>());
  CHECK(StepReplay::unsupported(*m->ex) == "");
  // Not yet run on a GPU: train.cuda_graph = auto leaves it op by op, true records it.
  CHECK_THAT(StepReplay(*m->ex, true, 2, true).why_not(), Catch::Contains("4-bit training"));
  CHECK(StepReplay(*m->ex, true, 2, false).why_not() == "");
  // bitmap_int4: the codes' size follows their count, so only in the stash's fixed layout (their
  // signedness is the layer's, not the step's).
  StashOptions codes;
  codes.format = StashFormat::BitmapI4;
  auto with_codes = [&](std::unique_ptr<Backend> be) {
    auto c = std::make_unique<Model>(std::move(be), "resnet8");
    c->ex = std::make_unique<Executor>(c->g, *c->be, codes, test::luq());
    return c;
  };
  CHECK_THAT(StepReplay::unsupported(*with_codes(std::make_unique<RecordingScalesCpu>())->ex),
             Catch::Contains("bitmap_int4"));
  auto deferring = std::make_unique<RecordingDeferringCpu>();
  deferring->scales = true;
  const auto fixed = with_codes(std::move(deferring));
  REQUIRE(fixed->ex->stash().fixed_layout());
  CHECK(StepReplay::unsupported(*fixed->ex) == "");
}
