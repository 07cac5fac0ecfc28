#include "engine/data/auto.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "engine/check.h"

namespace et {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Sum and sum of squares of n bytes. Blocks of 65536 keep both in 32 bits (65536 * 255^2 < 2^32),
// which the compiler vectorises (widening loads, 32-bit multiply-adds).
inline void byte_sums(const uint8_t* p, size_t n, uint64_t* s1, uint64_t* s2) {
  constexpr size_t kBlock = 65536;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    uint32_t a1 = 0, a2 = 0;
    for (size_t k = b; k < e; ++k) {
      const uint32_t v = p[k];
      a1 += v;
      a2 += v * v;
    }
    *s1 += a1;
    *s2 += a2;
  }
}

std::string join(const std::vector<float>& v) {
  std::string s;
  char buf[32];
  for (float x : v) {
    std::snprintf(buf, sizeof(buf), "%.4f", double(x));
    s += (s.empty() ? "" : ", ") + std::string(buf);
  }
  return "[" + s + "]";
}

std::string size_str(int w, int h) { return fmt(w, "x", h); }

// The auto keys among channels / height / width, as "data.channels / data.height".
std::string shape_keys(const Config& c) {
  std::string s;
  auto add = [&](bool is_auto, const char* k) {
    if (is_auto) s += (s.empty() ? "data." : " / data.") + std::string(k);
  };
  add(c.model.channels == 0, "channels");
  add(c.model.height == 0, "height");
  add(c.model.width == 0, "width");
  return s;
}

// Per-channel values given for a channel count that auto found otherwise.
void check_values_per_channel(const Config& c, const std::string& why) {
  for (const auto* v : {&c.data.mean, &c.data.std}) {
    if (v->empty() || v->size() == size_t(c.model.channels)) continue;
    user_error("data.", v == &c.data.mean ? "mean" : "std", " has ", v->size(), " values (one per channel), but ", why,
               ": set data.mean and data.std to \"auto\" or to ", c.model.channels, " value",
               c.model.channels > 1 ? "s" : "", " each, or data.channels = ", v->size());
  }
}

}  // namespace

ChannelStats channel_stats(const Dataset& d) {
  const int C = d.channels;
  const size_t plane = size_t(d.height) * size_t(d.width);
  ET_CHECK(C > 0 && d.pixels.size() == size_t(d.size) * size_t(C) * plane, "inconsistent Dataset from ", d.source);
  std::vector<uint64_t> s1(size_t(C), 0), s2(size_t(C), 0);
#pragma omp parallel
  {
    std::vector<uint64_t> t1(size_t(C), 0), t2(size_t(C), 0);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < d.size; ++i)
      for (int c = 0; c < C; ++c) byte_sums(d.image(i) + size_t(c) * plane, plane, &t1[size_t(c)], &t2[size_t(c)]);
#pragma omp critical
    for (size_t c = 0; c < size_t(C); ++c) s1[c] += t1[c], s2[c] += t2[c];
  }
  ChannelStats st;
  st.pixels = d.size * int64_t(plane);
  const auto n = static_cast<unsigned __int128>(st.pixels);
  for (size_t c = 0; c < size_t(C); ++c) {
    // N^2 var = N s2 - s1^2 exactly (s1 < 2^56, N s2 < 2^128 for any data set that fits in memory).
    const unsigned __int128 a = n * s2[c], b = static_cast<unsigned __int128>(s1[c]) * s1[c];
    const double nn = double(st.pixels);
    st.mean.push_back(st.pixels ? double(s1[c]) / nn / 255.0 : 0.0);
    st.std.push_back(st.pixels ? std::sqrt(double(a - b) / nn / nn) / 255.0 : 0.0);
  }
  return st;
}

