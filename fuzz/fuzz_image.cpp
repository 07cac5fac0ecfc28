// The image-folder loader's per-file path: edgetrain's JPEG decoder, stb_image for PNG and BMP,
// the channel rule and the resize (engine/data/image_folder.cpp, decode_image). Input: an options byte (bit 0: 3
// channels, else 1; bits 1-2: resize none / stretch / center_crop; bits 3-4: the model's size,
// 32x32, 1x1, 7x5 or 64x48), then the file.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "engine/check.h"
#include "engine/data/dataset.h"
#include "fuzz/fuzz_util.h"

// The seed writer only (its JPEG encoder shifts negative values: not the code under test).
#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#pragma clang attribute push(__attribute__((no_sanitize("undefined"))), apply_to = function)
#include <stb_image_write.h>
#pragma clang attribute pop

namespace {

void append(void* ctx, void* data, int n) {
  auto* out = static_cast<std::string*>(ctx);
  out->append(static_cast<const char*>(data), size_t(n));
}

// Small images of every channel count, in each format, with a few option bytes.
void write_seeds(const std::string& dir) {
  struct Img { const char* name; int w, h, n; char kind; unsigned char opts; };
  const Img imgs[] = {{"gray_5x3.png", 5, 3, 1, 'p', 0x00}, {"gray_alpha_4x4.png", 4, 4, 2, 'p', 0x03},
                      {"rgb_7x5.png", 7, 5, 3, 'p', 0x11}, {"rgba_3x3.png", 3, 3, 4, 'p', 0x05},
                      {"rgb_8x8.jpg", 8, 8, 3, 'j', 0x03}, {"gray_16x9.jpg", 16, 9, 1, 'j', 0x1C},
                      {"rgb_6x4.bmp", 6, 4, 3, 'b', 0x0B}, {"rgba_5x5.bmp", 5, 5, 4, 'b', 0x0D},
                      {"rgb_32x32.png", 32, 32, 3, 'p', 0x01}};
  for (const Img& m : imgs) {
    std::vector<unsigned char> px(size_t(m.w * m.h * m.n));
    for (size_t i = 0; i < px.size(); ++i) px[i] = (unsigned char)(i * 37 + 11);
    std::string file(1, char(m.opts));
    if (m.kind == 'p') stbi_write_png_to_func(append, &file, m.w, m.h, m.n, px.data(), m.w * m.n);
    if (m.kind == 'j') stbi_write_jpg_to_func(append, &file, m.w, m.h, m.n, px.data(), 90);
    if (m.kind == 'b') stbi_write_bmp_to_func(append, &file, m.w, m.h, m.n, px.data());
    et::fuzz::write_file(dir + "/" + m.name, file);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string seeds = et::fuzz::seed_dir();
  if (!seeds.empty()) {
    write_seeds(seeds);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const char* const kResize[] = {"none", "stretch", "center_crop", "stretch"};
  static const int kSize[4][2] = {{32, 32}, {1, 1}, {7, 5}, {64, 48}};
  et::ImageFolderOptions opt;
  opt.channels = (data[0] & 1) ? 3 : 1;
  opt.resize = kResize[(data[0] >> 1) & 3];
  opt.width = kSize[(data[0] >> 3) & 3][0];
  opt.height = kSize[(data[0] >> 3) & 3][1];
  std::vector<uint8_t> out(size_t(opt.channels * opt.height * opt.width));
  try {
    et::decode_image(data + 1, size - 1, "fuzz.img", opt, out.data());
  } catch (const et::UserError&) {
  }
  return 0;
}
