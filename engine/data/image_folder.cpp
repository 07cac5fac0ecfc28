// Image-folder reader: root/<split>/<class>/<image>, decoded on several threads: JPEGs with
// edgetrain's decoder (engine/data/jpeg_decode.h: libjpeg-turbo's pixels, what PIL and so PyTorch
// users get), PNG and BMP with stb_image.
// Each image lands in its own slot of Dataset::pixels, so the result does not depend on threads.
#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "engine/check.h"
#include "engine/data/dataset.h"
#include "engine/data/jpeg_decode.h"

// stb_image (Debian's libstb-dev) compiled privately here (static functions: no clash with another
// copy in the program), for PNG and BMP only. Its 2.27 JPEG decoder reads out of bounds on corrupt
// entropy-coded data (found by fuzz/fuzz_image.cpp: Huffman codes past its tables, a bit buffer
// shifted by 32), so every JPEG goes to edgetrain's decoder; and its PNG reader trusts chunk
// lengths, which decode_image checks first.
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_BMP
#define STBI_NO_STDIO  // we read the bytes ourselves (one reusable buffer per thread)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#include <stb_image.h>
#pragma GCC diagnostic pop

namespace et {
namespace fs = std::filesystem;

namespace {

struct Item {
  std::string path;
  int32_t label;
};

bool hidden(const fs::path& p) { return p.filename().string().rfind('.', 0) == 0; }

// Sub-folders of `dir`, byte-wise sorted (std::string compares as unsigned bytes).
std::vector<std::string> class_folders(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory() && !hidden(e.path())) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool is_image(const fs::path& p) {
  std::string ext = p.extension().string();
  for (char& c : ext) c = char(std::tolower(static_cast<unsigned char>(c)));
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".bmp";
}

void append_images(const fs::path& dir, int32_t label, std::vector<Item>& items) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && !hidden(e.path()) && is_image(e.path())) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  for (std::string& f : files) items.push_back({std::move(f), label});
}

fs::path split_dir(const fs::path& root, Split split) {
  if (!fs::is_directory(root)) user_error("image folder root ", root.string(), " does not exist or is not a folder");
  const fs::path dir = root / split_name(split);
  if (!fs::is_directory(dir))
    user_error("missing folder ", dir.string(), " (expected ", dir.string(), "/<class>/*.jpg|png|bmp)");
  return dir;
}

void check_options(const ImageFolderOptions& opt) {
  if (opt.channels != 1 && opt.channels != 3)
    user_error("image_folder: channels must be 1 or 3, got ", opt.channels);
  if (opt.height <= 0 || opt.width <= 0)
    user_error("image_folder: image size must be positive, got ", opt.height, "x", opt.width);
  if (opt.resize != "none" && opt.resize != "stretch" && opt.resize != "center_crop")
    user_error("image_folder: unknown resize mode \"", opt.resize, "\" (expected none, stretch or center_crop)");
}

constexpr uint64_t kMaxPixels = uint64_t(1) << 26, kMaxPixelsPerByte = 16384;

// stb_image allocates a PNG chunk's declared length (up to 2^30) before reading it: a chunk longer
// than what is left of the file is an error here first. Every chunk whose length and type are in
// the file counts, its CRC cut off or not (stb reads the type from 8 bytes).
void check_png_chunks(const uint8_t* p, size_t size, const std::string& path) {
  static const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (size < 8 || std::memcmp(p, kSignature, 8) != 0) return;
  for (size_t at = 8; at + 8 <= size;) {
    const uint64_t len = uint64_t(p[at]) << 24 | uint64_t(p[at + 1]) << 16 | uint64_t(p[at + 2]) << 8 | p[at + 3];
    const uint64_t left = size - at >= 12 ? size - at - 12 : 0;  // after length, type and CRC
    if (len > left)
      user_error(path, ": PNG chunk '", std::string(reinterpret_cast<const char*>(p + at + 4), 4), "' at byte ", at,
                 " declares ", len, " bytes, the file has ", left, " left: truncated or corrupt");
    if (std::memcmp(p + at + 4, "IEND", 4) == 0) return;
    at += 12 + size_t(len);
  }
}

