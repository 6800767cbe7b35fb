// defines: cuda::convert, cuda::convert_each, cuda::add_, cuda::add, cuda::scale_, cuda::sum_squares, cuda::sum_squares_each,
//          cuda::grad_norm_gate, cuda::fill_, cuda::running_segment_amax
// The elementwise utilities on GPU tensors, with the CPU's arithmetic (ops/cpu/tensor_utils.cpp):
// BF16 values are decoded to float, computed on in float, and encoded once with num::bf16_encode
// (RNE), so both backends give the same bits. The GPU backend holds F32 and BF16 only; F64
// tensors stay on the host.
//
// sum_squares is a reduction and must not depend on scheduling: every block owns one fixed chunk
// of kSumChunk elements and writes one double partial (fixed per-thread sums, fixed block tree),
// then a single block adds the partials in a fixed tree. No atomics; the chunking depends only on
// the element count, so the same tensor always gives the same bits.
//
// running_segment_amax needs no fixed order: a max is exact in any order, so each warp reduces a
// row and folds it into its segment's value with an integer atomicMax on the float's bits (for
// values >= 0 the bit patterns order like the floats).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fourbit/numerics/bf16.h"
#include "fourbit/ops/adamw_math.h"
#include "fourbit/ops/cuda/checks.cuh"
#include "fourbit/ops/cuda/common.cuh"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/index_errors.cuh"
#include "fourbit/ops/cuda/reduce.cuh"
#include "fourbit/ops/cuda/vec4.cuh"

namespace fourbit::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kSumChunk = 1 << 14;  // elements per sum_squares partial (the CPU's chunk)
constexpr int kFinalThreads = 1024;

bool is_value_dtype(DType t) { return t == DType::F32 || t == DType::BF16; }

void expect_value(const char* op, const char* name, const Tensor& t) {
  if (!t.defined()) fail("{}: {} is undefined", op, name);
  if (t.device() != Device::CUDA || !is_value_dtype(t.dtype()))
    fail("{}: {} must be an f32 or bf16 cuda tensor (GPU tensors are f32 or bf16; f64 stays on "
         "the host), got {}",
         op, name, t.str());
}

// ---- kernels (grid-stride over groups of 4 elements for F32; plain elements for BF16) ---------

// Eight values at i of src (those < n) rounded to BF16 (bf16_encode): two float4 loads and one
// 16-byte store when both ends are aligned (vec).
__device__ __forceinline__ void f32_to_bf16_8(const float* src, uint16_t* dst, int64_t i, int64_t n, bool vec) {
  float v[8];
  load4(src, i, n, vec, v);
  load4(src, i + 4, n, vec, v + 4);
  uint16_t h[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) h[c] = num::bf16_encode(v[c]);
  if (vec && i + 7 < n) {
    *reinterpret_cast<uint4*>(dst + i) = make_uint4(h[0] | uint32_t(h[1]) << 16, h[2] | uint32_t(h[3]) << 16,
                                                    h[4] | uint32_t(h[5]) << 16, h[6] | uint32_t(h[7]) << 16);
  } else {
    for (int c = 0; c < 8 && i + c < n; ++c) dst[i + c] = h[c];
  }
}

__global__ void f32_to_bf16_kernel(const float* src, uint16_t* dst, int64_t n, bool vec) {
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * 8; i < n;
       i += int64_t(gridDim.x) * blockDim.x * 8)
    f32_to_bf16_8(src, dst, i, n, vec);
}

// convert_each: one CTA a chunk of kConvertChunk values of one job (chunks numbered across the
// jobs; a CTA finds its job by binary search over their first chunks).
struct ConvertJob {
  const float* src;
  uint16_t* dst;
  int64_t n, chunk0;
  int vec;
};
constexpr int64_t kConvertChunk = 8 * kThreads * 4;

