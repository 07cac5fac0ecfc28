// The CUDA backend (issue 13): the Backend kernel table on one GPU. FP32 training: convolution
// (cuDNN, or im2col + cuBLAS SGEMM and direct kernels for grouped ones, measured per shape),
// linear (cuBLAS), batch norm, ReLU writing its bitmap, add, dropout (the CPU's counter-based
// mask), pooling, option-A shortcuts, softmax cross-entropy, SGD and the divergence checks; the
// stash through the CUDA codec; 4-bit training (cuda_quant.cu). Fused stacks: BN -> ReLU
// [-> pool], BN -> add [-> ReLU] (fusion::plan with FusionSpec::whole_tensors,
// cuda_batchnorm.cu), on fusion.enabled = true until a GPU has run their tests
// (tests/cuda/test_cuda_fused.cpp). C++14.
#pragma once
#include <memory>

#include "backends/backend.h"

namespace et {

// UserError naming the device if there is no such GPU.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace et
