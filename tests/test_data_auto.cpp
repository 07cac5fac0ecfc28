// data.channels / height / width / mean / std = "auto" (engine/data/auto.h): the shape and the
// normalisation from generated image folders (grayscale PNGs, colour JPEGs, mixed), the exact
// statistics, the errors on empty and mixed-size folders, the config round trip, the values a
// resumed run adopts, and end-to-end training with configs/resnet20_cifar10.json on such folders.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "engine/check.h"
#include "engine/data/auto.h"
#include "engine/data/dataset.h"
#include "engine/train/trainer.h"

#include <stb_image_write.h>  // compiled in tests/stb_image_write.cpp

#include "tests/test_util.h"

using namespace et;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

using test::TempDir;
using test::error_of;

std::vector<uint8_t> pixels(int w, int h, int n, const std::function<int(int, int, int)>& f) {
  std::vector<uint8_t> px(size_t(w * h * n));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < n; ++c) px[size_t((y * w + x) * n + c)] = uint8_t(f(y, x, c));
  return px;
}

void write_png(const fs::path& file, int w, int h, int n, const std::function<int(int, int, int)>& f) {
  fs::create_directories(file.parent_path());
  const auto px = pixels(w, h, n, f);
  REQUIRE(stbi_write_png(file.string().c_str(), w, h, n, px.data(), w * n) != 0);
}

void write_jpg(const fs::path& file, int w, int h, int n, const std::function<int(int, int, int)>& f) {
  fs::create_directories(file.parent_path());
  const auto px = pixels(w, h, n, f);
  REQUIRE(stbi_write_jpg(file.string().c_str(), w, h, n, px.data(), 90) != 0);
}

// A small classification folder: `per_class` train and `per_class / 2` test images in 2 classes,
// each image i of class k a smooth pattern (JPEG-friendly) offset by class.
enum class Kind { GrayPng, ColourJpg, ColourPng };
void make_folder(const fs::path& root, Kind kind, int side, int per_class) {
  for (const char* split : {"train", "test"})
    for (int k = 0; k < 2; ++k)
      for (int i = 0; i < (split[1] == 'r' ? per_class : per_class / 2); ++i) {
        const fs::path f = root / split / (k ? "dog" : "cat") / (std::to_string(i) + (kind == Kind::ColourJpg ? ".jpg" : ".png"));
        auto px = [&](int y, int x, int c) { return (40 + 100 * k + 3 * i + 2 * y + x + 50 * c) % 256; };
        if (kind == Kind::GrayPng) write_png(f, side, side, 1, px);
        if (kind == Kind::ColourPng) write_png(f, side, side, 3, px);
        if (kind == Kind::ColourJpg) write_jpg(f, side, side, 3, px);
      }
}

Config folder_config(const fs::path& root, const std::vector<std::string>& sets = {}) {
  std::vector<std::string> all = {"data.root=" + root.string(), "train.epochs=1", "train.batch_size=8", "train.threads=2"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config(std::string(EDGETRAIN_SOURCE_DIR) + "/configs/resnet20_cifar10.json", all);
}

// The statistics the slow way: two passes in double over the decoded pixels.
void direct_stats(const Dataset& d, std::vector<double>* mean, std::vector<double>* sd) {
  const size_t P = size_t(d.height) * size_t(d.width);
  for (int c = 0; c < d.channels; ++c) {
    double s = 0, q = 0;
    for (int64_t i = 0; i < d.size; ++i)
      for (size_t k = 0; k < P; ++k) s += d.image(i)[size_t(c) * P + k] / 255.0;
    const double m = s / double(d.size * int64_t(P));
    for (int64_t i = 0; i < d.size; ++i)
      for (size_t k = 0; k < P; ++k) q += std::pow(d.image(i)[size_t(c) * P + k] / 255.0 - m, 2);
    mean->push_back(m);
    sd->push_back(std::sqrt(q / double(d.size * int64_t(P))));
  }
}

struct Quiet : Progress {
  Quiet() : Progress(std::fopen("/dev/null", "w")) {}
};

}  // namespace

