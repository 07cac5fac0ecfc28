// Backend: the table of kernels an executor calls. The CPU backend is the reference every other
// backend is tested against. Kernels take tensor views (memory is planned by the executor) and
// never allocate; scratch comes in through `Workspace`.
//
// `accumulate` on an input gradient follows BLAS beta: false = overwrite, true = add into it
// (a value read by several consumers, e.g. a residual input, receives several gradients).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine/affine_relu.h"
#include "engine/fused_stack.h"
#include "engine/kernel_types.h"
#include "engine/tensor.h"
#include "memory/device_memory.h"
#include "memory/stash_codec.h"
#include "quant/scales.h"

namespace et {

// Geometry of a 2-D convolution / pooling window over an NCHW tensor.
struct Conv2dGeom {
  int64_t N = 0, C = 0, H = 0, W = 0;  // input
  int64_t K = 0;                       // output channels (conv) or C (pooling)
  int64_t R = 1, S = 1;                // window height, width
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  int64_t groups = 1;
  int64_t P = 0, Q = 0;  // output height, width
  void infer_output();   // P, Q from the rest; P or Q < 1 means the geometry is invalid
  Conv2dGeom with_batch(int64_t n) const { Conv2dGeom g = *this; g.N = n; return g; }
};

enum class ConvPass { Forward, BackwardData, BackwardWeight };

// One trained parameter with its gradient and momentum buffer (Backend::sgd_steps_deferred), f32.
struct SgdSlot {
  Tensor param, grad, momentum;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  // Where the executor's arena and stash region live (one allocation each).
  virtual DeviceMemory& memory() = 0;
  // The stash's encoders and decoders on that memory (memory/stash_codec.h).
  virtual StashCodec& stash_codec() = 0;
  // Host access (engine/host_view.h): whether host code may use this backend's tensor pointers
  // directly (the CPU; a GPU whose memory the host maps). Otherwise it goes through these copies
  // of whole contiguous tensors (nbytes()).
  virtual bool host_addressable() const = 0;
  virtual void copy_to_host(const Tensor& src, void* dst) = 0;
  virtual void copy_from_host(const void* src, Tensor& dst) = 0;
  // Host memory that the backend's copies read fastest (a GPU's page-locked memory), for a buffer
  // the host fills every step (the trainer's input batch, engine/host_view.h's HostStaging).
  virtual void* allocate_staging(size_t bytes) { return std::malloc(bytes); }
  virtual void free_staging(void* p) { std::free(p); }
  // A copy lane beside the compute work (a GPU's copy engine), so that the next input batch crosses
  // while this step computes (engine/train/input_feed.h). The default copies at once.
  // - side_copy_from_host: `src` (from allocate_staging) into `dst`, queued on the lane. It starts
  //   once the compute work issued before the last side_release() has run, not waiting for later
  //   work, and reads `src` until side_wait() returns.
  // - side_release(): the compute work issued so far is the last that reads the side copies' `dst`
  //   before they are overwritten.
  // - side_acquire(): compute work issued after it waits for the side copies issued so far.
  // - side_wait(): the host waits for the side copies issued so far (their `src` may be rewritten).
  virtual void side_copy_from_host(const void* src, Tensor& dst) { copy_from_host(src, dst); }
  virtual void side_release() {}
  virtual void side_acquire() {}
  virtual void side_wait() {}
  // Waits until the work issued so far has run (a GPU's kernels run after their calls return): a
  // timed profile (Executor::set_timing) calls it around each op, so each op's time is its own.
  virtual void synchronize() {}
  // A training step recorded once and replayed (engine/step_replay.h; CUDA graphs: one launch for
  // the hundreds of a step). Between begin_capture() and end_capture() the work issued is recorded,
  // not run; end_capture() returns "" or why the record failed (the work then did not run either).
  // replay() runs the record with its addresses and arguments; a host check the recorded work
  // deferred (CUDA: the loss's label check) fails there. A backend that cannot record says so in
  // capture_unsupported() (the CPU: nothing to save, its ops run as they are called).
  // record_generation() changes whenever a record made before may no longer be replayed: the
  // backend moved scratch memory that recorded work uses (grown for a larger batch or model), or
  // recorded another step (it keeps one); StepReplay then records its step again.
  virtual std::string capture_unsupported() const { return "the " + name() + " backend records no steps"; }
  virtual void begin_capture() { ET_CHECK(false, "begin_capture: ", capture_unsupported()); }
  virtual std::string end_capture() { return capture_unsupported(); }
  virtual void replay() { ET_CHECK(false, "replay: ", capture_unsupported()); }
  virtual void drop_capture() {}
  virtual int64_t record_generation() const { return 0; }

