// defines: RowMap, check_codec, slot_meta, encode_rows, pack_rows, decode_rows, unpack_rows, read_meta,
//          first_meta_mismatch (codec.h): argument checks, the CPU loops, the CUDA dispatch
// Every loop body is a payload.h function, which the CUDA kernels call too. Checks run before any
// OpenMP region (an exception must never leave one).
#include "fourbit/dist/codec.h"

#include <cstring>

#include "fourbit/tensor/error.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/dist/codec_cuda.h"
#endif

namespace fourbit::ops {
void raise_nonfinite();  // ops.cpp: the process-wide sticky flag the trainer reads each step
}  // namespace fourbit::ops

namespace fourbit::dist {
namespace {

bool on_cuda(const Tensor& t) { return t.device() == Device::CUDA; }

#if !FOURBIT_HAS_CUDA
[[noreturn]] void no_cuda(const char* op) {
  fail("{}: tensors are on a CUDA device but this fourbit was built without CUDA", op);
}
#endif

void expect(const char* op, const char* name, const Tensor& t, DType dt, int64_t ndim, Device dev) {
  if (!t.defined()) fail("{}: {} is undefined", op, name);
  if (t.dtype() != dt || t.dim() != ndim || t.device() != dev)
    fail("{}: {} must be a {}-D {} {} tensor, got {}", op, name, ndim, dtype_name(dt), device_name(dev), t.str());
}

void expect_meta(const char* op, const Tensor& meta, Device dev) {
  expect(op, "meta", meta, DType::I32, 2, dev);
  if (meta.size(1) != 3) fail("{}: meta must be i32[M, 3] (token, expert, k), got {}", op, meta.str());
}

void expect_payload(const char* op, const Tensor& payload, const RowCodec& codec) {
  expect(op, "payload", payload, DType::U8, 2, payload.device());
  if (payload.size(1) != codec.row_bytes())
    fail("{}: payload rows are {} bytes, but a {} row of {} values takes {}", op, payload.size(1),
         format_name(codec.fmt), codec.cols, codec.row_bytes());
}

// Host-side range check of a map over m payload rows into `rows` other rows (CPU maps; the GPU's
// are built by this file or by route_plan, which range-checks its own output).
void check_map(const char* op, const RowMap& map, int64_t m, int64_t rows) {
  if (map.index().defined() && map.index().size(0) != m)
    fail("{}: the row index has {} entries for {} payload rows", op, map.index().size(0), m);
  if (map.index().defined() && on_cuda(map.index())) return;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = map.at_host(i);
    if (r < 0 || r >= rows) fail("{}: payload row {} maps to row {}, outside [0, {})", op, i, r, rows);
  }
}

}  // namespace

// ---- RowMap ---------------------------------------------------------------------------------------

RowMap RowMap::gather(const Tensor& index) {
  if (!index.defined() || index.dtype() != DType::I32 || index.dim() != 1)
    fail("RowMap::gather: the index must be i32[M], got {}", index.defined() ? index.str() : "undefined");
  RowMap m;
  m.index_ = index;
  return m;
}

RowMap RowMap::segments(const std::vector<int64_t>& payload_offsets, const std::vector<int64_t>& other_starts,
                        Device device) {
  const size_t S = other_starts.size();
  if (payload_offsets.size() != S + 1 || payload_offsets.front() != 0)
    fail("RowMap::segments: {} segments need {} payload offsets from 0, got {}", S, S + 1, payload_offsets.size());
  for (size_t s = 0; s < S; ++s)
    if (payload_offsets[s + 1] < payload_offsets[s]) fail("RowMap::segments: payload offsets decrease at {}", s);
  RowMap m;
  m.nseg_ = int(S);
  m.host_table_ = payload_offsets;
  m.host_table_.insert(m.host_table_.end(), other_starts.begin(), other_starts.end());
  m.table_ = Tensor::from_host(m.host_table_.data(), {int64_t(m.host_table_.size())}, DType::I64, device);
  return m;
}

RowIndex RowMap::view() const {
  RowIndex v;
  if (index_.defined()) v.index = index_.data<int32_t>();
  if (table_.defined()) {
    v.table = table_.data<int64_t>();
    v.nseg = nseg_;
  }
  return v;
}

int64_t RowMap::at_host(int64_t i) const {
  if (index_.defined()) {
    FOURBIT_CHECK(!on_cuda(index_), "RowMap::at_host on a CUDA index");
    return index_.data<int32_t>()[i];
  }
  if (!table_.defined()) return i;
  RowIndex v;
  v.table = host_table_.data();
  v.nseg = nseg_;
  return v.at(i);
}