TEST_CASE("channel_stats: exact per-channel mean and population std", "[data][auto]") {
  Dataset d;
  d.size = 37;
  d.channels = 3;
  d.height = 5;
  d.width = 7;
  d.pixels.resize(size_t(37 * 3 * 5 * 7));
  uint32_t x = 12345;
  for (auto& p : d.pixels) p = uint8_t((x = x * 1664525u + 1013904223u) >> 24);
  for (size_t i = 0; i < size_t(37 * 35); ++i) d.pixels[size_t(i / 35) * 105 + 35 + i % 35] /= 4;  // channel 1 darker
  const ChannelStats st = channel_stats(d);
  std::vector<double> mean, sd;
  direct_stats(d, &mean, &sd);
  REQUIRE(st.mean.size() == 3);
  CHECK(st.pixels == 37 * 35);
  for (int c = 0; c < 3; ++c) {
    CHECK(st.mean[size_t(c)] == Approx(mean[size_t(c)]).epsilon(1e-12));
    CHECK(st.std[size_t(c)] == Approx(sd[size_t(c)]).epsilon(1e-12));
  }
  CHECK(st.mean[1] < st.mean[0] / 2);
  // Planes larger than the 65536-byte block of 32-bit sums; all 255: mean 1, std 0.
  Dataset big;
  big.size = 2;
  big.channels = 1;
  big.height = big.width = 300;
  big.pixels.assign(size_t(2 * 300 * 300), 255);
  const ChannelStats b = channel_stats(big);
  CHECK(b.mean[0] == 1.0);
  CHECK(b.std[0] == 0.0);
}

TEST_CASE("auto shape: grayscale PNGs, colour JPEGs, mixed channels", "[data][auto]") {
  TempDir g, c, m;
  make_folder(g.path, Kind::GrayPng, 28, 4);
  make_folder(c.path, Kind::ColourJpg, 64, 4);
  Config cfg = folder_config(g.path);
  CHECK(cfg.shape_auto());
  CHECK(cfg.stats_auto());
  CHECK(cfg.resolved()["data"]["channels"] == "auto");
  CHECK(cfg.resolved()["data"]["mean"] == "auto");
  std::string line = resolve_data_shape(cfg);
  CHECK((cfg.model.channels == 1 && cfg.model.height == 28 && cfg.model.width == 28));
  CHECK_THAT(line, Catch::Contains("1x28x28") && Catch::Contains("all grayscale") && Catch::Contains("8 training images"));
  CHECK(resolve_data_shape(cfg).empty());  // nothing auto any more

  cfg = folder_config(c.path);
  resolve_data_shape(cfg);
  CHECK((cfg.model.channels == 3 && cfg.model.height == 64 && cfg.model.width == 64));

  // Explicit keys stay; only the auto ones are filled.
  cfg = folder_config(c.path, {"data.channels=1", "data.height=32", "data.resize=stretch"});
  resolve_data_shape(cfg);
  CHECK((cfg.model.channels == 1 && cfg.model.height == 32 && cfg.model.width == 64));

  // Gray and colour mixed: 3 channels, the gray image replicated (as PIL's convert("RGB")).
  write_png(m.path / "train" / "a" / "0.png", 16, 16, 1, [](int y, int x, int) { return 7 * y + x; });
  write_png(m.path / "train" / "a" / "1.png", 16, 16, 4, [](int, int x, int ch) { return ch == 3 ? 0 : 9 * x + ch; });
  cfg = folder_config(m.path);
  line = resolve_data_shape(cfg);
  CHECK((cfg.model.channels == 3 && cfg.model.height == 16));
  CHECK_THAT(line, Catch::Contains("1 colour, 1 grayscale replicated to RGB"));
  const Dataset d = load_image_folder(m.path.string(), Split::Train, ImageFolderOptions{3, 16, 16, "none"});
  for (int ch = 0; ch < 3; ++ch) CHECK(d.image(0)[size_t(ch) * 256 + 16 * 2 + 5] == 7 * 2 + 5);
}

