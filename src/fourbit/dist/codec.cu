// defines: cuda::slot_meta, cuda::encode_rows, cuda::pack_rows, cuda::decode_rows, cuda::unpack_rows,
//          cuda::read_meta, cuda::fold_rank_chunks (codec_cuda.h)
// The payload kernels. Encoders and decoders give one thread a 32-value chunk and call the same
// payload.h functions as the CPU loop (the S2F6 chunk's RHT butterfly, scale and rounding, the
// MXFP8 block quantizer), so the bytes are the CPU's by construction; the kernels only add vector
// loads and stores around them. Pack and unpack are byte copies, a warp per row. Every byte of a
// payload row is written (the header's zeros and the tail padding too), as the CPU's memset does.
// tests/dist/cuda_codec_test.cpp compares every output with the CPU's.
#include <cuda_runtime.h>

#include "fourbit/dist/codec_cuda.h"
#include "fourbit/ops/cuda/common.cuh"

namespace fourbit::dist::cuda {
namespace {

using ops::cuda::grid_for;
using ops::cuda::stream;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__global__ void slot_meta_kernel(const int32_t* slot_of, const int32_t* topk_idx, int64_t n, int64_t k,
                                 int32_t* meta) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * k; i += int64_t(gridDim.x) * blockDim.x) {
    int32_t* row = meta + 3 * int64_t(slot_of[i]);
    row[0] = int32_t(i / k);
    row[1] = topk_idx[i];
    row[2] = int32_t(i % k);
  }
}

// The header (chunk 0's thread) and the zero tail after the codes and scales.
__device__ void write_header_and_tail(const RowCodec& c, uint8_t* row, RowMeta m, float outer) {
  write_row_header(row, m, outer);
  for (int64_t b = kRowHeaderBytes + c.code_bytes() + c.scale_bytes(); b < c.row_bytes(); ++b) row[b] = 0;
}

// One thread per (row, chunk). S2F6 and MXFP8 chunks of a row whose values sit 16-byte aligned are
// loaded as float4 and their 32 codes stored as two uint4; everything else goes through
// encode_payload_chunk's scalar code. Both paths run the same payload.h arithmetic.
__global__ void encode_rows_kernel(const float* x, RowIndex map, const int32_t* meta, int64_t m, RowCodec c,
                                   uint8_t* payload) {
  const int64_t C = c.chunks(), RB = c.row_bytes();
  const bool quantized = c.fmt == Format::S2F6 || c.fmt == Format::MXFP8_E4M3 || c.fmt == Format::MXFP8_E5M2;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < m * C; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = t / C, ch = t % C;
    uint8_t* row = payload + i * RB;
    const float* xr = x + map.at(i) * c.cols;
    if (ch == 0) write_header_and_tail(c, row, RowMeta{meta[3 * i], meta[3 * i + 1], meta[3 * i + 2]}, 0.0f);
    const int64_t base = ch * kPayloadChunk;
    if (!quantized || base + 32 > c.cols || !aligned16(xr + base)) {
      encode_payload_chunk(c, xr, ch, row);
      continue;
    }
    float v[32];
    const float4* src = reinterpret_cast<const float4*>(xr + base);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float4 f = src[q];
      v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
    }
    alignas(16) uint8_t codes[32];
    uint8_t scale;
    if (c.fmt == Format::S2F6)
      scale = s2f6_payload_encode(v, c.hadamard == 32, c.hadamard_signs, reinterpret_cast<int8_t*>(codes));
    else
      scale = mxfp8_payload_encode(v, mx_elem(c.fmt), codes);
    uint4* dst = reinterpret_cast<uint4*>(row + kRowHeaderBytes + base);  // rows and codes: 16-byte aligned
    dst[0] = reinterpret_cast<const uint4*>(codes)[0];
    dst[1] = reinterpret_cast<const uint4*>(codes)[1];
    row[kRowHeaderBytes + c.code_bytes() + ch] = scale;
  }
}

