// edgetrain's JPEG decoder (engine/data/jpeg_decode.h) against the pixels PIL (libjpeg-turbo 2.1)
// decodes from the files in tests/data/jpeg/ (made by bench/make_jpeg_references.py: sampling
// factors, odd sizes, qualities, progressive, restarts, damaged data, real CIFAR-10 images), its
// islow IDCT against libjpeg-turbo's x86 SIMD arithmetic and jidctint.c, and hostile input:
// truncations, bad markers and tables, over-large headers.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/check.h"
#include "engine/data/dataset.h"
#include "engine/data/jpeg_decode.h"
#include "engine/data/jpeg_internal.h"
#include "tests/test_util.h"

using namespace et;
namespace fs = std::filesystem;

namespace {

using test::error_of;

const fs::path kDir = fs::path(EDGETRAIN_SOURCE_DIR) / "tests" / "data" / "jpeg";

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct Image {
  int width = 0, height = 0, channels = 0;
  std::vector<uint8_t> pixels;
};

// Binary PPM (P6) / PGM (P5) as the generator writes them: "P6\nW H\n255\n" then the pixels.
Image read_pnm(const fs::path& p) {
  const std::vector<uint8_t> b = read_bytes(p);
  Image im;
  im.channels = b.at(1) == '6' ? 3 : 1;
  size_t at = 3;
  auto number = [&] {
    int v = 0;
    while (at < b.size() && b[at] >= '0' && b[at] <= '9') v = v * 10 + (b[at++] - '0');
    ++at;  // the separator
    return v;
  };
  im.width = number();
  im.height = number();
  REQUIRE(number() == 255);
  im.pixels.assign(b.begin() + long(at), b.end());
  REQUIRE(im.pixels.size() == size_t(im.width) * size_t(im.height) * size_t(im.channels));
  return im;
}

std::vector<fs::path> jpegs(const std::string& prefix = "") {
  std::vector<fs::path> v;
  for (const auto& e : fs::directory_iterator(kDir))
    if (e.path().extension() == ".jpg" && e.path().filename().string().rfind(prefix, 0) == 0) v.push_back(e.path());
  std::sort(v.begin(), v.end());
  return v;
}

fs::path reference_of(const fs::path& jpg) {
  fs::path p = jpg;
  p.replace_extension(".ppm");
  if (fs::exists(p)) return p;
  p.replace_extension(".pgm");
  return fs::exists(p) ? p : fs::path();
}

// Decodes with `dec` (UserError for a file it cannot decode).
void decode(JpegDecoder& dec, const std::vector<uint8_t>& b, const std::string& name, Image& im) {
  dec.read_header(b.data(), b.size(), name);
  im.width = dec.width();
  im.height = dec.height();
  im.channels = dec.channels();
  im.pixels.assign(size_t(im.width) * size_t(im.height) * size_t(im.channels), 0);
  dec.decode(im.pixels.data());
}

size_t marker_at(const std::vector<uint8_t>& b, uint8_t marker) {
  for (size_t i = 2; i + 3 < b.size();) {
    if (b[i + 1] == marker) return i;
    i += 2 + (size_t(b[i + 2]) << 8 | b[i + 3]);
  }
  FAIL("no marker " << int(marker));
  return 0;
}

}  // namespace

TEST_CASE("jpeg: every reference file decodes to PIL's pixels, with one decoder reused", "[jpeg]") {
  std::vector<fs::path> files;
  for (const fs::path& f : jpegs())
    if (!reference_of(f).empty()) files.push_back(f);
  REQUIRE(files.size() >= 40);
  JpegDecoder dec;  // reused: state from one file must not leak into the next
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) std::reverse(files.begin(), files.end());
    for (const fs::path& f : files) {
      INFO(f.filename().string());
      const Image ref = read_pnm(reference_of(f));
      Image im;
      decode(dec, read_bytes(f), f.string(), im);
      CHECK_FALSE(dec.libjpeg_would_smooth());
      REQUIRE(im.width == ref.width);
      REQUIRE(im.height == ref.height);
      REQUIRE(im.channels == ref.channels);
      const auto diff = std::mismatch(im.pixels.begin(), im.pixels.end(), ref.pixels.begin());
      INFO("first difference at value " << (diff.first - im.pixels.begin()));
      CHECK(diff.first == im.pixels.end());
    }
  }
}