__global__ void f32_to_bf16_jobs_kernel(const ConvertJob* __restrict__ jobs, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (jobs[mid].chunk0 <= int64_t(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  const ConvertJob j = jobs[lo];
  const int64_t first = (int64_t(blockIdx.x) - j.chunk0) * kConvertChunk, end = min(j.n, first + kConvertChunk);
  for (int64_t i = first + int64_t(threadIdx.x) * 8; i < end; i += int64_t(blockDim.x) * 8)
    f32_to_bf16_8(j.src, j.dst, i, j.n, j.vec != 0);
}

// zero_each: one CTA a chunk of kZeroChunk 16-byte words of one job, found as in convert_each.
struct ZeroJob {
  uint4* dst;
  int64_t words, chunk0;
};
constexpr int64_t kZeroChunk = 4 * kThreads;

__global__ void zero_jobs_kernel(const ZeroJob* __restrict__ jobs, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (jobs[mid].chunk0 <= int64_t(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  const ZeroJob j = jobs[lo];
  const int64_t first = (int64_t(blockIdx.x) - j.chunk0) * kZeroChunk, end = min(j.words, first + kZeroChunk);
  for (int64_t i = first + threadIdx.x; i < end; i += blockDim.x) j.dst[i] = make_uint4(0, 0, 0, 0);
}

__global__ void bf16_to_f32_kernel(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = num::bf16_decode(src[i]);
}

// out = a + b (out may be a: add_)
__global__ void add_f32_kernel(const float* a, const float* b, float* out, int64_t n, bool vec) {
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    float d[4], s[4];
    load4(a, 4 * g, n, vec, d);
    load4(b, 4 * g, n, vec, s);
#pragma unroll
    for (int c = 0; c < 4; ++c) d[c] = num::add_rn(d[c], s[c]);
    store4(out, 4 * g, n, vec, d);
  }
}

__global__ void add_bf16_kernel(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = num::bf16_encode(num::add_rn(num::bf16_decode(a[i]), num::bf16_decode(b[i])));
}

__global__ void scale_f32_kernel(float* t, float f, int64_t n, bool vec) {
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    float d[4];
    load4(t, 4 * g, n, vec, d);
#pragma unroll
    for (int c = 0; c < 4; ++c) d[c] = num::mul_rn(d[c], f);
    store4(t, 4 * g, n, vec, d);
  }
}

__global__ void scale_bf16_kernel(uint16_t* t, float f, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    t[i] = num::bf16_encode(num::mul_rn(num::bf16_decode(t[i]), f));
}

template <typename T>
__global__ void fill_kernel(T* t, T pattern, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    t[i] = pattern;
}

__device__ __forceinline__ double square_of(float x) { return double(x) * double(x); }
__device__ __forceinline__ double square_of(uint16_t x) {
  const double d = double(num::bf16_decode(x));
  return d * d;
}

// The block's partial of chunk c of x[0, n): thread t takes groups t, t + kThreads, ... of the
// chunk (four elements each, in order), then the block tree combines the threads. The loads of
// several groups are issued before their squares are added (in the same order).
__device__ __forceinline__ double chunk_sum_squares(const float* x, int64_t n, bool vec, int64_t c, double* scratch) {
  const int64_t begin = c * kSumChunk;
  const int64_t len = n - begin < kSumChunk ? n - begin : kSumChunk;
  double acc = 0.0;
#pragma unroll 4
  for (int64_t g = threadIdx.x; 4 * g < len; g += kThreads) {
    float v[4];
    load4(x + begin, 4 * g, len, vec, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc += square_of(v[k]);  // zeros past the end add nothing
  }
  return block_sum<kThreads>(acc, scratch);
}
__device__ __forceinline__ double chunk_sum_squares(const uint16_t* x, int64_t n, int64_t c, double* scratch) {
  const int64_t begin = c * kSumChunk;
  const int64_t len = n - begin < kSumChunk ? n - begin : kSumChunk;
  double acc = 0.0;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < len; i += kThreads) acc += square_of(x[begin + i]);
  return block_sum<kThreads>(acc, scratch);
}

// Block b: the partial of chunk b.
__global__ void __launch_bounds__(kThreads)
    sum_squares_f32_partials(const float* x, int64_t n, bool vec, double* partial) {
  __shared__ double scratch[kThreads / 32];
  const double acc = chunk_sum_squares(x, n, vec, blockIdx.x, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads)
    sum_squares_bf16_partials(const uint16_t* x, int64_t n, double* partial) {
  __shared__ double scratch[kThreads / 32];
  const double acc = chunk_sum_squares(x, n, blockIdx.x, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// The fixed-order total of count partials: thread t adds partials t, t + 1024, ... in order, then
// the block tree.
__device__ __forceinline__ double total_of_partials(const double* partial, int64_t count, double* scratch) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kFinalThreads) acc += partial[i];
  return block_sum<kFinalThreads>(acc, scratch);
}

__global__ void __launch_bounds__(kFinalThreads)
    sum_partials_kernel(const double* partial, int64_t count, double* out) {
  __shared__ double scratch[kFinalThreads / 32];
  const double acc = total_of_partials(partial, count, scratch);
  if (threadIdx.x == 0) out[0] = acc;
}

// sum_squares_each in two launches for any number of tensors: tensor i's chunks are blocks
// first_chunk .. first_chunk + chunks of the first kernel (each block finds its tensor by binary
// search over first_chunk), its total block i of the second. Every partial and total is computed
// by the functions above on the same data: the bits of the per-tensor launches.
struct SumJob {
  const void* x;
  int64_t n, first_chunk, chunks;
  int32_t bf16, vec;
};

__global__ void __launch_bounds__(kThreads)
    sum_squares_jobs_partials(const SumJob* jobs, int32_t count, double* partial) {
  __shared__ double scratch[kThreads / 32];
  const int64_t b = blockIdx.x;
  int32_t lo = 0, hi = count - 1;  // the last job whose first chunk is <= b
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (jobs[mid].first_chunk <= b) lo = mid;
    else hi = mid - 1;
  }
  const SumJob j = jobs[lo];
  const int64_t c = b - j.first_chunk;
  const double acc = j.bf16 ? chunk_sum_squares(static_cast<const uint16_t*>(j.x), j.n, c, scratch)
                            : chunk_sum_squares(static_cast<const float*>(j.x), j.n, j.vec != 0, c, scratch);
  if (threadIdx.x == 0) partial[b] = acc;
}

__global__ void __launch_bounds__(kFinalThreads)
    sum_squares_jobs_totals(const SumJob* jobs, const double* partial, double* totals) {
  __shared__ double scratch[kFinalThreads / 32];
  const SumJob j = jobs[blockIdx.x];
  const double acc = total_of_partials(partial + j.first_chunk, j.chunks, scratch);
  if (threadIdx.x == 0) totals[blockIdx.x] = acc;
}


// Segments of one running_segment_amax launch, passed by value (offsets relative to the launch's
// first entry): 256 segments cover any MoE layer's experts in one launch, more take several.
constexpr int kAmaxSegments = 256;
struct AmaxSegments {
  int count;
  int64_t off[kAmaxSegments + 1];
};

// The segment of entry j: the last one starting at or before it.
__device__ __forceinline__ int segment_of(const AmaxSegments& segs, int64_t j) {
  int g = 0;
  for (int lo = 0, hi = segs.count - 1; lo < hi;) {
    const int mid = (lo + hi + 1) / 2;
    if (segs.off[mid] <= j) g = lo = mid; else hi = mid - 1;
  }
  return g;
}

// Entry e's row of x (rows[e], or e without an index), or -1 for one outside [0, R), which the
// calling thread records where `record`.
__device__ __forceinline__ int64_t segment_amax_row(const int32_t* rows, int64_t e, int64_t R, IndexError* err,
                                                    bool record) {
  const int64_t r = rows ? int64_t(rows[e]) : e;
  if (r >= 0 && r < R) return r;
  if (record) record_index_error(err, IndexSite::SegmentAmaxRows, e, r, R, 1);
  return -1;
}

// The max |x| of row r over columns c0, c0 + step, ... below C, NaN and Inf left out.
__device__ __forceinline__ float row_finite_amax(const float* x, int64_t r, int64_t C, int64_t c0, int64_t step) {
  float m = 0.0f;
  for (int64_t c = c0; c < C; c += step) {
    const float a = fabsf(x[r * C + c]);
    if (a <= FLT_MAX && a > m) m = a;  // NaN and Inf fail the first test
  }
  return m;
}

// Rows narrower than a warp (the quantizers' row amaxes, one float a row: QTensor::row_amax): one
// entry a lane, and the lanes of one segment fold their maxima first, so that one atomic a
// warp and segment lands instead of one a row (16 K rows on 16 experts' amaxes).
__global__ void __launch_bounds__(kThreads)
    segment_amax_thin_kernel(const float* __restrict__ x, int64_t R, int64_t C, const int32_t* __restrict__ rows,
                             int64_t entry0, const AmaxSegments segs, float* __restrict__ amax, IndexError* err) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const int64_t n = segs.off[segs.count];
  for (int64_t base = 32 * (blockIdx.x * int64_t(kThreads / 32) + threadIdx.x / 32); base < n; base += 32 * warps) {
    const int64_t j = base + lane;
    int g = -1;  // lanes past the entries and rows out of range fold nothing
    float m = 0.0f;
    if (j < n) {
      const int64_t r = segment_amax_row(rows, entry0 + j, R, err, true);
      if (r >= 0) {
        m = row_finite_amax(x, r, C, 0, 1);
        g = segment_of(segs, j);
      }
    }
    const unsigned same = __match_any_sync(0xffffffffu, g);
    const unsigned folded = __reduce_max_sync(same, __float_as_uint(m));  // m >= 0: its bits order
    if (g >= 0 && lane == __ffs(same) - 1) atomicMax(reinterpret_cast<unsigned int*>(amax + g), folded);
  }
}

// One warp per entry j: the finite max |x| of its row, folded into its segment's amax.
__global__ void __launch_bounds__(kThreads)
    segment_amax_kernel(const float* __restrict__ x, int64_t R, int64_t C, const int32_t* __restrict__ rows,
                        int64_t entry0, const AmaxSegments segs, float* __restrict__ amax, IndexError* err) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const int64_t n = segs.off[segs.count];
  for (int64_t j = blockIdx.x * int64_t(kThreads / 32) + threadIdx.x / 32; j < n; j += warps) {
    const int64_t r = segment_amax_row(rows, entry0 + j, R, err, lane == 0);
    if (r < 0) continue;
    const float m = warp_max(row_finite_amax(x, r, C, lane, 32));
    if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax + segment_of(segs, j)), __float_as_uint(m));
  }
}

}  // namespace

