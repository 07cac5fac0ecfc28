#include "engine/train/input_feed.h"

#include "engine/data/loader.h"

namespace et {

InputFeed::InputFeed(Backend& backend, const Tensor& images, const Tensor& labels)
    : backend_(backend), staged_(!backend.host_addressable()) {
  ET_CHECK(images.dtype == DType::F32 && labels.dtype == DType::I32 && images.is_contiguous() && labels.is_contiguous());
  if (!staged_) return;
  image_staging_ = std::make_unique<HostStaging>(backend, images.nbytes());
  label_staging_ = std::make_unique<HostStaging>(backend, labels.nbytes());
  const size_t image_bytes = Arena::align_up(images.nbytes());
  prefetched_.reserve(image_bytes + labels.nbytes(), "the prefetched input batch", backend.memory());
  next_images_ = Tensor::contiguous(prefetched_.at(0), images.shape, DType::F32, images.device);
  next_labels_ = Tensor::contiguous(prefetched_.at(image_bytes), labels.shape, DType::I32, labels.device);
}

void InputFeed::start(BatchLoader& loader, const Tensor& images, const Tensor& labels) {
  ET_CHECK(images.dtype == DType::F32 && labels.dtype == DType::I32 && images.is_contiguous() && labels.is_contiguous());
  ET_CHECK(!staged_ || (images.nbytes() == next_images_.nbytes() && labels.nbytes() == next_labels_.nbytes()),
           "InputFeed: inputs of another shape than the feed's");
  images_ = images;
  labels_ = labels;
  loader_ = &loader;
  fetched_ = -1;
  prefetch();
}

int64_t InputFeed::next() {
  ET_CHECK(loader_ != nullptr, "InputFeed::next before start");
  if (!staged_) return loader_->next(images_.f32(), labels_.i32());
  ET_CHECK(fetched_ >= 0, "InputFeed::next without a prefetch since the last");
  const int64_t n = fetched_;
  fetched_ = -1;
  if (n > 0) {
    backend_.side_acquire();
    backend_.copy(next_images_, images_);  // whole tensors: a short batch's tail is not read
    backend_.copy(next_labels_, labels_);
    backend_.side_release();
  }
  return n;
}

void InputFeed::prefetch() {
  ET_CHECK(loader_ != nullptr, "InputFeed::prefetch before start");
  if (!staged_) return;  // the loader's own worker decodes ahead; the inputs are written in next()
  ET_CHECK(fetched_ < 0, "InputFeed::prefetch twice without a next");
  backend_.side_wait();  // the staging's last copy has run (long since, in a step that read it)
  fetched_ = loader_->next(static_cast<float*>(image_staging_->data()), static_cast<int32_t*>(label_staging_->data()));
  if (fetched_ > 0) {
    backend_.side_copy_from_host(image_staging_->data(), next_images_);
    backend_.side_copy_from_host(label_staging_->data(), next_labels_);
  }
}

}  // namespace et
