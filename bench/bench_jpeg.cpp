// bench_jpeg: edgetrain's JPEG decoder (engine/data/jpeg_decode.h) against stb_image, on a list
// of files (one path a line; bench/jpeg_exactness.py makes it).
//
//   bench_jpeg dump LIST OUT     decodes each file with edgetrain's decoder, appends its pixels
//                                (height x width x channels bytes) to OUT and prints one line a
//                                file: "ok W H C", "smoothed W H C" (a progressive file libjpeg
//                                smooths, jpeg_decode.h: PIL's pixels differ) or "error MESSAGE"
//   bench_jpeg time LIST [--reps N] [--threads T]
//                                decodes every file (read into memory first) to interleaved
//                                RGB / gray with both decoders, alternating, N times each (default
//                                5) on T threads (default 2, chunks of 64 files as the loader
//                                hands them out); prints each repetition and the medians
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/check.h"
#include "engine/data/jpeg_decode.h"

#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_JPEG
#define STBI_NO_STDIO
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#include <stb_image.h>
#pragma GCC diagnostic pop

namespace {

std::vector<std::string> read_list(const char* path) {
  std::ifstream in(path);
  if (!in) et::user_error("cannot open ", path);
  std::vector<std::string> files;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) files.push_back(line);
  return files;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) et::user_error("cannot open ", path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

int dump(const char* list, const char* out_path) {
  std::unique_ptr<FILE, int (*)(FILE*)> out(std::fopen(out_path, "wb"), std::fclose);
  if (!out) et::user_error("cannot write ", out_path);
  et::JpegDecoder dec;
  std::vector<uint8_t> px;
  for (const std::string& f : read_list(list)) {
    const std::vector<uint8_t> bytes = read_bytes(f);
    try {
      if (bytes.size() < 2 || bytes[0] != 0xFF || bytes[1] != 0xD8) et::user_error(f, ": no SOI marker at byte 0");
      dec.read_header(bytes.data(), bytes.size(), f);
      px.resize(size_t(dec.width()) * size_t(dec.height()) * size_t(dec.channels()));
      dec.decode(px.data());
      std::fwrite(px.data(), 1, px.size(), out.get());
      std::printf("%s %d %d %d\n", dec.libjpeg_would_smooth() ? "smoothed" : "ok", dec.width(), dec.height(),
                  dec.channels());
    } catch (const et::UserError& e) {
      std::string msg = e.what();
      std::replace(msg.begin(), msg.end(), '\n', ' ');
      std::printf("error %s\n", msg.c_str());
    }
  }
  return 0;
}

// Seconds to decode all `files` on `threads` threads with one decoder (0: edgetrain, 1: stb).
double time_decoder(const std::vector<std::vector<uint8_t>>& files, int which, int threads) {
  constexpr size_t kChunk = 64;
  std::atomic<size_t> next{0};
  std::atomic<size_t> checksum{0};
  auto work = [&] {
    et::JpegDecoder dec;
    std::vector<uint8_t> px;
    size_t sum = 0;
    for (;;) {
      const size_t begin = next.fetch_add(kChunk);
      if (begin >= files.size()) break;
      for (size_t i = begin; i < std::min(files.size(), begin + kChunk); ++i) {
        const std::vector<uint8_t>& b = files[i];
        if (which == 0) {
          dec.read_header(b.data(), b.size(), "bench");
          px.resize(size_t(dec.width()) * size_t(dec.height()) * size_t(dec.channels()));
          dec.decode(px.data());
          sum += px[px.size() / 2];
        } else {
          int w, h, n;
          stbi_uc* p = stbi_load_from_memory(b.data(), int(b.size()), &w, &h, &n, 0);
          if (!p) et::user_error("stb_image: ", stbi_failure_reason());
          sum += p[size_t(w) * size_t(h) * size_t(n) / 2];
          stbi_image_free(p);
        }
      }
    }
    checksum += sum;
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int time_both(const char* list, int reps, int threads) {
  std::vector<std::vector<uint8_t>> files;
  size_t bytes = 0;
  for (const std::string& f : read_list(list)) {
    files.push_back(read_bytes(f));
    bytes += files.back().size();
  }
  std::printf("%zu files, %.1f MB, %d threads\n", files.size(), double(bytes) / 1e6, threads);
  std::vector<double> t[2];
  time_decoder(files, 0, threads);  // warm-up
  time_decoder(files, 1, threads);
  for (int r = 0; r < reps; ++r)
    for (int which = 0; which < 2; ++which) {
      t[which].push_back(time_decoder(files, which, threads));
      std::printf("rep %d %-9s %.3f s\n", r, which == 0 ? "edgetrain" : "stb_image", t[which].back());
    }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double a = median(t[0]), b = median(t[1]);
  std::printf("median edgetrain %.3f s (%.0f img/s), stb_image %.3f s (%.0f img/s): edgetrain/stb time %.3f\n", a,
              double(files.size()) / a, b, double(files.size()) / b, a / b);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "dump" && argc == 4) return dump(argv[2], argv[3]);
    if (mode == "time" && argc >= 3) {
      int reps = 5, threads = 2;
      for (int i = 3; i + 1 < argc; i += 2) {
        if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
        if (std::strcmp(argv[i], "--threads") == 0) threads = std::max(1, std::atoi(argv[i + 1]));
      }
      return time_both(argv[2], reps, threads);
    }
    std::fprintf(stderr, "usage: bench_jpeg dump LIST OUT | bench_jpeg time LIST [--reps N] [--threads T]\n");
    return 2;
  } catch (const et::UserError& e) {
    std::fprintf(stderr, "bench_jpeg: %s\n", e.what());
    return 1;
  }
}