std::string resolve_data_shape(Config& cfg, bool synthetic) {
  if (!cfg.shape_auto()) return "";
  const std::string keys = shape_keys(cfg);
  auto set_shape = [&](int c, int h, int w) {
    if (cfg.model.channels == 0) cfg.model.channels = c;
    if (cfg.model.height == 0) cfg.model.height = h;
    if (cfg.model.width == 0) cfg.model.width = w;
  };
  if (cfg.data.format == "cifar10_binary") {
    const bool channels_auto = cfg.model.channels == 0;
    set_shape(3, 32, 32);
    if (channels_auto) check_values_per_channel(cfg, "data.channels = auto: CIFAR-10 images have 3 channels");
    return keys + " = auto: " + fmt(cfg.model.channels, "x", cfg.model.height, "x", cfg.model.width) + " (cifar10_binary)";
  }
  std::error_code ec;
  if (synthetic && !fs::is_directory(fs::path(cfg.data.root) / "train", ec)) {
    set_shape(3, 32, 32);
    return keys + " = auto: no training images at " + (fs::path(cfg.data.root) / "train").string() +
           ", so the shape is taken as " + fmt(cfg.model.channels, "x", cfg.model.height, "x", cfg.model.width);
  }
  const FolderHeaders fh = read_image_folder_headers(cfg.data.root, Split::Train);
  const size_t n = fh.files.size();
  size_t colour = 0;
  struct Seen {
    size_t count = 0, first = 0;
  };
  std::map<std::pair<int, int>, Seen> sizes;  // (width, height)
  for (size_t i = 0; i < n; ++i) {
    const ImageHeader& h = fh.headers[i];
    colour += h.channels >= 3;
    Seen& s = sizes[{h.width, h.height}];
    if (s.count++ == 0) s.first = i;
  }
  // The most common size; on a tie the one met first.
  auto mode = sizes.begin();
  for (auto it = sizes.begin(); it != sizes.end(); ++it)
    if (it->second.count > mode->second.count ||
        (it->second.count == mode->second.count && it->second.first < mode->second.first))
      mode = it;
  const int W = mode->first.first, H = mode->first.second;
  std::string why;
  if (cfg.model.height == 0 || cfg.model.width == 0) {
    if (sizes.size() > 1 && cfg.data.resize == "none") {
      const ImageHeader& a = fh.headers[0];
      size_t other = 1;
      while (fh.headers[other].width == a.width && fh.headers[other].height == a.height) ++other;
      const ImageHeader& b = fh.headers[other];
      user_error("data.height / data.width = auto: the images under ", fh.dir, " are not all one size: ", fh.files[0],
                 " is ", size_str(a.width, a.height), " (width x height), ", fh.files[other], " is ",
                 size_str(b.width, b.height), " (", sizes.size(), " sizes among ", n, " images; the most common, ",
                 size_str(W, H), ", has ", mode->second.count,
                 " of them). Set data.resize to \"stretch\" or \"center_crop\" to resize every image to the most common size "
                 "(or to data.height x data.width, if given)");
    }
    if (H < 8 || W < 8 || H > 1024 || W > 1024)
      user_error("data.height / data.width = auto: the ", sizes.size() > 1 ? "most common size of the " : "",
                 "images under ", fh.dir, " is ", size_str(W, H), " (width x height, e.g. ", fh.files[mode->second.first],
                 "); the model's input must be 8..1024 pixels a side: set data.height and data.width, and data.resize "
                 "to \"stretch\" or \"center_crop\"");
    why = sizes.size() == 1 ? fmt("all ", size_str(W, H))
                            : fmt(sizes.size(), " sizes, the most common ", size_str(W, H), " (", mode->second.count,
                                  " images), data.resize = ", cfg.data.resize);
  }
  if (cfg.model.channels == 0) {
    why += std::string(why.empty() ? "" : "; ") +
           (colour == 0 ? "all grayscale"
                        : colour == n ? "colour" : fmt(colour, " colour, ", n - colour, " grayscale replicated to RGB"));
  }
  const bool channels_auto = cfg.model.channels == 0;
  set_shape(colour > 0 ? 3 : 1, H, W);
  if (channels_auto)
    check_values_per_channel(cfg, colour ? "data.channels = auto found colour images under " + fh.dir + " (3 channels)"
                                         : "data.channels = auto found only grayscale images under " + fh.dir + " (1 channel)");
  return keys + " = auto: " + fmt(cfg.model.channels, "x", cfg.model.height, "x", cfg.model.width, " from the ", n,
                                  " training images under ", fh.dir, " (", why, ")");
}

