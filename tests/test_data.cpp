// Data pipeline: CIFAR-10 binary and image-folder readers (round trips and error messages on
// generated files), and BatchLoader (shapes, determinism, coverage, normalisation, augmentation).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <set>

#include "engine/check.h"
#include "engine/data/dataset.h"
#include "engine/data/loader.h"

#include <stb_image_write.h>  // compiled in tests/stb_image_write.cpp

#include "tests/test_util.h"

using namespace et;
namespace fs = std::filesystem;

namespace {

using test::TempDir;
using test::error_of;

// CIFAR record i: label = labels[i], pixel j of the 3072 = (i * 7 + j) % 256.
void write_cifar(const fs::path& file, const std::vector<int>& labels, size_t drop_bytes = 0) {
  std::string bytes;
  for (size_t i = 0; i < labels.size(); ++i) {
    bytes.push_back(char(labels[i]));
    for (int j = 0; j < 3072; ++j) bytes.push_back(char((i * 7 + size_t(j)) % 256));
  }
  bytes.resize(bytes.size() - drop_bytes);
  std::ofstream(file, std::ios::binary) << bytes;
}

// Writes a w x h PNG with n channels; pixel (y, x) channel c = f(y, x, c).
template <typename F>
void write_png(const fs::path& file, int w, int h, int n, F f) {
  std::vector<uint8_t> px(size_t(w * h * n));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < n; ++c) px[size_t((y * w + x) * n + c)] = uint8_t(f(y, x, c));
  fs::create_directories(file.parent_path());
  REQUIRE(stbi_write_png(file.string().c_str(), w, h, n, px.data(), w * n) != 0);
}

Dataset synthetic(int64_t n, int c, int h, int w) {
  Dataset d;
  d.size = n;
  d.channels = c;
  d.height = h;
  d.width = w;
  d.pixels.resize(size_t(n * c * h * w));
  d.labels.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    d.labels[size_t(i)] = int32_t(i);  // label = image index: lets tests track samples
    for (int64_t k = 0; k < c * h * w; ++k) d.pixels[size_t(i * c * h * w + k)] = uint8_t((i * 31 + k) % 251);
  }
  d.source = "synthetic";
  return d;
}

// All batches of one epoch: (images, labels) concatenated.
std::pair<std::vector<float>, std::vector<int32_t>> run_epoch(BatchLoader& l, const Dataset& d, int64_t B, int epoch,
                                                              std::vector<int64_t>* sizes = nullptr) {
  std::vector<float> img(size_t(B * d.image_elems())), all_img;
  std::vector<int32_t> lab(static_cast<size_t>(B)), all_lab;
  l.start_epoch(epoch);
  for (int64_t n; (n = l.next(img.data(), lab.data())) > 0;) {
    if (sizes) sizes->push_back(n);
    all_img.insert(all_img.end(), img.begin(), img.begin() + n * d.image_elems());
    all_lab.insert(all_lab.end(), lab.begin(), lab.begin() + n);
  }
  return {all_img, all_lab};
}

}  // namespace