TEST_CASE("jpeg: files libjpeg smooths decode unsmoothed, other kinds and PIL's failures are errors naming the file",
          "[jpeg]") {
  JpegDecoder dec;
  Image im;
  const auto smoothing = jpegs("smoothing_"), unsupported = jpegs("unsupported_"), errors = jpegs("error_");
  REQUIRE(smoothing.size() == 2);
  REQUIRE(unsupported.size() == 2);
  REQUIRE(errors.size() == 2);
  // Progressive, coefficients unfinished: libjpeg estimates them from the neighbouring blocks'
  // DC (block smoothing), this decoder leaves them zero. Its pixels against PIL's
  // (NAME.smoothed.ppm), measured: mean |diff| 7.56 and 2.32, max 35 and 18. The bounds are
  // those, rounded up; stb_image 2.27, which decoded these files before, is further off (7.54 and
  // 10.04, max 35 and 242).
  const double mean_bound[2] = {7.6, 2.4};
  const int max_bound[2] = {35, 18};
  for (size_t n = 0; n < smoothing.size(); ++n) {
    const fs::path& f = smoothing[n];
    decode(dec, read_bytes(f), f.string(), im);
    CHECK(dec.libjpeg_would_smooth());
    fs::path smoothed = f;
    smoothed.replace_extension(".smoothed.ppm");
    const Image ref = read_pnm(smoothed);
    REQUIRE(im.pixels.size() == ref.pixels.size());
    double sum = 0;
    int worst = 0;
    for (size_t i = 0; i < ref.pixels.size(); ++i) {
      const int d = std::abs(int(im.pixels[i]) - int(ref.pixels[i]));
      sum += d;
      worst = std::max(worst, d);
    }
    INFO(f.filename().string() << ": mean |diff| " << sum / double(ref.pixels.size()) << ", max " << worst);
    CHECK(sum / double(ref.pixels.size()) < mean_bound[n]);
    CHECK(worst <= max_bound[n]);
  }
  CHECK_THAT(error_of([&] { decode(dec, read_bytes(kDir / "unsupported_arithmetic.jpg"), "a.jpg", im); }),
             Catch::Contains("a.jpg: a JPEG of a kind edgetrain does not decode (arithmetic coding)"));
  CHECK_THAT(error_of([&] { decode(dec, read_bytes(kDir / "unsupported_cmyk.jpg"), "c.jpg", im); }),
             Catch::Contains("c.jpg: a JPEG of a kind edgetrain does not decode (4 components: CMYK or YCCK)"));
  CHECK_THAT(error_of([&] { decode(dec, read_bytes(kDir / "error_truncated.jpg"), "cut.jpg", im); }),
             Catch::Contains("cut.jpg: JPEG file truncated (inside the entropy-coded data"));
  CHECK_THAT(error_of([&] { decode(dec, read_bytes(kDir / "error_truncated_header.jpg"), "cut.jpg", im); }),
             Catch::Contains("cut.jpg: JPEG file truncated (in the segment of marker 0xFFDB"));
}