std::string resolve_data_stats(Config& cfg, const Dataset& train) {
  if (!cfg.stats_auto()) return "";
  if (train.channels != cfg.model.channels)
    user_error(train.source, ": images have ", train.channels, " channels, the model expects ", cfg.model.channels);
  if (train.size == 0) user_error(train.source, ": no training images to compute data.mean / data.std = auto from");
  const auto t0 = std::chrono::steady_clock::now();
  const ChannelStats st = channel_stats(train);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string keys;
  if (cfg.data.mean.empty()) {
    for (double m : st.mean) cfg.data.mean.push_back(float(m));
    keys = "data.mean";
  }
  if (cfg.data.std.empty()) {
    for (size_t c = 0; c < st.std.size(); ++c) {
      // A constant channel (every pixel the same value) cannot be normalised by its spread.
      if (!(float(st.std[c]) > 0.f))
        user_error("data.std = auto: channel ", c, " of the ", train.size, " training images from ", train.source,
                   " is constant (every pixel ", std::lround(st.mean[c] * 255.0),
                   " / 255), so its standard deviation is 0: set data.std");
      cfg.data.std.push_back(float(st.std[c]));
    }
    keys += keys.empty() ? "data.std" : " / data.std";
  }
  check_data_resolved(cfg);
  char t[32];
  std::snprintf(t, sizeof(t), "%.3f", secs);
  return keys + " = auto over the " + fmt(train.size, " training images from ", train.source, ": mean ",
                                          join(cfg.data.mean), ", std ", join(cfg.data.std),
                                          " (population std over ", st.pixels, " pixels a channel; ", t, " s)");
}

std::shared_ptr<const Dataset> training_images(std::shared_ptr<const Dataset> train, const Config& cfg) {
  if (!train || cfg.data.train_subset <= 0) return train;
  return subset_dataset(*train, cfg.data.train_subset, cfg.train.seed);
}

std::vector<std::string> adopt_saved_data(Config& cfg, const json& saved) {
  std::vector<std::string> filled;
  const json* d = saved.is_object() && saved.contains("data") && saved["data"].is_object() ? &saved["data"] : nullptr;
  if (!d) return filled;
  auto integer = [&](const char* key, int64_t& out, int64_t lo, int64_t hi) {
    if (out != 0 || !d->contains(key)) return;
    const json& v = (*d)[key];
    if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) return;
    out = v.get<int64_t>();
    filled.push_back(std::string("data.") + key);
  };
  if (cfg.model.channels == 0 && d->contains("channels") && ((*d)["channels"] == 1 || (*d)["channels"] == 3))
    integer("channels", cfg.model.channels, 1, 3);
  integer("height", cfg.model.height, 8, 1024);
  integer("width", cfg.model.width, 8, 1024);
  auto values = [&](const char* key, std::vector<float>& out) {
    if (!out.empty() || !d->contains(key)) return;
    const json& v = (*d)[key];
    if (!v.is_array() || (v.size() != 1 && v.size() != 3)) return;
    std::vector<float> got;
    for (const json& x : v) {
      if (!x.is_number()) return;
      got.push_back(x.get<float>());
    }
    out = got;
    filled.push_back(std::string("data.") + key);
  };
  values("mean", cfg.data.mean);
  values("std", cfg.data.std);
  return filled;
}

void check_data_resolved(const Config& cfg) {
  ET_CHECK(!cfg.shape_auto(), "data shape used before it was resolved");
  for (const auto* v : {&cfg.data.mean, &cfg.data.std})
    if (!v->empty() && v->size() != size_t(cfg.model.channels))
      user_error("data.", v == &cfg.data.mean ? "mean" : "std", " has ", v->size(), " values, the model's input has ",
                 cfg.model.channels, " channel", cfg.model.channels > 1 ? "s" : "", " (data.channels): one value per channel");
}

}  // namespace et