__global__ void decode_rows_kernel(const uint8_t* payload, int64_t m, RowIndex map, RowCodec c, float* out) {
  const int64_t C = c.chunks(), RB = c.row_bytes();
  const bool quantized = c.fmt == Format::S2F6 || c.fmt == Format::MXFP8_E4M3 || c.fmt == Format::MXFP8_E5M2;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < m * C; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = t / C, ch = t % C;
    const uint8_t* row = payload + i * RB;
    float* orow = out + map.at(i) * c.cols;
    const int64_t base = ch * kPayloadChunk;
    if (!quantized || base + 32 > c.cols || !aligned16(orow + base)) {
      decode_payload_chunk(c, row, ch, orow);
      continue;
    }
    alignas(16) uint8_t codes[32];
    const uint4* src = reinterpret_cast<const uint4*>(row + kRowHeaderBytes + base);
    reinterpret_cast<uint4*>(codes)[0] = src[0];
    reinterpret_cast<uint4*>(codes)[1] = src[1];
    const uint8_t scale = row[kRowHeaderBytes + c.code_bytes() + ch];
    float v[32];
    if (c.fmt == Format::S2F6) {
      s2f6_payload_decode(reinterpret_cast<const int8_t*>(codes), scale, c.hadamard == 32, c.hadamard_signs, v);
    } else {
      mxfp8_payload_decode(codes, scale, mx_elem(c.fmt), v);
    }
    float4* dst = reinterpret_cast<float4*>(orow + base);
#pragma unroll
    for (int q = 0; q < 8; ++q) dst[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  }
}

// n bytes from src to dst by lanes of one warp: 4-byte words when both ends allow, else bytes.
__device__ void warp_copy(uint8_t* dst, const uint8_t* src, int64_t n, int lane) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 3u) == 0) {
    const int64_t words = n / 4;
    for (int64_t w = lane; w < words; w += 32)
      reinterpret_cast<uint32_t*>(dst)[w] = reinterpret_cast<const uint32_t*>(src)[w];
    for (int64_t b = words * 4 + lane; b < n; b += 32) dst[b] = src[b];
    return;
  }
  for (int64_t b = lane; b < n; b += 32) dst[b] = src[b];
}

__global__ void pack_rows_kernel(const uint8_t* codes, const uint8_t* scales, const float* outer, OuterScale kind,
                                 int64_t slice_rows, RowIndex map, const int32_t* meta, int64_t m, RowCodec c,
                                 uint8_t* payload) {
  const int lane = threadIdx.x % 32;
  const int64_t CB = c.code_bytes(), SB = c.scale_bytes(), RB = c.row_bytes();
  for (int64_t i = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; i < m;
       i += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t r = map.at(i);
    uint8_t* row = payload + i * RB;
    if (lane == 0) {
      float o = 0.0f;
      if (outer) o = kind == OuterScale::PerRow ? outer[r] : kind == OuterScale::PerSlice ? outer[r / slice_rows] : outer[0];
      write_header_and_tail(c, row, RowMeta{meta[3 * i], meta[3 * i + 1], meta[3 * i + 2]}, o);
    }
    warp_copy(row + kRowHeaderBytes, codes + r * CB, CB, lane);
    warp_copy(row + kRowHeaderBytes + CB, scales + r * SB, SB, lane);
  }
}

__global__ void unpack_rows_kernel(const uint8_t* payload, int64_t m, RowIndex map, RowCodec c, uint8_t* codes,
                                   uint8_t* scales, float* outer) {
  const int lane = threadIdx.x % 32;
  const int64_t CB = c.code_bytes(), SB = c.scale_bytes(), RB = c.row_bytes();
  for (int64_t i = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; i < m;
       i += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t r = map.at(i);
    const uint8_t* row = payload + i * RB;
    if (lane == 0 && outer) outer[r] = read_row_outer(row);
    warp_copy(codes + r * CB, row + kRowHeaderBytes, CB, lane);
    warp_copy(scales + r * SB, row + kRowHeaderBytes + CB, SB, lane);
  }
}

