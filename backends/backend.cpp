// make_backend: train.device to a backend.
#include "backends/backend.h"

#include "engine/check.h"

namespace et {

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  ET_CHECK(device.rfind("cuda", 0) == 0, "train.device '", device, "' was not validated");
#ifdef EDGETRAIN_WITH_CUDA
  user_error("config key 'train.device' = \"", device, "\": this build has the CUDA toolkit, but the CUDA backend's "
             "kernels are not written yet (issue 13); use \"cpu\"");
#else
  user_error("config key 'train.device' = \"", device, "\": this build has no CUDA backend (configure with "
             "-DEDGETRAIN_CUDA=ON where the CUDA toolkit is installed); use \"cpu\"");
#endif
}

}  // namespace et
