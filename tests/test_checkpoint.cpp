// Checkpoints: exact round trip; corrupt, truncated or foreign files are rejected with the file
// named and the model left untouched.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/train/checkpoint.h"
#include "engine/train/trainer.h"
#include "memory/uss.h"
#include "models/models.h"
#include "tests/fit_helper.h"
#include "tests/synthetic_data.h"
#include "tests/test_util.h"

using namespace et;
namespace fs = std::filesystem;

namespace {

struct Model {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;
  explicit Model(const std::string& name, uint64_t seed) {
    ModelSpec s;
    s.name = name;
    s.batch = 4;
    build_model(g, s);
    ex = std::make_unique<Executor>(g, *be);
    init_parameters(*ex, seed);
    // Non-trivial optimizer state and BN statistics.
    for (int p : g.params()) {
      Tensor m = ex->opt_slot(p, 0);
      for (int64_t i = 0; i < m.numel(); ++i) m.f32()[i] = float(i % 7) * 0.125f + float(seed);
    }
    for (int b : g.buffers()) {
      Tensor t = ex->value(b);
      for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = float(i % 5) + float(seed);
    }
  }
  std::vector<float> all() const {
    std::vector<float> out;
    for (int id : g.params()) {
      for (Tensor t : {ex->value(id), ex->opt_slot(id, 0)}) out.insert(out.end(), t.f32(), t.f32() + t.numel());
    }
    for (int id : g.buffers()) out.insert(out.end(), ex->value(id).f32(), ex->value(id).f32() + ex->value(id).numel());
    return out;
  }
};

std::string tmp(const std::string& name) {
  return (fs::temp_directory_path() / ("edgetrain_ckpt_" + std::to_string(::getpid()) + "_" + name)).string();
}

std::vector<char> read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_all(const std::string& p, const std::vector<char>& b) {
  std::ofstream(p, std::ios::binary).write(b.data(), std::streamsize(b.size()));
}

}  // namespace

TEST_CASE("checkpoint round trip restores every tensor and the progress", "[checkpoint]") {
  Model a("resnet8", 1), b("resnet8", 2);
  REQUIRE(a.all() != b.all());
  const std::string path = tmp("rt.ckpt");
  TrainProgress pr{"resnet8", 4, 1234, 99, 0.5, 0.125 * 0.1f, 2, {}};  // after two divergence rollbacks
  pr.fp32_layers = {"layer2.0.conv1", "layer1.0.conv2"};               // ... which raised these to FP32
  save_checkpoint(path, *a.ex, pr);
  CHECK_FALSE(fs::exists(path + ".tmp"));
  const TrainProgress got = load_checkpoint(path, *b.ex, "resnet8");
  CHECK(got.epoch == 4);
  CHECK(got.step == 1234);
  CHECK(got.seed == 99);
  CHECK(got.lr_factor == pr.lr_factor);  // exactly: the resumed run trains at the same rate
  CHECK(got.rollbacks == 2);
  CHECK(got.fp32_layers == pr.fp32_layers);
  CHECK(a.all() == b.all());
  // A raised layer the model does not have (or that is not a conv / linear) is an error naming it.
  for (const char* bad : {"layer9.conv1", "layer1.0.bn1"}) {
    pr.fp32_layers = {bad};
    save_checkpoint(path, *a.ex, pr);
    CHECK_THROWS_WITH(load_checkpoint(path, *b.ex, "resnet8"), Catch::Contains("fp32_layers") && Catch::Contains(bad));
  }
  // Without rollbacks the factor is exactly 1.
  save_checkpoint(path, *a.ex, TrainProgress{"resnet8", 0, 10, 1, 0, 1.0, 0, {}});
  CHECK(load_checkpoint(path, *b.ex, "resnet8").lr_factor == 1.0);
  fs::remove(path);
}