// Where a JPEG's SOI marker (FF D8) is: at 0, or after fill bytes (0xFF), which stb_image took
// and libjpeg does not; edgetrain skips them, as it did when stb_image decoded such files.
// kNotJpeg for a file not starting with 0xFF (PNG and BMP never do); an error for one that does
// without SOI, and for an empty file.
constexpr size_t kNotJpeg = ~size_t(0);
size_t jpeg_soi(const uint8_t* p, size_t size, const std::string& path) {
  if (size == 0) user_error(path, ": empty file, not an image");
  if (p[0] != 0xFF) return kNotJpeg;
  size_t i = 1;
  while (i < size && p[i] == 0xFF) ++i;
  if (i == size) user_error(path, ": not an image: ", size, " bytes of 0xFF");
  if (p[i] != 0xD8) {
    char next[8];
    std::snprintf(next, sizeof next, "0x%02X", unsigned(p[i]));
    user_error(path, ": not a JPEG file: starts with 0xFF ", next, " (a JPEG starts with its SOI marker, 0xFF 0xD8)");
  }
  return i - 1;
}

// The header's size, checked before anything is allocated for it: no image edgetrain reads has
// more than kMaxPixels, nor more than kMaxPixelsPerByte per byte of its file (deflate packs at
// most ~1032 bytes in one, 8 1-bit pixels a byte; a JPEG block takes at least 2 bits).
void check_size(const std::string& path, size_t size, uint64_t w, uint64_t h) {
  const uint64_t pixels = w * h;
  if (pixels > kMaxPixels || pixels > kMaxPixelsPerByte * uint64_t(size))
    user_error(path, ": image header says ", w, "x", h, " pixels, ",
               pixels > kMaxPixels ? "more than the 2^26 edgetrain decodes" : fmt("impossible in ", size, " bytes"));
}

// A PNG's or BMP's header, after the checks that precede stb_image on a file's bytes: width,
// height and the channels as stored (1 gray, 2 gray + alpha, 3 colour, 4 colour + alpha; a palette
// counts as colour).
ImageHeader stb_header(const uint8_t* bytes, size_t size, const std::string& path) {
  if (size > size_t(INT32_MAX)) user_error(path, ": ", size, " bytes, too large for an image");
  check_png_chunks(bytes, size, path);
  int w = 0, h = 0, n = 0;
  if (!stbi_info_from_memory(bytes, int(size), &w, &h, &n))
    user_error(path, ": cannot decode image: ", stbi_failure_reason());
  if (w <= 0 || h <= 0) user_error(path, ": image header says ", w, "x", h, " pixels: no image");
  check_size(path, size, uint64_t(w), uint64_t(h));
  if (n < 1 || n > 4) user_error(path, ": image header says ", n, " channels");
  return {w, h, n};
}

// Any image file's header (what data.* = auto looks at), with the checks decoding makes first.
ImageHeader read_header(const uint8_t* bytes, size_t size, const std::string& path, JpegDecoder& jpeg) {
  const size_t soi = jpeg_soi(bytes, size, path);
  if (soi == kNotJpeg) return stb_header(bytes, size, path);
  jpeg.read_header(bytes + soi, size - soi, path);
  check_size(path, size, uint64_t(jpeg.width()), uint64_t(jpeg.height()));
  return {jpeg.width(), jpeg.height(), jpeg.channels()};
}

// A whole file's bytes into `bytes` (reused between files).
void read_file(const std::string& path, std::vector<uint8_t>& bytes) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!f) user_error(path, ": cannot open file");
  std::fseek(f.get(), 0, SEEK_END);
  const long size = std::ftell(f.get());
  std::fseek(f.get(), 0, SEEK_SET);
  if (size <= 0) user_error(path, ": empty file, not an image");
  bytes.resize(size_t(size));
  if (std::fread(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) user_error(path, ": cannot read file");
}

