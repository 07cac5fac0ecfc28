// cuDNN's convolutions beside cuda_conv.cu's own (im2col + SGEMM for dense convs, direct kernels
// for grouped ones). Which of the two runs a pass is measured per geometry and pass at its first
// use, as the CPU backend measures its conv kernels: the backend's path against cuDNN's candidates
// that are deterministic, FP32 without TF32 (the CPU's arithmetic, within the tests' tolerance),
// and need no more workspace than the backend's path already plans (none for grouped convs). The
// planned workspace is unchanged. C++14.
#pragma once
#include <cstddef>
#include <memory>

#include "backends/backend.h"

struct CUstream_st;  // cudaStream_t without the runtime header

namespace et {
namespace cuda {

// Each choice is kept per geometry, pass and operands: the f32 tensors the pass was given, or
// (x_decoded) a weight gradient's x that the stash keeps encoded, which cuDNN reads decoded to f32
// at the workspace's front while the own kernels read it in place (cuda_stored_x.h), so cuDNN has
// the rest of the workspace.
class CudnnConvs {
 public:
  static constexpr int kUnmeasured = -2, kOwn = -1;
  virtual ~CudnnConvs() = default;
  // This geometry and pass's choice so far: kUnmeasured, kOwn (the backend's own kernels) or a cuDNN
  // algorithm.
  virtual int choice(const Conv2dGeom& g, ConvPass pass, bool x_decoded) const = 0;
  // The workspace its cuDNN choice needs (0 for kOwn): the choice is measured with one executor's
  // workspace, and an executor with less (another model on the same backend) runs its own kernels.
  virtual size_t workspace(const Conv2dGeom& g, ConvPass pass, bool x_decoded) const = 0;
  // EDGETRAIN_CUDA_CONV=cudnn: cuDNN's fastest candidate whatever the own kernels' time (which then
  // need not be measured).
  virtual bool forced() const = 0;
  // Times the cuDNN candidates on these operands into `out` (a scratch of the output's size, never
  // the real output), keeps the fastest, or kOwn where `own_ms` (the backend's kernels) is less, and
  // returns the choice.
  // Operands: forward (x, w) -> y; backward data (dy, w) -> dx; backward weight (x, dy) -> dw.
  virtual int measure(const Conv2dGeom& g, ConvPass pass, bool x_decoded, const float* a, const float* b, float* out,
                      Workspace ws, float own_ms) = 0;
  // Runs the pass with cuDNN algorithm `algo` (a choice >= 0); the gradients accumulate into `out`
  // where asked.
  virtual void run(const Conv2dGeom& g, ConvPass pass, int algo, const float* a, const float* b, float* out,
                   bool accumulate, Workspace ws) = 0;
};

// nullptr where the build has no cuDNN (EDGETRAIN_WITH_CUDNN) or EDGETRAIN_CUDA_CONV=im2col asks
// for the backend's own kernels alone (im2col + SGEMM, direct grouped kernels);
// EDGETRAIN_CUDA_CONV=cudnn: the fastest cuDNN candidate wherever one fits, whatever the own
// kernels' time (tests and A/B runs).
// Its work goes on `stream` (a cudaStream_t; nullptr: the legacy default stream).
std::unique_ptr<CudnnConvs> make_cudnn_convs(CUstream_st* stream = nullptr);

}  // namespace cuda
}  // namespace et