TEST_CASE("bad checkpoints are rejected and change nothing", "[checkpoint]") {
  Model a("resnet8", 1), b("resnet8", 2);
  const std::string path = tmp("bad.ckpt");
  save_checkpoint(path, *a.ex, TrainProgress{"resnet8", 0, 10, 1, 0, 1.0, 0, {}});
  const auto bytes = read_all(path);
  const auto before = b.all();

  SECTION("truncated") {
    write_all(path, std::vector<char>(bytes.begin(), bytes.begin() + int64_t(bytes.size() / 2)));
    CHECK_THROWS_WITH(load_checkpoint(path, *b.ex, "resnet8"), Catch::Contains(path) && Catch::Contains("checksum"));
  }
  SECTION("one flipped bit in the data") {
    auto c = bytes;
    c[c.size() - 100] ^= 0x10;
    write_all(path, c);
    CHECK_THROWS_WITH(load_checkpoint(path, *b.ex, "resnet8"), Catch::Contains("corrupt"));
  }
  SECTION("not a checkpoint") {
    write_all(path, std::vector<char>{'h', 'e', 'l', 'l', 'o'});
    CHECK_THROWS_WITH(load_checkpoint(path, *b.ex, "resnet8"), Catch::Contains("not an edgetrain checkpoint"));
  }
  SECTION("missing") {
    fs::remove(path);
    CHECK_THROWS_WITH(load_checkpoint(path, *b.ex, "resnet8"), Catch::Contains(path));
  }
  SECTION("another model") {
    Model c("resnet20", 3);
    const auto c_before = c.all();
    CHECK_THROWS_WITH(load_checkpoint(path, *c.ex, "resnet20"),
                      Catch::Contains("resnet8") && Catch::Contains("resnet20"));
    CHECK(c.all() == c_before);
  }
  SECTION("a header with a valid CRC but fields of the wrong kind or range") {
    // Rewrites the JSON header and recomputes the CRC: what only a fuzzer or a bug would produce.
    uint64_t hlen;
    std::memcpy(&hlen, bytes.data() + 8, 8);
    const std::string header(bytes.data() + 16, size_t(hlen));
    for (const auto& [from, to, why] : std::vector<std::array<std::string, 3>>{
             {"\"epoch\":0", "\"epoch\":1e300", "'epoch'"},
             {"\"epoch\":0", "\"epoch\":-7", "'epoch' = -7 is out of range"},
             {"\"step\":10", "\"step\":\"ten\"", "'step'"},
             {"\"seed\":1", "\"seed\":-1", "'seed'"},
             {"\"model\":\"resnet8\"", "\"model\":8", "'model'"},
             {"\"tensors\":[{", "\"tensors\":[7,{", "tensors"},
             {"{\"name\":\"conv1.weight\",\"role\":\"param\",\"shape\":[16,3,3,3]}", "[1]", "tensor 0 is [1]"}}) {
      const size_t at = header.find(from);
      REQUIRE(at != std::string::npos);
      std::string h = header;
      h.replace(at, from.size(), to);
      std::vector<char> c(bytes.begin(), bytes.begin() + 8);
      const uint64_t n = h.size();
      c.insert(c.end(), reinterpret_cast<const char*>(&n), reinterpret_cast<const char*>(&n) + 8);
      c.insert(c.end(), h.begin(), h.end());
      c.insert(c.end(), bytes.begin() + int64_t(16 + hlen), bytes.end() - 4);
      const uint32_t crc = crc32_update(0, c.data(), c.size());
      c.insert(c.end(), reinterpret_cast<const char*>(&crc), reinterpret_cast<const char*>(&crc) + 4);
      INFO(h.substr(0, 120));
      CHECK_THROWS_WITH(load_checkpoint_bytes(c.data(), c.size(), path, *b.ex, "resnet8"),
                        Catch::Contains(path) && Catch::Contains(why));
    }
  }
  SECTION("same name, other architecture (num_classes)") {
    Graph g;
    ModelSpec s;
    s.name = "resnet8";
    s.num_classes = 7;
    s.batch = 4;
    build_model(g, s);
    auto be = make_cpu_backend();
    Executor ex(g, *be);
    CHECK_THROWS_WITH(load_checkpoint(path, ex, "resnet8"), Catch::Contains("linear.weight"));
  }
  CHECK(b.all() == before);
  fs::remove(path);
}

TEST_CASE("saving into an unwritable place fails cleanly and keeps the old file", "[checkpoint]") {
  Model a("resnet8", 1);
  CHECK_THROWS_WITH(save_checkpoint("/nonexistent-dir/x.ckpt", *a.ex, TrainProgress{"resnet8", 0, 0, 1, 0, 1.0, 0, {}}),
                    Catch::Contains("/nonexistent-dir/x.ckpt"));
}

