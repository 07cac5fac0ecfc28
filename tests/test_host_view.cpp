// The device-aware core's host access (engine/host_view.h): with a backend whose memory the host
// may not address, initialisation, the input batch, the loss and accuracy readout, weights and
// checkpoints go through the backend's copies, and training computes the same bits as on the CPU.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "backends/cpu/cpu_backend.h"
#include "engine/host_view.h"
#include "engine/init.h"
#include "engine/train/checkpoint.h"
#include "engine/train/optimizer.h"
#include "engine/train/trainer.h"
#include "tests/counting_codec.h"
#include "tests/fit_helper.h"
#include "tests/synthetic_data.h"
#include "tests/tiny_training.h"

using namespace et;
namespace fs = std::filesystem;

namespace {

// The CPU backend, but host code must copy (as it will for a GPU's memory); copies are counted.
class StagedCpu : public CpuBackend {
 public:
  int to_host = 0, from_host = 0;
  bool host_addressable() const override { return false; }
  void copy_to_host(const Tensor& src, void* dst) override {
    ++to_host;
    CpuBackend::copy_to_host(src, dst);
  }
  void copy_from_host(const void* src, Tensor& dst) override {
    ++from_host;
    CpuBackend::copy_from_host(src, dst);
  }
};

struct Run {
  Graph g;
  std::unique_ptr<Backend> be;
  std::unique_ptr<Executor> ex;
  explicit Run(std::unique_ptr<Backend> backend, uint64_t seed = 3) : be(std::move(backend)) {
    ModelSpec spec;
    spec.name = "resnet8";
    spec.batch = 8;
    build_model(g, spec);
    ex = std::make_unique<Executor>(g, *be);
    init_parameters(*ex, seed);
  }
  // One SGD step on a fixed batch written from the host; returns the loss.
  float step(bool first) {
    {
      const HostView x(*be, ex->value(g.image_input), HostView::Write), y(*be, ex->value(g.label_input), HostView::Write);
      for (int64_t i = 0; i < ex->value(g.image_input).numel(); ++i) x.f32()[i] = float(i % 17) / 8.f - 1.f;
      for (int64_t i = 0; i < 8; ++i) y.i32()[i] = int32_t(i * 3 % 10);
    }
    ex->forward(8, true);
    ex->backward();
    sgd_update(*ex, SgdOptions{0.9f, 5e-4f, false}, 0.05f, first);
    return ex->loss();
  }
  std::vector<char> state() const {
    std::vector<char> out;
    for (const Tensor& t : ex->state_tensors()) {
      const HostView v(*be, t, HostView::Read);
      out.insert(out.end(), static_cast<const char*>(v.data()), static_cast<const char*>(v.data()) + t.nbytes());
    }
    return out;
  }
};

std::vector<char> file_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST_CASE("host access through a backend's copies: the same training, checkpoints and readouts", "[host]") {
  Run cpu(make_cpu_backend());
  auto staged_backend = std::make_unique<StagedCpu>();
  StagedCpu& staged = *staged_backend;
  Run dev(std::move(staged_backend));
  CHECK(staged.from_host > 0);  // initialisation wrote through copies
  CHECK(dev.state() == cpu.state());

  for (int s = 0; s < 2; ++s) {
    const int before = staged.to_host;
    CHECK(dev.step(s == 0) == cpu.step(s == 0));
    CHECK(staged.to_host > before);  // the loss came back through a copy
  }
  CHECK(dev.state() == cpu.state());
  const Tensor logits = dev.ex->value(dev.g.logits), labels = dev.ex->value(dev.g.label_input);
  CHECK(count_correct(staged, logits, labels, 8) ==
        count_correct(*cpu.be, cpu.ex->value(cpu.g.logits), cpu.ex->value(cpu.g.label_input), 8));

  const std::string base = (fs::temp_directory_path() / ("edgetrain_host_view_" + std::to_string(::getpid()))).string();
  const TrainProgress pr{"resnet8", 1, 2, 3, 0.25, 1.0, 0, {}};
  save_checkpoint(base + "_cpu.ckpt", *cpu.ex, pr);
  save_checkpoint(base + "_dev.ckpt", *dev.ex, pr);
  CHECK(file_bytes(base + "_cpu.ckpt") == file_bytes(base + "_dev.ckpt"));
  // ... and one loads into the other's kind of backend (a run resumed on another device).
  Run back(std::make_unique<StagedCpu>(), 4);
  save_checkpoint(base + "_back.ckpt", *back.ex, pr);
  CHECK(file_bytes(base + "_back.ckpt") != file_bytes(base + "_cpu.ckpt"));  // its own initialisation
  load_checkpoint(base + "_cpu.ckpt", *back.ex, "resnet8");
  save_checkpoint(base + "_back.ckpt", *back.ex, pr);
  CHECK(file_bytes(base + "_back.ckpt") == file_bytes(base + "_cpu.ckpt"));
  for (const char* f : {"_cpu.ckpt", "_dev.ckpt", "_back.ckpt"}) fs::remove(base + f);
}

namespace {

class CodecCpu final : public CpuBackend {
 public:
  test::CountingCodec codec;
  StashCodec& stash_codec() override { return codec; }
};

// Two steps of the same model on both backends with these options: the same losses and state.
void train_alongside(Run& cpu, Run& own, const StashOptions& so, const QuantOptions& q) {
  cpu.ex = std::make_unique<Executor>(cpu.g, *cpu.be, so, q);
  own.ex = std::make_unique<Executor>(own.g, *own.be, so, q);
  init_parameters(*cpu.ex, 3);
  init_parameters(*own.ex, 3);
  for (int s = 0; s < 2; ++s) CHECK(cpu.step(s == 0) == own.step(s == 0));
  CHECK(cpu.state() == own.state());
}

}  // namespace

TEST_CASE("the stash encodes and decodes through its backend's codec", "[host][stash]") {
  // Each format's step on a backend with its own codec: the same bits as the CPU's, and the
  // stash's element work went to that codec (a GPU backend's runs on device memory).
  for (StashFormat f : {StashFormat::BitmapF32, StashFormat::BitmapF16, StashFormat::DenseF16, StashFormat::DenseBF16,
                        StashFormat::Auto}) {
    StashOptions so;
    so.format = f;
    Run cpu(make_cpu_backend()), own(std::make_unique<CodecCpu>());
    INFO("format " << stash_format_name(f));
    train_alongside(cpu, own, so, QuantOptions{});
    const test::CountingCodec& c = static_cast<CodecCpu&>(*own.be).codec;
    CHECK(c.encodes > 0);
    // fp32 bitmaps are read as stored by every reader here (conv weight gradients, masks); the
    // 16-bit formats are also decoded for BN's backward.
    if (f == StashFormat::BitmapF16 || f == StashFormat::DenseF16 || f == StashFormat::DenseBF16) CHECK(c.decodes > 0);
  }
  // bitmap_int4 under LUQ: the codes' encoding too.
  StashOptions so;
  so.format = StashFormat::BitmapI4;
  Run cpu(make_cpu_backend()), own(std::make_unique<CodecCpu>());
  train_alongside(cpu, own, so, test::luq());
  CHECK(static_cast<CodecCpu&>(*own.be).codec.code_encodes > 0);
}

namespace {

struct StashReport {
  std::vector<std::string> records;  // per saved value: stored as, bytes, non-zeros
  size_t peak = 0;
};

StashReport stash_report(Run& r) {
  StashReport out;
  for (const SavedValue& s : r.ex->stash().saved()) {
    const StashRecord& rec = r.ex->stash().record(s.value);
    out.records.push_back(r.g.value(s.value).name + " " + rec.stored_as + " " + std::to_string(rec.bytes) + " " +
                          std::to_string(rec.nonzero));
  }
  out.peak = r.ex->stash().peak_bytes();
  return out;
}

}  // namespace

TEST_CASE("the stash's fixed layout: counts left in slots, settled after the step, the compact layout's numbers",
          "[host][stash]") {
  // A codec that defers its counts (a GPU's) gets the fixed layout: every entry at its worst case,
  // no count read back during the step. Training computes the same bits, and the records and peak
  // settled from the slots are the compact layout's, byte for byte: with activation pruning (the
  // exact mask apart), recomputation and 4-bit codes. auto chooses by each entry's room there (all
  // at their worst case here: copies), not by a count read back, so its records are its own.
  struct Case {
    StashFormat format;
    float prune;
    int checkpoint_every;
    bool luq;
  };
  for (const Case c : {Case{StashFormat::BitmapF32, 0.f, 0, false}, Case{StashFormat::BitmapF16, 0.f, 0, false},
                       Case{StashFormat::BitmapF32, 0.05f, 0, false}, Case{StashFormat::BitmapF32, 0.f, 2, false},
                       Case{StashFormat::DenseF16, 0.f, 0, false}, Case{StashFormat::Auto, 0.f, 0, false},
                       Case{StashFormat::BitmapI4, 0.f, 0, true}, Case{StashFormat::Auto, 0.f, 0, true}}) {
    StashOptions so;
    so.format = c.format;
    so.prune_threshold = c.prune;
    so.checkpoint_every = c.checkpoint_every;
    const QuantOptions q = c.luq ? test::luq() : QuantOptions{};
    INFO("format " << stash_format_name(c.format) << ", prune " << c.prune << ", checkpoint_every "
                   << c.checkpoint_every << ", luq " << c.luq);
    Run cpu(make_cpu_backend()), own(std::make_unique<test::DeferringCpu>());
    train_alongside(cpu, own, so, q);
    CHECK_FALSE(cpu.ex->stash().fixed_layout());
    REQUIRE(own.ex->stash().fixed_layout());
    const StashReport a = stash_report(cpu), b = stash_report(own);
    if (c.format == StashFormat::Auto) {
      REQUIRE(a.records.size() == b.records.size());
      for (size_t i = 0; i < a.records.size(); ++i) {
        const bool chose = a.records[i].find("bitmap+fp32") != std::string::npos ||
                           a.records[i].find("fp32 (copy)") != std::string::npos;
        CAPTURE(a.records[i], b.records[i]);
        if (chose)
          CHECK(b.records[i].find("fp32 (copy)") != std::string::npos);
        else
          CHECK(a.records[i] == b.records[i]);
      }
      CHECK(b.peak >= a.peak);
    } else {
      CHECK(a.records == b.records);
      CHECK(a.peak == b.peak);
    }
    CHECK(a.peak > 0);
    const test::DeferringCpu& d = static_cast<test::DeferringCpu&>(*own.be);
    if (c.format != StashFormat::DenseF16) CHECK(d.codec.deferred + d.relu_slots > 0);
    CHECK(d.codec.read_backs > 0);
    // The fixed layout's region top is the worst case: at least the packed peak's region part.
    CHECK(own.ex->stash().region_peak_bytes() >= cpu.ex->stash().region_peak_bytes());
  }
}

TEST_CASE("a codec without the INT4 code bitmap: bitmap_int4 names its key, auto keeps the codes in X",
          "[host][stash][quant]") {
  const QuantOptions q = test::luq();
  StashOptions so;
  so.format = StashFormat::BitmapI4;
  {
    Run own(std::make_unique<CodecCpu>());
    static_cast<CodecCpu&>(*own.be).codec.code_bitmap = false;
    CHECK_THROWS_WITH(Executor(own.g, *own.be, so, q),
                      Catch::Contains("memory.stash") && Catch::Contains("bitmap_int4") && Catch::Contains("cpu"));
    StashOptions per_layer;
    per_layer.layers.push_back({own.g.value(own.g.node(1).output).name, StashFormat::BitmapI4});
    CHECK_THROWS_WITH(Executor(own.g, *own.be, per_layer, q), Catch::Contains("memory.layers."));
  }
  // auto: the codes stay in the layers' X buffers; the same bits as the CPU's auto, which stashes them.
  so.format = StashFormat::Auto;
  Run cpu(make_cpu_backend()), own(std::make_unique<CodecCpu>());
  static_cast<CodecCpu&>(*own.be).codec.code_bitmap = false;
  train_alongside(cpu, own, so, q);
  CHECK(static_cast<CodecCpu&>(*own.be).codec.code_encodes == 0);
}

namespace {

// Each epoch's train loss, test loss and accuracy; `copies`: the backend's copies from the host,
// where it is a StagedCpu. 24 training images (3 steps an epoch), 10 test images: evaluation
// batches of 8 and 2, so each epoch after the first starts after a forward of 2 images.
std::vector<std::string> fit_lines(std::unique_ptr<Backend> backend, const std::string& tag, int* copies = nullptr) {
  Trainer t(test::small_fit_config(3), test::synthetic_dataset(24, 1), test::synthetic_dataset(10, 2),
            std::move(backend));
  std::vector<std::string> lines;
  for (const nlohmann::json& j : test::fit_quietly(t, "staged_" + tag))
    lines.push_back(j["train_loss"].dump() + " " + j["test_loss"].dump() + " " + j["test_acc"].dump());
  if (copies) *copies = dynamic_cast<StagedCpu&>(t.executor().backend()).from_host;
  return lines;
}

}  // namespace

// StagedCpu with a copy lane that runs its copies as late as the Backend contract allows: when
// compute work must wait for them (side_acquire) or the host must (side_wait). A feed that read a
// batch before acquiring it, or rewrote the staging before the copy ran, would train on other data.
class LateSideCopies final : public StagedCpu {
 public:
  int side_copies = 0, deferred = 0;  // copies issued; acquires that found copies not run yet
  void side_copy_from_host(const void* src, Tensor& dst) override {
    ++side_copies;
    pending_.push_back({src, dst});
  }
  void side_acquire() override {
    deferred += !pending_.empty();
    run();
  }
  void side_wait() override { run(); }
  ~LateSideCopies() override { CHECK(pending_.empty()); }