TEST_CASE("jpeg: the image-folder path gives PIL's pixels, channel rule, fill bytes before SOI, kinds left aside", "[jpeg]") {
  ImageFolderOptions o;  // 3 x 32 x 32, no resize
  std::vector<uint8_t> out(3 * 32 * 32);
  const auto jpg = read_bytes(kDir / "q75_420_32x32.jpg");  // like a CIFAR-10 JPEG: 32x32, 4:2:0
  decode_image(jpg.data(), jpg.size(), "q75.jpg", o, out.data());
  const Image ref = read_pnm(kDir / "q75_420_32x32.ppm");
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < 32 * 32; ++i) REQUIRE(out[size_t(c * 1024 + i)] == ref.pixels[size_t(i * 3 + c)]);

  // Gray replicated to 3 channels.
  o.width = 17;
  o.height = 13;
  std::vector<uint8_t> gray_out(3 * 17 * 13);
  const auto gray = read_bytes(kDir / "gray_q80_17x13.jpg");
  decode_image(gray.data(), gray.size(), "g.jpg", o, gray_out.data());
  const Image gref = read_pnm(kDir / "gray_q80_17x13.pgm");
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < 17 * 13; ++i) REQUIRE(gray_out[size_t(c * 17 * 13 + i)] == gref.pixels[size_t(i)]);

  // Fill bytes (0xFF) before SOI, which libjpeg refuses and stb_image took: skipped, the same
  // pixels. A file starting with 0xFF without SOI, and the kinds the decoder leaves aside: errors
  // naming the file (no JPEG reaches stb_image, whose 2.27 reads out of bounds on corrupt data).
  o.width = o.height = 32;
  std::vector<uint8_t> filled(3 * 32 * 32);
  // (Sized at once: GCC 12's -Warray-bounds misreads an insert that grows a 3-byte vector.)
  std::vector<uint8_t> jpg_fill(3 + jpg.size(), 0xFF);
  std::copy(jpg.begin(), jpg.end(), jpg_fill.begin() + 3);
  decode_image(jpg_fill.data(), jpg_fill.size(), "f.jpg", o, filled.data());
  CHECK(filled == out);
  jpg_fill[3] = 0xD9;
  CHECK_THAT(error_of([&] { decode_image(jpg_fill.data(), jpg_fill.size(), "f.jpg", o, filled.data()); }),
             Catch::Contains("f.jpg: not a JPEG file: starts with 0xFF 0xD9"));
  o.width = 40;
  o.height = 24;
  std::vector<uint8_t> big(3 * 40 * 24);
  const auto smooth = read_bytes(kDir / "smoothing_chroma_dc_only.jpg");
  CHECK(error_of([&] { decode_image(smooth.data(), smooth.size(), "s.jpg", o, big.data()); }).empty());
  const auto arith = read_bytes(kDir / "unsupported_arithmetic.jpg");
  CHECK_THAT(error_of([&] { decode_image(arith.data(), arith.size(), "a.jpg", o, big.data()); }),
             Catch::Contains("a.jpg: a JPEG of a kind edgetrain does not decode (arithmetic coding)"));
}

