// The integer products of 4-bit training on CUDA (docs/quant.md, issue 13): the implicit-GEMM
// kernel, its outputs and launches, shared by cuda_quant.cu (the quantizers and the forward),
// cuda_quant_data_grad.cu and cuda_quant_weight_grad.cu. Three files, not one, because each pass
// instantiates the kernel for its own operand views, 4 block heights and both multipliers, on every
// architecture built: in one file that was one nvcc process of about 6 minutes, the longest step
// of every CUDA build (CI's included); split, the passes compile side by side. Everything here is
// in an unnamed namespace: each file has its own copies of the kernels it launches (the emulator,
// tests/cuda_emu, rewrites this header's launches as it rewrites the .cu files').
//
// Integer products: one implicit-GEMM kernel, C[M][N] = sum_k A(m, k) B(k, n) over int8 codes with
// int32 sums, its operands gathered in place by the views of int_gemm_operands.h (no im2col
// buffer) into shared-memory tiles, multiplied by int8 tensor cores (mma.m16n8k32; sm_80 and
// later, which includes Jetson Orin) or dp4a before. The sums are exact (|sum| < 2^31 is checked
// as on the CPU), so any tiling gives the CPU's integers; each output is then scaled once with the
// CPU's float operations in the CPU's order. The weight gradients sum over every position of the
// batch: the kernel splits that sum over blocks (split-K) and adds the parts with integer atomics
// into a workspace (exact in any order), which a second kernel scales.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/cuda_backend_impl.h"
#include "backends/cuda/int_gemm_operands.h"
#include "memory/stash_codec.h"