  // ---- memory helpers
  virtual void fill(Tensor& t, float value) = 0;
  virtual void copy(const Tensor& src, Tensor& dst) = 0;

  // ---- convolution: x [N,C,H,W], w [K,C/groups,R,S], b [K] or undefined, y [N,K,P,Q]
  virtual size_t conv2d_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const = 0;
  // x is f32, or (DType::AffineRelu) a fused stack's output that the kernel computes from the stack's
  // input as it stages it, where conv2d_forward_reads(g) lists it: the stack never writes it.
  virtual DTypeSet conv2d_forward_reads(const Conv2dGeom& g) const { return dtype_bit(DType::F32); }
  virtual void conv2d_forward(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                              Workspace ws) = 0;
  // conv2d_forward, and y's per-plane sums for the fused BN stack reading y (plane_sums below):
  // written while each plane is still in cache where the kernel allows it, else by plane_sums.
  virtual void conv2d_forward_sums(const Conv2dGeom& g, const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y,
                                   Tensor& sums, Workspace ws) {
    conv2d_forward(g, x, w, b, y, ws);
    plane_sums(y, sums);
  }
  virtual void conv2d_backward_data(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                    bool accumulate, Workspace ws) = 0;
  // conv2d_backward_data into dx (+= where accumulate) with the first backward sweep of the fused
  // stack whose output is x on dx's final values, image by image while dx is in cache
  // (DzSumsEpilogue, FusedGrads::dz_sums), where the kernel chosen for g can; false (and nothing
  // done) where it cannot.
  virtual bool conv2d_backward_data_dz_sums(const Conv2dGeom& g, const Tensor& dy, const Tensor& w, Tensor& dx,
                                            bool accumulate, const DzSumsEpilogue& e, Workspace ws) {
    return false;
  }
  // dw (and db if defined) are overwritten or accumulated per `accumulate`. x is f32, or a saved
  // tensor as the stash keeps it in any dtype conv2d_weight_reads(g) lists (decoded as it is read).
  virtual DTypeSet conv2d_weight_reads(const Conv2dGeom& g) const { return dtype_bit(DType::F32); }
  virtual void conv2d_backward_weight(const Conv2dGeom& g, const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db,
                                      bool accumulate, Workspace ws) = 0;