// Per-thread decoder: the scratch buffers grow to the largest image and are then reused.
class Decoder {
 public:
  explicit Decoder(const ImageFolderOptions& opt) : opt_(opt) {}

  // Decodes `path` into `out` ([C, H, W] uint8). Throws UserError naming the file.
  void decode(const std::string& path, uint8_t* out) {
    read_file(path, bytes_);
    decode(bytes_.data(), bytes_.size(), path, out);
  }

  void decode(const uint8_t* bytes, size_t size, const std::string& path, uint8_t* out) {
    int w = 0, h = 0;
    const size_t soi = jpeg_soi(bytes, size, path);
    if (soi != kNotJpeg) {
      decode_jpeg(bytes + soi, size - soi, path, w, h);
    } else {
      decode_stb(bytes, size, path, w, h);
    }
    const int H = opt_.height, W = opt_.width, C = opt_.channels;
    if (w == W && h == H) {
      for (int c = 0; c < C; ++c)  // HWC -> CHW
        for (size_t i = 0; i < size_t(H) * size_t(W); ++i) out[size_t(c) * H * W + i] = hwc_[i * size_t(C) + size_t(c)];
      return;
    }
    if (opt_.resize == "none")
      user_error(path, ": image is ", w, "x", h, " (width x height), expected ", W, "x", H,
                 " (set data.resize to \"stretch\" or \"center_crop\" to resize)");
    // dst pixel d samples src (d + off + 0.5) / scale - 0.5 (pixel centres, like cv2 INTER_LINEAR).
    float sy = float(H) / float(h), sx = float(W) / float(w), oy = 0, ox = 0;
    if (opt_.resize == "center_crop") {
      sy = sx = std::max(sy, sx);
      oy = (float(h) * sy - float(H)) / 2;
      ox = (float(w) * sx - float(W)) / 2;
    }
    bilinear(w, h, sx, sy, ox, oy, out);
  }

 private:
  // A JPEG (`bytes` starts with SOI) into hwc_, by edgetrain's decoder.
  void decode_jpeg(const uint8_t* bytes, size_t size, const std::string& path, int& w, int& h) {
    jpeg_.read_header(bytes, size, path);
    w = jpeg_.width();
    h = jpeg_.height();
    check_size(path, size, uint64_t(w), uint64_t(h));
    // What the decoder allocates: whole MCUs (blocks of up to 32 x 32 pixels) of each component.
    const uint64_t padded = jpeg_.padded_pixels();
    if (padded > kMaxPixels || padded > kMaxPixelsPerByte * uint64_t(size))
      user_error(path, ": JPEG of ", w, "x", h, " pixels is ", padded, " pixels in whole MCUs, ",
                 padded > kMaxPixels ? "more than the 2^26 edgetrain decodes" : fmt("impossible in ", size, " bytes"));
    const int n = jpeg_.channels();
    px_.resize(size_t(w) * size_t(h) * size_t(n));
    jpeg_.decode(px_.data());
    to_channels(px_.data(), size_t(w) * size_t(h), n);
  }

  // PNG and BMP with stb_image, after stb_header's checks.
  void decode_stb(const uint8_t* bytes, size_t size, const std::string& path, int& w, int& h) {
    const ImageHeader hd = stb_header(bytes, size, path);
    int n = 0;
    // The header's channel count is asked for explicitly: with 0 (as stored), stb 2.27 returns a
    // gray or RGB PNG with a tRNS chunk with an alpha channel added but reports the count without
    // it, and the pixels would be read with the wrong stride.
    std::unique_ptr<stbi_uc, void (*)(void*)> px(stbi_load_from_memory(bytes, int(size), &w, &h, &n, hd.channels),
                                                 stbi_image_free);
    if (!px) user_error(path, ": cannot decode image: ", stbi_failure_reason());
    if (w != hd.width || h != hd.height)
      user_error(path, ": cannot decode image: the header says ", hd.width, "x", hd.height, ", the pixels are ", w, "x", h);
    to_channels(px.get(), size_t(w) * size_t(h), hd.channels);
  }