TEST_CASE("auto shape: empty and mixed-size folders are errors naming the folder and files", "[data][auto]") {
  TempDir t;
  Config cfg = folder_config(t.path);
  CHECK_THAT(error_of([&] { resolve_data_shape(cfg); }), Catch::Contains((t.path / "train").string()));
  fs::create_directories(t.path / "train" / "cat");
  std::string e = error_of([&] { resolve_data_shape(cfg); });
  CHECK_THAT(e, Catch::Contains("no images") && Catch::Contains((t.path / "train").string()));

  write_png(t.path / "train" / "cat" / "a.png", 32, 32, 3, [](int, int, int) { return 1; });
  write_png(t.path / "train" / "cat" / "b.png", 32, 32, 3, [](int, int, int) { return 2; });
  write_png(t.path / "train" / "cat" / "c.png", 40, 30, 3, [](int, int, int) { return 3; });
  write_png(t.path / "train" / "dog" / "d.png", 40, 30, 3, [](int, int, int) { return 4; });
  write_png(t.path / "train" / "dog" / "e.png", 40, 30, 3, [](int, int, int) { return 5; });
  e = error_of([&] { resolve_data_shape(cfg); });
  CHECK_THAT(e, Catch::Contains("data.height / data.width = auto") && Catch::Contains((t.path / "train").string()) &&
                    Catch::Contains((t.path / "train" / "cat" / "a.png").string() + " is 32x32") &&
                    Catch::Contains((t.path / "train" / "cat" / "c.png").string() + " is 40x30") &&
                    Catch::Contains("2 sizes among 5 images") && Catch::Contains("data.resize"));
  CHECK(cfg.shape_auto());

  // With a resize rule: the most common size, 40x30 (3 of 5).
  cfg = folder_config(t.path, {"data.resize=center_crop"});
  CHECK_THAT(resolve_data_shape(cfg), Catch::Contains("2 sizes, the most common 40x30 (3 images)"));
  CHECK((cfg.model.height == 30 && cfg.model.width == 40));
  // On a tie, the size met first in file order.
  fs::remove(t.path / "train" / "dog" / "e.png");
  cfg = folder_config(t.path, {"data.resize=stretch"});
  resolve_data_shape(cfg);
  CHECK((cfg.model.height == 32 && cfg.model.width == 32));
  // Explicit height and width: no size is auto, mixed sizes are left to data.resize.
  cfg = folder_config(t.path, {"data.height=32", "data.width=32"});
  resolve_data_shape(cfg);
  CHECK(cfg.model.channels == 3);

  // A size the model cannot take.
  TempDir s;
  write_png(s.path / "train" / "x" / "0.png", 4, 6, 1, [](int, int, int) { return 0; });
  cfg = folder_config(s.path);
  CHECK_THAT(error_of([&] { resolve_data_shape(cfg); }),
             Catch::Contains("4x6") && Catch::Contains("8..1024") && Catch::Contains((s.path / "train").string()));
}

TEST_CASE("auto channels against per-channel values given", "[data][auto]") {
  TempDir g;
  make_folder(g.path, Kind::GrayPng, 28, 2);
  // resnet20_cifar10_short.json pins 3-channel CIFAR statistics: on a grayscale folder that is an
  // error saying what to change, not a silent conversion.
  Config cfg = load_config(std::string(EDGETRAIN_SOURCE_DIR) + "/configs/resnet20_cifar10_short.json",
                           {"data.root=" + g.path.string()});
  const std::string e = error_of([&] { resolve_data_shape(cfg); });
  CHECK_THAT(e, Catch::Contains("data.mean has 3 values") && Catch::Contains("grayscale") &&
                    Catch::Contains("\"auto\"") && Catch::Contains("data.channels = 3"));
  cfg = load_config(std::string(EDGETRAIN_SOURCE_DIR) + "/configs/resnet20_cifar10_short.json",
                    {"data.root=" + g.path.string(), "data.channels=3"});
  resolve_data_shape(cfg);
  CHECK((cfg.model.channels == 3 && cfg.model.height == 28));
  cfg = folder_config(g.path, {"data.mean=[0.5]", "data.std=[0.25]"});
  resolve_data_shape(cfg);
  CHECK(cfg.model.channels == 1);
}