TEST_CASE("jpeg: islow IDCT: the fast path is libjpeg-turbo's x86 SIMD arithmetic, equal to its C code in range", "[jpeg]") {
  namespace jd = jpeg_detail;
  std::mt19937 rng(7);
  int16_t coef[64], quant[64];
  uint8_t fast[64], simd[64], c_code[64];
  // Blocks of valid-data magnitudes (dequantised within +-1024: all three agree), at the fast
  // path's edges, and far beyond them (only the fast path and the SIMD reference must agree).
  for (int trial = 0; trial < 40000; ++trial) {
    const int kind = trial % 5;
    const int limit = kind == 0 ? 1024 : kind == 1 ? 1100 : kind == 2 ? 40000 : kind == 3 ? 2000 : 64;
    std::fill(coef, coef + 64, int16_t(0));
    for (int i = 0; i < 64; ++i) quant[i] = int16_t(1 + rng() % (trial % 3 == 0 ? 255 : 16));
    if (trial % 97 == 0) quant[int(rng() % 64)] = int16_t(uint16_t(40000 + rng() % 25536));  // 16-bit DQT
    const int nonzero = 1 + int(rng() % 64);
    for (int k = 0; k < nonzero; ++k) {
      const int i = int(rng() % 64);
      coef[i] = int16_t(int(rng() % uint32_t(2 * limit + 1)) - limit);
      if (kind == 0 || kind == 4) coef[i] = int16_t(int(coef[i]) / quant[i]);
    }
    if (trial % 50 == 0) std::fill(coef + 1, coef + 64, int16_t(0));       // DC only
    if (trial % 50 == 1) std::fill(coef + 8, coef + 64, int16_t(0));       // row 0 only: SIMD's shortcut
    jd::idct_islow(coef, quant, fast, 8);
    jd::idct_islow_x86_simd(coef, quant, simd, 8);
    INFO("trial " << trial);
    REQUIRE(std::memcmp(fast, simd, 64) == 0);
    if (kind == 4 && trial % 97 != 0) {  // realistic magnitudes: the C code gives the same bytes
      jd::idct_islow_c(coef, quant, c_code, 8);
      REQUIRE(std::memcmp(fast, c_code, 64) == 0);
    }
  }
  // Out of range they differ: DC 1000 x 8 is 1000 after the IDCT. jidctint.c masks it into its
  // range-limit table's last part (896..1023 -> 0..127): 104; the SIMD code saturates: 255.
  std::fill(coef, coef + 64, int16_t(0));
  std::fill(quant, quant + 64, int16_t(8));
  coef[0] = 1000;
  jd::idct_islow_c(coef, quant, c_code, 8);
  jd::idct_islow(coef, quant, fast, 8);
  CHECK(std::count(c_code, c_code + 64, uint8_t(104)) == 64);
  CHECK(std::count(fast, fast + 64, uint8_t(255)) == 64);
  coef[0] = 40;  // 40 * 8 / 8 + 128 = 168 in both
  jd::idct_islow_c(coef, quant, c_code, 8);
  jd::idct_islow(coef, quant, fast, 8);
  CHECK(std::count(c_code, c_code + 64, uint8_t(168)) == 64);
  CHECK(std::count(fast, fast + 64, uint8_t(168)) == 64);
  // A 16-bit quantiser above 32767 is libjpeg's short multiplier: 65535 acts as -1 (both).
  quant[0] = int16_t(uint16_t(65535));
  coef[0] = 80;  // -80 / 8 + 128 = 118
  jd::idct_islow(coef, quant, fast, 8);
  CHECK(std::count(fast, fast + 64, uint8_t(118)) == 64);
  // The SIMD code's 16-bit dequantisation wraps: 300 x 200 = 60000 is -5536 in 16 bits,
  // -5536 / 8 + 128 = -564: saturated to 0 (the C code: 60000 / 8 = 7500, masked: 255).
  std::fill(quant, quant + 64, int16_t(200));
  coef[0] = 300;
  jd::idct_islow(coef, quant, fast, 8);
  jd::idct_islow_c(coef, quant, c_code, 8);
  CHECK(std::count(fast, fast + 64, uint8_t(0)) == 64);
  CHECK(std::count(c_code, c_code + 64, uint8_t(255)) == 64);
}

