#include "engine/data/dataset.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "engine/check.h"

namespace et {

const char* split_name(Split split) { return split == Split::Train ? "train" : "test"; }

std::shared_ptr<const Dataset> subset_dataset(const Dataset& d, int64_t n, uint64_t seed) {
  if (n >= d.size) return std::make_shared<Dataset>(d);
  std::vector<int64_t> idx(size_t(d.size));
  std::iota(idx.begin(), idx.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(idx.begin(), idx.end(), rng);
  idx.resize(size_t(n));
  std::sort(idx.begin(), idx.end());
  const size_t img = size_t(d.channels) * size_t(d.height) * size_t(d.width);
  std::vector<uint8_t> pixels(static_cast<size_t>(n) * img);
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (size_t i = 0; i < idx.size(); ++i) {
    std::copy_n(d.pixels.begin() + int64_t(size_t(idx[i]) * img), img, pixels.begin() + int64_t(i * img));
    labels[i] = d.labels[size_t(idx[i])];
  }
  auto out = std::make_shared<Dataset>();
  out->size = n;
  out->channels = d.channels;
  out->height = d.height;
  out->width = d.width;
  out->classes = d.classes;
  out->source = d.source;
  out->pixels = std::move(pixels);
  out->labels = std::move(labels);
  return out;
}

Dataset load_dataset(const std::string& format, const std::string& root, Split split,
                     const ImageFolderOptions& opt) {
  if (format == "cifar10_binary") return load_cifar10_binary(root, split);
  if (format == "image_folder") return load_image_folder(root, split, opt);
  user_error("unknown data format \"", format, "\" (expected \"image_folder\" or \"cifar10_binary\")");
}

}  // namespace et