  // Decoded pixels (n = 1 gray, 2 gray+alpha, 3 RGB, 4 RGBA) -> hwc_ with opt_.channels (1 or 3).
  void to_channels(const uint8_t* px, size_t pixels, int n) {
    const int C = opt_.channels;
    hwc_.resize(pixels * size_t(C));
    uint8_t* o = hwc_.data();
    if (n <= 2) {  // gray (alpha dropped), replicated to C channels
      for (size_t i = 0; i < pixels; ++i)
        for (int c = 0; c < C; ++c) *o++ = px[i * size_t(n)];
    } else if (C == 3) {  // RGB(A) -> RGB
      for (size_t i = 0; i < pixels; ++i)
        for (int c = 0; c < 3; ++c) *o++ = px[i * size_t(n) + size_t(c)];
    } else {  // RGB(A) -> BT.601 luma, rounded
      for (size_t i = 0; i < pixels; ++i) {
        const stbi_uc* p = px + i * size_t(n);
        *o++ = uint8_t((299u * p[0] + 587u * p[1] + 114u * p[2] + 500u) / 1000u);
      }
    }
  }

  // Bilinear sampling of hwc_ (w x h) into out [C, H, W], edges clamped.
  void bilinear(int w, int h, float sx, float sy, float ox, float oy, uint8_t* out) {
    const int H = opt_.height, W = opt_.width, C = opt_.channels;
    x0_.resize(size_t(W));
    x1_.resize(size_t(W));
    fx_.resize(size_t(W));
    for (int x = 0; x < W; ++x) {
      const float s = std::clamp((float(x) + ox + 0.5f) / sx - 0.5f, 0.f, float(w - 1));
      x0_[size_t(x)] = int(s);
      x1_[size_t(x)] = std::min(int(s) + 1, w - 1);
      fx_[size_t(x)] = s - float(int(s));
    }
    for (int y = 0; y < H; ++y) {
      const float s = std::clamp((float(y) + oy + 0.5f) / sy - 0.5f, 0.f, float(h - 1));
      const int y0 = int(s), y1 = std::min(y0 + 1, h - 1);
      const float fy = s - float(y0);
      const uint8_t* r0 = hwc_.data() + size_t(y0) * size_t(w) * size_t(C);
      const uint8_t* r1 = hwc_.data() + size_t(y1) * size_t(w) * size_t(C);
      for (int c = 0; c < C; ++c) {
        uint8_t* o = out + (size_t(c) * H + size_t(y)) * W;
        for (int x = 0; x < W; ++x) {
          const size_t a = size_t(x0_[size_t(x)]) * C + c, b = size_t(x1_[size_t(x)]) * C + c;
          const float f = fx_[size_t(x)];
          const float top = float(r0[a]) + f * (float(r0[b]) - float(r0[a]));
          const float bot = float(r1[a]) + f * (float(r1[b]) - float(r1[a]));
          o[x] = uint8_t(std::lround(std::clamp(top + fy * (bot - top), 0.f, 255.f)));
        }
      }
    }
  }

  const ImageFolderOptions& opt_;
  JpegDecoder jpeg_;
  std::vector<uint8_t> bytes_, px_, hwc_;
  std::vector<int> x0_, x1_;
  std::vector<float> fx_;
};