// ---- checks ---------------------------------------------------------------------------------------

void check_codec(const RowCodec& c, const char* what) {
  const bool payload_format = c.fmt == Format::F32 || c.fmt == Format::BF16 || c.fmt == Format::NVFP4 ||
                              c.fmt == Format::MXFP8_E4M3 || c.fmt == Format::MXFP8_E5M2 || c.fmt == Format::S2F6;
  if (!payload_format)
    fail("{}: {} rows cannot travel (payload formats: fp32, bf16, nvfp4, mxfp8-e4m3, mxfp8-e5m2, s2f6)", what,
         format_name(c.fmt));
  if (c.cols <= 0) fail("{}: a payload row needs at least one value, got cols = {}", what, c.cols);
  if (c.hadamard != 0 && !(c.hadamard == 32 && c.fmt == Format::S2F6))
    fail("{}: an RHT of size {} on {} rows; payloads take RHT-32 on s2f6 only", what, c.hadamard, format_name(c.fmt));
}

// ---- slot metadata ----------------------------------------------------------------------------------

Tensor slot_meta(const ops::RoutePlan& plan, const Tensor& topk_idx) {
  const char* op = "slot_meta";
  const Device dev = topk_idx.device();
  expect(op, "topk_idx", topk_idx, DType::I32, 2, dev);
  expect(op, "plan.slot_of", plan.slot_of, DType::I32, 2, dev);
  if (plan.slot_of.shape() != topk_idx.shape())
    fail("{}: slot_of {} and topk_idx {} differ in shape", op, plan.slot_of.str(), topk_idx.str());
  const int64_t N = topk_idx.size(0), K = topk_idx.size(1);
  if (K > 256) fail("{}: top-k of {} does not fit the payload's 8-bit k", op, K);
  Tensor meta = Tensor::empty({N * K, 3}, DType::I32, dev);
  if (on_cuda(topk_idx)) {
#if FOURBIT_HAS_CUDA
    cuda::slot_meta(plan.slot_of.data<int32_t>(), topk_idx.data<int32_t>(), N, K, meta.data<int32_t>());
    return meta;
#else
    no_cuda(op);
#endif
  }
  const int32_t* slot = plan.slot_of.data<int32_t>();
  const int32_t* idx = topk_idx.data<int32_t>();
  int32_t* m = meta.data<int32_t>();
  for (int64_t i = 0; i < N * K; ++i) {
    if (slot[i] < 0 || slot[i] >= N * K) fail("{}: slot_of[{}] = {} is outside [0, {})", op, i, slot[i], N * K);
    if (idx[i] < 0 || idx[i] > 0xFFFF) fail("{}: expert {} does not fit the payload's 16-bit expert", op, idx[i]);
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < K; ++j) {
      int32_t* row = m + 3 * int64_t(slot[n * K + j]);
      row[0] = int32_t(n);
      row[1] = idx[n * K + j];
      row[2] = int32_t(j);
    }
  return meta;
}

// ---- encode / pack ----------------------------------------------------------------------------------

Tensor encode_rows(const Tensor& x, const RowMap& map, const Tensor& meta, const RowCodec& codec) {
  const char* op = "encode_rows";
  check_codec(codec, op);
  if (!codec.encodes_dense()) fail("{}: {} rows are packed from QTensors (pack_rows), not encoded", op, format_name(codec.fmt));
  const Device dev = x.device();
  expect(op, "x", x, DType::F32, 2, dev);
  expect_meta(op, meta, dev);
  if (x.size(1) != codec.cols) fail("{}: x has {} columns, the codec {}", op, x.size(1), codec.cols);
  const int64_t M = meta.size(0), R = x.size(0), RB = codec.row_bytes();
  check_map(op, map, M, R);
  Tensor payload = Tensor::empty({M, RB}, DType::U8, dev);
  if (on_cuda(x)) {
#if FOURBIT_HAS_CUDA
    cuda::encode_rows(x.data<float>(), R, map.view(), meta.data<int32_t>(), M, codec, payload.data<uint8_t>());
    return payload;
#else
    no_cuda(op);
#endif
  }
  const float* xs = x.data<float>();
  const int32_t* ms = meta.data<int32_t>();
  uint8_t* out = payload.data<uint8_t>();
  const RowIndex idx = map.view();
  const int64_t C = codec.chunks();
  int64_t nonfinite = 0;
#pragma omp parallel for schedule(static) reduction(+ : nonfinite)
  for (int64_t i = 0; i < M; ++i) {
    uint8_t* row = out + i * RB;
    std::memset(row, 0, size_t(RB));
    write_row_header(row, RowMeta{ms[3 * i], ms[3 * i + 1], ms[3 * i + 2]}, 0.0f);
    const float* xr = xs + idx.at(i) * codec.cols;
    for (int64_t c = 0; c < C; ++c) encode_payload_chunk(codec, xr, c, row);
    for (int64_t j = 0; j < codec.cols; ++j) nonfinite += num::is_finite_bits(xr[j]) ? 0 : 1;
  }
  // F32/BF16 rows carry NaN/Inf as they are; the quantized ones decode them to NaN. Either way the
  // sticky flag says a non-finite value travelled, as every quantizer does (NUMERICS).
  if (nonfinite) ops::raise_nonfinite();
  return payload;
}