namespace et {

namespace {

using cuda::blocks_for;
using cuda::kThreads;
using int_gemm::ConvShape;

// A code tensor's scale as a kernel reads it: the value, or the float of the device's memory a
// kernel wrote before it in the stream (Tensor::scale_at: Backend::quant_scales_in_memory).
struct ScaleRef {
  float value;
  const float* at;
  __device__ float get() const { return at ? *at : value; }
};
inline ScaleRef scale_ref(const Tensor& t) { return ScaleRef{t.scale, t.scale_at}; }
// Two operands' scales multiplied, rounded once as the CPU's xq.scale * wq.scale.
struct ScaleProduct {
  ScaleRef a, b;
  __device__ float get() const { return __fmul_rn(a.get(), b.get()); }
};

// ---- the integer product

// A block computes BM x 128 outputs (BM = 16, 32, 64 or 128: the rows a layer has, up to 128) with
// 8 warps, over k in steps of 32 codes. A step's codes go to shared memory as words of 4 codes of
// consecutive k (code k0 + 4 kw + j in byte j), the unit of mma.m16n8k32's fragments:
//   A fragment (16 x 32): a0 = A[g][4t..], a1 = A[g + 8][4t..], a2 = A[g][16 + 4t..], a3 = A[g + 8][16 + 4t..]
//   B fragment (32 x 8):  b0 = B[4t..][g], b1 = B[16 + 4t..][g]
//   C (16 x 8, int32):    c0, c1 = C[g][2t, 2t + 1], c2, c3 = C[g + 8][2t, 2t + 1]
// (lane = 4 g + t). Rows of words are padded by 8 words, so a fragment load hits 32 banks.
// Tensor cores (sm_80 and later) multiply; before sm_80 (or with EDGETRAIN_CUDA_INT_MMA=0) each
// lane sums its C fragment with dp4a.
constexpr int kTileK = 32, kTileN = 128, kGemmThreads = 256;

__device__ __forceinline__ int dot4(int a, int b, int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  return __dp4a(a, b, c);
#else
  for (int j = 0; j < 4; ++j) c += int(int8_t(a >> (8 * j))) * int(int8_t(b >> (8 * j)));
  return c;
#endif
}

// c += A (16 x 32 codes at rows r.., words as[kw * lda]) x B (32 x 8 at columns n.., bs[kw * ldb]),
// each lane summing its own C fragment's elements with dp4a: the products without tensor cores
// (before sm_80), and the reference the tensor cores are tested against (EDGETRAIN_CUDA_INT_MMA=0).
__device__ __forceinline__ void dp4a_16x8x32(int (&c)[4], const int* as, int lda, int r, const int* bs, int ldb,
                                             int n, int lane) {
  const int g = lane / 4, t = lane % 4;
  for (int kw = 0; kw < kTileK / 4; ++kw) {
    const int a0 = as[kw * lda + r + g], a1 = as[kw * lda + r + g + 8];
    const int b0 = bs[kw * ldb + n + 2 * t], b1 = bs[kw * ldb + n + 2 * t + 1];
    c[0] = dot4(a0, b0, c[0]);
    c[1] = dot4(a0, b1, c[1]);
    c[2] = dot4(a1, b0, c[2]);
    c[3] = dot4(a1, b1, c[3]);
  }
}

// The same on the tensor cores (sm_80 and later; dp4a before). On the CUDA emulator
// (tests/cuda_emu) the instruction is its model of the PTX ISA's fragment layouts, chosen by the
// emulated device's compute capability as nvcc chooses by the architecture it builds for.
__device__ __forceinline__ void mma_16x8x32(int (&c)[4], const int* as, int lda, int r, const int* bs, int ldb, int n,
                                            int lane) {
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800) || defined(EDGETRAIN_CUDA_EMULATOR)
#if defined(EDGETRAIN_CUDA_EMULATOR)
  if (emu::device_major() < 8) return dp4a_16x8x32(c, as, lda, r, bs, ldb, n, lane);
#endif
  const int g = lane / 4, t = lane % 4;
  const int a0 = as[t * lda + r + g], a1 = as[t * lda + r + g + 8], a2 = as[(t + 4) * lda + r + g],
            a3 = as[(t + 4) * lda + r + g + 8];
  const int b0 = bs[t * ldb + n + g], b1 = bs[(t + 4) * ldb + n + g];
#if defined(EDGETRAIN_CUDA_EMULATOR)
  emu::mma_m16n8k32_s8(c, a0, a1, a2, a3, b0, b1);
#else
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
#else
  dp4a_16x8x32(c, as, lda, r, bs, ldb, n, lane);
#endif
}

// The words of 4 codes a thread gathers for one k step, held in registers while the tensor cores
// multiply the step before.
template <int kWords>
struct Gathered {
  int word[kWords];
};

// The word of codes k .. k + 3 (the first n of them; the others 0) at a fixed row of A or column
// of B (kFixedRow: A's), code j in byte j: the tile's unit, kept packed (a register, not four).
template <bool kFixedRow, class V>
__device__ __forceinline__ int gather_word(const V& v, const int_gemm::Pos& fixed, const int_gemm::Pos* k, int n) {
  unsigned w = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < n) w |= (unsigned(kFixedRow ? v.get(fixed, k[j]) : v.get(k[j], fixed)) & 0xFFu) << (8 * j);
  return int(w);
}