TEST_CASE("a checkpoint that is not a regular file, or empty, is named and rejected", "[checkpoint]") {
  Model b("resnet8", 2);
  const auto before = b.all();
  const std::string dir = tmp("dir.ckpt");
  fs::create_directories(dir);
  CHECK_THROWS_WITH(load_checkpoint(dir, *b.ex, "resnet8"), Catch::Contains(dir) && Catch::Contains("not a regular file"));
  CHECK_THROWS_WITH(read_checkpoint_tensors(dir, nullptr), Catch::Contains(dir) && Catch::Contains("not a regular file"));
  fs::remove(dir);
  const std::string empty = tmp("empty.ckpt");
  write_all(empty, {});
  CHECK_THROWS_WITH(load_checkpoint(empty, *b.ex, "resnet8"), Catch::Contains(empty) && Catch::Contains("too short"));
  CHECK_THROWS_WITH(read_checkpoint_tensors(empty, nullptr), Catch::Contains(empty) && Catch::Contains("too short"));
  fs::remove(empty);
  CHECK(b.all() == before);
}

// A load reads the file where the page cache holds it: its peak is the file's pages (clean, which
// the kernel can drop under pressure), not a heap copy of them. The growing vector it used to read
// into raised the USS by 135 MB for this 74 MB file (the last doubling holds both buffers).
TEST_CASE("loading a checkpoint needs no copy of the file beside it", "[checkpoint]") {
  Model a("vgg11_bn", 1), b("vgg11_bn", 2);
  const std::string path = tmp("vgg.ckpt");
  save_checkpoint(path, *a.ex, TrainProgress{"vgg11_bn", 0, 10, 1, 0, 1.0, 0, {}});
  const double file_mb = double(fs::file_size(path)) / 1e6;
  REQUIRE(file_mb > 50);  // params and momentum of 9 M parameters
  UssPeak peak;
  const std::optional<size_t> before = read_uss_bytes();
  if (!before) ET_SKIP("USS cannot be read here (no /proc)");
  peak.begin_step();
  load_checkpoint(path, *b.ex, "vgg11_bn");
  peak.end_step();
  const double after_mb = (double(*read_uss_bytes()) - double(*before)) / 1e6;
  const double peak_mb = (double(*peak.peak()) - double(*before)) / 1e6;
  fs::remove(path);
  INFO("file " << file_mb << " MB; USS during the load +" << peak_mb << " MB, after it +" << after_mb << " MB ("
               << uss_method_name(peak.method()) << ")");
  CHECK(b.all() == a.all());
  if (et::test::kAddressSanitizer) ET_SKIP("USS margins under AddressSanitizer (its shadow and quarantine)");
  CHECK(peak_mb < 1.1 * file_mb);
  CHECK(after_mb < 4.0);
}

TEST_CASE("a new run that stops before it records anything leaves no folder, one that recorded is kept",
          "[checkpoint]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("edgetrain_unstarted_" + std::to_string(::getpid()));
  std::FILE* null = std::fopen("/dev/null", "w");
  Progress quiet(null);
  // Stops with an error (as an out-of-memory does) at training step `at`: 2 steps an epoch.
  auto run_stopping_at = [&](int64_t at) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    write_file_durably((dir / "config.json").string(), "{}\n");  // (train writes it before fit)
    Trainer t(test::small_fit_config(2), test::synthetic_dataset(16, 1), test::synthetic_dataset(8, 2));
    t.set_before_step([&](Executor&, int64_t step) {
      if (step == at) user_error("out of memory: (injected at step ", step, ")");
    });
    CHECK_THROWS_AS(t.fit(dir.string(), false, quiet), UserError);
  };
  run_stopping_at(0);  // in the first step: nothing recorded
  REQUIRE(fs::exists(dir / "config.json"));
  CHECK(discard_unstarted_run(dir.string(), true));
  CHECK_FALSE(fs::exists(dir));
  run_stopping_at(0);  // the same in a folder the run did not make: emptied, kept
  CHECK(discard_unstarted_run(dir.string(), false));
  CHECK(fs::is_directory(dir));
  CHECK(fs::is_empty(dir));
  run_stopping_at(3);  // in epoch 2: epoch 1's record and checkpoint stay
  CHECK_FALSE(discard_unstarted_run(dir.string(), true));
  CHECK(fs::exists(dir / "checkpoint_last.ckpt"));
  CHECK(fs::file_size(dir / "metrics.jsonl") > 0);
  CHECK(fs::exists(dir / "config.json"));
  // Something the run does not write (a folder): left alone.
  run_stopping_at(0);
  fs::create_directories(dir / "notes");
  CHECK_FALSE(discard_unstarted_run(dir.string(), true));
  CHECK(fs::exists(dir / "config.json"));
  std::fclose(null);
  fs::remove_all(dir);
}
