// Compiled as C++14 by the `headers_cxx14` test (tests/CMakeLists.txt): the headers a CUDA
// translation unit includes must not need C++17 (Jetson Nano's CUDA 10.2 has nothing newer).
#include "backends/backend.h"
#include "engine/fused_stack.h"
#include "engine/kernel_types.h"
#include "engine/op.h"
#include "memory/bitmap.h"
#include "memory/device_memory.h"
#include "memory/stash_codec.h"
#include "backends/cuda/cuda_device.h"
#include "backends/cuda/cuda_conv_cudnn.h"
#include "backends/cuda/cuda_stash_codec.h"
#include "backends/cuda/int_gemm_operands.h"
#include "quant/codes.h"
#include "quant/scales.h"

int main() { return 0; }