// Block (x, y, z): outputs [n0, n0 + 128) x [m0, m0 + BM), the sum over k in [z * k_chunk, + k_chunk).
// A step's tiles are words of 4 codes of consecutive k: A's BM rows x 8 words, B's 8 words x 128
// columns. Word w of a tile goes to thread w % 256 (its i-th word, i = w / 256) in one of two
// orders (int_gemm::GatherOrder, chosen per operand by its layout in memory): along k (w = row * 8
// + word: a warp's lanes read 4 rows (columns) at 8 consecutive words, adjacent where k is) or
// across (w = word * BM + row: a warp's lanes read 32 consecutive rows (columns) at one word,
// adjacent where those are). The block decomposes its rows of A and columns of B once into tables
// (row(), col()), and the 32 k of a step once into another; a code then costs two table reads,
// an add, the bounds and one load. The loop is pipelined: the next step's codes are loaded into
// registers while this step's are multiplied, so the loads' latency hides behind the products
// even with one block on an SM.
template <bool kTensorCores, int BM, int WARPS_M, class A, class B, class Out>
__global__ void __launch_bounds__(kGemmThreads)
    int_gemm_kernel(int64_t M, int64_t N, int64_t K, int64_t k_chunk, A a, B b, Out out, int_gemm::GatherOrder order) {
  constexpr int kWarpsN = 8 / WARPS_M, kWM = BM / WARPS_M, kWN = kTileN / kWarpsN, kTM = kWM / 16, kTN = kWN / 8;
  constexpr int kLda = BM + 8, kLdb = kTileN + 8, kWordRows = kTileK / 4;
  // Words a thread gathers a step: A's BM x 8 and B's 8 x 128 over 256 threads (BM = 16: half the
  // threads take one word of A, the others none).
  constexpr int kAWords = BM * kWordRows >= kGemmThreads ? BM * kWordRows / kGemmThreads : 1;
  constexpr int kBWords = kTileN * kWordRows / kGemmThreads;
  static_assert(kGemmThreads % BM == 0 && kWM % 16 == 0 && kWN % 8 == 0 && BM <= kTileN, "tile shape");
  __shared__ int as[kWordRows * kLda];
  __shared__ int bs[kWordRows * kLdb];
  __shared__ int_gemm::Pos a_k[2][kTileK], b_k[2][kTileK];  // A's col(k), B's row(k) of a step, two steps
  __shared__ int_gemm::Pos a_rows[BM], b_cols[kTileN];      // the block's rows of A, columns of B
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % WARPS_M * kWM, wn = warp / WARPS_M * kWN;
  const int64_t m0 = int64_t(blockIdx.y) * BM, n0 = int64_t(blockIdx.x) * kTileN;
  const int64_t k_begin = int64_t(blockIdx.z) * k_chunk, k_end = K < k_begin + k_chunk ? K : k_begin + k_chunk;
  if (tid < BM) a_rows[tid] = a.row(m0 + tid < M ? m0 + tid : 0);
  if (tid >= kGemmThreads - kTileN) {
    const int c = tid - (kGemmThreads - kTileN);
    b_cols[c] = b.col(n0 + c < N ? n0 + c : 0);
  }
  // Word i of this thread: its row (column) of the tile and its word of k, in the operand's order.
  auto a_word = [&](int i, int& row, int& kw) {
    const int w = tid + i * kGemmThreads;
    row = order.a_along_k ? w / kWordRows : w % BM;
    kw = order.a_along_k ? w % kWordRows : w / BM;
    return w < BM * kWordRows;
  };
  auto b_word = [&](int i, int& col, int& kw) {
    const int w = tid + i * kGemmThreads;
    col = order.b_along_k ? w / kWordRows : w % kTileN;
    kw = order.b_along_k ? w % kWordRows : w / kTileN;
  };

  auto tables = [&](int64_t k0, int buf) {  // threads 0-63: the step at k0 (< k_end)
    const int kn = k_end - k0 < kTileK ? int(k_end - k0) : kTileK, i = tid % kTileK;
    if (tid < kTileK)
      a_k[buf][i] = a.col(k0 + (i < kn ? i : 0));
    else if (tid < 2 * kTileK)
      b_k[buf][i] = b.row(k0 + (i < kn ? i : 0));
  };
  auto gather = [&](int64_t k0, int buf, Gathered<kAWords>& ga, Gathered<kBWords>& gb) {
    const int kn = k_end - k0 < kTileK ? int(k_end - k0) : kTileK;
#pragma unroll
    for (int i = 0; i < kAWords; ++i) {
      int row, kw;
      const bool in = a_word(i, row, kw) && m0 + row < M;
      ga.word[i] = in ? gather_word<true>(a, a_rows[row], &a_k[buf][4 * kw], kn - 4 * kw) : 0;
    }
#pragma unroll
    for (int i = 0; i < kBWords; ++i) {
      int col, kw;
      b_word(i, col, kw);
      gb.word[i] = n0 + col < N ? gather_word<false>(b, b_cols[col], &b_k[buf][4 * kw], kn - 4 * kw) : 0;
    }
  };
  auto store = [&](const Gathered<kAWords>& ga, const Gathered<kBWords>& gb) {
#pragma unroll
    for (int i = 0; i < kAWords; ++i) {
      int row, kw;
      if (a_word(i, row, kw)) as[kw * kLda + row] = ga.word[i];
    }
#pragma unroll
    for (int i = 0; i < kBWords; ++i) {
      int col, kw;
      b_word(i, col, kw);
      bs[kw * kLdb + col] = gb.word[i];
    }
  };

  int acc[kTM][kTN][4] = {};
  Gathered<kAWords> ga;
  Gathered<kBWords> gb;
  if (k_begin < k_end) {
    tables(k_begin, 0);
    __syncthreads();
    gather(k_begin, 0, ga, gb);
    store(ga, gb);
    if (k_begin + kTileK < k_end) tables(k_begin + kTileK, 1);
    __syncthreads();
  }
  int buf = 0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileK, buf ^= 1) {
    const bool next = k0 + kTileK < k_end;
    if (next) gather(k0 + kTileK, buf ^ 1, ga, gb);  // in flight during the products
#pragma unroll
    for (int i = 0; i < kTM; ++i)
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        if (kTensorCores) mma_16x8x32(acc[i][j], as, kLda, wm + 16 * i, bs, kLdb, wn + 8 * j, lane);
        else dp4a_16x8x32(acc[i][j], as, kLda, wm + 16 * i, bs, kLdb, wn + 8 * j, lane);
      }
    __syncthreads();  // the step's tiles and its k table are read
    if (next) store(ga, gb);
    if (k0 + 2 * kTileK < k_end) tables(k0 + 2 * kTileK, buf);
    __syncthreads();
  }
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int j = 0; j < kTN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t m = m0 + wm + 16 * i + g + (e >= 2 ? 8 : 0), n = n0 + wn + 8 * j + 2 * t + (e & 1);
        if (m < M && n < N) out(m, n, acc[i][j][e]);
      }
}