TEST_CASE("auto in the config: parsing, defaults, round trip, bad values", "[config][auto]") {
  const json base = {{"model", {{"name", "resnet8"}}}, {"data", {{"root", "/x"}}}};
  Config c = parse_config(base, "t.json");
  CHECK((c.model.channels == 0 && c.model.height == 0 && c.model.width == 0));
  CHECK((c.data.mean.empty() && c.data.std.empty()));
  for (const char* k : {"channels", "height", "width", "mean", "std"}) CHECK(c.resolved()["data"][k] == "auto");
  CHECK(parse_config(c.resolved(), "r.json").resolved() == c.resolved());
  json j = base;
  j["data"].update({{"channels", "auto"}, {"height", 40}, {"width", "auto"}, {"mean", {0.5}}, {"std", "auto"}});
  c = parse_config(j, "t.json");
  CHECK((c.model.channels == 0 && c.model.height == 40 && c.model.width == 0 && c.data.mean.size() == 1));
  CHECK(parse_config(c.resolved(), "r.json").resolved() == c.resolved());

  auto error_for = [&](const json& data) {
    json k = base;
    k["data"].update(data);
    return error_of([&] { parse_config(k, "t.json"); });
  };
  CHECK_THAT(error_for({{"height", "automatic"}}), Catch::Contains("data.height") && Catch::Contains("\"auto\""));
  CHECK_THAT(error_for({{"mean", "mean"}}), Catch::Contains("data.mean") && Catch::Contains("\"auto\" or an array"));
  CHECK_THAT(error_for({{"channels", 2}}), Catch::Contains("data.channels") && Catch::Contains("1, 3 or \"auto\""));
  CHECK_THAT(error_for({{"width", 4}}), Catch::Contains("data.width") && Catch::Contains("8..1024"));
  CHECK_THAT(error_for({{"mean", {0.5, 0.5}}}), Catch::Contains("data.mean") && Catch::Contains("1 or 3 values"));
  CHECK_THAT(error_for({{"mean", {0.5}}, {"std", {0.2, 0.2, 0.2}}}), Catch::Contains("data.std"));
  CHECK_THAT(error_for({{"channels", 1}, {"std", {0.2, 0.2, 0.2}}}), Catch::Contains("data.std") && Catch::Contains("(1)"));
  CHECK_THAT(error_for({{"std", {0.0}}}), Catch::Contains("data.std") && Catch::Contains("positive"));
  // 0 and [] are what "auto" is held as, never a way to write it.
  CHECK_THAT(error_for({{"channels", 0}}), Catch::Contains("data.channels") && Catch::Contains("= 0"));
  CHECK_THAT(error_for({{"height", 0}}), Catch::Contains("data.height") && Catch::Contains("= 0"));
  CHECK_THAT(error_for({{"mean", json::array()}}), Catch::Contains("data.mean") && Catch::Contains("one value per channel"));
}

TEST_CASE("resumed runs: auto keys adopt the run's saved values", "[config][auto]") {
  Config c = parse_config({{"model", {{"name", "resnet8"}}}, {"data", {{"root", "/x"}, {"height", 40}}}}, "t.json");
  const json saved = {{"data",
                       {{"channels", 1}, {"height", 28}, {"width", 28}, {"mean", {0.13f}}, {"std", {0.31f}}}}};
  const auto keys = adopt_saved_data(c, saved);
  CHECK(keys == std::vector<std::string>{"data.channels", "data.width", "data.mean", "data.std"});
  CHECK((c.model.channels == 1 && c.model.height == 40 && c.model.width == 28));  // height was explicit: kept
  CHECK(c.resolved()["data"]["mean"] == saved["data"]["mean"]);  // the same float, written the same
  // Values a config.json cannot hold stay auto (the comparison then names the key).
  Config d = parse_config({{"model", {{"name", "resnet8"}}}, {"data", {{"root", "/x"}}}}, "t.json");
  CHECK(adopt_saved_data(d, {{"data", {{"channels", 2}, {"height", "auto"}, {"mean", {0.1, 0.2}}}}}).empty());
  CHECK(adopt_saved_data(d, json::object()).empty());
  CHECK(d.shape_auto());
}

