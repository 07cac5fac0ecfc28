// End-to-end training on a subset of ../shared/data/cifar10: loss falls, accuracy beats chance,
// same seed gives identical losses, and a resumed run equals an uninterrupted one.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "engine/train/trainer.h"
#include "tests/test_util.h"

using namespace et;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string cifar_root() { return std::string(EDGETRAIN_SOURCE_DIR) + "/../shared/data/cifar10"; }

// The real data set, decoded once for all tests of this file.
std::shared_ptr<const Dataset> cifar(Split split) {
  static std::shared_ptr<const Dataset> train, test;
  auto& slot = split == Split::Train ? train : test;
  if (!slot) slot = std::make_shared<Dataset>(load_dataset("image_folder", cifar_root(), split, ImageFolderOptions{}));
  return slot;
}

Config small_config(int epochs, int64_t train_images, int64_t batch) {
  json j = {{"model", {{"name", "resnet8"}}},
            {"data", {{"root", cifar_root()}, {"train_subset", train_images}, {"test_subset", 1000}}},
            {"train",
             {{"epochs", epochs},
              {"batch_size", batch},
              {"lr", 0.1},
              {"weight_decay", 5e-4},
              {"threads", 2},
              {"schedule", {{"type", "cosine"}}}}}};
  return parse_config(j, "<test>");
}

std::vector<json> read_metrics(const fs::path& dir) {
  std::vector<json> out;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("edgetrain_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

struct Quiet : Progress {
  Quiet() : Progress(std::fopen("/dev/null", "w")) {}
};

}  // namespace

TEST_CASE("a small ResNet on CIFAR-10 learns", "[training][cifar]") {
  if (!fs::exists(cifar_root())) ET_SKIP(cifar_root() << " not found");
  const Config cfg = small_config(3, 5000, 64);
  Trainer t(cfg, cifar(Split::Train), cifar(Split::Test));
  const EvalResult before = t.evaluate();
  const fs::path dir = fresh_dir("learns");
  Quiet quiet;
  t.fit(dir.string(), false, quiet);
  const auto m = read_metrics(dir);
  REQUIRE(m.size() == 3);
  for (const auto& row : m)
    for (const char* k : {"epoch", "train_loss", "train_acc", "test_loss", "test_acc", "img_per_s", "epoch_s",
                          "peak_uss_mb"})
      CHECK(row.contains(k));
  INFO("metrics: " << m[0].dump() << " / " << m[2].dump() << ", before " << before.acc);
  CHECK(m[2]["train_loss"].get<double>() < m[0]["train_loss"].get<double>());
  CHECK(m[2]["test_acc"].get<double>() > 0.35);  // chance is 0.10
  CHECK(m[2]["test_acc"].get<double>() > before.acc + 0.15);
  CHECK(m[2]["peak_uss_mb"].get<double>() > 0);
  fs::remove_all(dir);
}

TEST_CASE("training without a readable USS records null, never 0 MB", "[training][cifar][uss]") {
  if (!fs::exists(cifar_root())) ET_SKIP(cifar_root() << " not found");
  Trainer t(small_config(1, 128, 64), cifar(Split::Train), cifar(Split::Test));
  ProcFiles missing;
  missing.smaps_rollup = missing.smaps = missing.status = missing.clear_refs = "/nonexistent/proc";
  t.set_proc_files(missing);
  const fs::path dir = fresh_dir("no_uss");
  Quiet quiet;
  t.fit(dir.string(), false, quiet);
  const auto m = read_metrics(dir);
  REQUIRE(m.size() == 1);
  CHECK(m[0]["peak_uss_mb"].is_null());
  CHECK(m[0]["uss_method"] == "unavailable");
  // And with /proc: the kernel's high-water mark over every step.
  Trainer t2(small_config(1, 128, 64), cifar(Split::Train), cifar(Split::Test));
  const fs::path dir2 = fresh_dir("uss");
  t2.fit(dir2.string(), false, quiet);
  const auto m2 = read_metrics(dir2);
  REQUIRE(m2.size() == 1);
  CHECK(m2[0]["peak_uss_mb"].get<double>() > 0);
  CHECK(m2[0]["uss_method"] == "high-water mark (VmHWM)");
  fs::remove_all(dir);
  fs::remove_all(dir2);
}

TEST_CASE("same seed and threads give identical losses", "[training][cifar]") {
  if (!fs::exists(cifar_root())) ET_SKIP(cifar_root() << " not found");
  const Config cfg = small_config(1, 512, 32);
  std::vector<float> losses[2];
  for (auto& l : losses) {
    Trainer t(cfg, cifar(Split::Train), cifar(Split::Test));
    Executor& ex = t.executor();
    const Dataset& d = *t.train_data();
    Tensor x = ex.value(ex.graph().image_input), y = ex.value(ex.graph().label_input);
    for (int step = 0; step < 4; ++step) {
      for (int64_t i = 0; i < 32; ++i) {
        const int64_t src = (step * 32 + i) % d.size;
        const int64_t px = 3 * 32 * 32;
        for (int64_t k = 0; k < px; ++k) x.f32()[i * px + k] = d.pixels[size_t(src * px + k)] / 255.f - 0.5f;
        y.i32()[i] = d.labels[size_t(src)];
      }
      t.train_step(32, 0.05f);
      l.push_back(ex.loss());
    }
  }
  CHECK(losses[0] == losses[1]);
  CHECK(losses[0].back() != losses[0].front());
}

TEST_CASE("resume reproduces an uninterrupted run", "[training][cifar]") {
  if (!fs::exists(cifar_root())) ET_SKIP(cifar_root() << " not found");
  const Config cfg = small_config(2, 640, 64);
  const fs::path full = fresh_dir("full"), split = fresh_dir("split");
  Quiet quiet;
  {
    Trainer t(cfg, cifar(Split::Train), cifar(Split::Test));
    t.fit(full.string(), false, quiet);
  }
  {
    Trainer t(cfg, cifar(Split::Train), cifar(Split::Test));
    t.fit(split.string(), false, quiet, 1);  // interrupted after epoch 1
  }
  REQUIRE(read_metrics(split).size() == 1);
  {
    Trainer t(cfg, cifar(Split::Train), cifar(Split::Test));  // a new process, in effect
    t.fit(split.string(), true, quiet);
  }
  const auto a = read_metrics(full), b = read_metrics(split);
  REQUIRE(a.size() == 2);
  REQUIRE(b.size() == 2);
  for (size_t e = 0; e < 2; ++e)
    for (const char* k : {"epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr"}) {
      INFO("epoch " << e << " key " << k);
      CHECK(a[e][k] == b[e][k]);
    }
  fs::remove_all(full);
  fs::remove_all(split);
}