__global__ void read_meta_kernel(const uint8_t* payload, int64_t m, int64_t row_bytes, RowIndex map, int32_t* meta) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m; i += int64_t(gridDim.x) * blockDim.x) {
    const RowMeta r = read_row_header(payload + i * row_bytes);
    int32_t* o = meta + 3 * map.at(i);
    o[0] = r.token;
    o[1] = r.expert;
    o[2] = r.k;
  }
}

// The CPU's left fold: acc = chunk 0, then acc = acc + chunk r, one rounding per add, in rank order.
template <typename T>
__global__ void fold_kernel(const T* chunks, int ranks, int64_t n, int64_t stride, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    T acc = chunks[i];
    for (int r = 1; r < ranks; ++r) acc = acc + chunks[int64_t(r) * stride + i];
    out[i] = acc;
  }
}

}  // namespace

void slot_meta(const int32_t* slot_of, const int32_t* topk_idx, int64_t n, int64_t k, int32_t* meta) {
  if (n * k == 0) return;
  slot_meta_kernel<<<grid_for(n * k, kThreads), kThreads, 0, stream()>>>(slot_of, topk_idx, n, k, meta);
  FOURBIT_LAUNCH_CHECK();
}

void encode_rows(const float* x, int64_t, RowIndex map, const int32_t* meta, int64_t m, const RowCodec& codec,
                 uint8_t* payload) {
  if (m == 0) return;
  encode_rows_kernel<<<grid_for(m * codec.chunks(), kThreads), kThreads, 0, stream()>>>(x, map, meta, m, codec,
                                                                                      payload);
  FOURBIT_LAUNCH_CHECK();
}

void pack_rows(const QTensor& q, RowIndex map, const int32_t* meta, int64_t m, const RowCodec& codec,
               uint8_t* payload) {
  if (m == 0) return;
  pack_rows_kernel<<<grid_for(m, kWarpsPerBlock), kThreads, 0, stream()>>>(
      q.codes.data<uint8_t>(), q.block_scales.data<uint8_t>(),
      q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr, q.outer, q.rows, map, meta, m, codec,
      payload);
  FOURBIT_LAUNCH_CHECK();
}

void decode_rows(const uint8_t* payload, int64_t m, RowIndex map, const RowCodec& codec, float* out) {
  if (m == 0) return;
  decode_rows_kernel<<<grid_for(m * codec.chunks(), kThreads), kThreads, 0, stream()>>>(payload, m, map, codec, out);
  FOURBIT_LAUNCH_CHECK();
}

void unpack_rows(const uint8_t* payload, int64_t m, RowIndex map, const RowCodec& codec, QTensor& out) {
  if (m == 0) return;
  unpack_rows_kernel<<<grid_for(m, kWarpsPerBlock), kThreads, 0, stream()>>>(
      payload, m, map, codec, out.codes.data<uint8_t>(), out.block_scales.data<uint8_t>(),
      out.outer_scales.defined() ? out.outer_scales.data<float>() : nullptr);
  FOURBIT_LAUNCH_CHECK();
}

void read_meta(const uint8_t* payload, int64_t m, int64_t row_bytes, RowIndex map, int32_t* meta) {
  if (m == 0) return;
  read_meta_kernel<<<grid_for(m, kThreads), kThreads, 0, stream()>>>(payload, m, row_bytes, map, meta);
  FOURBIT_LAUNCH_CHECK();
}

void fold_rank_chunks(const void* chunks, int ranks, int64_t n, int64_t stride, DType dtype, void* out, void* s) {
  if (n == 0) return;
  cudaStream_t st = static_cast<cudaStream_t>(s);
  if (dtype == DType::F64)
    fold_kernel<<<grid_for(n, kThreads), kThreads, 0, st>>>(static_cast<const double*>(chunks), ranks, n, stride,
                                                             static_cast<double*>(out));
  else
    fold_kernel<<<grid_for(n, kThreads), kThreads, 0, st>>>(static_cast<const float*>(chunks), ranks, n, stride,
                                                             static_cast<float*>(out));
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace fourbit::dist::cuda