TEST_CASE("CIFAR-10 binary: records round-trip, nested folder, class names", "[data]") {
  TempDir t;
  write_cifar(t.path / "test_batch.bin", {3, 0, 9, 5});
  const Dataset d = load_cifar10_binary(t.path.string(), Split::Test);
  REQUIRE(d.size == 4);
  CHECK((d.channels == 3 && d.height == 32 && d.width == 32));
  CHECK(d.labels == std::vector<int32_t>{3, 0, 9, 5});
  REQUIRE(d.pixels.size() == 4u * 3072u);
  for (size_t i = 0; i < 4; ++i)
    for (size_t j = 0; j < 3072; j += 101) CHECK(d.pixels[i * 3072 + j] == (i * 7 + j) % 256);
  REQUIRE(d.classes.size() == 10);
  CHECK(d.classes[0] == "airplane");
  CHECK(d.classes[9] == "truck");

  // The tarball's layout: root/cifar-10-batches-bin/, with batches.meta.txt (trailing blank lines).
  TempDir u;
  const fs::path nested = u.path / "cifar-10-batches-bin";
  fs::create_directories(nested);
  for (int i = 1; i <= 5; ++i) write_cifar(nested / ("data_batch_" + std::to_string(i) + ".bin"), {i, i - 1});
  std::ofstream(nested / "batches.meta.txt") << "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\n\n\n";
  const Dataset tr = load_cifar10_binary(u.path.string(), Split::Train);
  CHECK(tr.size == 10);
  CHECK(tr.labels == std::vector<int32_t>{1, 0, 2, 1, 3, 2, 4, 3, 5, 4});
  CHECK(tr.classes.front() == "a");
  CHECK(tr.classes.back() == "j");
  CHECK(load_dataset("cifar10_binary", u.path.string(), Split::Train, {}).size == 10);
}

TEST_CASE("CIFAR-10 binary: errors name the file", "[data]") {
  TempDir t;
  std::string e = error_of([&] { load_cifar10_binary(t.path.string(), Split::Test); });
  CHECK_THAT(e, Catch::Contains("test_batch.bin"));

  write_cifar(t.path / "test_batch.bin", {1, 2, 3}, 100);
  e = error_of([&] { load_cifar10_binary(t.path.string(), Split::Test); });
  CHECK_THAT(e, Catch::Contains((t.path / "test_batch.bin").string()));
  CHECK_THAT(e, Catch::Contains(std::to_string(3 * 3073 - 100)));
  CHECK_THAT(e, Catch::Contains("truncated"));

  write_cifar(t.path / "test_batch.bin", {1, 2, 10, 3});
  e = error_of([&] { load_cifar10_binary(t.path.string(), Split::Test); });
  CHECK_THAT(e, Catch::Contains((t.path / "test_batch.bin").string()));
  CHECK_THAT(e, Catch::Contains("record 2"));
  CHECK_THAT(e, Catch::Contains("label 10"));

  write_cifar(t.path / "data_batch_1.bin", {1});
  e = error_of([&] { load_cifar10_binary(t.path.string(), Split::Train); });
  CHECK_THAT(e, Catch::Contains("data_batch_2.bin"));

  e = error_of([&] { load_dataset("mnist", t.path.string(), Split::Train, {}); });
  CHECK_THAT(e, Catch::Contains("\"mnist\""));
}

TEST_CASE("image folder: labels, order and channel rules", "[data]") {
  TempDir t;
  const fs::path tr = t.path / "train", te = t.path / "test";
  // RGB pixel (y, x) = (10y + x, 100 + x, 200 - y); classes sorted byte-wise: "B" < "a".
  auto rgb = [](int y, int x, int c) { return c == 0 ? 10 * y + x : c == 1 ? 100 + x : 200 - y; };
  write_png(tr / "a" / "2.png", 4, 3, 3, rgb);
  write_png(tr / "a" / "1.png", 4, 3, 4, [&](int y, int x, int c) { return c == 3 ? 17 : rgb(y, x, c); });  // RGBA
  write_png(tr / "B" / "g.png", 4, 3, 1, [](int y, int x, int) { return 50 + 10 * y + x; });                // gray
  write_png(tr / "B" / "ga.png", 4, 3, 2, [](int y, int x, int c) { return c ? 3 : 60 + y + 2 * x; });             // gray+alpha
  std::ofstream(tr / "a" / "notes.txt") << "ignored";
  write_png(te / "a" / "x.PNG", 4, 3, 3, rgb);

  ImageFolderOptions o;
  o.height = 3;
  o.width = 4;
  const Dataset d = load_image_folder(t.path.string(), Split::Train, o);
  REQUIRE(d.size == 4);
  CHECK(d.classes == std::vector<std::string>{"B", "a"});
  CHECK(d.labels == std::vector<int32_t>{0, 0, 1, 1});
  const int64_t P = 12;
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 3; ++y)
      for (int x = 0; x < 4; ++x) {
        const int64_t k = c * P + y * 4 + x;
        CHECK(d.image(0)[k] == 50 + 10 * y + x);  // gray replicated
        CHECK(d.image(1)[k] == 60 + y + 2 * x);   // gray+alpha: alpha dropped
        CHECK(d.image(2)[k] == rgb(y, x, c));     // 1.png (RGBA): alpha dropped, CHW
        CHECK(d.image(3)[k] == rgb(y, x, c));     // 2.png
      }

  const Dataset test = load_image_folder(t.path.string(), Split::Test, o);
  CHECK(test.size == 1);
  CHECK(test.labels == std::vector<int32_t>{1});  // label from the train class list

  o.channels = 1;  // colour -> BT.601 luma; gray stays
  const Dataset g = load_image_folder(t.path.string(), Split::Train, o);
  REQUIRE(g.channels == 1);
  CHECK(g.image(0)[5] == 50 + 10 + 1);
  const int r = rgb(1, 1, 0), gg = rgb(1, 1, 1), b = rgb(1, 1, 2);
  CHECK(g.image(3)[5] == int(std::lround(0.299 * r + 0.587 * gg + 0.114 * b)));
}

