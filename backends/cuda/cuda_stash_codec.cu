// The CUDA stash codec (backends/cuda/cuda_stash_codec.h). Elements go in chunks of kChunk = 256
// (one block of 256 threads, 8 warps, 4 bitmap words); a chunk's values start at the exclusive
// scan of the chunk popcounts before it, an element's at that plus the set bits before it in its
// chunk (warp ballots and __popc), so the packed order is the host's.
// bitmap_int4 (memory/code_bitmap.h) goes a code block (4096 elements) per thread block: each
// thread's 16 elements are a quarter of a bitmap word, a block scan of their counts places each
// kept code, and the block writes its nibble bytes from a compacted copy in shared memory.
#include "backends/cuda/cuda_stash_codec.h"
#include "backends/cuda/cuda_half.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/cuda_device.h"
#include "engine/check.h"
#include "memory/bitmap.h"
#include "memory/code_bitmap.h"

namespace et {

namespace {

using cuda::from_f16;
constexpr int kChunk = int(StashCodec::kOffsetChunk);  // elements per chunk = threads per block
constexpr int kWarps = kChunk / 32;
static_assert(kWarps <= 32 && (kWarps & (kWarps - 1)) == 0, "a chunk's words are a power-of-two group of lanes in one warp");
constexpr int kScanThreads = 1024;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) user_error("CUDA stash codec: ", what, " failed: ", cudaGetErrorString(e));
}

int64_t num_words(int64_t n) { return (n + 63) / 64; }
// Chunks that cover every bitmap word (the last word's bits past n are written as zeros).
int64_t num_chunks(int64_t n) { return (num_words(n) * 64 + kChunk - 1) / kChunk; }
unsigned grid_for(int64_t chunks) { return unsigned(chunks < 65535 ? chunks : 65535); }

__device__ __forceinline__ uint32_t keep_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

// memory/bitmap.cpp's f32_to_f16 (f16_to_f32: cuda_half.h), on the bits (round to nearest even; NaN quiet
// with its top 10 payload bits; the denormal range rounded by an FP32 add, far from FTZ).
__device__ __forceinline__ uint16_t to_f16(float x) {
  uint32_t u = __float_as_uint(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7FFFFFFFu;
  uint32_t h;
  if (u > 0x7F800000u) {
    h = 0x7E00u | ((u >> 13) & 0x3FFu);
  } else if (u >= 0x47800000u) {
    h = 0x7C00u;
  } else if (u < 0x38800000u) {
    const float f = __fadd_rn(__uint_as_float(u), 0.5f);
    h = __float_as_uint(f) - 0x3F000000u;
  } else {
    u += 0xC8000FFFu + ((u >> 13) & 1u);
    h = u >> 13;
  }
  return uint16_t((h & 0xFFFFu) | sign);
}


__device__ __forceinline__ uint16_t to_bf16(float x) {
  const uint32_t u = __float_as_uint(x);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? uint16_t((u >> 16) | 0x40u) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Bitmap of x (as 32-bit halves of the 64-bit words), each chunk's count, the total.
__global__ void make_bits_kernel(const float* x, int64_t n, uint32_t threshold, uint32_t* bits32, int64_t words32,
                                 unsigned long long* chunk_counts, int64_t chunks, unsigned long long* total) {
  __shared__ unsigned int warp_count[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t i = c * kChunk + threadIdx.x;
    const bool keep = i < n && keep_bits(x[i]) >= threshold;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, keep);
    if (lane == 0) {
      if (i / 32 < words32) bits32[i / 32] = ballot;
      warp_count[warp] = __popc(ballot);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += warp_count[w];
      if (chunk_counts) chunk_counts[c] = sum;
      if (total) atomicAdd(total, sum);
    }
    __syncthreads();
  }
}

// Each chunk's count from an existing bitmap: a thread per 32-bit word, so that a warp's loads
// coalesce (a thread per chunk read 8 words 32 bytes apart: 8 sectors a warp for every 1 used, and
// a stage-1 layer at batch 128 gave 32 blocks), each chunk's kWarps words summed across its lanes.
__global__ void chunk_counts_kernel(const uint32_t* bits32, int64_t words32, unsigned long long* chunk_counts,
                                    int64_t chunks) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // grid: whole warps, past the last word
  unsigned sum = j < words32 ? unsigned(__popc(bits32[j])) : 0u;
  for (int d = kWarps / 2; d > 0; d /= 2) sum += __shfl_down_sync(0xFFFFFFFFu, sum, d, kWarps);
  if (j % kWarps == 0 && j / kWarps < chunks) chunk_counts[j / kWarps] = sum;
}