// Outputs: the CPU's float operations on the exact sum, each rounded as the CPU rounds it.
// y = float(v) * scale + bias (0 without one); bias by row (conv: the output channel) or column.
template <class Index>
struct BiasedOut {
  float* y;
  Index at;
  ScaleProduct scale;
  const float* bias;
  bool bias_by_row;
  __device__ void operator()(int64_t m, int64_t n, int v) const {
    const float b = bias ? bias[bias_by_row ? m : n] : 0.f;
    y[at.at(m, n)] = __fadd_rn(__fmul_rn(float(v), scale.get()), b);
  }
};
// d = float(v) * scale, + d where it accumulates; plus_zero: + 0 otherwise (the CPU's form there).
template <class Index>
struct ScaledOut {
  float* d;
  Index at;
  ScaleProduct scale;
  bool accumulate, plus_zero;
  __device__ void operator()(int64_t m, int64_t n, int v) const {
    float* p = d + at.at(m, n);
    const float s = __fmul_rn(float(v), scale.get());
    *p = accumulate ? __fadd_rn(s, *p) : plus_zero ? __fadd_rn(s, 0.f) : s;
  }
};
// The split sums, added into an int32 workspace (zeroed first).
struct AtomicOut {
  int* acc;
  int64_t ld;
  __device__ void operator()(int64_t m, int64_t n, int v) const { atomicAdd(acc + m * ld + n, v); }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The rows a block takes: the fewest of 16, 32, 64, 128 that cover M, else 128.
inline int block_rows(int64_t M) { return M <= 16 ? 16 : M <= 32 ? 32 : M <= 64 ? 64 : 128; }

// How many blocks share a product's k range: where its tiles are fewer than 4 blocks per
// multiprocessor, enough to make up that number, each with at least 512 codes of k.
inline int64_t k_splits(int64_t M, int64_t N, int64_t K, int sms) {
  const int64_t tiles = ceil_div(M, block_rows(M)) * ceil_div(N, kTileN);
  return std::max<int64_t>(1, std::min(ceil_div(4 * int64_t(sms), tiles), K / 512));
}

// The split sums' workspace: one int32 per output where the product splits, else none.
inline size_t split_bytes(int64_t M, int64_t N, int64_t K, int sms) {
  return k_splits(M, N, K, sms) > 1 ? size_t(M * N) * 4 : 0;
}

// EDGETRAIN_CUDA_INT_MMA: 1 (or unset) multiplies on the tensor cores where the device has them,
// 0 with dp4a everywhere (the reference for tests and A/B runs; the same integers).
inline bool tensor_cores() {
  const char* env = std::getenv("EDGETRAIN_CUDA_INT_MMA");
  if (!env || !std::strcmp(env, "1")) return true;
  if (!std::strcmp(env, "0")) return false;
  user_error("EDGETRAIN_CUDA_INT_MMA='", env, "': expected 0 or 1");
}

// EDGETRAIN_CUDA_INT_GATHER: auto (or unset) gathers each operand in the order its layout
// coalesces (int_gemm::along_k_as_a / _as_b), across or k everywhere (A/B runs and the tests, which
// take every view both ways; the same integers).
template <class A, class B>
int_gemm::GatherOrder gather_order(const A& a, const B& b) {
  const char* env = std::getenv("EDGETRAIN_CUDA_INT_GATHER");
  if (!env || !std::strcmp(env, "auto")) return int_gemm::GatherOrder{int_gemm::along_k_as_a(a), int_gemm::along_k_as_b(b)};
  if (!std::strcmp(env, "across")) return int_gemm::GatherOrder{false, false};
  if (!std::strcmp(env, "k")) return int_gemm::GatherOrder{true, true};
  user_error("EDGETRAIN_CUDA_INT_GATHER='", env, "': expected auto, across or k");
}

template <bool kTensorCores, class A, class B, class Out>
void launch_int_gemm(dim3 grid, cudaStream_t stream, int bm, int64_t M, int64_t N, int64_t K, int64_t k_chunk,
                     const A& a, const B& b, const Out& out, int_gemm::GatherOrder order) {
  if (bm == 16)
    int_gemm_kernel<kTensorCores, 16, 1><<<grid, kGemmThreads, 0, stream>>>(M, N, K, k_chunk, a, b, out, order);
  else if (bm == 32)
    int_gemm_kernel<kTensorCores, 32, 2><<<grid, kGemmThreads, 0, stream>>>(M, N, K, k_chunk, a, b, out, order);
  else if (bm == 64)
    int_gemm_kernel<kTensorCores, 64, 2><<<grid, kGemmThreads, 0, stream>>>(M, N, K, k_chunk, a, b, out, order);
  else
    int_gemm_kernel<kTensorCores, 128, 2><<<grid, kGemmThreads, 0, stream>>>(M, N, K, k_chunk, a, b, out, order);
}

// C = A x B into out on the stream; the k range split over `splits` blocks (out must add then).
template <class A, class B, class Out>
void run_int_gemm(cudaStream_t stream, int64_t M, int64_t N, int64_t K, const A& a, const B& b, const Out& out,
                  int64_t splits = 1) {
  if (M == 0 || N == 0) return;
  const int bm = block_rows(M);
  const int64_t k_chunk = ceil_div(ceil_div(std::max<int64_t>(K, 1), splits), kTileK) * kTileK;
  splits = ceil_div(std::max<int64_t>(K, 1), k_chunk);
  ET_CHECK(ceil_div(M, bm) <= 65535 && splits <= 65535 && ceil_div(N, kTileN) < (int64_t(1) << 31),
           "integer product: ", M, " x ", N, ", ", splits, " splits");
  const dim3 grid(unsigned(ceil_div(N, kTileN)), unsigned(ceil_div(M, bm)), unsigned(splits));
  const int_gemm::GatherOrder order = gather_order(a, b);
  if (tensor_cores()) launch_int_gemm<true>(grid, stream, bm, M, N, K, k_chunk, a, b, out, order);
  else launch_int_gemm<false>(grid, stream, bm, M, N, K, k_chunk, a, b, out, order);
  cuda::launched("int_gemm");
}

// out(m, n, sum) for the split sums.
template <class Out>
__global__ void apply_sums_kernel(const int* acc, int64_t M, int64_t N, Out out) {
  ET_GRID_STRIDE(i, M * N) out(i / N, i % N, acc[i]);
}

// C = A x B into out: split over k (k_splits) where the workspace holds the sums, added with
// integer atomics (exact in any order) and then handed to out; in one pass otherwise.
template <class A, class B, class Out>
void run_split_int_gemm(cudaStream_t stream, int sms, int64_t M, int64_t N, int64_t K, const A& a, const B& b,
                        const Out& out, Workspace ws) {
  const int64_t splits = k_splits(M, N, K, sms);
  if (splits == 1 || ws.bytes < size_t(M * N) * 4) return run_int_gemm(stream, M, N, K, a, b, out);
  int* acc = static_cast<int*>(ws.data);
  cuda::check(cudaMemsetAsync(acc, 0, size_t(M * N) * 4, stream), "cudaMemsetAsync");
  run_int_gemm(stream, M, N, K, a, b, AtomicOut{acc, N}, splits);
  apply_sums_kernel<<<cuda::blocks_for(M * N), kThreads, 0, stream>>>(acc, M, N, out);
  cuda::launched("apply_sums");
}

inline ConvShape conv_shape(const Conv2dGeom& g) {
  ET_CHECK(g.C * g.H * g.W < (int64_t(1) << 31) && g.K * g.P * g.Q < (int64_t(1) << 31), "conv too large");
  return int_gemm::conv_shape_of(g);
}

inline size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// f(phase) for each phase of a strided data gradient with input positions (one at stride 1).
template <class F>
void for_each_data_grad_phase(const ConvShape& s, F f) {
  for (int a = 0; a < s.stride_h; ++a)
    for (int b = 0; b < s.stride_w; ++b) {
      const int_gemm::DataGradPhase ph = int_gemm::data_grad_phase(s, a, b);
      if (ph.positions() > 0) f(ph);
    }
}

// The input codes a kernel reads in place: xq itself where dense (I4 / U4), or under
// memory.stash = bitmap_int4 the stash's encoding (BitmapI4 / BitmapU4) decoded at the start of
// the workspace.
inline Tensor dense_codes(StashCodec& codec, const Tensor& xq, Workspace ws) {
  if (xq.dtype == DType::I4 || xq.dtype == DType::U4) return xq;
  ET_CHECK(xq.dtype == DType::BitmapI4 || xq.dtype == DType::BitmapU4,
           "CUDA integer kernels read INT4 input codes, not ", dtype_name(xq.dtype));
  ET_CHECK(ws.bytes >= size_t(xq.numel()), "workspace for the decoded input codes");
  const bool is_signed = xq.dtype == DType::BitmapI4;
  int8_t* out = static_cast<int8_t*>(ws.data);
  codec.decode_codes(xq.data, xq.numel(), is_signed, out);
  Tensor d = xq;  // its shape, strides and scale
  d.data = out;
  d.dtype = is_signed ? DType::I4 : DType::U4;
  return d;
}

// A conv pass's workspace: first room to decode stored input codes (the forward, which a recompute
// runs on the stash's codes, and the weight gradient: one byte an input element), then the split
// sums where the pass splits. At a smaller batch than planned both parts shrink; a split that
// does not fit runs unsplit (run_split_int_gemm).
inline size_t decode_bytes(const Conv2dGeom& g, ConvPass pass) {
  return pass == ConvPass::BackwardData ? 0 : align_up(size_t(g.N * g.C * g.H * g.W));
}
inline Workspace split_part(Workspace ws, size_t decode) {
  return decode >= ws.bytes ? Workspace{nullptr, 0} : Workspace{static_cast<uint8_t*>(ws.data) + decode, ws.bytes - decode};
}

}  // namespace
}  // namespace et
