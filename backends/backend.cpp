// make_backend: train.device to a backend.
#include "backends/backend.h"

#include "engine/check.h"
#ifdef EDGETRAIN_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_device.h"
#endif

namespace et {

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  ET_CHECK(device.rfind("cuda", 0) == 0, "train.device '", device, "' was not validated");
#ifdef EDGETRAIN_WITH_CUDA
  std::string why;
  const int n = cuda_device_count(&why);
  const int index = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
  if (index >= n)
    user_error("config key 'train.device' = \"", device, "\": this machine has ", n, " CUDA device", n == 1 ? "" : "s",
               n == 0 ? " (" + why + ")" : std::string(), "; use \"cpu\"");
  return make_cuda_backend(index);
#else
  user_error("config key 'train.device' = \"", device, "\": this build has no CUDA backend (configure with "
             "-DEDGETRAIN_CUDA=ON where the CUDA toolkit is installed); use \"cpu\"");
#endif
}

}  // namespace et