  // ---- linear: x [N,I], w [O,I], b [O] or undefined, y [N,O]
  virtual void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) = 0;
  virtual void linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx, bool accumulate) = 0;
  virtual void linear_backward_weight(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db, bool accumulate) = 0;

  // ---- batch norm over N,H,W per channel. x,y [N,C,H,W]; gamma, beta, running_*, mean, invstd [C].
  // Training: batch statistics normalise; running stats updated with `momentum` (PyTorch convention,
  // unbiased variance for the running estimate; undefined running_* tensors: no update, as when a
  // recomputed forward runs again); mean/invstd saved for backward.
  virtual void batchnorm_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta, Tensor& running_mean,
                                       Tensor& running_var, float momentum, float eps, Tensor& y, Tensor& mean,
                                       Tensor& invstd) = 0;
  virtual void batchnorm_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y) = 0;
  // x: f32, or the stash's copy in any dtype batchnorm_backward_reads() lists, read without a decode pass.
  virtual DTypeSet batchnorm_backward_reads() const { return dtype_bit(DType::F32); }
  virtual void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                  const Tensor& invstd, Tensor& dx, bool accumulate_dx, Tensor& dgamma, Tensor& dbeta,
                                  bool accumulate_params) = 0;
  // Frozen BN (finetune.bn = frozen) normalises with the running statistics in training too, so
  // its backward is per-channel scaling: dx (+)= dy * gamma / sqrt(running_var + eps).
  virtual void batchnorm_backward_frozen(const Tensor& dy, const Tensor& gamma, const Tensor& running_var, float eps,
                                         Tensor& dx, bool accumulate) = 0;

  // ---- element-wise
  // y = max(x, 0); with `mask`, also y's bitmap (fused: the stash's pack skips a pass over y).
  virtual void relu_forward(const Tensor& x, Tensor& y, MaskOut* mask = nullptr) = 0;
  virtual void relu_backward(const Tensor& dy, const MaskView& mask, Tensor& dx, bool accumulate) = 0;
  // y[i] = 0 where ref[i] == 0 (double-mask BN: the input's zeros mask the output and its gradient).
  virtual void zero_where_zero(const Tensor& ref, Tensor& y) = 0;
  virtual void add_forward(const Tensor& a, const Tensor& b, Tensor& y) = 0;
  // dst (+)= src
  virtual void accumulate_grad(const Tensor& src, Tensor& dst, bool accumulate) = 0;
  // Inverted dropout with a counter-based mask: element i is kept iff hash(seed, i) >= p; kept values are
  // scaled by 1/(1-p). The backward recomputes the mask from the seed, so nothing is saved.
  virtual void dropout_forward(const Tensor& x, float p, const DropoutSeed& seed, Tensor& y) = 0;
  virtual void dropout_backward(const Tensor& dy, float p, const DropoutSeed& seed, Tensor& dx, bool accumulate) = 0;
  // The executor's step seed, given before each step's work (Executor::set_step_seed). A backend
  // whose dropout kernels read it from the backend's memory (replays_draws) replays a recorded
  // step with dropout: set before the replay, it gives the replayed step its own masks.
  virtual void set_step_seed(uint64_t step) { (void)step; }
  virtual bool replays_draws() const { return false; }

  // ---- pooling (Conv2dGeom with K = C, groups ignored)
  virtual void maxpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) = 0;
  // maxpool2d_forward / avgpool2d_forward, and y's per-plane sums for the fused BN stack reading y
  // (plane_sums below), as conv2d_forward_sums: taken while each plane is in cache where the
  // backend can, else by plane_sums.
  virtual void maxpool2d_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums) {
    maxpool2d_forward(g, x, y);
    plane_sums(y, sums);
  }
  virtual void avgpool2d_forward_sums(const Conv2dGeom& g, const Tensor& x, Tensor& y, Tensor& sums) {
    avgpool2d_forward(g, x, y);
    plane_sums(y, sums);
  }
  // Gradient goes to the first maximum of each window (PyTorch's rule), found again from x.
  // x: f32 or the stash's copy in any dtype maxpool2d_backward_reads() lists (decoded a plane at a
  // time in the workspace, maxpool2d_workspace_bytes()).
  virtual DTypeSet maxpool2d_backward_reads() const { return dtype_bit(DType::F32); }
  virtual size_t maxpool2d_workspace_bytes(const Conv2dGeom& g) const { return 0; }
  virtual void maxpool2d_backward(const Conv2dGeom& g, const Tensor& dy, const Tensor& x, Tensor& dx,
                                  bool accumulate, Workspace ws) = 0;
  // count_include_pad = true (PyTorch's default)
  virtual void avgpool2d_forward(const Conv2dGeom& g, const Tensor& x, Tensor& y) = 0;
  virtual void avgpool2d_backward(const Conv2dGeom& g, const Tensor& dy, Tensor& dx, bool accumulate) = 0;
  // x [N,C,H,W] -> y [N,C]
  virtual void global_avgpool_forward(const Tensor& x, Tensor& y) = 0;
  virtual void global_avgpool_backward(const Tensor& dy, Tensor& dx, bool accumulate) = 0;
  // Option-A shortcut (He et al.): x [N,C,H,W] -> y [N,K,ceil(H/s),ceil(W/s)], y[n, pad + c, p, q] =
  // x[n, c, s*p, s*q], the other K - C channels zero; `pad` channels before, K - C - pad after.
  virtual void subsample_pad_forward(const Tensor& x, int64_t stride, int64_t pad, Tensor& y) = 0;
  virtual void subsample_pad_backward(const Tensor& dy, int64_t stride, int64_t pad, Tensor& dx, bool accumulate) = 0;

  // ---- fused stacks (engine/fused_stack.h, docs/fusion.md), tile by tile; the results are bit
  // for bit those of the stack's layers run one by one through the kernels above.
  virtual size_t fused_workspace_bytes(const FusedStack& s, int64_t batch) const = 0;
  // The sums BN's statistics take of each plane of y [N,C,H,W], as the BN kernels take them (same
  // order, same bits): sums [2, >= N, C], sum of x at [0, n, c], of x^2 at [1, n, c]. A producer of a
  // stack's x writes them (Op::write_plane_sums), so the stack's forward need not read x twice.
  virtual void plane_sums(const Tensor& y, Tensor& sums) {
    ET_CHECK(false, name(), ": plane sums for fused stacks are not built on this backend");
  }
  // Training: batch statistics into t.mean / t.invstd, running statistics updated unless undefined
  // (a recompute); else the running statistics. `mask`: y's bitmap, as relu_forward writes it.
  virtual void fused_forward(const FusedStack& s, FusedTensors& t, bool training, MaskOut* mask, Workspace ws) = 0;
  // Recomputes what the stages need from x (and the saved y mask), then BN's two sweeps: the
  // per-channel reductions (dgamma, dbeta; the side gradient on the way), then dx. t.x: f32, or
  // the stash's copy in any dtype fused_backward_reads() lists, read without a decode pass.
  virtual DTypeSet fused_backward_reads() const { return dtype_bit(DType::F32); }
  virtual void fused_backward(const FusedStack& s, const FusedTensors& t, FusedGrads& g, Workspace ws) = 0;
  // Whether fused_backward of s reads its dy as the BN after it leaves it (FusedGrads::dy_coef), the
  // pool's output found again as it goes.
  virtual bool fused_reads_dy_affine(const FusedStack& s) const { return false; }
  // Whether fused_backward of s, a stack ending in a pool whose dx and dy have one size (stride 1,
  // "same" padding), reads each plane's dy before it writes that plane's dx, so the executor may
  // give dx the buffer of dy (Op::grad_in_place): dz is then written over the dy just read, whose
  // lines are in cache, instead of into lines read from memory first.
  virtual bool fused_pool_grad_in_place(const FusedStack& s) const { return false; }
  // Whether fused_backward of s takes its first sweep from its reader's data gradient
  // (FusedGrads::dz_sums, conv2d_backward_data_dz_sums).
  virtual bool fused_takes_dz_sums(const FusedStack& s) const { return false; }
  // y again from x (t.x: f32 or a dtype fused_backward_reads() lists) with the batch statistics of
  // the training forward (t.mean, t.invstd), bit for bit its y where x is exact, for stacks where
  // fused_recomputes(s) (memory.recompute_stack_outputs). No workspace: it runs inside another
  // node's backward.
  virtual bool fused_recomputes(const FusedStack& s) const { return false; }
  virtual void fused_recompute_output(const FusedStack& s, const FusedTensors& t, Tensor& y) {
    ET_CHECK(false, name(), ": fused stacks recompute no output on this backend");
  }
  // Where fused_recomputes(s) and y = relu(x * scale[c] + shift[c]): whether readers that take
  // DType::AffineRelu (engine/affine_relu.h) may compute y as they read it, as the forward did (bit
  // for bit); fused_affine_relu: the host run that does it for the host's readers
  // (memory/stored_reader.h), null where they are the backend's own kernels (a GPU's).
  // fused_affine_coefficients writes scale / shift [C] (the backend's memory) from the batch
  // statistics and gamma / beta in t.
  virtual bool fused_output_is_affine_relu(const FusedStack& s) const { return fused_affine_relu(s) != nullptr; }
  virtual AffineReluRun fused_affine_relu(const FusedStack& s) const { return nullptr; }
  virtual void fused_affine_coefficients(const FusedStack& s, const FusedTensors& t, float* scale, float* shift) {
    ET_CHECK(false, name(), ": fused stacks give no relu(affine) output on this backend");
  }
  // Where every forward reader of y computes it (conv2d_forward_reads): fused_forward without its
  // pass over the planes. The statistics (t.mean, t.invstd, the running ones) as fused_forward
  // takes them, and scale / shift [C] of y = relu(x * scale[c] + shift[c]): the batch statistics'
  // in training, the running ones' in evaluation. t.y is not read.
  virtual bool fused_forward_by_readers(const FusedStack& s) const { return false; }
  virtual void fused_forward_statistics(const FusedStack& s, FusedTensors& t, bool training, float* scale,
                                        float* shift, Workspace ws) {
    ET_CHECK(false, name(), ": fused stacks leave no output to their readers on this backend");
  }

  // ---- loss: logits [N,K], labels i32 [N]; loss [1] = mean over N of cross-entropy with label smoothing
  virtual void softmax_xent_forward(const Tensor& logits, const Tensor& labels, float smoothing, Tensor& loss) = 0;
  // dlogits = dloss * (softmax - target) / N
  virtual void softmax_xent_backward(const Tensor& logits, const Tensor& labels, float smoothing, float dloss,
                                     Tensor& dlogits, bool accumulate) = 0;

  // ---- 4-bit training (docs/quant.md). Code tensors (I4 / U4 / F4, one code per byte) carry their
  // scale in Tensor::scale. Products of codes are exact integer GEMMs; results come back in f32.
  virtual TensorStats tensor_stats(const Tensor& x) = 0;
  // Only max_abs and finite (the sums stay 0): what the FP4 alpha needs, in a cheaper pass.
  virtual TensorStats tensor_max_abs(const Tensor& x) = 0;
  // q (I4: -7..7, U4: 0..15) = clamp(round half to even(x / q.scale)).
  virtual void quantize_int4(const Tensor& x, Tensor& q) = 0;
  // q (F4) of g with alpha = q.scale and `levels` magnitudes alpha * 2^0 .. 2^(levels-1); the
  // stochastic bits come from draw.key() and the element index (quant/codes.h).
  virtual void quantize_fp4(const Tensor& g, int levels, Fp4Rounding mode, const QuantDraw& draw, Tensor& q) = 0;
  virtual void dequantize(const Tensor& q, Tensor& y) = 0;  // y = code * scale

  // Scales kept in the backend's memory (a recordable 4-bit step: engine/step_replay.h). Where
  // quant_scales_in_memory(), the layers read no statistics back: each scale is a float of the
  // backend's memory that these write in stream order and the code tensors point at
  // (Tensor::scale_at). An operand that is not finite writes `code` to *flag (a uint32 of the
  // backend's memory) if nothing is there yet; the executor reads it after the forward and the
  // backward (Executor::check_quant_finite). The CPU's compute them from tensor_stats /
  // tensor_max_abs as the layers do (tests keep its scales in memory); a GPU's with kernels.
  virtual bool quant_scales_in_memory() const { return false; }
  // *scale = quant::sawb_scale of x (is_unsigned: U4 codes).
  virtual void int4_scale_to(const Tensor& x, bool is_unsigned, float* scale, uint32_t* flag, uint32_t code) = 0;
  // *alpha = quant::fp4_alpha(max|g|, levels).
  virtual void fp4_alpha_to(const Tensor& g, int levels, float* alpha, uint32_t* flag, uint32_t code) = 0;
  // *out = *scale / divisor (SMP: each sample's codes carry alpha / smp).
  virtual void divide_scale_to(const float* scale, int divisor, float* out) = 0;
  // Convolution on codes: xq I4/U4 [N,C,H,W], wq I4 [K,C,R,S], gq F4 [N,K,P,Q] (or I4/U4).
  virtual size_t conv2d_q_workspace_bytes(const Conv2dGeom& g, ConvPass pass) const = 0;
  virtual void conv2d_forward_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y,
                                Workspace ws) = 0;
  // conv2d_forward_q, and y's per-plane sums for the fused BN stack reading y (conv2d_forward_sums's).
  virtual void conv2d_forward_q_sums(const Conv2dGeom& g, const Tensor& xq, const Tensor& wq, const Tensor& b,
                                     Tensor& y, Tensor& sums, Workspace ws) {
    conv2d_forward_q(g, xq, wq, b, y, ws);
    plane_sums(y, sums);
  }
  virtual void conv2d_backward_data_q(const Conv2dGeom& g, const Tensor& gq, const Tensor& wq, Tensor& dx,
                                      bool accumulate, Workspace ws) = 0;
  // dw (+)= corr(xq, gq), db (+)= sum(gq) (db undefined: none)
  virtual void conv2d_backward_weight_q(const Conv2dGeom& g, const Tensor& xq, const Tensor& gq, Tensor& dw,
                                        Tensor& db, bool accumulate, Workspace ws) = 0;
  // Linear on codes: xq [N,I], wq [O,I], gq [N,O].
  virtual size_t linear_q_workspace_bytes(int64_t n, int64_t in, int64_t out) const = 0;
  virtual void linear_forward_q(const Tensor& xq, const Tensor& wq, const Tensor& b, Tensor& y, Workspace ws) = 0;
  virtual void linear_backward_data_q(const Tensor& gq, const Tensor& wq, Tensor& dx, bool accumulate,
                                      Workspace ws) = 0;
  virtual void linear_backward_weight_q(const Tensor& xq, const Tensor& gq, Tensor& dw, Tensor& db, bool accumulate,
                                        Workspace ws) = 0;

  // ---- divergence guard: whether every element of every f32 tensor is finite, in one pass.
  virtual bool all_finite(const std::vector<Tensor>& tensors) = 0;

  // ---- optimizer: SGD with momentum (PyTorch formulation), optional Nesterov, L2 weight decay.
  // Returns whether every updated parameter is finite: a non-finite gradient or momentum makes its
  // parameter non-finite, so this one check, on values the step writes anyway, covers all three
  // (the trainer's divergence guard).
  virtual bool sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                        float weight_decay, bool nesterov, bool first_step) = 0;
  // The same step with its answer deferred: sgd_finite() says whether every parameter such steps
  // updated since its last call is finite. sgd_update uses these, so a GPU backend reads one flag
  // back per update, not one per parameter (a wait for the device each).
  virtual void sgd_step_deferred(Tensor& param, const Tensor& grad, Tensor& momentum_buf, float lr, float momentum,
                                 float weight_decay, bool nesterov, bool first_step) {
    deferred_finite_ &= sgd_step(param, grad, momentum_buf, lr, momentum, weight_decay, nesterov, first_step);
  }
  virtual bool sgd_finite() {
    const bool finite = deferred_finite_;
    deferred_finite_ = true;
    return finite;
  }
  // The deferred step over every trained parameter at once (sgd_update's): each in turn here; a GPU
  // backend makes it one launch, not one per parameter.
  virtual void sgd_steps_deferred(const std::vector<SgdSlot>& slots, float lr, float momentum, float weight_decay,
                                  bool nesterov, bool first_step) {
    for (const SgdSlot& s : slots) {
      Tensor param = s.param, momentum_buf = s.momentum;
      sgd_step_deferred(param, s.grad, momentum_buf, lr, momentum, weight_decay, nesterov, first_step);
    }
  }

 private:
  bool deferred_finite_ = true;
};

std::unique_ptr<Backend> make_cpu_backend();
// The backend of config key train.device: "cpu", "cuda" or "cuda:N" (validated by the config).
// UserError naming the key for a device this build or machine does not have.
std::unique_ptr<Backend> make_backend(const std::string& device);

}  // namespace et