// offsets[c] = counts[0] + ... + counts[c - 1], one block looping over tiles with a carry.
__global__ void exclusive_scan_kernel(const unsigned long long* counts, int64_t chunks, unsigned long long* offsets) {
  __shared__ unsigned long long tile[kScanThreads];
  __shared__ unsigned long long carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < chunks; base += kScanThreads) {
    const int64_t c = base + threadIdx.x;
    const unsigned long long v = c < chunks ? counts[c] : 0ull;
    tile[threadIdx.x] = v;
    __syncthreads();
    for (int step = 1; step < kScanThreads; step *= 2) {  // inclusive Hillis-Steele scan
      const unsigned long long add = threadIdx.x >= step ? tile[threadIdx.x - step] : 0ull;
      __syncthreads();
      tile[threadIdx.x] += add;
      __syncthreads();
    }
    if (c < chunks) offsets[c] = carry + tile[threadIdx.x] - v;
    __syncthreads();
    if (threadIdx.x == kScanThreads - 1) carry += tile[threadIdx.x];
    __syncthreads();
  }
}

// An element's kept bit and its value index (chunk offset + set bits before it in the chunk).
struct Slot {
  bool keep;
  unsigned long long index;
};

__device__ __forceinline__ Slot slot_of(const uint32_t* bits32, int64_t words32, int64_t n, int64_t c,
                                        const unsigned long long* offsets, unsigned int* warp_prefix) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t i = c * kChunk + threadIdx.x;
  const uint32_t word = i / 32 < words32 ? bits32[i / 32] : 0u;
  if (lane == 0) warp_prefix[warp] = __popc(word);
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int sum = 0;
    for (int w = 0; w < kWarps; ++w) {
      const unsigned int v = warp_prefix[w];
      warp_prefix[w] = sum;
      sum += v;
    }
  }
  __syncthreads();
  Slot s;
  s.keep = i < n && ((word >> lane) & 1u);
  s.index = offsets[c] + warp_prefix[warp] + __popc(word & ((1u << lane) - 1u));
  __syncthreads();  // warp_prefix is reused by the next chunk
  return s;
}

// Values past `capacity` (the room the stash gave the entry) are not written, and their bits are
// cleared (each warp rewrites its own word), so readers stay within the room; the count tells.
__global__ void pack_values_kernel(const float* x, uint32_t* bits32, int64_t words32, int64_t n,
                                   const unsigned long long* offsets, int64_t chunks, void* values, bool f16,
                                   int64_t capacity) {
  __shared__ unsigned int warp_prefix[kWarps];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const Slot s = slot_of(bits32, words32, n, c, offsets, warp_prefix);
    const bool fits = int64_t(s.index) < capacity;
    const unsigned kept = __ballot_sync(0xFFFFFFFFu, s.keep), stored = __ballot_sync(0xFFFFFFFFu, s.keep && fits);
    const int64_t word = (c * kChunk + threadIdx.x) / 32;
    if ((threadIdx.x & 31) == 0 && stored != kept && word < words32) bits32[word] = stored;
    if (!s.keep || !fits) continue;
    const float v = x[c * kChunk + threadIdx.x];
    if (f16) static_cast<uint16_t*>(values)[s.index] = to_f16(v);
    else static_cast<float*>(values)[s.index] = v;
  }
}

__global__ void unpack_kernel(const uint32_t* bits32, int64_t words32, const void* values, int64_t n,
                              const unsigned long long* offsets, int64_t chunks, bool f16, float* y) {
  __shared__ unsigned int warp_prefix[kWarps];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const Slot s = slot_of(bits32, words32, n, c, offsets, warp_prefix);
    const int64_t i = c * kChunk + threadIdx.x;
    if (i >= n) continue;
    y[i] = !s.keep ? 0.f : f16 ? from_f16(static_cast<const uint16_t*>(values)[s.index])
                               : static_cast<const float*>(values)[s.index];
  }
}

__global__ void to_half_kernel(const float* x, int64_t n, bool bf16, uint16_t* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = bf16 ? to_bf16(x[i]) : to_f16(x[i]);
}

