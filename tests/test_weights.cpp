// model.weights: the safetensors reader and writer (round trip, dtypes, hostile headers) and the
// loader's matching rules (exact fit, head swap, missing / unexpected / mismatched tensors, the
// option-A / B shortcut hint), each failure a UserError naming the file and tensors.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/executor.h"
#include "engine/init.h"
#include "engine/io/safetensors.h"
#include "engine/train/checkpoint.h"
#include "engine/train/weights.h"
#include "models/models.h"
#include "tests/test_util.h"

using namespace et;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

using test::TempDir;

struct Model {
  Graph g;
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::unique_ptr<Executor> ex;
  Model(const std::string& name, uint64_t seed, int64_t classes = 10, char shortcut = 'B') {
    ModelSpec s;
    s.name = name;
    s.batch = 2;
    s.num_classes = classes;
    s.shortcut = shortcut;
    build_model(g, s);
    ex = std::make_unique<Executor>(g, *be);
    init_parameters(*ex, seed);
    for (int b : g.buffers()) {  // BN statistics unlike the initial ones
      Tensor t = ex->value(b);
      for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = float(i % 5) + float(seed) * 0.25f;
    }
  }
  std::vector<int> tensors() const {
    std::vector<int> ids = g.params();
    for (int b : g.buffers()) ids.push_back(b);
    return ids;
  }
  void save(const std::string& path) const {
    std::vector<SafetensorsOut> out;
    for (int id : tensors()) {
      const Value& v = g.value(id);
      out.push_back({v.name, std::vector<int64_t>(v.shape.d, v.shape.d + v.shape.ndim), ex->value(id).f32()});
    }
    write_safetensors(path, out);
  }
  bool same_as(const Model& o, const std::string& except = "") const {
    for (int id : tensors()) {
      const std::string& name = g.value(id).name;
      if (!except.empty() && name.rfind(except, 0) == 0) continue;
      const Tensor a = ex->value(id), b = o.ex->value(o.g.find_value(name));
      if (std::memcmp(a.data, b.data, a.nbytes()) != 0) return false;
    }
    return true;
  }
};

// A safetensors file from a header text and data bytes, for hand-made (and broken) files.
void write_raw(const std::string& path, const std::string& header, const std::string& data, int64_t hlen = -1) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = hlen < 0 ? header.size() : uint64_t(hlen);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
}

std::string load_error(const std::string& path, Executor& ex) {
  try {
    load_weights(path, ex);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors round trip is exact and the header follows the format", "[weights]") {
  TempDir t;
  Model a("resnet8", 1), b("resnet8", 2);
  REQUIRE_FALSE(a.same_as(b));
  a.save(t.file("a.safetensors"));
  const WeightsReport r = load_weights(t.file("a.safetensors"), *b.ex);
  CHECK(a.same_as(b));
  CHECK(r.loaded == int(a.tensors().size()));
  CHECK_FALSE(r.head_swapped);
  // Header: 8-byte length, JSON, data 8-byte aligned; no temporary file left.
  SafetensorsFile f(t.file("a.safetensors"));
  CHECK(f.entries().size() == a.tensors().size());
  CHECK(f.find("layer2.0.shortcut.0.weight")->shape == std::vector<int64_t>{32, 16, 1, 1});
  CHECK(f.find("bn1.running_var")->dtype == "F32");
  CHECK_FALSE(fs::exists(t.file("a.safetensors.tmp")));
}

TEST_CASE("safetensors: F16, BF16 and F64 tensors are read as float32", "[weights]") {
  TempDir t;
  const uint16_t f16[2] = {0x3C00, 0xC000};  // 1, -2
  const uint16_t bf16[2] = {0x3F80, 0x4040};  // 1, 3
  const double f64[2] = {0.5, -0.25};
  std::string data(reinterpret_cast<const char*>(f16), 4);
  data += std::string(reinterpret_cast<const char*>(bf16), 4);
  data += std::string(reinterpret_cast<const char*>(f64), 16);
  write_raw(t.file("d.safetensors"),
            R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},)"
            R"("c":{"dtype":"F64","shape":[2],"data_offsets":[8,24]},"__metadata__":{"format":"pt"}})",
            data);
  SafetensorsFile f(t.file("d.safetensors"));
  float v[2];
  f.read_f32(*f.find("a"), v);
  CHECK((v[0] == 1.f && v[1] == -2.f));
  f.read_f32(*f.find("b"), v);
  CHECK((v[0] == 1.f && v[1] == 3.f));
  f.read_f32(*f.find("c"), v);
  CHECK((v[0] == 0.5f && v[1] == -0.25f));
  CHECK(f.metadata().at("format") == "pt");
}