void convert(const Tensor& src, Tensor& dst) {
  expect_value("convert", "src", src);
  expect_value("convert", "dst", dst);
  if (src.numel() != dst.numel())
    fail("convert: src {} and dst {} differ in element count", src.str(), dst.str());
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {
    FOURBIT_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), size_t(src.nbytes()),
                                       cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  if (src.dtype() == DType::F32) {  // F32 -> BF16: one RNE rounding (bf16_encode)
    const bool vec = reinterpret_cast<uintptr_t>(src.raw()) % 16 == 0 && reinterpret_cast<uintptr_t>(dst.raw()) % 16 == 0;
    f32_to_bf16_kernel<<<grid_for((n + 7) / 8, kThreads), kThreads, 0, stream()>>>(src.data<float>(),
                                                                                  dst.data<uint16_t>(), n, vec);
  } else {  // BF16 -> F32: exact
    bf16_to_f32_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(src.data<uint16_t>(),
                                                            dst.data<float>(), n);
  }
  FOURBIT_LAUNCH_CHECK();
}

bool convert_each(const std::vector<Tensor>& src, std::vector<Tensor>& dst) {
  std::vector<ConvertJob> jobs;
  int64_t chunks = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].dtype() != DType::F32 || dst[i].dtype() != DType::BF16) return false;
    const int64_t n = src[i].numel();
    if (n == 0) continue;
    const bool vec = aligned16(src[i].raw()) && aligned16(dst[i].raw());
    jobs.push_back({src[i].data<float>(), dst[i].data<uint16_t>(), n, chunks, vec ? 1 : 0});
    chunks += (n + kConvertChunk - 1) / kConvertChunk;
  }
  if (jobs.empty()) return true;
  if (chunks > INT32_MAX) return false;
  // the table goes up through a pinned staging slot without waiting (copy_bytes)
  const Tensor table = Tensor::from_host(jobs.data(), {int64_t(jobs.size() * sizeof(ConvertJob))}, DType::U8, Device::CUDA);
  f32_to_bf16_jobs_kernel<<<unsigned(chunks), kThreads, 0, stream()>>>(static_cast<const ConvertJob*>(table.raw()),
                                                                       int(jobs.size()));
  FOURBIT_LAUNCH_CHECK();
  return true;
}