TEST_CASE("image folder: sizes and resize modes", "[data]") {
  TempDir t;
  // 8x4 horizontal ramp, value 20x in every channel.
  write_png(t.path / "train" / "c" / "big.png", 8, 4, 3, [](int, int x, int) { return 20 * x; });
  ImageFolderOptions o;
  o.height = o.width = 4;
  std::string e = error_of([&] { load_image_folder(t.path.string(), Split::Train, o); });
  CHECK_THAT(e, Catch::Contains("big.png"));
  CHECK_THAT(e, Catch::Contains("8x4"));
  CHECK_THAT(e, Catch::Contains("4x4"));

  o.resize = "stretch";  // output column x samples source column 2x + 0.5: 20 * (2x + 0.5)
  Dataset d = load_image_folder(t.path.string(), Split::Train, o);
  REQUIRE(d.size == 1);
  for (int c = 0; c < 3; ++c)
    for (int x = 0; x < 4; ++x) CHECK(d.image(0)[c * 16 + 4 + x] == 40 * x + 10);

  o.resize = "center_crop";  // scale 1 (height fits), keep the centre columns 2..5
  d = load_image_folder(t.path.string(), Split::Train, o);
  for (int x = 0; x < 4; ++x) CHECK(d.image(0)[8 + x] == 20 * (x + 2));
}

TEST_CASE("image folder: errors name the folder or file", "[data]") {
  TempDir t;
  ImageFolderOptions o;
  CHECK_THAT(error_of([&] { load_image_folder((t.path / "nope").string(), Split::Train, o); }),
             Catch::Contains("nope"));
  CHECK_THAT(error_of([&] { load_image_folder(t.path.string(), Split::Train, o); }),
             Catch::Contains((t.path / "train").string()));
  fs::create_directories(t.path / "train");
  CHECK_THAT(error_of([&] { load_image_folder(t.path.string(), Split::Train, o); }),
             Catch::Contains("no class folders"));
  fs::create_directories(t.path / "train" / "cat");
  CHECK_THAT(error_of([&] { load_image_folder(t.path.string(), Split::Train, o); }), Catch::Contains("no images"));

  write_png(t.path / "train" / "cat" / "0.png", 32, 32, 3, [](int, int, int) { return 1; });
  std::ofstream(t.path / "train" / "cat" / "1.jpg") << "this is not a jpeg";
  const std::string e = error_of([&] { load_image_folder(t.path.string(), Split::Train, o); });
  CHECK_THAT(e, Catch::Contains("1.jpg"));
  CHECK_THAT(e, Catch::Contains("cannot decode"));

  write_png(t.path / "test" / "dog" / "0.png", 32, 32, 3, [](int, int, int) { return 1; });
  CHECK_THAT(error_of([&] { load_image_folder(t.path.string(), Split::Test, o); }), Catch::Contains("dog"));
  CHECK_THAT(error_of([&] { load_image_folder(t.path.string(), Split::Train, ImageFolderOptions{2, 32, 32}); }),
             Catch::Contains("channels"));
}

