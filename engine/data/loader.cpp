#include "engine/data/loader.h"

#include <algorithm>
#include <cstring>

#include "engine/check.h"

namespace et {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Counter-based random numbers: one independent 64-bit value per (seed, stream, epoch, counter).
enum Stream : uint64_t { kShuffle = 1, kCrop = 2, kFlip = 3 };
uint64_t hash(uint64_t seed, Stream stream, uint64_t epoch, uint64_t counter) {
  return splitmix64(splitmix64(splitmix64(seed ^ (uint64_t(stream) << 56)) ^ epoch) ^ counter);
}

// Uniform in [0, n): high half of a 32x32-bit product (bias below 2^-32 * n).
uint64_t below(uint64_t r, uint64_t n) { return ((r & 0xFFFFFFFFull) * n) >> 32; }

int64_t count_batches(int64_t size, int64_t batch, bool drop_last) {
  return drop_last ? size / batch : (size + batch - 1) / batch;
}

}  // namespace

BatchLoader::BatchLoader(const Dataset& data, LoaderOptions opt)
    : data_(data),
      opt_(std::move(opt)),
      C_(data.channels),
      H_(data.height),
      W_(data.width),
      image_elems_(data.image_elems()),
      num_batches_(count_batches(data.size, std::max<int64_t>(opt_.batch_size, 1), opt_.drop_last)) {
  ET_CHECK(opt_.batch_size > 0, "batch_size ", opt_.batch_size);
  ET_CHECK(opt_.crop_padding >= 0, "crop_padding ", opt_.crop_padding);
  ET_CHECK(data.pixels.size() == size_t(data.size * image_elems_) && data.labels.size() == size_t(data.size),
           "inconsistent Dataset from ", data.source);
  for (const auto* v : {&opt_.mean, &opt_.std})
    if (!v->empty() && v->size() != size_t(C_))
      user_error(data.source, ": ", v->size(), " normalisation mean/std values for ", C_, "-channel images");
  lut_.resize(size_t(C_) * 256);
  for (int c = 0; c < C_; ++c) {
    const double mean = opt_.mean.empty() ? 0.0 : opt_.mean[size_t(c)];
    const double std = opt_.std.empty() ? 1.0 : opt_.std[size_t(c)];
    if (!(std > 0)) user_error(data.source, ": normalisation std of channel ", c, " is ", std, ", must be positive");
    for (int v = 0; v < 256; ++v) lut_[size_t(c) * 256 + size_t(v)] = float((v / 255.0 - mean) / std);
  }
  perm_.resize(size_t(data.size));
  for (int s = 0; s < 2; ++s) {
    images_[s].resize(size_t(opt_.batch_size * image_elems_));
    labels_[s].resize(size_t(opt_.batch_size));
  }
  thread_ = std::thread([this] { worker(); });
}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void BatchLoader::start_epoch(int epoch) {
  ET_CHECK(epoch >= 0, "epoch ", epoch);
  std::unique_lock<std::mutex> lock(mu_);
  ++generation_;
  ready_cv_.wait(lock, [&] { return !busy_; });  // the worker reads perm_ and epoch_ while busy
  epoch_ = epoch;
  const int64_t n = data_.size;
  for (int64_t i = 0; i < n; ++i) perm_[size_t(i)] = i;
  if (opt_.shuffle)  // Fisher-Yates, swap i drawn from (seed, epoch, i)
    for (int64_t i = n - 1; i > 0; --i)
      std::swap(perm_[size_t(i)], perm_[below(hash(opt_.seed, kShuffle, uint64_t(epoch), uint64_t(i)), uint64_t(i + 1))]);
  produce_next_ = consume_next_ = 0;
  ready_[0] = ready_[1] = -1;
  lock.unlock();
  work_cv_.notify_one();
}