__global__ void from_half_kernel(const uint16_t* x, int64_t n, bool bf16, float* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = bf16 ? __uint_as_float(uint32_t(x[i]) << 16) : from_f16(x[i]);
}

// ---- bitmap_int4: bits, directory, nibbles (memory/code_bitmap.h's layout)

// A block of the code bitmap (code_bitmap::kBlock = 4096 elements, 128 bitmap words of 32 bits)
// per thread block of 256 threads. Element e of a block goes to thread e % 256 (its e / 256-th),
// so that a warp's loads and stores of elements coalesce (a thread per 16 consecutive elements
// took a sector per lane: 8 to 16 times the sectors its bytes need); a kept element's place among
// the block's kept codes is its word's prefix plus the set bits below it in the word.
constexpr int kCodeThreads = 256, kCodeWords = int(code_bitmap::kBlock) / 32, kCodeRounds = int(code_bitmap::kBlock) / kCodeThreads;
static_assert(kCodeWords <= kCodeThreads && kCodeThreads % 32 == 0, "a thread per bitmap word");

struct CodeLayout {
  uint64_t* bits;
  unsigned long long* directory;  // int64 offsets (non-negative)
  uint8_t* nibbles;
  int64_t nibble_room;  // bytes `nibbles` may take: what `capacity` kept codes need at most
};
CodeLayout code_layout(void* data, int64_t n, int64_t capacity) {
  uint64_t* bits = static_cast<uint64_t*>(data);
  auto* dir = reinterpret_cast<unsigned long long*>(bits + (n + 63) / 64);
  return CodeLayout{bits, dir, reinterpret_cast<uint8_t*>(dir + code_bitmap::num_blocks(n)),
                    code_bitmap::nibble_bytes(n, capacity < n ? capacity : n)};
}

// Exclusive prefix of v over the block's 256 threads; *total = the sum. `warp_sums`: 8 ints.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
  for (int d = 1; d < 32; d *= 2) {  // inclusive scan within the warp
    const int y = __shfl_up_sync(0xFFFFFFFFu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < kCodeThreads / 32; ++w) {
    if (w < warp) before += warp_sums[w];
    sum += warp_sums[w];
  }
  *total = sum;
  __syncthreads();  // warp_sums is reused by the next scan
  return before + x - v;
}

// The block's bitmap words (32 bits; 0 past the bitmap) into words[128] and the set bits before
// each into prefix[128]; returns the block's count. Ends with a barrier.
__device__ __forceinline__ int load_code_words(const uint64_t* bits, int64_t n, uint32_t* words, int* prefix,
                                               int* warp_sums) {
  const int t = threadIdx.x;
  const int64_t w = int64_t(blockIdx.x) * kCodeWords + t, words32 = (n + 63) / 64 * 2;
  const uint32_t word = t < kCodeWords && w < words32 ? reinterpret_cast<const uint32_t*>(bits)[w] : 0u;
  int count = 0;
  const int before = block_exclusive_scan(__popc(word), warp_sums, &count);
  if (t < kCodeWords) {
    words[t] = word;
    prefix[t] = before;
  }
  __syncthreads();
  return count;
}

// Element e of the block: kept (its bit), and where among the block's kept codes.
struct CodeSlot {
  bool kept;
  int rank;
};
__device__ __forceinline__ CodeSlot code_slot(const uint32_t* words, const int* prefix, int e) {
  const uint32_t word = words[e / 32], bit = uint32_t(e % 32);
  return CodeSlot{((word >> bit) & 1u) != 0, prefix[e / 32] + __popc(word & ((1u << bit) - 1u))};
}

// The bitmap of x (a warp's ballot is a 32-bit word of it; 0 past n to the word's end) and each
// block's nibble bytes, (count + 1) / 2, into block_bytes; the kept total into *total.
__global__ void code_bits_kernel(const float* x, int64_t n, uint32_t threshold, uint64_t* bits,
                                 unsigned long long* block_bytes, unsigned long long* total) {
  __shared__ int warp_counts[kCodeThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t first = int64_t(blockIdx.x) * code_bitmap::kBlock, words32 = (n + 63) / 64 * 2;
  int count = 0;
  for (int r = 0; r < kCodeRounds; ++r) {
    const int64_t i = first + r * kCodeThreads + threadIdx.x;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, i < n && keep_bits(x[i]) >= threshold);
    if (lane == 0 && i / 32 < words32) reinterpret_cast<uint32_t*>(bits)[i / 32] = ballot;
    count += __popc(ballot);
  }
  if (lane == 0) warp_counts[warp] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    for (int w = 0; w < kCodeThreads / 32; ++w) sum += warp_counts[w];
    block_bytes[blockIdx.x] = (unsigned long long)(sum + 1) / 2;
    atomicAdd(total, (unsigned long long)sum);
  }
}

