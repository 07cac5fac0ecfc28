// Test helper: a synthetic image data set a ResNet-8 learns in a few epochs (each label has its
// own pixel range), n images of 3x32x32, deterministic in `seed`.
#pragma once
#include <cstdint>
#include <memory>

#include "engine/data/dataset.h"

namespace et::test {

inline std::shared_ptr<Dataset> synthetic_dataset(int64_t n, uint32_t seed) {
  auto d = std::make_shared<Dataset>();
  d->size = n;
  d->channels = 3;
  d->height = d->width = 32;
  d->source = "<synthetic>";
  d->pixels.resize(size_t(n) * 3 * 32 * 32);
  d->labels.resize(size_t(n));
  uint32_t x = seed;
  auto next = [&] { return x = x * 1664525u + 1013904223u, x >> 8; };
  for (int64_t i = 0; i < n; ++i) {
    const int32_t l = int32_t(next() % 10);
    d->labels[size_t(i)] = l;
    for (size_t k = 0; k < 3 * 32 * 32; ++k) d->pixels[size_t(i) * 3072 + k] = uint8_t((l * 20 + next() % 40) % 256);
  }
  return d;
}

}  // namespace et::test