// The target: configs/resnet20_cifar10.json with data.root set, and nothing else about
// the data, trains on 28x28 grayscale PNGs and on 64x64 colour JPEGs; the resolved config holds
// the numbers, which equal a direct computation, and it reproduces the inputs exactly.
TEST_CASE("resnet20_cifar10.json trains on a grayscale PNG and a colour JPEG folder", "[data][auto][training]") {
  for (const Kind kind : {Kind::GrayPng, Kind::ColourJpg}) {
    const int side = kind == Kind::GrayPng ? 28 : 64, C = kind == Kind::GrayPng ? 1 : 3;
    INFO((kind == Kind::GrayPng ? "gray 28x28 PNG" : "colour 64x64 JPEG"));
    TempDir t;
    make_folder(t.path / "data", kind, side, 8);
    const Config cfg = folder_config(t.path / "data");
    Trainer tr(cfg, true);
    const Config& r = tr.config();
    CHECK((r.model.channels == C && r.model.height == side && r.model.width == side));
    REQUIRE(tr.notes().size() == 2);
    CHECK_THAT(tr.notes()[1], Catch::Contains("data.mean / data.std = auto over the 16 training images"));
    const Dataset d = load_image_folder((t.path / "data").string(), Split::Train, ImageFolderOptions{C, side, side, "none"});
    std::vector<double> mean, sd;
    direct_stats(d, &mean, &sd);
    REQUIRE(r.data.mean.size() == size_t(C));
    for (int c = 0; c < C; ++c) {
      CHECK(r.data.mean[size_t(c)] == Approx(mean[size_t(c)]).epsilon(1e-6));
      CHECK(r.data.std[size_t(c)] == Approx(sd[size_t(c)]).epsilon(1e-6));
    }
    const json res = r.resolved();
    CHECK(res["data"]["channels"] == C);
    CHECK(res["data"]["height"] == side);
    CHECK(res["data"]["mean"].size() == size_t(C));
    CHECK(parse_config(res, "config.json").resolved() == res);  // what config.json holds parses back

    Quiet quiet;
    const fs::path out = t.path / "run";
    fs::create_directories(out);
    tr.fit(out.string(), false, quiet);
    std::ifstream in(out / "metrics.jsonl");
    std::string line;
    REQUIRE(std::getline(in, line));
    CHECK(std::isfinite(json::parse(line)["train_loss"].get<double>()));

    // eval from the auto config (train split recomputed) equals eval from the resolved one.
    Trainer a(cfg, false), b(parse_config(res, "config.json"), false);
    CHECK(a.config().resolved() == res);
    CHECK(b.notes().empty());
    CHECK(a.train_data() == nullptr);
    const EvalResult ea = a.evaluate(), eb = b.evaluate();
    CHECK(ea.loss == eb.loss);
    CHECK(ea.images == 8);
  }
}

TEST_CASE("auto mean / std over the training subset, and a constant channel is an error", "[data][auto]") {
  TempDir t;
  make_folder(t.path, Kind::ColourPng, 16, 10);
  const Config cfg = folder_config(t.path, {"data.train_subset=8", "data.test_subset=4"});
  Trainer tr(cfg, true);
  REQUIRE(tr.train_data()->size == 8);
  const ChannelStats st = channel_stats(*tr.train_data());
  for (size_t c = 0; c < 3; ++c) CHECK(tr.config().data.mean[c] == float(st.mean[c]));
  const ChannelStats all = channel_stats(load_image_folder(t.path.string(), Split::Train, ImageFolderOptions{3, 16, 16, "none"}));
  CHECK(all.mean[0] != st.mean[0]);  // the subset's, not the whole split's

  TempDir k;
  for (int i = 0; i < 8; ++i)
    write_png(k.path / (i < 6 ? "train" : "test") / "a" / (std::to_string(i) + ".png"), 8, 8, 3,
              [i](int y, int x, int c) { return c == 1 ? 77 : 10 * i + y + x; });
  const std::string e = error_of([&] { Trainer bad(folder_config(k.path, {"train.batch_size=2"}), true); });
  CHECK_THAT(e, Catch::Contains("data.std = auto: channel 1") && Catch::Contains("constant") &&
                    Catch::Contains("every pixel 77 / 255"));
  Trainer ok(folder_config(k.path, {"train.batch_size=2", "data.std=[0.2, 0.2, 0.2]"}), true);
  CHECK(ok.config().data.mean[1] == float(77 / 255.0));
}

// stb_image 2.27 returns a gray (or RGB) PNG with a tRNS chunk with an alpha channel added when
// asked for the channels as stored, and reports the count without it: the pixels were read with
// the wrong stride. decode_image asks for the header's count.
TEST_CASE("image decode: a grayscale PNG with a tRNS chunk", "[data]") {
  TempDir t;
  const fs::path f = t.path / "g.png";
  write_png(f, 6, 4, 1, [](int y, int x, int) { return 30 * y + x; });
  std::ifstream in(f, std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // tRNS for gray: one 16-bit sample; stb checks no CRC. After IHDR (8 + 25 bytes).
  const std::vector<uint8_t> trns = {0, 0, 0, 2, 't', 'R', 'N', 'S', 0, 31, 0, 0, 0, 0};
  b.insert(b.begin() + 33, trns.begin(), trns.end());
  for (int channels : {1, 3}) {
    std::vector<uint8_t> out(size_t(channels * 24));
    decode_image(b.data(), b.size(), "g.png", ImageFolderOptions{channels, 4, 6, "none"}, out.data());
    for (int c = 0; c < channels; ++c)
      for (int y = 0; y < 4; ++y)
        for (int x = 0; x < 6; ++x) CHECK(int(out[size_t(c * 24 + y * 6 + x)]) == 30 * y + x);
  }
}