// Each block's kept codes, two a byte, low nibble first, at its directory offset. A block whose
// nibbles would pass the room keeps the codes that fit (an even number) and clears the others'
// bits (memory/code_bitmap.h's encode with a capacity), so readers stay within the room.
__global__ void code_pack_kernel(const int8_t* codes, int64_t n, CodeLayout l) {
  __shared__ int warp_sums[kCodeThreads / 32];
  __shared__ uint32_t words[kCodeWords];
  __shared__ int prefix[kCodeWords];
  __shared__ uint8_t kept[code_bitmap::kBlock];
  const int count = load_code_words(l.bits, n, words, prefix, warp_sums);
  const int64_t first = int64_t(blockIdx.x) * code_bitmap::kBlock, at = int64_t(l.directory[blockIdx.x]);
  // The codes of this block that fit: nibble bytes at + p / 2 < room, i.e. p < 2 * (room - at).
  const int64_t fit = 2 * (l.nibble_room - at);
  if (int(threadIdx.x) < kCodeWords) {  // a word with set bits past the fit: those cleared, highest first
    uint32_t stored = words[threadIdx.x];
    while (stored && prefix[threadIdx.x] + __popc(stored) > fit) stored &= ~(1u << (31 - __clz(stored)));
    if (stored != words[threadIdx.x])  // (so never a word past the bitmap: those are 0)
      reinterpret_cast<uint32_t*>(l.bits)[int64_t(blockIdx.x) * kCodeWords + threadIdx.x] = stored;
  }
  for (int r = 0; r < kCodeRounds; ++r) {
    const int e = r * kCodeThreads + int(threadIdx.x);
    const CodeSlot s = code_slot(words, prefix, e);
    if (s.kept) kept[s.rank] = uint8_t(codes[first + e]) & 0x0Fu;
  }
  __syncthreads();
  uint8_t* out = l.nibbles + at;
  for (int b = threadIdx.x; b < (count + 1) / 2; b += kCodeThreads)
    if (at + b < l.nibble_room)  // past the entry's room: the count tells the stash
      out[b] = uint8_t(kept[2 * b] | (2 * b + 1 < count ? kept[2 * b + 1] << 4 : 0));
}

// out[i] = the code of element i: its nibble (sign-extended for I4 codes) where its bit is set, else 0.
__global__ void code_unpack_kernel(CodeLayout l, int64_t n, bool is_signed, int8_t* out) {
  __shared__ int warp_sums[kCodeThreads / 32];
  __shared__ uint32_t words[kCodeWords];
  __shared__ int prefix[kCodeWords];
  load_code_words(l.bits, n, words, prefix, warp_sums);
  const int64_t first = int64_t(blockIdx.x) * code_bitmap::kBlock;
  const uint8_t* nib = l.nibbles + l.directory[blockIdx.x];
  for (int r = 0; r < kCodeRounds; ++r) {
    const int e = r * kCodeThreads + int(threadIdx.x);
    if (first + e >= n) break;
    const CodeSlot s = code_slot(words, prefix, e);
    int8_t c = 0;
    if (s.kept) {
      const int v = (nib[s.rank >> 1] >> ((s.rank & 1) * 4)) & 0x0F;
      c = is_signed ? int8_t(v >= 8 ? v - 16 : v) : int8_t(v);
    }
    out[first + e] = c;
  }
}

