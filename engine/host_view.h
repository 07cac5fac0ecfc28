// Host code's access to a backend's tensor (the device-aware core, docs/architecture.md section
// 5): the tensor's own memory where the backend's is host addressable (the CPU: no copy, no
// allocation), else a host copy through the backend, read in at construction and, for a writable
// view, written back at destruction. Initialisation, checkpoints, weights, the input batch and the
// loss / logits readout go through it.
#pragma once
#include <cstdint>
#include <vector>

#include "backends/backend.h"

namespace et {

class HostView {
 public:
  enum Mode { Read, Write, ReadWrite };
  HostView(Backend& backend, const Tensor& t, Mode mode) : backend_(backend), t_(t), mode_(mode) {
    if (backend.host_addressable()) {
      data_ = t.data;
      return;
    }
    staged_.resize(t.nbytes());
    data_ = staged_.data();
    if (mode != Write) backend.copy_to_host(t, data_);
  }
  HostView(const HostView&) = delete;
  HostView& operator=(const HostView&) = delete;
  ~HostView() {
    if (!staged_.empty() && mode_ != Read) backend_.copy_from_host(data_, t_);
  }

  void* data() const { return data_; }
  float* f32() const { ET_CHECK(t_.dtype == DType::F32); return static_cast<float*>(data_); }
  int32_t* i32() const { ET_CHECK(t_.dtype == DType::I32); return static_cast<int32_t*>(data_); }

 private:
  Backend& backend_;
  Tensor t_;
  Mode mode_;
  void* data_ = nullptr;
  std::vector<char> staged_;  // only for a backend whose memory the host cannot address
};


}  // namespace et