// Inputs found by fuzz/fuzz_image.cpp (tests/data/fuzz/), and headers asking for more pixels than
// a file can hold: errors naming the file, decided before anything large is allocated.
TEST_CASE("image decode: fuzzer findings and over-large headers", "[data]") {
  auto bytes_of = [](const std::string& name) {
    std::ifstream in(std::string(EDGETRAIN_SOURCE_DIR) + "/tests/data/fuzz/" + name, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  ImageFolderOptions o;
  o.resize = "stretch";
  std::vector<uint8_t> out(3 * 32 * 32);
  auto decode = [&](const std::vector<uint8_t>& b) {
    return error_of([&] { decode_image(b.data(), b.size(), "x.img", o, out.data()); });
  };
  // DHT segments declaring more than 256 codes (found by the fuzzer; the other made from a seed):
  // stb_image 2.27 (Debian 12) wrote past its Huffman tables, which ASan sees. JPEGs are decoded
  // by edgetrain's decoder now, which checks DHT segments as libjpeg does, fill bytes before SOI
  // included (jpeg_dht_after_fill). jpeg_dht_past_end: the segment runs past the end of the file.
  CHECK_THAT(decode(bytes_of("jpeg_dht_over_256_codes.jpg")),
             Catch::Contains("x.img: corrupt JPEG: Huffman table (DHT) declares 783 codes, 256 possible"));
  CHECK_THAT(decode(bytes_of("jpeg_dht_4080_codes.jpg")),
             Catch::Contains("x.img: corrupt JPEG: Huffman table (DHT) declares 4080 codes, 256 possible"));
  CHECK_THAT(decode(bytes_of("jpeg_dht_past_end.jpg")),
             Catch::Contains("x.img: JPEG file truncated (in the segment of marker 0xFFC4"));
  const auto after_fill = bytes_of("jpeg_dht_after_fill.jpg");
  REQUIRE(after_fill.size() > 200);
  CHECK_THAT(decode(after_fill), Catch::Contains("x.img: corrupt JPEG: Huffman table (DHT) declares 1744 codes"));
  // JPEGs with fill bytes before SOI and corrupt entropy-coded data, found by the fuzzer (CI, and
  // seeds with fill bytes here) while stb_image decoded such files: its 2.27 read past its Huffman
  // tables (maxcode[18], values[1061900344]) and shifted its bit buffer by 32. Edgetrain's decoder
  // takes them now and fails where libjpeg does: their scans name Huffman tables never defined.
  const std::pair<const char*, const char*> stb_findings[] = {
      {"jpeg_fill_stb_huffman_index_18.jpg", "x.img: corrupt JPEG: scan uses AC Huffman table 2, which is not defined"},
      {"jpeg_fill_stb_values_index.jpg", "x.img: corrupt JPEG: scan uses AC Huffman table 1, which is not defined"}};
  for (const auto& [name, message] : stb_findings) {
    const auto b = bytes_of(name);
    REQUIRE(b.size() > 900);  // the file, without the fuzz input's options byte
    CHECK_THAT(decode(b), Catch::Contains(message));
  }
  // An 80-byte PNG whose IDAT chunk declares 822 MB: stb_image allocated that before reading.
  const auto idat = bytes_of("png_idat_length_822mb.png");
  REQUIRE(idat.size() == 79);
  CHECK_THAT(decode(idat), Catch::Contains("x.img: PNG chunk 'IDAT' at byte 33 declares 822083606 bytes, the file has 34 left"));
  // Found by the fuzzer once JPEGs had their own decoder: an IDAT chunk of 1 GB whose length and
  // type end the file (11 bytes after byte 33: no room for the CRC); the check skipped chunks
  // without their 12 bytes of framing, and stb_image allocated 1 GB.
  const auto idat_at_end = bytes_of("png_idat_header_at_end.png");
  REQUIRE(idat_at_end.size() == 44);
  CHECK_THAT(decode(idat_at_end),
             Catch::Contains("x.img: PNG chunk 'IDAT' at byte 33 declares 1073766934 bytes, the file has 0 left"));

  // A BMP of 327685 x 0 pixels, which stb_image returns as decoded: the resize divided by zero.
  const auto empty_bmp = bytes_of("bmp_height_0.bmp");
  REQUIRE(empty_bmp.size() == 263);
  CHECK_THAT(decode(empty_bmp), Catch::Contains("x.img: image header says 327685x0 pixels: no image"));

  // An IHDR of W x H pixels and an empty IEND (stb checks no CRC).
  auto png_header = [](uint32_t w, uint32_t h) {
    std::vector<uint8_t> b = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n', 0, 0, 0, 13, 'I', 'H', 'D', 'R'};
    for (uint32_t v : {w, h})
      for (int k = 3; k >= 0; --k) b.push_back(uint8_t(v >> (8 * k)));
    for (int v : std::initializer_list<int>{8, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 'I', 'E', 'N', 'D', 0, 0, 0, 0}) b.push_back(uint8_t(v));
    return b;
  };
  CHECK_THAT(decode(png_header(10000, 10000)), Catch::Contains("10000x10000") && Catch::Contains("2^26"));
  CHECK_THAT(decode(png_header(4096, 4096)), Catch::Contains("4096x4096") && Catch::Contains("impossible in 45 bytes"));
  CHECK_THAT(decode({}), Catch::Contains("empty file"));
}

TEST_CASE("loader: shapes, partial batch, coverage, determinism", "[data]") {
  const Dataset d = synthetic(10, 3, 4, 5);
  LoaderOptions o;
  o.batch_size = 4;
  o.seed = 7;
  o.drop_last = false;
  BatchLoader l(d, o);
  CHECK(l.batches_per_epoch() == 3);
  std::vector<int64_t> sizes;
  const auto e0 = run_epoch(l, d, 4, 0, &sizes);
  CHECK(sizes == std::vector<int64_t>{4, 4, 2});
  std::vector<int32_t> sorted = e0.second;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int32_t> all(10);
  std::iota(all.begin(), all.end(), 0);
  CHECK(sorted == all);  // every sample exactly once
  CHECK(e0.second != all);  // shuffled
  // Pixels travel with their label (no augmentation, mean 0 std 1: x / 255).
  for (size_t j = 0; j < 10; ++j)
    for (int64_t k = 0; k < d.image_elems(); ++k)
      REQUIRE(e0.first[j * 60 + size_t(k)] == Approx(d.image(e0.second[j])[k] / 255.0));

  const auto e1 = run_epoch(l, d, 4, 1);
  CHECK(e1.second != e0.second);           // another epoch, another order
  CHECK(run_epoch(l, d, 4, 0) == e0);      // restarting epoch 0 reproduces it
  BatchLoader same(d, o);
  CHECK(run_epoch(same, d, 4, 1) == e1);   // a fresh loader (resume) reproduces epoch 1

  o.drop_last = true;
  BatchLoader dl(d, o);
  CHECK(dl.batches_per_epoch() == 2);
  sizes.clear();
  run_epoch(dl, d, 4, 0, &sizes);
  CHECK(sizes == std::vector<int64_t>{4, 4});

  o.shuffle = false;
  BatchLoader seq(d, o);
  CHECK(run_epoch(seq, d, 4, 3).second == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});

  // Abandoning an epoch half way and starting another is fine.
  std::vector<float> img(size_t(4 * d.image_elems()));
  std::vector<int32_t> lab(4);
  l.start_epoch(2);
  CHECK(l.next(img.data(), lab.data()) == 4);
  CHECK(run_epoch(l, d, 4, 1) == e1);
}

TEST_CASE("loader: normalisation", "[data]") {
  Dataset d = synthetic(1, 2, 1, 2);
  d.pixels = {0, 255, 51, 102};
  LoaderOptions o;
  o.batch_size = 1;
  o.mean = {0.5f, 0.2f};
  o.std = {0.25f, 2.f};
  BatchLoader l(d, o);
  const auto e = run_epoch(l, d, 1, 0).first;
  CHECK(e[0] == Approx(-2.0));
  CHECK(e[1] == Approx(2.0));
  CHECK(e[2] == Approx(0.0).margin(1e-6));
  CHECK(e[3] == Approx(0.1));
  o.mean = {0.5f};
  CHECK_THAT(error_of([&] { BatchLoader bad(d, o); }), Catch::Contains("mean/std"));
}

TEST_CASE("loader: crop with padding shifts content, flip mirrors it", "[data]") {
  // One 1-channel 4x4 image with values 1..16 (row-major), seen across many epochs.
  Dataset d = synthetic(1, 1, 4, 4);
  std::iota(d.pixels.begin(), d.pixels.end(), uint8_t(1));
  LoaderOptions o;
  o.batch_size = 1;
  o.crop_padding = 1;
  o.hflip = true;
  BatchLoader l(d, o);
  std::set<std::pair<int, int>> shifts;
  int flips = 0;
  for (int epoch = 0; epoch < 200; ++epoch) {
    const std::vector<float> v = run_epoch(l, d, 1, epoch).first;
    std::vector<int> px(16);
    for (int i = 0; i < 16; ++i) px[size_t(i)] = int(std::lround(v[size_t(i)] * 255));
    // Find the shift (dy, dx) and flip that explain the output: out(y, x) = in(y + dy, x' + dx).
    int found = 0;
    for (int f = 0; f < 2; ++f)
      for (int dy = -1; dy <= 1; ++dy)
        for (int dx = -1; dx <= 1; ++dx) {
          bool ok = true;
          for (int y = 0; y < 4; ++y)
            for (int x = 0; x < 4; ++x) {
              const int sy = y + dy, sx = (f ? 3 - x : x) + dx;
              const int want = sy < 0 || sy > 3 || sx < 0 || sx > 3 ? 0 : 1 + sy * 4 + sx;
              ok = ok && px[size_t(y * 4 + x)] == want;
            }
          if (ok) {
            ++found;
            shifts.insert({dy, dx});
            flips += f;
          }
        }
    REQUIRE(found == 1);
  }
  CHECK(shifts.size() == 9);  // every offset in [-1, 1]^2 occurs
  CHECK(flips > 60);
  CHECK(flips < 140);

  // No augmentation: the image itself.
  BatchLoader plain(d, LoaderOptions{1, false, false, 0, 0, false, {}, {}});
  const auto v = run_epoch(plain, d, 1, 5).first;
  for (int i = 0; i < 16; ++i) CHECK(std::lround(v[size_t(i)] * 255) == i + 1);
}

TEST_CASE("real CIFAR-10 test split from the image folder", "[data][cifar]") {
  const char* env = std::getenv("EDGETRAIN_CIFAR_ROOT");
  const std::string root = env ? env : std::string(EDGETRAIN_SOURCE_DIR) + "/../shared/data/cifar10";
  if (!fs::is_directory(fs::path(root) / "test")) ET_SKIP("no CIFAR-10 image folder at " << root);
  const Dataset d = load_image_folder(root, Split::Test, ImageFolderOptions{});
  REQUIRE(d.size == 10000);
  CHECK(d.classes.size() == 10);
  std::vector<int> count(10);
  for (int32_t l : d.labels) {
    REQUIRE((l >= 0 && l < 10));
    ++count[size_t(l)];
  }
  CHECK(count == std::vector<int>(10, 1000));
}