Tensor pack_rows(const QTensor& q, const RowMap& map, const Tensor& meta, const RowCodec& codec) {
  const char* op = "pack_rows";
  check_codec(codec, op);
  if (!codec.packs_qtensor()) fail("{}: {} rows are encoded from float32 (encode_rows), not packed", op, format_name(codec.fmt));
  if (q.fmt != codec.fmt || q.cols != codec.cols)
    fail("{}: a {} QTensor of {} columns cannot fill {} rows of {} values", op, format_name(q.fmt), q.cols,
         format_name(codec.fmt), codec.cols);
  if (q.axis != BlockAxis::Row || q.slices != 1 || q.hadamard != 0 || q.tile_2d)
    fail("{}: only a one-slice Row-axis QTensor without RHT or 16x16 tiles packs row by row", op);
  const Device dev = q.device();
  expect_meta(op, meta, dev);
  if (q.fmt == Format::NVFP4 && !q.outer_scales.defined()) fail("{}: an NVFP4 QTensor without outer scales", op);
  const int64_t M = meta.size(0), RB = codec.row_bytes();
  check_map(op, map, M, q.rows);
  Tensor payload = Tensor::empty({M, RB}, DType::U8, dev);
  if (on_cuda(q.codes)) {
#if FOURBIT_HAS_CUDA
    cuda::pack_rows(q, map.view(), meta.data<int32_t>(), M, codec, payload.data<uint8_t>());
    return payload;
#else
    no_cuda(op);
#endif
  }
  const uint8_t* codes = q.codes.data<uint8_t>();
  const uint8_t* scales = q.block_scales.data<uint8_t>();
  const float* outer = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  const int32_t* ms = meta.data<int32_t>();
  uint8_t* out = payload.data<uint8_t>();
  const RowIndex idx = map.view();
  const int64_t CB = codec.code_bytes(), SB = codec.scale_bytes();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    uint8_t* row = out + i * RB;
    std::memset(row, 0, size_t(RB));
    const int64_t r = idx.at(i);
    write_row_header(row, RowMeta{ms[3 * i], ms[3 * i + 1], ms[3 * i + 2]},
                     outer ? outer[q.outer_index(r)] : 0.0f);
    std::memcpy(row + kRowHeaderBytes, codes + r * CB, size_t(CB));
    std::memcpy(row + kRowHeaderBytes + CB, scales + r * SB, size_t(SB));
  }
  return payload;
}

// ---- decode / unpack --------------------------------------------------------------------------------

void decode_rows(const Tensor& payload, const RowMap& map, const RowCodec& codec, Tensor& out) {
  const char* op = "decode_rows";
  check_codec(codec, op);
  if (!codec.encodes_dense()) fail("{}: {} rows are unpacked into QTensors (unpack_rows)", op, format_name(codec.fmt));
  expect_payload(op, payload, codec);
  const Device dev = payload.device();
  expect(op, "out", out, DType::F32, 2, dev);
  if (out.size(1) != codec.cols) fail("{}: out has {} columns, the codec {}", op, out.size(1), codec.cols);
  const int64_t M = payload.size(0), RB = codec.row_bytes();
  check_map(op, map, M, out.size(0));
  if (on_cuda(payload)) {
#if FOURBIT_HAS_CUDA
    cuda::decode_rows(payload.data<uint8_t>(), M, map.view(), codec, out.data<float>());
    return;
#else
    no_cuda(op);
#endif
  }
  const uint8_t* in = payload.data<uint8_t>();
  float* o = out.data<float>();
  const RowIndex idx = map.view();
  const int64_t C = codec.chunks();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    float* orow = o + idx.at(i) * codec.cols;
    for (int64_t c = 0; c < C; ++c) decode_payload_chunk(codec, in + i * RB, c, orow);
  }
}