TEST_CASE("jpeg: hostile input: truncations, bad markers and tables, over-large headers", "[jpeg]") {
  JpegDecoder dec;
  Image im;
  // Every prefix of a baseline, a progressive and a restart file: an error naming the file, or
  // (cut after the last scan's data) the image; never a crash. Cut inside the first half of the
  // scan data: always an error.
  for (const char* name : {"q75_420_32x32.jpg", "q75_420_progressive_33x17.jpg", "restart_mcu_420_40x24.jpg"}) {
    const auto full = read_bytes(kDir / name);
    const size_t data_start = marker_at(full, 0xDA) + 14;
    for (size_t n = 2; n < full.size(); ++n) {
      const std::vector<uint8_t> cut(full.begin(), full.begin() + long(n));
      const std::string e = error_of([&] { decode(dec, cut, "cut.jpg", im); });
      INFO(name << " cut to " << n << " bytes: " << e);
      if (!e.empty()) CHECK_THAT(e, Catch::StartsWith("cut.jpg: "));
      if (n < data_start + (full.size() - data_start) / 2) CHECK_FALSE(e.empty());
    }
  }

  const auto base = read_bytes(kDir / "q75_420_32x32.jpg");
  auto patched = [&](const std::function<void(std::vector<uint8_t>&)>& edit) {
    std::vector<uint8_t> b = base;
    edit(b);
    return error_of([&] { decode(dec, b, "bad.jpg", im); });
  };
  const size_t sof = marker_at(base, 0xC0), dht = marker_at(base, 0xC4), dqt = marker_at(base, 0xDB);
  CHECK_THAT(patched([&](auto& b) { b[dqt + 1] = 0x02; }), Catch::Contains("bad.jpg: corrupt JPEG: unknown marker 0xFF02"));
  CHECK_THAT(patched([&](auto& b) { b[dqt + 3] -= 1; }), Catch::Contains("quantisation table segment (DQT) length"));
  CHECK_THAT(patched([&](auto& b) { b[dqt + 4] = 0x07; }), Catch::Contains("quantisation table index 7"));
  CHECK_THAT(patched([&](auto& b) { b[dht + 20] = 50; }), Catch::Contains("declares 62 codes, 12 possible"));
  // Two codes of length 1 (the whole code space) then more: not a Huffman code.
  CHECK_THAT(patched([&](auto& b) { b[dht + 5] = 2; b[dht + 7] -= 2; }), Catch::Contains("code counts overflow their lengths"));
  CHECK_THAT(patched([&](auto& b) { b[dht + 4] = 0x15; }), Catch::Contains("Huffman table index 21"));
  CHECK_THAT(patched([&](auto& b) { b[sof + 5] = b[sof + 6] = 0; }), Catch::Contains("frame header says 32x0 pixels"));
  CHECK_THAT(patched([&](auto& b) { b[sof + 7] = 0xFF; b[sof + 8] = 0xFF; }), Catch::Contains("65535x32 pixels, libjpeg's limit is 65500"));
  CHECK_THAT(patched([&](auto& b) { b[sof + 11] = 0x31; b[sof + 14] = 0x21; }), Catch::Contains("fractional upsampling"));
  CHECK_THAT(patched([&](auto& b) { b[sof + 11] = 0x50; }), Catch::Contains("sampling factors 5x0"));
  CHECK_THAT(patched([&](auto& b) { b[sof + 11] = 0x44; b[sof + 14] = 0x22; }),
             Catch::Contains("an MCU of 21 blocks (libjpeg allows 10)"));
  CHECK_THAT(patched([&](auto& b) { b[sof + 12] = 3; }), Catch::Contains("quantisation table 3, which is not defined"));
  CHECK_THAT(patched([&](auto& b) { b[marker_at(b, 0xDA) + 5] = 9; }), Catch::Contains("scan names component id 9"));
  CHECK_THAT(patched([&](auto& b) { b[marker_at(b, 0xDA) + 6] = 0x22; }), Catch::Contains("DC Huffman table 2, which is not defined"));
  CHECK_THAT(patched([&](auto& b) { b.insert(b.begin() + long(sof), {0xFF, 0xDA, 0, 8, 1, 1, 0, 0, 63, 0}); }),
             Catch::Contains("a scan (SOS) before the frame header (SOF)"));
  CHECK_THAT(patched([&](auto& b) { b.insert(b.end() - 2, {0xFF, 0xD8}); }), Catch::Contains("a second SOI marker"));

  // Over-large headers: decode_image refuses before the decoder allocates (2^26 pixels, 16384
  // pixels a byte, whole MCUs counted).
  ImageFolderOptions o;
  o.resize = "stretch";
  std::vector<uint8_t> out(3 * 32 * 32);
  auto sized = [&](int w, int h, size_t comment_bytes) {
    std::vector<uint8_t> b = base;
    b[sof + 5] = uint8_t(h >> 8);
    b[sof + 6] = uint8_t(h);
    b[sof + 7] = uint8_t(w >> 8);
    b[sof + 8] = uint8_t(w);
    std::vector<uint8_t> com = {0xFF, 0xFE, uint8_t((comment_bytes + 2) >> 8), uint8_t(comment_bytes + 2)};
    com.resize(4 + comment_bytes, 'x');
    b.insert(b.begin() + 2, com.begin(), com.end());
    return error_of([&] { decode_image(b.data(), b.size(), "big.jpg", o, out.data()); });
  };
  CHECK_THAT(sized(65500, 65500, 0), Catch::Contains("big.jpg: image header says 65500x65500 pixels, more than the 2^26"));
  CHECK_THAT(sized(6000, 6000, 0), Catch::Contains("big.jpg: image header says 6000x6000 pixels, impossible in"));
  // 8193 x 8191 is 2^26 - 1 pixels, but 8208 x 8192 in the 16 x 16 MCUs of 4:2:0 (a 4 KB comment
  // makes the file large enough for them by the per-byte rule).
  CHECK_THAT(sized(8193, 8191, 4000),
             Catch::Contains("big.jpg: JPEG of 8193x8191 pixels is 67239936 pixels in whole MCUs, more than the 2^26"));
}
