// BatchLoader: float batches [B, C, H, W] + int32 labels [B] from a Dataset, prepared on a
// background thread (double buffering: while the caller trains on batch i, batch i+1 is built).
// Shuffle order and augmentation are pure functions of (seed, epoch, position in epoch), so the
// batches never depend on thread timing and start_epoch(e) after a resume reproduces epoch e.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/data/dataset.h"

namespace et {

struct LoaderOptions {
  int64_t batch_size = 128;
  bool shuffle = true;
  bool drop_last = true;  // train: true; eval: false (the last partial batch is delivered)
  uint64_t seed = 0;
  int crop_padding = 0;  // random HxW crop of the image zero-padded by this much on each side; 0 = off
  bool hflip = false;    // random horizontal flip, probability 1/2 (applied after the crop)
  std::vector<float> mean, std;  // per channel: (x/255 - mean) / std; empty = mean 0, std 1
};

class BatchLoader {
 public:
  // `data` must outlive the loader. Starts the worker thread; allocates everything it will use.
  BatchLoader(const Dataset& data, LoaderOptions opt);
  ~BatchLoader();  // stops and joins the thread
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Resets the position to the start of `epoch` (>= 0) and begins prefetching its first batch.
  // Call from the same thread as next(); any batch of a previous epoch still pending is dropped.
  void start_epoch(int epoch);
  int64_t batches_per_epoch() const { return num_batches_; }
  // Copies the next batch into images (capacity batch_size*C*H*W floats) and labels (batch_size);
  // returns its size, 0 at the end of the epoch. Allocates nothing.
  int64_t next(float* images, int32_t* labels);

 private:
  void worker();
  int64_t produce(int64_t batch, int slot);  // fills slot, returns the batch size
  void sample(int64_t pos, int64_t index, float* out) const;

  const Dataset& data_;
  const LoaderOptions opt_;
  const int C_, H_, W_;
  const int64_t image_elems_, num_batches_;
  std::vector<float> lut_;     // [C, 256]: normalised value of each byte value
  std::vector<int64_t> perm_;  // [size]: position in epoch -> image index
  std::vector<float> images_[2];
  std::vector<int32_t> labels_[2];

  // Shared with the worker, guarded by mu_. Batch b goes to slot b % 2; the worker may build
  // batch b once batch b - 2 has been consumed.
  std::mutex mu_;
  std::condition_variable work_cv_, ready_cv_;
  int epoch_ = -1;
  uint64_t generation_ = 0;  // bumped by start_epoch: a batch built for an older one is dropped
  int64_t produce_next_ = 0, consume_next_ = 0;
  int64_t ready_[2] = {-1, -1};  // batch index held by each slot, -1 = none
  int64_t sizes_[2] = {0, 0};
  bool busy_ = false, stop_ = false;
  std::thread thread_;
};

}  // namespace et