bool zero_each(std::vector<Tensor>& ts) {
  std::vector<ZeroJob> jobs;
  int64_t chunks = 0;
  for (Tensor& t : ts) {
    if (!aligned16(t.raw()) || t.nbytes() % 16 != 0) return false;
    const int64_t words = t.nbytes() / 16;
    if (words == 0) continue;
    jobs.push_back({static_cast<uint4*>(t.raw()), words, chunks});
    chunks += (words + kZeroChunk - 1) / kZeroChunk;
  }
  if (jobs.empty()) return true;
  if (chunks > INT32_MAX) return false;
  const Tensor table = Tensor::from_host(jobs.data(), {int64_t(jobs.size() * sizeof(ZeroJob))}, DType::U8, Device::CUDA);
  zero_jobs_kernel<<<unsigned(chunks), kThreads, 0, stream()>>>(static_cast<const ZeroJob*>(table.raw()),
                                                               int(jobs.size()));
  FOURBIT_LAUNCH_CHECK();
  return true;
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  expect_add_args(a, b, out, expect_value);
  const int64_t n = a.numel();
  if (n == 0) return;
  if (a.dtype() == DType::F32) {
    const bool vec = aligned16(a.raw()) && aligned16(b.raw()) && aligned16(out.raw());
    add_f32_kernel<<<grid_for((n + 3) / 4, kThreads), kThreads, 0, stream()>>>(a.data<float>(), b.data<float>(),
                                                                             out.data<float>(), n, vec);
  } else {
    add_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(a.data<uint16_t>(), b.data<uint16_t>(),
                                                                    out.data<uint16_t>(), n);
  }
  FOURBIT_LAUNCH_CHECK();
}