// Runs body(state, i) for every item i in [0, n) on up to 8 threads, each with its own state from
// make_state(), chunks handed out in index order. On errors, the one of the lowest index is
// rethrown: chunks are taken in order and a started chunk is finished unless it fails itself, so
// every item before the first failure has been tried. Deterministic message.
template <typename MakeState, typename Body>
void for_each_item(size_t n, MakeState make_state, Body body) {
  constexpr size_t kChunk = 64;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min<size_t>({hw, 8, (n + kChunk - 1) / kChunk});
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  size_t err_index = n;
  std::exception_ptr err;
  auto work = [&] {
    auto state = make_state();
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t begin = next.fetch_add(kChunk);
      if (begin >= n) return;
      for (size_t i = begin; i < std::min(n, begin + kChunk); ++i) {
        try {
          body(state, i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (i < err_index) err_index = i, err = std::current_exception();
          failed = true;
          return;
        }
      }
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (err) std::rethrow_exception(err);
}

void decode_all(const std::vector<Item>& items, const ImageFolderOptions& opt, Dataset& d) {
  const size_t img = size_t(d.image_elems());
  for_each_item(
      items.size(), [&] { return Decoder(opt); },
      [&](Decoder& dec, size_t i) { dec.decode(items[i].path, d.pixels.data() + i * img); });
}

// The images of root/<split>, labelled by root/train's class folders (see load_image_folder).
struct Listing {
  fs::path dir, train_dir;
  std::vector<std::string> classes;
  std::vector<Item> items;
};

Listing list_images(const fs::path& root, Split split) {
  Listing l;
  l.train_dir = split_dir(root, Split::Train);  // the class list always comes from train
  l.dir = split == Split::Train ? l.train_dir : split_dir(root, split);
  try {
    l.classes = class_folders(l.train_dir);
  } catch (const fs::filesystem_error& e) {
    user_error("cannot list ", l.train_dir.string(), ": ", e.what());
  }
  if (l.classes.empty()) user_error(l.train_dir.string(), " has no class folders (expected <class>/*.jpg|png|bmp)");
  try {
    for (const std::string& name : class_folders(l.dir)) {
      const auto it = std::find(l.classes.begin(), l.classes.end(), name);
      if (it == l.classes.end())
        user_error((l.dir / name).string(), ": class folder not in ", l.train_dir.string(),
                   " (labels come from the train split's class folders)");
      append_images(l.dir / name, int32_t(it - l.classes.begin()), l.items);
    }
  } catch (const fs::filesystem_error& e) {  // e.g. an unreadable folder
    user_error("cannot list ", l.dir.string(), ": ", e.what());
  }
  if (l.items.empty()) user_error("no images (*.jpg, *.jpeg, *.png, *.bmp) under ", l.dir.string(), "/<class>/");
  return l;
}

}  // namespace

FolderHeaders read_image_folder_headers(const std::string& root, Split split) {
  Listing l = list_images(fs::path(root), split);
  FolderHeaders out;
  out.dir = l.dir.string();
  out.headers.resize(l.items.size());
  struct State {
    std::vector<uint8_t> bytes;
    JpegDecoder jpeg;
  };
  for_each_item(
      l.items.size(), [] { return State(); },
      [&](State& st, size_t i) {
        read_file(l.items[i].path, st.bytes);
        out.headers[i] = read_header(st.bytes.data(), st.bytes.size(), l.items[i].path, st.jpeg);
      });
  out.files.reserve(l.items.size());
  for (Item& it : l.items) out.files.push_back(std::move(it.path));
  return out;
}

void decode_image(const uint8_t* bytes, size_t size, const std::string& path, const ImageFolderOptions& opt,
                  uint8_t* out) {
  check_options(opt);
  Decoder(opt).decode(bytes, size, path, out);
}

Dataset load_image_folder(const std::string& root_str, Split split, const ImageFolderOptions& opt) {
  check_options(opt);
  Listing l = list_images(fs::path(root_str), split);
  const std::vector<Item>& items = l.items;
  Dataset d;
  d.classes = std::move(l.classes);
  d.channels = opt.channels;
  d.height = opt.height;
  d.width = opt.width;
  d.source = l.dir.string();

  d.size = int64_t(items.size());
  d.pixels.resize(size_t(d.size * d.image_elems()));
  d.labels.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) d.labels[i] = items[i].label;
  decode_all(items, opt, d);
  return d;
}

}  // namespace et
