// defines: RowMap, check_codec, slot_meta, encode_rows, pack_rows, decode_rows, unpack_rows, read_meta,
//          first_meta_mismatch
// Payload rows as tensors: U8 [rows, codec.row_bytes()] on the CPU or a GPU (layout: payload.h).
// Every function runs on the device of its tensors; the CUDA kernels (codec.cu) write the same
// bytes as the CPU loops (codec.cpp), both through payload.h's chunk functions. Non-finite values
// travel as NaN (payload.h), never as a finite code.
#pragma once
#include <cstdint>
#include <vector>

#include "fourbit/dist/payload.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/qtensor.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::dist {

// Which row of the other side (a float32 tensor or a QTensor) each payload row is: the identity,
// an explicit I32 index, or segments of consecutive rows (payload.h RowIndex).
class RowMap {
 public:
  RowMap() = default;  // the identity
  static RowMap gather(const Tensor& index);  // I32 [M]: payload row i <-> other row index[i]
  // Payload rows [payload_offsets[s], payload_offsets[s + 1]) <-> other rows other_starts[s] + j.
  static RowMap segments(const std::vector<int64_t>& payload_offsets, const std::vector<int64_t>& other_starts,
                         Device device);
  RowIndex view() const;
  int64_t at_host(int64_t i) const;  // the same mapping, on the host (CPU maps only for an index)
  bool is_identity() const { return !index_.defined() && !table_.defined(); }
  const Tensor& index() const { return index_; }

 private:
  Tensor index_;  // I32 [M]
  Tensor table_;  // I64 [2 S + 1] (RowIndex::table)
  std::vector<int64_t> host_table_;
  int nseg_ = 0;
};

// Fails (naming `what`) unless rows of this codec can travel: a payload format (F32, BF16, NVFP4,
// MXFP8 E4M3/E5M2, S2F6), cols > 0, an RHT only on S2F6 and only of size 32.
void check_codec(const RowCodec& codec, const char* what);

// The routing metadata of every slot of a route plan, in slot order: I32 [N * k, 3] holding
// (token, expert, k) on topk_idx's device (plan.slot_of's rows are tokens, its columns k).
Tensor slot_meta(const ops::RoutePlan& plan, const Tensor& topk_idx);

// Payload row i = the encoding of x's row map(i) with header meta row i. x: F32 [R, codec.cols];
// meta: I32 [M, 3]; returns U8 [M, codec.row_bytes()]. Formats that encode from float32.
Tensor encode_rows(const Tensor& x, const RowMap& map, const Tensor& meta, const RowCodec& codec);

// Payload row i = the codes, block scales and outer scale of q's storage row map(i), verbatim,
// with header meta row i. q: a one-slice Row-axis NVFP4/MXFP8 QTensor of codec's format and cols.
Tensor pack_rows(const QTensor& q, const RowMap& map, const Tensor& meta, const RowCodec& codec);

// out row map(i) = the decoding of payload row i (every format but NVFP4). out: F32 [R, cols];
// rows no payload row maps to are left as they were.
void decode_rows(const Tensor& payload, const RowMap& map, const RowCodec& codec, Tensor& out);

// A one-slice Row-axis QTensor of `rows` rows whose row map(i) is payload row i (NVFP4 with
// per-row outer scales, each the row's own S_dec; MXFP8 without). Every row must be mapped to.
QTensor unpack_rows(const Tensor& payload, const RowMap& map, const RowCodec& codec, int64_t rows);

// The header metadata of payload row i at row map(i): I32 [rows, 3].
Tensor read_meta(const Tensor& payload, const RowMap& map, int64_t rows);

// The first row where two I32 [M, 3] metadata tensors differ, or -1 (copies to the host).
int64_t first_meta_mismatch(const Tensor& got, const Tensor& expected);

}  // namespace fourbit::dist
