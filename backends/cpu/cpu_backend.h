// CPU backend: the reference backend. Kernels are split by op family over backends/cpu/*.cpp;
// each family file implements its CpuBackend methods. Threads: OpenMP over both cores, static
// schedules and fixed-order reductions so results are deterministic for a given thread count.
#pragma once
#include <vector>

#include "backends/backend.h"

namespace et {

class CpuBackend : public Backend {
 public:
  CpuBackend();
  Device device() const override { return Device::CPU; }
  std::string name() const override { return "cpu"; }
  DeviceMemory& memory() override { return host_memory(); }
  StashCodec& stash_codec() override { return host_stash_codec(); }
  bool host_addressable() const override { return true; }
  void copy_to_host(const Tensor& src, void* dst) override;
  void copy_from_host(const void* src, Tensor& dst) override;

  void fill(Tensor& t, float value) override;
  void copy(const Tensor& src, Tensor& dst) override;

  size_t conv2d_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const override;
  void conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                      Workspace ws) override;
  void conv2d_forward_sums(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                           Tensor& sums, Workspace ws) override;
  void conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate,
                            Workspace ws) override;
  bool conv2d_backward_data_dz_sums(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                    bool accumulate, const DzSumsEpilogue& e, Workspace ws) override;
  DTypeSet conv2d_weight_reads(const Conv2dGeom& g) const override;
  DTypeSet conv2d_forward_reads(const Conv2dGeom& g) const override;
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
  DTypeSet batchnorm_backward_reads() const override {
    return dtype_bit(DType::F32) | dtype_bit(DType::F16) | dtype_bit(DType::BF16);
  }
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                          const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma, Tensor& dbeta,
                          bool accumulate_params) override;
  void batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var, float eps,
                                 Tensor& dx, bool accumulate) override;

  void relu_forward(const Tensor& x, Tensor& y, MaskOut* mask = nullptr) override;
  void relu_backward(const Tensor& dy, const MaskView& mask, Tensor& dx, bool accumulate) override;
  void zero_where_zero(const Tensor& ref, Tensor& y) override;
  void add_forward(const Tensor& a, const Tensor& b, Tensor& y) override;
  void accumulate_grad(const Tensor& src, Tensor& dst, bool accumulate) override;
  void dropout_forward(const Tensor& x, float p, const DropoutSeed& seed, Tensor& y) override;
  void dropout_backward(const Tensor& dy, float p, const DropoutSeed& seed, Tensor& dx, bool accumulate) override;

  void maxpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) override;
  void maxpool2d_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums) override;
  void avgpool2d_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums) override;
  DTypeSet maxpool2d_backward_reads() const override { return kStashDTypes; }
  size_t maxpool2d_workspace_bytes(const Conv2dGeom& g) const override;
  void maxpool2d_backward(const Conv2dGeom& g, const Tensor& dy, const Tensor& x, Tensor& dx, bool accumulate,
                          Workspace ws) override;
  void avgpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) override;
  void avgpool2d_backward(const Conv2dGeom& g, const Tensor& dy, Tensor& dx, bool accumulate) override;
  void global_avgpool_forward(const Tensor& x, Tensor& y) override;
  void global_avgpool_backward(const Tensor& dy, Tensor& dx, bool accumulate) override;
  void subsample_pad_forward(const Tensor& x, int64_t stride, int64_t pad, Tensor& y) override;
  void subsample_pad_backward(const Tensor& dy, int64_t stride, int64_t pad, Tensor& dx, bool accumulate) override;

  void softmax_xent_forward(const Tensor& logits, const Tensor& labels, float smoothing, Tensor& loss) override;
  void softmax_xent_backward(const Tensor& logits, const Tensor& labels, float smoothing, float dloss, Tensor& dlogits,
                             bool accumulate) override;

  TensorStats tensor_stats(const Tensor& x) override;
  TensorStats tensor_max_abs(const Tensor& x) override;
  void quantize_int4(const Tensor& x, Tensor& q) override;
  void quantize_fp4(const Tensor& g, int levels, Fp4Rounding mode, const QuantDraw& draw, Tensor& q) override;
  void dequantize(const Tensor& q, Tensor& y) override;
  void int4_scale_to(const Tensor& x, bool is_unsigned, float* scale, uint32_t* flag, uint32_t code) override;
  void fp4_alpha_to(const Tensor& g, int levels, float* alpha, uint32_t* flag, uint32_t code) override;
  void divide_scale_to(const float* scale, int divisor, float* out) override;
  size_t conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const override;
  void conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                        Workspace ws) override;
  void conv2d_forward_q_sums(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                             Tensor& sums, Workspace ws) override;
  void conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate,
                              Workspace ws) override;
  void conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db,
                                bool accumulate, Workspace ws) override;
  size_t linear_q_workspace_bytes(int64_t n, int64_t in, int64_t out) const override;
  void linear_forward_q(const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws) override;
  void linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate, Workspace ws) override;
  void linear_backward_weight_q(const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db, bool accumulate,
                                Workspace ws) override;

  size_t fused_workspace_bytes(const FusedStack& s, int64_t batch) const override;
  void plane_sums(const Tensor& y, Tensor& sums) override;
  void fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) override;
  DTypeSet fused_backward_reads() const override { return batchnorm_backward_reads(); }
  void fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) override;
  bool fused_reads_dy_affine(const FusedStack& s) const override;
  bool fused_pool_grad_in_place(const FusedStack& s) const override;
  bool fused_takes_dz_sums(const FusedStack& s) const override;
  bool fused_recomputes(const FusedStack& s) const override;
  void fused_recompute_output(const FusedStack& s, const FusedTensors& t, Tensor& y) override;
  AffineReluRun fused_affine_relu(const FusedStack& s) const override;
  void fused_affine_coefficients(const FusedStack& s, const FusedTensors& t, float* scale, float* shift) override;
  bool fused_forward_by_readers(const FusedStack& s) const override;
  void fused_forward_statistics(const FusedStack& s, FusedTensors& t, bool training, float* scale, float* shift,
                                Workspace ws) override;

  bool all_finite(const std::vector<Tensor>& tensors) override;
  bool sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum, float weight_decay,
                bool nesterov, bool first_step) override;

 private:
  // Stacks without a BN: a ReLU, then a pool whose windows do not overlap (fused_relu_pool.cpp).
  void relu_pool_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws);
  void relu_pool_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws);
  void finish_output_mask(Tensor y, MaskOut* mask, bool plane_words, int64_t kept);
  // BN-headed stacks on small planes: channel blocks (fused_blocks.cpp).
  void fused_blocks_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws);
  void fused_blocks_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws);
  // batchnorm_backward on small planes (channel blocks, batchnorm.cpp).
  void batchnorm_backward_blocks(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                 const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma, Tensor& dbeta,
                                 bool accumulate_params);

  // SGEMM packing scratch for the ops without a Workspace (linear): one block-bounded slice per
  // thread, allocated here once so that no training step allocates (linear.cpp).
  std::vector<float> gemm_scratch_;
  int gemm_threads_ = 1;
  int gemm_threads() const;
  float* gemm_scratch(int thread);
};

// Threads the CPU kernels use (OpenMP's max threads at the time of the call).
int cpu_threads();

}  // namespace et