void add_(Tensor& dst, const Tensor& src) {
  expect_value("add_", "dst", dst);
  expect_value("add_", "src", src);
  expect_add_inplace_args(dst, src);
  add(dst, src, dst);
}

// As on the CPU: the factor is rounded to float once and every element is multiplied by it.
void scale_(Tensor& t, double s) {
  expect_value("scale_", "t", t);
  const int64_t n = t.numel();
  if (n == 0) return;
  const float f = float(s);
  if (t.dtype() == DType::F32)
    scale_f32_kernel<<<grid_for((n + 3) / 4, kThreads), kThreads, 0, stream()>>>(t.data<float>(), f, n,
                                                                    aligned16(t.raw()));
  else
    scale_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(t.data<uint16_t>(), f, n);
  FOURBIT_LAUNCH_CHECK();
}

namespace {
int64_t sum_chunks(const Tensor& t) { return (t.numel() + kSumChunk - 1) / kSumChunk; }

// t's chunk partials into partial[0 .. sum_chunks(t)), then their fixed-order total into *total.
void launch_sum_squares(const Tensor& t, double* partial, double* total) {
  const int64_t n = t.numel(), chunks = sum_chunks(t);
  if (t.dtype() == DType::F32)
    sum_squares_f32_partials<<<unsigned(chunks), kThreads, 0, stream()>>>(t.data<float>(), n, aligned16(t.raw()),
                                                                        partial);
  else
    sum_squares_bf16_partials<<<unsigned(chunks), kThreads, 0, stream()>>>(t.data<uint16_t>(), n, partial);
  FOURBIT_LAUNCH_CHECK();
  sum_partials_kernel<<<1, kFinalThreads, 0, stream()>>>(partial, chunks, total);
  FOURBIT_LAUNCH_CHECK();
}
}  // namespace