QTensor unpack_rows(const Tensor& payload, const RowMap& map, const RowCodec& codec, int64_t rows) {
  const char* op = "unpack_rows";
  check_codec(codec, op);
  if (!codec.packs_qtensor()) fail("{}: {} rows decode to float32 (decode_rows)", op, format_name(codec.fmt));
  expect_payload(op, payload, codec);
  const Device dev = payload.device();
  const int64_t M = payload.size(0), RB = codec.row_bytes(), CB = codec.code_bytes(), SB = codec.scale_bytes();
  if (M != rows) fail("{}: {} payload rows cannot fill a QTensor of {} rows (every row must be mapped to)", op, M, rows);
  check_map(op, map, M, rows);
  QTensor q;
  q.fmt = codec.fmt;
  q.axis = BlockAxis::Row;
  q.slices = 1;
  q.rows = rows;
  q.cols = codec.cols;
  q.outer = codec.fmt == Format::NVFP4 ? OuterScale::PerRow : OuterScale::None;
  q.codes = Tensor::empty({rows, CB}, DType::U8, dev);
  q.block_scales = Tensor::empty({rows, SB}, DType::U8, dev);
  if (q.outer == OuterScale::PerRow) q.outer_scales = Tensor::empty({rows}, DType::F32, dev);
  if (on_cuda(payload)) {
#if FOURBIT_HAS_CUDA
    cuda::unpack_rows(payload.data<uint8_t>(), M, map.view(), codec, q);
    return q;
#else
    no_cuda(op);
#endif
  }
  const uint8_t* in = payload.data<uint8_t>();
  uint8_t* codes = q.codes.data<uint8_t>();
  uint8_t* scales = q.block_scales.data<uint8_t>();
  float* outer = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  const RowIndex idx = map.view();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) {
    const uint8_t* row = in + i * RB;
    const int64_t r = idx.at(i);
    std::memcpy(codes + r * CB, row + kRowHeaderBytes, size_t(CB));
    std::memcpy(scales + r * SB, row + kRowHeaderBytes + CB, size_t(SB));
    if (outer) outer[r] = read_row_outer(row);
  }
  return q;
}

Tensor read_meta(const Tensor& payload, const RowMap& map, int64_t rows) {
  const char* op = "read_meta";
  expect(op, "payload", payload, DType::U8, 2, payload.device());
  if (payload.size(1) < kRowHeaderBytes) fail("{}: payload rows of {} bytes hold no header", op, payload.size(1));
  const int64_t M = payload.size(0), RB = payload.size(1);
  check_map(op, map, M, rows);
  Tensor meta = Tensor::zeros({rows, 3}, DType::I32, payload.device());
  if (on_cuda(payload)) {
#if FOURBIT_HAS_CUDA
    cuda::read_meta(payload.data<uint8_t>(), M, RB, map.view(), meta.data<int32_t>());
    return meta;
#else
    no_cuda(op);
#endif
  }
  const uint8_t* in = payload.data<uint8_t>();
  int32_t* m = meta.data<int32_t>();
  const RowIndex idx = map.view();
  for (int64_t i = 0; i < M; ++i) {
    const RowMeta r = read_row_header(in + i * RB);
    int32_t* o = m + 3 * idx.at(i);
    o[0] = r.token;
    o[1] = r.expert;
    o[2] = r.k;
  }
  return meta;
}

int64_t first_meta_mismatch(const Tensor& got, const Tensor& expected) {
  if (got.shape() != expected.shape() || got.dtype() != DType::I32 || expected.dtype() != DType::I32)
    fail("first_meta_mismatch: {} and {} are not two i32[M, 3] metadata tensors", got.str(), expected.str());
  const Tensor a = got.to(Device::CPU), b = expected.to(Device::CPU);
  const int32_t* pa = a.data<int32_t>();
  const int32_t* pb = b.data<int32_t>();
  for (int64_t i = 0; i < a.size(0); ++i)
    if (pa[3 * i] != pb[3 * i] || pa[3 * i + 1] != pb[3 * i + 1] || pa[3 * i + 2] != pb[3 * i + 2]) return i;
  return -1;
}

}  // namespace fourbit::dist