TEST_CASE("safetensors: hostile or broken files are errors naming the file and tensor", "[weights]") {
  TempDir t;
  const std::string p = t.file("bad.safetensors");
  auto error_of = [&]() -> std::string {
    try {
      SafetensorsFile f(p);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  const std::string four(16, '\0');
  SECTION("too short") {
    std::ofstream(p) << "abc";
    CHECK_THAT(error_of(), Contains(p) && Contains("too short"));
  }
  SECTION("header length beyond the file (a hostile 2^60 does not allocate)") {
    write_raw(p, "{}", "", int64_t(1) << 60);
    CHECK_THAT(error_of(), Contains("exceeds the file"));
  }
  SECTION("not JSON") {
    write_raw(p, "{nope", "");
    CHECK_THAT(error_of(), Contains("unreadable header"));
  }
  SECTION("offsets outside the data (a truncated file)") {
    write_raw(p, R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'));
    CHECK_THAT(error_of(), Contains("tensor 'w'") && Contains("truncated"));
  }
  SECTION("shape and byte size disagree") {
    write_raw(p, R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", four);
    CHECK_THAT(error_of(), Contains("tensor 'w'") && Contains("needs 12 bytes"));
  }
  SECTION("a huge shape cannot overflow the size check") {
    write_raw(p, R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}})", four);
    CHECK_THAT(error_of(), Contains("tensor 'w'"));
  }
  SECTION("unknown dtype, negative size, overlapping tensors") {
    write_raw(p, R"({"w":{"dtype":"F8","shape":[4],"data_offsets":[0,4]}})", four);
    CHECK_THAT(error_of(), Contains("unknown dtype 'F8'"));
    write_raw(p, R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", four);
    CHECK_THAT(error_of(), Contains("non-size"));
    write_raw(p, R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
              four);
    CHECK_THAT(error_of(), Contains("overlap"));
  }
  SECTION("a missing file") {
    CHECK_THAT(error_of(), Contains("cannot open weights file"));
  }
}

TEST_CASE("weights that do not fit are listed by name and change nothing", "[weights]") {
  TempDir t;
  Model b_model("resnet8", 1), a_model("resnet8", 2, 10, 'A'), target("resnet8", 3);
  Model before("resnet8", 3);
  b_model.save(t.file("b.safetensors"));
  a_model.save(t.file("a.safetensors"));

  SECTION("option-A weights into an option-B model: missing shortcut tensors, with the hint") {
    const std::string e = load_error(t.file("a.safetensors"), *target.ex);
    CHECK_THAT(e, Contains(t.file("a.safetensors")) && Contains("missing") && Contains("layer2.0.shortcut.0.weight") &&
                      Contains("model.shortcut"));
  }
  SECTION("option-B weights into an option-A model: unexpected tensors") {
    Model a_target("resnet8", 4, 10, 'A');
    const std::string e = load_error(t.file("b.safetensors"), *a_target.ex);
    CHECK_THAT(e, Contains("unexpected") && Contains("layer3.0.shortcut.1.running_mean"));
  }
  SECTION("another architecture: shape mismatches") {
    Model r20("resnet20", 5);
    const std::string e = load_error(t.file("b.safetensors"), *r20.ex);
    CHECK_THAT(e, Contains("missing") && Contains("layer1.1.conv1.weight"));
  }
  SECTION("a non-finite value") {
    Model nan_model("resnet8", 6);
    nan_model.ex->value(nan_model.g.find_value("layer1.0.bn2.bias")).f32()[3] = std::nanf("");
    nan_model.save(t.file("nan.safetensors"));
    CHECK_THAT(load_error(t.file("nan.safetensors"), *target.ex), Contains("'layer1.0.bn2.bias'") && Contains("non-finite"));
  }
  CHECK(target.same_as(before));
}

TEST_CASE("head swap: another number of classes keeps the new classifier, loads the rest", "[weights]") {
  TempDir t;
  Model src("resnet8", 1, 100), dst("resnet8", 2, 10), fresh("resnet8", 2, 10);
  src.save(t.file("c100.safetensors"));
  const WeightsReport r = load_weights(t.file("c100.safetensors"), *dst.ex);
  CHECK(r.head_swapped);
  REQUIRE(r.lines.size() == 2);
  CHECK_THAT(r.lines[1], Contains("head swap") && Contains("100 classes") && Contains("linear.weight"));
  CHECK(dst.same_as(src, "linear."));  // everything but the classifier came from the file
  const Tensor w = dst.ex->value(dst.g.find_value("linear.weight")), w0 = fresh.ex->value(fresh.g.find_value("linear.weight"));
  CHECK(std::memcmp(w.data, w0.data, w.nbytes()) == 0);  // the classifier kept its initialisation
}

TEST_CASE("an edgetrain checkpoint is a weights file too", "[weights]") {
  TempDir t;
  Model a("resnet8", 1, 10, 'A'), b("resnet8", 2, 10, 'A');
  save_checkpoint(t.file("a.ckpt"), *a.ex, TrainProgress{"resnet8", 3, 40, 1, 0, 1.0, 0, {}});
  load_weights(t.file("a.ckpt"), *b.ex);
  CHECK(a.same_as(b));
  // Its tensors by name (what `edgetrain export` writes), optimizer state left out.
  std::string model;
  const auto tensors = read_checkpoint_tensors(t.file("a.ckpt"), &model);
  CHECK(model == "resnet8");
  CHECK(tensors.size() == a.tensors().size());
}
