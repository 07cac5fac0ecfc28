// CudaBackend's declaration and the helpers its kernel files share (backends/cuda/*.cu).
// Kernels, cuBLAS, cuDNN and the stash codec run in issue order on the backend's stream (stream_),
// which a training step can be recorded on (CUDA graphs: begin_capture / replay). It is a blocking
// stream, so the synchronous copies of a call that returns a host value (a count, a finiteness
// flag) wait for its work. C++14.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/cuda_conv_cudnn.h"
#include "backends/cuda/cuda_device.h"
#include "engine/check.h"

namespace et {
namespace cuda {

struct OutputMask;  // cuda_fused_output.h

void check(cudaError_t e, const char* what);
void check(cublasStatus_t s, const char* what);
// After a launch: a launch error names the kernel.
inline void launched(const char* kernel) { check(cudaGetLastError(), kernel); }

constexpr int kThreads = 256;
// A grid-stride loop of `i` over [0, n).
#define ET_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)
// Blocks for a grid-stride loop over n elements.
inline unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

// One tensor of a list that a kernel runs over as one index space (the multi-tensor SGD and
// finiteness check): elements [start, start + n) of that space; g and m: the SGD's gradient and
// momentum beside its parameter p.
struct ListEntry {
  float* p;
  const float* g;
  float* m;
  int64_t n, start;
};

}  // namespace cuda

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  Device device() const override { return Device::CUDA; }
  std::string name() const override;
  DeviceMemory& memory() override { return *memory_; }
  StashCodec& stash_codec() override { return *codec_; }
  bool host_addressable() const override { return false; }
  void copy_to_host(const Tensor& src, void* dst) override;
  void copy_from_host(const void* src, Tensor& dst) override;
  void synchronize() override;
  void* allocate_staging(size_t bytes) override;
  void free_staging(void* p) override;
  void side_copy_from_host(const void* src, Tensor& dst) override;
  void side_release() override;
  void side_acquire() override;
  void side_wait() override;

  void fill(Tensor& t, float value) override;
  void copy(const Tensor& src, Tensor& dst) override;