double sum_squares(const Tensor& t) {
  expect_value("sum_squares", "t", t);
  if (t.numel() == 0) return 0.0;
  const int64_t chunks = sum_chunks(t);
  Tensor partial = Tensor::empty({chunks + 1}, DType::F64, Device::CUDA);  // + 1: the total
  double* p = partial.data<double>();
  launch_sum_squares(t, p, p + chunks);
  double total = 0.0;  // the host needs the value: this copy is the op's one synchronisation
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&total, p + chunks, sizeof total, cudaMemcpyDeviceToHost, stream()));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return total;
}

namespace {
bool operator==(const SumJob& a, const SumJob& b) {
  return a.x == b.x && a.n == b.n && a.first_chunk == b.first_chunk && a.chunks == b.chunks && a.bf16 == b.bf16 &&
         a.vec == b.vec;
}

// The per-tensor totals of sum_squares_each on the device: launches the two kernels and returns
// the buffer (the totals of the non-empty tensors first, in order, then the partials), with
// job_tensor[j] the index in ts of total j. Each total by the kernels of sum_squares (the same
// bits). The job table is uploaded once and kept while the tensors stay the same (an optimizer's
// gradients, every step).
Tensor launch_sum_squares_each(const char* op, const std::vector<Tensor>& ts, std::vector<int64_t>& job_tensor) {
  int64_t chunks = 0;
  for (const Tensor& t : ts) {
    expect_value(op, "t", t);
    chunks += sum_chunks(t);
  }
  std::vector<SumJob> jobs;
  job_tensor.clear();
  int64_t first = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    if (t.numel() == 0) continue;  // totals 0
    jobs.push_back(SumJob{t.raw(), t.numel(), first, sum_chunks(t), t.dtype() == DType::BF16 ? 1 : 0,
                          aligned16(t.raw()) ? 1 : 0});
    job_tensor.push_back(int64_t(i));
    first += sum_chunks(t);
  }
  if (jobs.empty()) return Tensor();
  const int64_t J = int64_t(jobs.size());
  // kept for the process (not destroyed at exit, after the device may be gone)
  static std::vector<SumJob>* const cached_jobs = new std::vector<SumJob>();
  static Tensor* const cached_table = new Tensor();
  if (jobs != *cached_jobs || !cached_table->defined()) {
    *cached_table = Tensor::from_host(jobs.data(), {J * int64_t(sizeof(SumJob))}, DType::U8, Device::CUDA);
    *cached_jobs = jobs;
  }
  Tensor buf = Tensor::empty({J + chunks}, DType::F64, Device::CUDA);
  double* totals = buf.data<double>();
  const SumJob* dev_jobs = static_cast<const SumJob*>(cached_table->raw());
  sum_squares_jobs_partials<<<unsigned(chunks), kThreads, 0, stream()>>>(dev_jobs, int32_t(J), totals + J);
  FOURBIT_LAUNCH_CHECK();
  sum_squares_jobs_totals<<<unsigned(J), kFinalThreads, 0, stream()>>>(dev_jobs, totals + J, totals);
  FOURBIT_LAUNCH_CHECK();
  return buf;
}