 private:
  struct Copy {
    const void* src;
    Tensor dst;
  };
  void run() {
    for (Copy& c : pending_) StagedCpu::copy_from_host(c.src, c.dst);
    pending_.clear();
  }
  std::vector<Copy> pending_;
};

TEST_CASE("fit through a copy lane that runs late: the next batch prefetched, the CPU's numbers bit for bit",
          "[host][training]") {
  // engine/train/input_feed.h: batch i + 1 is staged and sent while step i computes, then copied
  // into the executor's inputs at step i + 1. Training and evaluation see the same batches as the
  // CPU's in-place loader, and the accuracy readout reads each step's own labels.
  auto lane = std::make_unique<LateSideCopies>();
  LateSideCopies& l = *lane;
  Trainer t(test::small_fit_config(3), test::synthetic_dataset(24, 1), test::synthetic_dataset(10, 2),
            std::move(lane));
  std::vector<std::string> late;
  for (const nlohmann::json& j : test::fit_quietly(t, "late"))
    late.push_back(j["train_loss"].dump() + " " + j["test_loss"].dump() + " " + j["test_acc"].dump() + " " +
                   j["train_acc"].dump());
  Trainer d(test::small_fit_config(3), test::synthetic_dataset(24, 1), test::synthetic_dataset(10, 2),
            make_cpu_backend());
  std::vector<std::string> direct;
  for (const nlohmann::json& j : test::fit_quietly(d, "late_direct"))
    direct.push_back(j["train_loss"].dump() + " " + j["test_loss"].dump() + " " + j["test_acc"].dump() + " " +
                     j["train_acc"].dump());
  REQUIRE(direct.size() == 3);
  CHECK(late == direct);
  CHECK(l.side_copies == 2 * 3 * (3 + 2));  // images and labels of every training and evaluation batch
  CHECK(l.deferred == 3 * (3 + 2));         // every batch was still in flight when its step began
}

TEST_CASE("fit through a backend's copies: staged input batches, the CPU's numbers bit for bit", "[host][training]") {
  // The trainer's input batch goes through the feed's staging and copy lane where the host
  // cannot address the backend's memory, at the whole batch whatever the last forward's was (a
  // view sized by the last evaluation batch overflowed on the first GPU run).
  int copies = 0;
  const std::vector<std::string> copied = fit_lines(std::make_unique<StagedCpu>(), "staged", &copies);
  const std::vector<std::string> direct = fit_lines(make_cpu_backend(), "direct");
  REQUIRE(direct.size() == 3);
  CHECK(copied == direct);
  CHECK(copies >= 2 * 3 * (3 + 2));  // images and labels of every training and evaluation batch
}
