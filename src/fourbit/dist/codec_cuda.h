// defines: cuda::slot_meta, cuda::encode_rows, cuda::pack_rows, cuda::decode_rows, cuda::unpack_rows,
//          cuda::read_meta, cuda::fold_rank_chunks
// The CUDA side of codec.h (codec.cu) and the ordered reduction the NCCL all-reduce folds with.
// Plain C++: codec.cpp, compiled by the host compiler, includes it. Arguments are checked by the
// callers in codec.cpp; kernels run on ops' current stream (the default stream or a GPU lane).
#pragma once
#include <cstdint>

#include "fourbit/dist/payload.h"
#include "fourbit/tensor/qtensor.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::dist::cuda {

// meta[slot_of[n, j]] = (n, topk_idx[n, j], j) for N x k assignments.
void slot_meta(const int32_t* slot_of, const int32_t* topk_idx, int64_t n, int64_t k, int32_t* meta);
void encode_rows(const float* x, int64_t x_rows, RowIndex map, const int32_t* meta, int64_t m,
                 const RowCodec& codec, uint8_t* payload);
void pack_rows(const QTensor& q, RowIndex map, const int32_t* meta, int64_t m, const RowCodec& codec,
               uint8_t* payload);
void decode_rows(const uint8_t* payload, int64_t m, RowIndex map, const RowCodec& codec, float* out);
void unpack_rows(const uint8_t* payload, int64_t m, RowIndex map, const RowCodec& codec, QTensor& out);
void read_meta(const uint8_t* payload, int64_t m, int64_t row_bytes, RowIndex map, int32_t* meta);

// out[i] = ((chunk_0[i] + chunk_1[i]) + chunk_2[i]) + ... over `ranks` chunks of n values, chunk r
// starting `stride` elements after chunk r - 1 (F32 or F64 by dtype), on `stream`: the fixed-order
// sum of the NCCL communicator's all-reduce, the CPU's left fold.
void fold_rank_chunks(const void* chunks, int ranks, int64_t n, int64_t stride, DType dtype, void* out, void* stream);

}  // namespace fourbit::dist::cuda