// grad_norm_gate's fields from the totals (fill_gate, the host's sequence of double operations)
// on one thread, taking the quantizers' sticky flag. The block first stages up to kGateStaged
// totals in shared memory, so that the sequential sum waits on shared loads, not on one global
// load after another.
constexpr int kGateStaged = 2048;
__global__ void __launch_bounds__(kThreads)
    grad_norm_gate_kernel(const double* totals, int64_t count, double max_norm, bool host_nonfinite,
                          unsigned int* quant_flag, double* gate) {
  __shared__ double staged[kGateStaged];
  const bool stage = count <= kGateStaged;
  if (stage)
    for (int64_t i = threadIdx.x; i < count; i += kThreads) staged[i] = totals[i];
  __syncthreads();
  if (threadIdx.x != 0) return;
  const bool quant = atomicExch(quant_flag, 0u) != 0u || host_nonfinite;
  fill_gate(stage ? staged : totals, count, max_norm, quant, gate);
}
}  // namespace

std::vector<double> sum_squares_each(const std::vector<Tensor>& ts) {
  std::vector<int64_t> job_tensor;
  const Tensor buf = launch_sum_squares_each("sum_squares_each", ts, job_tensor);
  std::vector<double> out(ts.size(), 0.0);
  if (!buf.defined()) return out;
  std::vector<double> job_totals(job_tensor.size());
  // the host needs the values: this copy is the op's one synchronisation
  FOURBIT_CUDA_CHECK(cudaMemcpyAsync(job_totals.data(), buf.raw(), job_totals.size() * sizeof(double),
                                     cudaMemcpyDeviceToHost, stream()));
  FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  for (size_t j = 0; j < job_tensor.size(); ++j) out[size_t(job_tensor[j])] = job_totals[j];
  return out;
}

void grad_norm_gate(const std::vector<Tensor>& grads, double max_norm, bool host_nonfinite, Tensor& gate) {
  // The empty tensors' totals (0) are left out of the sum: adding +0 to a sum >= 0 changes no bit.
  std::vector<int64_t> job_tensor;
  const Tensor buf = launch_sum_squares_each("grad_norm_gate", grads, job_tensor);
  grad_norm_gate_kernel<<<1, kThreads, 0, stream()>>>(buf.defined() ? buf.data<double>() : nullptr,
                                                      int64_t(job_tensor.size()), max_norm, host_nonfinite,
                                                      nonfinite_flag_address(), gate.data<double>());
  FOURBIT_LAUNCH_CHECK();
}

void fill_(Tensor& t, double v) {
  expect_value("fill_", "t", t);
  const int64_t n = t.numel();
  if (n == 0) return;
  // The value is rounded once on the host, as the CPU's store() rounds it, and copied n times.
  if (t.dtype() == DType::F32)
    fill_kernel<float><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(t.data<float>(), float(v), n);
  else
    fill_kernel<uint16_t><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(t.data<uint16_t>(),
                                                               num::bf16_encode_f64(v), n);
  FOURBIT_LAUNCH_CHECK();
}

void running_segment_amax(const Tensor& x, const Tensor& rows, const std::vector<int64_t>& offsets, Tensor& amax) {
  const int64_t M = expect_segment_amax_args(Device::CUDA, "running_segment_amax", x, rows, offsets, amax);
  const int64_t G = int64_t(offsets.size()) - 1, R = x.size(0), C = x.size(1);
  if (M == 0 || C == 0) return;
  for (int64_t g0 = 0; g0 < G; g0 += kAmaxSegments) {
    AmaxSegments segs{};
    segs.count = int(std::min<int64_t>(kAmaxSegments, G - g0));
    for (int i = 0; i <= segs.count; ++i) segs.off[i] = offsets[size_t(g0 + i)] - offsets[size_t(g0)];
    const int64_t n = segs.off[segs.count];
    if (n == 0) continue;
    const bool thin = C < 32;  // a lane a row, else a warp a row
    const auto kernel = thin ? segment_amax_thin_kernel : segment_amax_kernel;
    kernel<<<grid_for(thin ? (n + 31) / 32 : n, kThreads / 32), kThreads, 0, stream()>>>(
        x.data<float>(), R, C, rows.defined() ? rows.data<int32_t>() : nullptr, offsets[size_t(g0)], segs,
        amax.data<float>() + g0, index_error_record());
    FOURBIT_LAUNCH_CHECK();
  }
}

}  // namespace fourbit::ops::cuda
