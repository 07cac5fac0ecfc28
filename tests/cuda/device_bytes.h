// The bytes of tensors on any backend, read back through HostView, for the CUDA tests'
// bit-for-bit comparisons of whole training states.
#pragma once
#include <vector>

#include "backends/backend.h"
#include "engine/host_view.h"

namespace et {

inline std::vector<char> host_bytes(Backend& be, const std::vector<Tensor>& tensors) {
  std::vector<char> out;
  for (const Tensor& t : tensors) {
    const HostView v(be, t, HostView::Read);
    out.insert(out.end(), static_cast<const char*>(v.data()), static_cast<const char*>(v.data()) + t.nbytes());
  }
  return out;
}

}  // namespace et