class CudaStashCodec final : public StashCodec {
 public:
  CudaStashCodec(int device, cudaStream_t stream) : device_(device), stream_(stream) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    total_ = cuda_allocate_array<unsigned long long>(1, "the stash codec's total");
  }
  ~CudaStashCodec() override {
    cudaFree(total_);
    cudaFree(counts_);
    cudaFree(offsets_);
  }

  bool defers_counts() const override { return true; }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  void reserve(int64_t n) override { reserve_chunks(num_chunks(n)); }  // (code blocks are fewer)
  int64_t scratch_generation() const override { return generation_; }
  int64_t count_nonzero(const float* x, int64_t n, float prune_threshold) override {
    return bits_and_counts(x, n, prune_threshold, nullptr, false, nullptr);
  }
  int64_t make_bits(const float* x, int64_t n, float prune_threshold, uint64_t* bits, int64_t* count_out) override {
    return bits_and_counts(x, n, prune_threshold, bits, false, count_out);
  }
  void pack_values(const float* x, uint64_t* bits, int64_t n, void* values, bool f16,
                   int64_t capacity) override {
    if (n <= 0) return;
    offsets_from_bits(bits, n);
    const int64_t chunks = num_chunks(n);
    pack_values_kernel<<<grid_for(chunks), kChunk, 0, stream_>>>(
        x, reinterpret_cast<uint32_t*>(bits), num_words(n) * 2, n, offsets_, chunks, values, f16, capacity);
    check(cudaGetLastError(), "pack_values");
  }
  int64_t pack(const float* x, int64_t n, float prune_threshold, uint64_t* bits, void* values, bool f16,
               int64_t capacity, int64_t* count_out) override {
    if (n <= 0) return zero_count(count_out);
    const int64_t kept = bits_and_counts(x, n, prune_threshold, bits, true, count_out);
    const int64_t chunks = num_chunks(n);
    exclusive_scan_kernel<<<1, kScanThreads, 0, stream_>>>(counts_, chunks, offsets_);
    pack_values_kernel<<<grid_for(chunks), kChunk, 0, stream_>>>(
        x, reinterpret_cast<uint32_t*>(bits), num_words(n) * 2, n, offsets_, chunks, values, f16, capacity);
    check(cudaGetLastError(), "pack");
    return kept;
  }
  void unpack(const uint64_t* bits, const void* values, int64_t n, bool f16, float* y) override {
    if (n <= 0) return;
    offsets_from_bits(bits, n);
    const int64_t chunks = num_chunks(n);
    unpack_kernel<<<grid_for(chunks), kChunk, 0, stream_>>>(reinterpret_cast<const uint32_t*>(bits), num_words(n) * 2,
                                                            values, n, offsets_, chunks, f16, y);
    check(cudaGetLastError(), "unpack");
  }
  int64_t encode_codes(const float* x, const int8_t* codes, int64_t n, float prune_threshold, void* out,
                       int64_t capacity, int64_t* count_out) override {
    if (n <= 0) return zero_count(count_out);
    const int64_t blocks = code_bitmap::num_blocks(n);
    ET_CHECK(blocks < (int64_t(1) << 31), "bitmap_int4 of ", n, " elements");
    reserve_chunks(blocks);
    const CodeLayout l = code_layout(out, n, capacity);
    check(cudaMemsetAsync(total_, 0, sizeof(unsigned long long), stream_), "cudaMemsetAsync");
    code_bits_kernel<<<unsigned(blocks), kCodeThreads, 0, stream_>>>(x, n, bitmap::keep_threshold_bits(prune_threshold),
                                                                     l.bits, counts_, total_);
    exclusive_scan_kernel<<<1, kScanThreads, 0, stream_>>>(counts_, blocks, l.directory);
    code_pack_kernel<<<unsigned(blocks), kCodeThreads, 0, stream_>>>(codes, n, l);
    check(cudaGetLastError(), "encode_codes");
    return total_count(count_out);
  }
  void decode_codes(const void* data, int64_t n, bool is_signed, int8_t* out) override {
    if (n <= 0) return;
    const CodeLayout l = code_layout(const_cast<void*>(data), n, n);
    code_unpack_kernel<<<unsigned(code_bitmap::num_blocks(n)), kCodeThreads, 0, stream_>>>(l, n, is_signed, out);
    check(cudaGetLastError(), "decode_codes");
  }
  void to_half(const float* x, int64_t n, bool bf16, uint16_t* out) override {
    if (n <= 0) return;
    to_half_kernel<<<grid_for((n + kChunk - 1) / kChunk), kChunk, 0, stream_>>>(x, n, bf16, out);
    check(cudaGetLastError(), "to_half");
  }
  void from_half(const uint16_t* x, int64_t n, bool bf16, float* out) override {
    if (n <= 0) return;
    from_half_kernel<<<grid_for((n + kChunk - 1) / kChunk), kChunk, 0, stream_>>>(x, n, bf16, out);
    check(cudaGetLastError(), "from_half");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
  }
  // A synchronous copy on the legacy stream, which waits for the blocking stream_'s work.
  void read_back(void* dst, const void* src, size_t bytes) override {
    check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (stash counts)");
  }

 private:
  // The kept total in total_: to count_out on the device (returns -1), or read back (a wait for
  // the device) where none is given.
  int64_t total_count(int64_t* count_out) {
    if (count_out) {
      check(cudaMemcpyAsync(count_out, total_, sizeof(int64_t), cudaMemcpyDeviceToDevice, stream_),
            "cudaMemcpyAsync (a count)");
      return -1;
    }
    unsigned long long total = 0;
    check(cudaMemcpy(&total, total_, sizeof(total), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return int64_t(total);
  }
  int64_t zero_count(int64_t* count_out) {
    if (!count_out) return 0;
    check(cudaMemsetAsync(count_out, 0, sizeof(int64_t), stream_), "cudaMemsetAsync (a count)");
    return -1;
  }
  // The bitmap (bits != nullptr) and, with `chunk_counts`, each chunk's count in counts_;
  // returns the kept total (total_count).
  int64_t bits_and_counts(const float* x, int64_t n, float prune_threshold, uint64_t* bits, bool chunk_counts,
                          int64_t* count_out) {
    if (n <= 0) return zero_count(count_out);
    const int64_t chunks = num_chunks(n);
    if (chunk_counts) reserve_chunks(chunks);
    const uint32_t threshold = bitmap::keep_threshold_bits(prune_threshold);
    check(cudaMemsetAsync(total_, 0, sizeof(unsigned long long), stream_), "cudaMemsetAsync");
    make_bits_kernel<<<grid_for(chunks), kChunk, 0, stream_>>>(x, n, threshold, reinterpret_cast<uint32_t*>(bits),
                                                               bits ? num_words(n) * 2 : 0,
                                                               chunk_counts ? counts_ : nullptr, chunks, total_);
    check(cudaGetLastError(), "make_bits");
    return total_count(count_out);
  }
  const uint64_t* value_offsets(const uint64_t* bits, int64_t n) override {
    if (n <= 0) return nullptr;
    offsets_from_bits(bits, n);
    return reinterpret_cast<const uint64_t*>(offsets_);
  }
  void offsets_from_bits(const uint64_t* bits, int64_t n) {
    const int64_t chunks = num_chunks(n);
    reserve_chunks(chunks);
    chunk_counts_kernel<<<unsigned((chunks * kWarps + 255) / 256), 256, 0, stream_>>>(
        reinterpret_cast<const uint32_t*>(bits), num_words(n) * 2, counts_, chunks);
    exclusive_scan_kernel<<<1, kScanThreads, 0, stream_>>>(counts_, chunks, offsets_);
    check(cudaGetLastError(), "chunk offsets");
  }
  // Grows the chunk scratch: at the stash's configure (reserve above), so never inside a step.
  void reserve_chunks(int64_t chunks) {
    if (chunks <= capacity_) return;
    cudaFree(counts_);
    cudaFree(offsets_);
    counts_ = offsets_ = nullptr;
    capacity_ = 0;
    ++generation_;
    counts_ = cuda_allocate_array<unsigned long long>(size_t(chunks), "the stash codec's counts");
    offsets_ = cuda_allocate_array<unsigned long long>(size_t(chunks), "the stash codec's offsets");
    capacity_ = chunks;
  }

  int device_;
  cudaStream_t stream_;  // the backend's (nullptr: the legacy default stream)
  unsigned long long* total_ = nullptr;
  unsigned long long *counts_ = nullptr, *offsets_ = nullptr;
  int64_t capacity_ = 0;
  int64_t generation_ = 0;  // scratch_generation()
};

}  // namespace

std::unique_ptr<StashCodec> make_cuda_stash_codec(int device, CUstream_st* stream) {
  make_cuda_memory(device);  // validates the index (UserError naming it)
  return std::unique_ptr<StashCodec>(new CudaStashCodec(device, stream));
}

}  // namespace et
