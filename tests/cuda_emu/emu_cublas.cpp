// The CUDA emulator's cuBLAS (include/cublas_v2.h): the handle and the single precision GEMMs,
// column-major as cuBLAS's, with its argument checks and the operands inside device allocations,
// run on Eigen in the handle's stream order (emu_internal.h).
#include <Eigen/Core>
#include <algorithm>
#include <mutex>
#include <string>

#include "cublas_v2.h"
#include "emu_internal.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
};

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t s) {
  handle->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* s) {
  *s = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void* workspace, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(emu::runtime_lock());
  return bytes == 0 || emu::in_device_memory(workspace, bytes) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

namespace {

using ConstMap = Eigen::Map<const Eigen::MatrixXf, 0, Eigen::OuterStride<>>;
using Map = Eigen::Map<Eigen::MatrixXf, 0, Eigen::OuterStride<>>;

// cuBLAS's checks of one GEMM's arguments, and its operands inside device allocations.
cublasStatus_t check_gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const float* A, int lda,
                          const float* B, int ldb, const float* C, int ldc, long long batch_extra_a,
                          long long batch_extra_b, long long batch_extra_c) {
  if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T)) return CUBLAS_STATUS_INVALID_VALUE;
  const int rows_a = ta == CUBLAS_OP_N ? m : k, cols_a = ta == CUBLAS_OP_N ? k : m;
  const int rows_b = tb == CUBLAS_OP_N ? k : n, cols_b = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, rows_a) || ldb < std::max(1, rows_b) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  auto inside = [](const float* p, int rows, int cols, int ld, long long extra, const char* which) {
    if (rows == 0 || cols == 0) return;
    const size_t elems = size_t(cols - 1) * size_t(ld) + size_t(rows) + size_t(extra);
    if (!emu::in_device_memory(p, elems * sizeof(float)))
      emu::report_fault(std::string("a cuBLAS SGEMM's operand ") + which + " is not inside one device allocation (" +
                        emu::where(p) + ")");
  };
  inside(A, rows_a, cols_a, lda, batch_extra_a, "A");
  inside(B, rows_b, cols_b, ldb, batch_extra_b, "B");
  inside(C, m, n, ldc, batch_extra_c, "C");
  return CUBLAS_STATUS_SUCCESS;
}

// C = alpha op(A) op(B) + beta C, column-major; C is not read where beta is 0 (as cuBLAS).
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  if (m == 0 || n == 0) return;
  const int rows_a = ta == CUBLAS_OP_N ? m : k, cols_a = ta == CUBLAS_OP_N ? k : m;
  const int rows_b = tb == CUBLAS_OP_N ? k : n, cols_b = tb == CUBLAS_OP_N ? n : k;
  Eigen::MatrixXf a = ConstMap(A, rows_a, cols_a, Eigen::OuterStride<>(lda));
  Eigen::MatrixXf b = ConstMap(B, rows_b, cols_b, Eigen::OuterStride<>(ldb));
  if (ta == CUBLAS_OP_T) a.transposeInPlace();
  if (tb == CUBLAS_OP_T) b.transposeInPlace();
  Eigen::MatrixXf p = k == 0 ? Eigen::MatrixXf::Zero(m, n) : Eigen::MatrixXf(a * b);
  Map c(C, m, n, Eigen::OuterStride<>(ldc));
  if (beta == 0.f)
    c = alpha * p;
  else
    c = alpha * p + beta * c;
}

}  // namespace

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float* alpha, const float* A, int lda, const float* B, int ldb, const float* beta,
                           float* C, int ldc) {
  std::lock_guard<std::recursive_mutex> lock(emu::runtime_lock());
  const cublasStatus_t st = check_gemm(ta, tb, m, n, k, A, lda, B, ldb, C, ldc, 0, 0, 0);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float al = *alpha, be = *beta;
  return emu::issue(handle->stream, [=]() { gemm(ta, tb, m, n, k, al, A, lda, B, ldb, be, C, ldc); }) == cudaSuccess
             ? CUBLAS_STATUS_SUCCESS
             : CUBLAS_STATUS_EXECUTION_FAILED;
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m,
                                         int n, int k, const float* alpha, const float* A, int lda, long long sa,
                                         const float* B, int ldb, long long sb, const float* beta, float* C,
                                         int ldc, long long sc, int batch) {
  std::lock_guard<std::recursive_mutex> lock(emu::runtime_lock());
  if (batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (batch == 0) return CUBLAS_STATUS_SUCCESS;
  const long long last = batch - 1;
  const cublasStatus_t st = check_gemm(ta, tb, m, n, k, A, lda, B, ldb, C, ldc, last * sa, last * sb, last * sc);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float al = *alpha, be = *beta;
  return emu::issue(handle->stream,
                 [=]() {
                   for (int i = 0; i < batch; ++i)
                     gemm(ta, tb, m, n, k, al, A + i * sa, lda, B + i * sb, ldb, be, C + i * sc, ldc);
                 }) == cudaSuccess
             ? CUBLAS_STATUS_SUCCESS
             : CUBLAS_STATUS_EXECUTION_FAILED;
}
