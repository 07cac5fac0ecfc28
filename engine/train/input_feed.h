// The trainer's input batches, from the loader to the executor's input tensors.
//
// On a backend the host addresses (the CPU) the loader writes the inputs in place. Elsewhere (a GPU)
// batch i + 1 crosses while step i computes, through the backend's copy lane (Backend::side_*):
//   next()      [compute] wait for the fetched batch's copy; copy it from the prefetch buffers into
//               the inputs (device to device); then side_release: the prefetch buffers are free.
//   (step i)    the caller issues it
//   prefetch()  [host] wait for the last copy out of the staging, then the loader's next batch
//               into it (page-locked) while the GPU computes; [copy lane] staging -> prefetch
//               buffers, after the release.
// The inputs keep their addresses, so a recorded step (engine/step_replay.h) reads every batch, and
// the inputs hold step i's batch until the next next(): the accuracy readout reads its labels.
#pragma once
#include <cstdint>
#include <memory>

#include "backends/backend.h"
#include "memory/arena.h"

namespace et {

class BatchLoader;

// A host buffer for data the host writes every step into a backend whose memory it cannot
// address: allocated once, page-locked on a GPU (Backend::allocate_staging).
class HostStaging {
 public:
  HostStaging(Backend& backend, size_t bytes) : backend_(backend), data_(backend.allocate_staging(bytes)) {
    ET_CHECK(data_ != nullptr || bytes == 0, "host staging buffer of ", bytes, " bytes");
  }
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  ~HostStaging() { backend_.free_staging(data_); }
  void* data() const { return data_; }

 private:
  Backend& backend_;
  void* data_;
};

class InputFeed {
 public:
  // images [N,C,H,W] f32 and labels [N] i32: the shapes of the executor's inputs at the whole
  // batch N. Allocates the staging and the prefetch buffers (none on a host-addressable backend).
  InputFeed(Backend& backend, const Tensor& images, const Tensor& labels);

  // A pass over `loader`, whose epoch has started, into the executor's inputs `images` and `labels`
  // (of the constructor's shapes; a re-planned executor has new ones). The loader must outlive the
  // pass. Fetches its first batch.
  void start(BatchLoader& loader, const Tensor& images, const Tensor& labels);
  // The fetched batch into the inputs (queued behind the work issued so far); its size, 0 at the
  // loader's end. Each next() but the first of a pass follows a prefetch().
  int64_t next();
  // Fetches the loader's next batch for the next next(), while the work issued so far runs. The
  // caller issues the step that reads the current batch first.
  void prefetch();

 private:
  Backend& backend_;
  Tensor images_, labels_;
  BatchLoader* loader_ = nullptr;
  bool staged_ = false;  // the host cannot address the backend's memory
  std::unique_ptr<HostStaging> image_staging_, label_staging_;
  Arena prefetched_;               // the backend's: the fetched batch's images, then its labels
  Tensor next_images_, next_labels_;  // views of prefetched_
  int64_t fetched_ = -1;           // the fetched batch's size; -1: none fetched
};

}  // namespace et