int64_t BatchLoader::next(float* images, int32_t* labels) {
  std::unique_lock<std::mutex> lock(mu_);
  ET_CHECK(epoch_ >= 0, "BatchLoader::next before start_epoch");
  if (consume_next_ >= num_batches_) return 0;
  const int64_t b = consume_next_;
  const int s = int(b % 2);
  ready_cv_.wait(lock, [&] { return ready_[s] == b; });
  const int64_t n = sizes_[s];
  lock.unlock();
  // The worker does not touch slot s until batch b is marked consumed below.
  std::memcpy(images, images_[s].data(), size_t(n * image_elems_) * sizeof(float));
  std::memcpy(labels, labels_[s].data(), size_t(n) * sizeof(int32_t));
  lock.lock();
  ready_[s] = -1;
  ++consume_next_;
  lock.unlock();
  work_cv_.notify_one();
  return n;
}

void BatchLoader::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] {
      return stop_ || (epoch_ >= 0 && produce_next_ < num_batches_ && produce_next_ <= consume_next_ + 1);
    });
    if (stop_) return;
    const int64_t b = produce_next_++;
    const uint64_t gen = generation_;
    busy_ = true;
    lock.unlock();
    const int64_t n = produce(b, int(b % 2));
    lock.lock();
    busy_ = false;
    if (gen == generation_) {
      ready_[b % 2] = b;
      sizes_[b % 2] = n;
    }
    ready_cv_.notify_all();  // next() waits for the batch, start_epoch() for !busy_
  }
}

int64_t BatchLoader::produce(int64_t batch, int slot) {
  const int64_t first = batch * opt_.batch_size;
  const int64_t n = std::min(opt_.batch_size, data_.size - first);
  float* out = images_[slot].data();
  int32_t* labels = labels_[slot].data();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t index = perm_[size_t(first + j)];
    labels[j] = data_.labels[size_t(index)];
    sample(first + j, index, out + j * image_elems_);
  }
  return n;
}

// out(c, y, x) = padded(c, y + dy, x' + dx) with x' = flip ? W-1-x : x, where padded is the image
// with `p` zero pixels on each side and dy, dx in [0, 2p]. Zeros normalise to lut[c][0].
void BatchLoader::sample(int64_t pos, int64_t index, float* out) const {
  const int p = opt_.crop_padding;
  int dy = p, dx = p;  // no shift
  if (p > 0) {
    const uint64_t r = hash(opt_.seed, kCrop, uint64_t(epoch_), uint64_t(pos));
    dy = int(below(r, uint64_t(2 * p + 1)));
    dx = int(below(r >> 32, uint64_t(2 * p + 1)));
  }
  const bool flip = opt_.hflip && (hash(opt_.seed, kFlip, uint64_t(epoch_), uint64_t(pos)) >> 63) != 0;
  const int sy0 = dy - p, sx0 = dx - p;  // source offset of output (0, 0) before flipping
  // Output columns whose source column lies inside the image: [lo, hi) in both cases.
  const int lo = std::clamp(flip ? sx0 : -sx0, 0, W_), hi = std::clamp(flip ? W_ + sx0 : W_ - sx0, lo, W_);
  const uint8_t* img = data_.image(index);
  for (int c = 0; c < C_; ++c) {
    const float* lut = lut_.data() + size_t(c) * 256;
    const float zero = lut[0];
    for (int y = 0; y < H_; ++y) {
      float* o = out + (int64_t(c) * H_ + y) * W_;
      const int sy = y + sy0;
      if (sy < 0 || sy >= H_) {
        std::fill(o, o + W_, zero);
        continue;
      }
      const uint8_t* src = img + (int64_t(c) * H_ + sy) * W_;
      std::fill(o, o + lo, zero);
      if (flip) {
        const int last = W_ - 1 + sx0;  // source column of x = 0, walking left
        for (int x = lo; x < hi; ++x) o[x] = lut[src[last - x]];
      } else {
        for (int x = lo; x < hi; ++x) o[x] = lut[src[x + sx0]];
      }
      std::fill(o + hi, o + W_, zero);
    }
  }
}

}  // namespace et