  size_t conv2d_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const override;
  DTypeSet conv2d_weight_reads(const Conv2dGeom& g) const override;
  void conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                      Workspace ws) override;
  void conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate,
                            Workspace ws) override;
  void conv2d_backward_weight(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db,
                              bool accumulate, Workspace ws) override;

  void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) override;
  void linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) override;
  void linear_backward_weight(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db, bool accumulate) override;

  void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& running_mean,
                               Tensor& running_var, float momentum, float eps, Tensor& y, Tensor& mean,
                               Tensor& invstd) override;
  void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& running_mean,
                              const Tensor& running_var, float eps, Tensor& y) override;
  DTypeSet batchnorm_backward_reads() const override;
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                          const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma, Tensor& dbeta,
                          bool accumulate_params) override;
  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var, float eps,
                                 Tensor& dx, bool accumulate) override;

  void relu_forward(const Tensor& x, Tensor& y, MaskOut* mask) override;
  void relu_backward(const Tensor& dy, const MaskView& mask, Tensor& dx, bool accumulate) override;
  void zero_where_zero(const Tensor& ref, Tensor& y) override;
  void add_forward(const Tensor& a, const Tensor& b, Tensor& y) override;
  void accumulate_grad(const Tensor& src, Tensor& dst, bool accumulate) override;
  void dropout_forward(const Tensor& x, float p, const DropoutSeed& seed, Tensor& y) override;
  void dropout_backward(const Tensor& dy, float p, const DropoutSeed& seed, Tensor& dx, bool accumulate) override;
  void set_step_seed(uint64_t step) override;
  bool replays_draws() const override { return true; }

  void maxpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) override;
  DTypeSet maxpool2d_backward_reads() const override;
  void maxpool2d_backward(const Conv2dGeom& g, const Tensor& dy, const Tensor& x, Tensor& dx, bool accumulate,
                          Workspace ws) override;
  void avgpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) override;
  void avgpool2d_backward(const Conv2dGeom& g, const Tensor& dy, Tensor& dx, bool accumulate) override;
  void global_avgpool_forward(const Tensor& x, Tensor& y) override;
  void global_avgpool_backward(const Tensor& dy, Tensor& dx, bool accumulate) override;
  void subsample_pad_forward(const Tensor& x, int64_t stride, int64_t pad, Tensor& y) override;
  void subsample_pad_backward(const Tensor& dy, int64_t stride, int64_t pad, Tensor& dx, bool accumulate) override;

  size_t fused_workspace_bytes(const FusedStack& s, int64_t batch) const override;
  void fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) override;
  DTypeSet fused_backward_reads() const override { return batchnorm_backward_reads(); }
  bool fused_recomputes(const FusedStack& s) const override;
  void fused_recompute_output(const FusedStack& s, const FusedTensors& t, Tensor& y) override;
  bool fused_output_is_affine_relu(const FusedStack& s) const override { return fused_recomputes(s); }
  void fused_affine_coefficients(const FusedStack& s, const FusedTensors& t, float* scale, float* shift) override;
  void fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) override;

  void softmax_xent_forward(const Tensor& logits, const Tensor& labels, float smoothing, Tensor& loss) override;
  void softmax_xent_backward(const Tensor& logits, const Tensor& labels, float smoothing, float dloss,
                             Tensor& dlogits, bool accumulate) override;

  TensorStats tensor_stats(const Tensor& x) override;
  TensorStats tensor_max_abs(const Tensor& x) override;
  // Scales on the device (a 4-bit step without read backs, recordable); EDGETRAIN_CUDA_HOST_SCALES=1
  // reads the statistics back instead (the layers' own path, as before session 57).
  bool quant_scales_in_memory() const override { return scales_on_device_; }
  void int4_scale_to(const Tensor& x, bool is_unsigned, float* scale, uint32_t* flag, uint32_t code) override;
  void fp4_alpha_to(const Tensor& g, int levels, float* alpha, uint32_t* flag, uint32_t code) override;
  void divide_scale_to(const float* scale, int divisor, float* out) override;
  void quantize_int4(const Tensor& x, Tensor& q) override;
  void quantize_fp4(const Tensor& g, int levels, Fp4Rounding mode, const QuantDraw& draw, Tensor& q) override;
  void dequantize(const Tensor& q, Tensor& y) override;
  size_t conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const override;
  void conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                        Workspace ws) override;
  void conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate,
                              Workspace ws) override;
  void conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db,
                                bool accumulate, Workspace ws) override;
  size_t linear_q_workspace_bytes(int64_t n, int64_t in, int64_t out) const override;
  void linear_forward_q(const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws) override;
  void linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate, Workspace ws) override;
  void linear_backward_weight_q(const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db, bool accumulate,
                                Workspace ws) override;

  bool all_finite(const std::vector<Tensor>& tensors) override;
  bool sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum, float weight_decay,
                bool nesterov, bool first_step) override;
  void sgd_step_deferred(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                         float weight_decay, bool nesterov, bool first_step) override;
  void sgd_steps_deferred(const std::vector<SgdSlot>& slots, float lr, float momentum, float weight_decay,
                          bool nesterov, bool first_step) override;
  bool sgd_finite() override;

  std::string capture_unsupported() const override { return ""; }
  void begin_capture() override;
  std::string end_capture() override;
  void replay() override;
  void drop_capture() override;
  int64_t record_generation() const override { return record_generation_ + codec_->scratch_generation(); }

 private:
  // A device counter for reductions that come back to the host (zeroed before each use).
  unsigned long long* counter();
  int64_t read_counter();
  // The kernel arguments for y's bitmap of n outputs where `mask` asks for one (else none), its
  // bits counted in counter() (cuda_fused_output.h).
  cuda::OutputMask output_mask(MaskOut* mask, int64_t n);
  // Fused stacks without a BN (cuda_relu_pool.cu): ReLU, then a pool with windows that do not
  // overlap; the pass bits (FusedTensors::pass) carry what the backward needs.
  void relu_pool_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask);
  void relu_pool_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g);
  // After a kernel wrote a bitmap and counted its bits in counter(): the count into the stash's
  // slot (its fixed layout, the CUDA codec's: no wait), else mask.kept, read back.
  void take_mask_count(MaskOut& mask);
  unsigned long long* deferred_sgd_count();  // sgd_step_deferred's, read and zeroed by sgd_finite
  unsigned long long* label_errors();        // the label check's count, on the device
  // The label check's count crosses to label_host_ behind the step (no wait for it): the next
  // check, replay or synchronize() reads it, once the copy (label_copied_) has run.
  void queue_label_check(int64_t classes);
  void check_labels();
  unsigned long long* label_host_ = nullptr;  // pinned
  cudaEvent_t label_copied_ = nullptr;
  bool label_pending_ = false;
  int64_t label_classes_ = 0;

  int device_;
  cudaStream_t stream_ = nullptr;
  // The copy lane (Backend::side_*): a non-blocking stream, so the synchronous readbacks on the
  // legacy stream do not wait for it; `released_` on stream_ orders its copies after the last reads
  // of their destination, `copied_` on it orders later kernels after its copies.
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t released_ = nullptr, copied_ = nullptr;
  // The step seed the dropout kernels read (set_step_seed): on the device, written in stream
  // order, so a replayed step reads the value set before its launch; step_seed_ mirrors it.
  uint64_t* step_seed_dev_ = nullptr;
  uint64_t step_seed_ = 0;
  int sm_count_ = 1;  // the device's multiprocessors (how many blocks fill it)
  bool capturing_ = false;                // between begin_capture and end_capture
  cudaGraphExec_t graph_exec_ = nullptr;  // the recorded step, instantiated
  int64_t record_generation_ = 0;         // + the codec's: bumped by each record and scratch growth
  std::unique_ptr<DeviceMemory> memory_;
  std::unique_ptr<StashCodec> codec_;
  cublasHandle_t blas_ = nullptr;
  void* blas_workspace_ = nullptr;
  size_t blas_workspace_bytes_ = 0;
  std::unique_ptr<cuda::CudnnConvs> cudnn_;  // null: im2col only (cuda_conv_cudnn.h)
  // 64 bytes: the counter, a few reduction results, the deferred SGD count, the recorded label check
  void* scratch_ = nullptr;
  static constexpr int64_t kStatsBlocks = 2048;
  void* stats_parts_ = nullptr;  // tensor_stats' per-block parts (kStatsBlocks of them)
  void stats_on_device(const Tensor& x);
  bool scales_on_device_ = true;
  double* xent_rows_ = nullptr;
  int64_t xent_rows_capacity_ = 0;
  // A list of tensors in device memory for one launch over all of them (sgd_steps_deferred,
  // all_finite): built on the host each call without allocating, uploaded when it differs from the
  // last upload (the same executor's list: once).
  struct TensorListTable {
    std::vector<cuda::ListEntry> entries, uploaded;
    cuda::ListEntry* device = nullptr;
    size_t capacity = 0;  // entries the device table holds
  };
  const cuda::ListEntry* upload(TensorListTable& t, const char* what);
  TensorListTable sgd_list_, finite_list_;
  // Batch norm's per-block partial sums and per-channel coefficients (cuda_batchnorm.cu); grows in
  // the first step only.
  double* bn_scratch(int64_t doubles);
  double* bn_scratch_ = nullptr;
  int64_t bn_scratch_capacity_ = 0;
};

}  // namespace et
