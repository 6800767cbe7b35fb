// defines: moe_codecs, payload_rht_signs, ExpertParallel (expert_parallel.h)
#include "fourbit/dist/expert_parallel.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "fourbit/numerics/hadamard.h"

namespace fourbit::dist {
namespace {

// A payload format for rows a dense recipe keeps dense.
Format dense_payload(Format f, const char* what) {
  if (f == Format::F32 || f == Format::BF16) return f;
  fail("moe_codecs: {} has no dense payload for {} operands (fp32 or bf16)", what, format_name(f));
}

bool env_verify() {
  const char* v = std::getenv("FOURBIT_DIST_VERIFY");
  return v && std::string(v) == "1";
}

}  // namespace

MoeCodecs moe_codecs(const QuantSpec& fprop_a, const QuantSpec& dgrad_a, Format combine_fmt, int64_t d_model,
                     uint32_t combine_signs, uint32_t grad_combine_signs) {
  MoeCodecs c;
  // dispatch: the fprop operand's own rows when they are per-row (NVFP4 / MXFP8 Row-axis blocks
  // with per-token or no outer scale); a per-tensor NVFP4 scale depends on the whole batch, so such
  // rows travel as BF16 and the expert quantizes them (nvidia-nvfp4).
  c.dispatch.cols = d_model;
  const bool per_row_nvfp4 = fprop_a.fmt == Format::NVFP4 && fprop_a.outer == OuterScale::PerRow &&
                             fprop_a.hadamard == 0 && !fprop_a.tile_2d;
  const bool mx = fprop_a.fmt == Format::MXFP8_E4M3 || fprop_a.fmt == Format::MXFP8_E5M2;
  if (per_row_nvfp4 || (mx && fprop_a.hadamard == 0)) c.dispatch.fmt = fprop_a.fmt;
  else if (fprop_a.quantized()) c.dispatch.fmt = Format::BF16;
  else c.dispatch.fmt = dense_payload(fprop_a.fmt, "the expert fprop A");

  // dY: MXFP8 rows (RNE, RCEIL, per 32 values: per row) are what the dgrad GEMM consumes; other
  // quantized dY specs (SR, whose bits follow the element's place in the batch; NVFP4 with a
  // tensor scale) are applied by the expert to BF16 rows.
  c.grad_dispatch.cols = d_model;
  const bool mx_dy = dgrad_a.fmt == Format::MXFP8_E4M3 || dgrad_a.fmt == Format::MXFP8_E5M2;
  if (mx_dy && dgrad_a.rounding == num::Rounding::RNE && dgrad_a.hadamard == 0) {
    c.grad_dispatch.fmt = dgrad_a.fmt;
  } else if (dgrad_a.quantized()) {
    c.grad_dispatch.fmt = Format::BF16;
  } else {
    c.grad_dispatch.fmt = dense_payload(dgrad_a.fmt, "the expert dgrad A");
  }

  if (combine_fmt != Format::S2F6 && combine_fmt != Format::BF16 && combine_fmt != Format::F32)
    fail("moe_codecs: expert outputs combine in s2f6, bf16 or fp32, not {}", format_name(combine_fmt));
  c.combine = RowCodec{combine_fmt, d_model, combine_fmt == Format::S2F6 ? 32 : 0,
                       combine_fmt == Format::S2F6 ? combine_signs : 0u};
  c.grad_combine = RowCodec{combine_fmt, d_model, combine_fmt == Format::S2F6 ? 32 : 0,
                            combine_fmt == Format::S2F6 ? grad_combine_signs : 0u};
  check_codec(c.dispatch, "moe_codecs (dispatch)");
  check_codec(c.grad_dispatch, "moe_codecs (dY)");
  check_codec(c.combine, "moe_codecs (combine)");
  return c;
}

uint32_t payload_rht_signs(uint64_t seed, int64_t layer, bool grad) {
  // A stream far from the SR streams' mixed keys: a fixed tag, the layer and the direction.
  const uint64_t stream = 0xC0B1'4E00'0000'0000ull | (uint64_t(layer) << 1) | (grad ? 1u : 0u);
  return num::rht_signs(seed, stream, 32);
}

// ---- ExpertParallel -------------------------------------------------------------------------------

ExpertParallel::ExpertParallel(Communicator& comm, int64_t n_experts)
    : ExpertParallel(comm, n_experts, env_verify()) {
  if (!env_verify()) verify_ = Verify::Auto;
}

ExpertParallel::ExpertParallel(Communicator& comm, int64_t n_experts, bool verify_metadata)
    : comm_(comm), verify_(verify_metadata ? Verify::Always : Verify::Never) {
  if (n_experts < 1 || n_experts % comm.size())
    fail("expert parallel: {} experts do not split evenly over ep = {} ranks (n_experts % ep must be 0)", n_experts,
         comm.size());
  if (n_experts > 0x10000) fail("expert parallel: {} experts exceed the payload's 16-bit expert index", n_experts);
  shard_ = ExpertShard{n_experts, comm.size(), comm.rank()};
}

ExchangePlan ExpertParallel::plan(const ops::RoutePlan& route, const Tensor& topk_idx) {
  const int ep = shard_.ep;
  const int64_t E = shard_.n_experts, L = shard_.per_rank();
  if (int64_t(route.offsets.size()) != E + 1)
    fail("expert parallel plan: the route plan has {} offsets for {} experts", route.offsets.size(), E);
  ExchangePlan p;
  p.shard = shard_;
  p.slots = route.offsets.back();
  p.token_of_slot = route.token_of_slot;
  p.slot_meta = slot_meta(route, topk_idx);

  // counts this rank sends: for destination d, its experts' slot counts (the slot order is
  // expert-major, so they are one contiguous run per destination)
  std::vector<int64_t> send_counts(size_t(ep * L));
  p.send_rows.assign(size_t(ep), 0);
  for (int d = 0; d < ep; ++d)
    for (int64_t e = 0; e < L; ++e) {
      const int64_t g = int64_t(d) * L + e;
      send_counts[size_t(d * L + e)] = route.offsets[size_t(g + 1)] - route.offsets[size_t(g)];
      p.send_rows[size_t(d)] += send_counts[size_t(d * L + e)];
    }
  p.counts = all_to_all_counts(comm_, send_counts, L);
  p.recv_rows.assign(size_t(ep), 0);
  for (int s = 0; s < ep; ++s)
    for (int64_t e = 0; e < L; ++e) {
      const int64_t c = p.counts[size_t(s * L + e)];
      if (c < 0) fail("expert parallel plan: rank {} announced {} rows for expert {}", s, c, shard_.first() + e);
      p.recv_rows[size_t(s)] += c;
    }

  // expert-major layout: expert e's rows from source 0, then source 1, ...
  p.expert_offsets.assign(size_t(L + 1), 0);
  p.segment_offsets.assign(size_t(L * ep + 1), 0);
  for (int64_t e = 0; e < L; ++e)
    for (int s = 0; s < ep; ++s) {
      const int64_t seg = e * ep + s;
      p.segment_offsets[size_t(seg + 1)] = p.segment_offsets[size_t(seg)] + p.counts[size_t(s * L + e)];
    }
  for (int64_t e = 0; e <= L; ++e) p.expert_offsets[size_t(e)] = p.segment_offsets[size_t(e * ep)];

  // received rows arrive source-major: source s's rows for expert 0, expert 1, ...
  std::vector<int64_t> payload_offsets(size_t(ep * L + 1), 0), other_starts(size_t(ep * L));
  for (int s = 0; s < ep; ++s)
    for (int64_t e = 0; e < L; ++e) {
      const int64_t i = int64_t(s) * L + e;
      payload_offsets[size_t(i + 1)] = payload_offsets[size_t(i)] + p.counts[size_t(i)];
      other_starts[size_t(i)] = p.segment_offsets[size_t(e * ep + s)];
    }
  if (ep > 1) p.to_expert_rows = RowMap::segments(payload_offsets, other_starts, topk_idx.device());
  return p;
}

// ---- the byte exchanges -----------------------------------------------------------------------------

Tensor ExpertParallel::to_experts(const ExchangePlan& plan, const Tensor& payload, int64_t row_bytes) {
  if (shard_.ep == 1) return payload;  // a group of one: the rows are already where they go
  std::vector<int64_t> send(size_t(shard_.ep)), recv(size_t(shard_.ep));
  for (int p = 0; p < shard_.ep; ++p) {
    send[size_t(p)] = plan.send_rows[size_t(p)] * row_bytes;
    recv[size_t(p)] = plan.recv_rows[size_t(p)] * row_bytes;
  }
  Tensor out = Tensor::empty({plan.expert_rows(), row_bytes}, DType::U8, payload.device());
  comm_.all_to_all_v(payload, send, out, recv);
  return out;
}

Tensor ExpertParallel::to_sources(const ExchangePlan& plan, const Tensor& payload, int64_t row_bytes) {
  if (shard_.ep == 1) return payload;
  std::vector<int64_t> send(size_t(shard_.ep)), recv(size_t(shard_.ep));
  for (int p = 0; p < shard_.ep; ++p) {
    send[size_t(p)] = plan.recv_rows[size_t(p)] * row_bytes;
    recv[size_t(p)] = plan.send_rows[size_t(p)] * row_bytes;
  }
  Tensor out = Tensor::empty({plan.slots, row_bytes}, DType::U8, payload.device());
  comm_.all_to_all_v(payload, send, out, recv);
  return out;
}

// Rows of expert-major segment (e, s) must name local expert e and come in ascending token order.
bool ExpertParallel::verifies(const Tensor& t) const {
  return verify_ == Verify::Always || (verify_ == Verify::Auto && t.device() == Device::CPU);
}

void ExpertParallel::verify_arrival(const ExchangePlan& plan, const Tensor& recv_meta) const {
  if (!verifies(recv_meta)) return;
  const Tensor got = recv_meta.to(Device::CPU);
  std::vector<int32_t> m(size_t(3 * plan.expert_rows()));
  for (int64_t i = 0; i < plan.expert_rows(); ++i)
    std::memcpy(&m[size_t(3 * plan.to_expert_rows.at_host(i))], got.data<int32_t>() + 3 * i, 3 * sizeof(int32_t));
  for (int64_t seg = 0; seg + 1 < int64_t(plan.segment_offsets.size()); ++seg) {
    const int64_t expert = plan.segment_expert(seg);
    for (int64_t r = plan.segment_offsets[size_t(seg)]; r < plan.segment_offsets[size_t(seg + 1)]; ++r) {
      const bool ordered = r == plan.segment_offsets[size_t(seg)] || m[3 * r] > m[3 * (r - 1)];
      if (m[3 * r + 1] != expert || !ordered)
        throw DistError(fmt::format(
            "rank {}: dispatch: row {} from rank {} carries token {} for expert {} (k {}), expected expert {} "
            "with tokens ascending: the payload is not what the plan announced",
            shard_.rank, r, plan.segment_source(seg), m[3 * r], m[3 * r + 1], m[3 * r + 2], expert));
    }
  }
}

void ExpertParallel::verify_echo(const Tensor& got, const Tensor& expected, const char* what) const {
  if (!verifies(got)) return;
  const int64_t bad = first_meta_mismatch(got, expected);
  if (bad >= 0) {
    const Tensor g = got.to(Device::CPU), e = expected.to(Device::CPU);
    const int32_t* pg = g.data<int32_t>();
    const int32_t* pe = e.data<int32_t>();
    throw DistError(fmt::format("rank {}: {}: row {} came back as (token {}, expert {}, k {}), sent as (token {}, "
                                "expert {}, k {})",
                                shard_.rank, what, bad, pg[3 * bad], pg[3 * bad + 1], pg[3 * bad + 2], pe[3 * bad],
                                pe[3 * bad + 1], pe[3 * bad + 2]));
  }
}

// ---- the four flows -----------------------------------------------------------------------------------

ExpertRows ExpertParallel::dispatch(ExchangePlan& plan, const QTensor& x, const RowCodec& codec) {
  // A group of one keeps its rows: gathering them by slot gives the bytes packing and unpacking
  // would (QTensors whose rows carry their own scales; any other goes the long way, which checks it).
  const bool own_scales = x.axis == BlockAxis::Row && x.slices == 1 && x.hadamard == 0 && !x.tile_2d &&
                          codec.packs_qtensor() && x.fmt == codec.fmt && x.cols == codec.cols &&
                          ((x.fmt == Format::NVFP4 && x.outer == OuterScale::PerRow) ||
                           (x.fmt != Format::NVFP4 && x.outer == OuterScale::None));
  if (shard_.ep == 1 && own_scales) {
    check_codec(codec, "expert parallel dispatch");
    plan.recv_meta = plan.slot_meta;
    ExpertRows rows;
    rows.q = ops::gather_rows(x, plan.token_of_slot);
    return rows;
  }
  const Tensor payload = pack_rows(x, RowMap::gather(plan.token_of_slot), plan.slot_meta, codec);
  const Tensor recv = to_experts(plan, payload, codec.row_bytes());
  plan.recv_meta = read_meta(recv, RowMap(), plan.expert_rows());
  verify_arrival(plan, plan.recv_meta);
  ExpertRows rows;
  rows.q = unpack_rows(recv, plan.to_expert_rows, codec, plan.expert_rows());
  return rows;
}

ExpertRows ExpertParallel::dispatch(ExchangePlan& plan, const Tensor& x, const RowCodec& codec) {
  const Tensor payload = encode_rows(x, RowMap::gather(plan.token_of_slot), plan.slot_meta, codec);
  const Tensor recv = to_experts(plan, payload, codec.row_bytes());
  plan.recv_meta = read_meta(recv, RowMap(), plan.expert_rows());
  verify_arrival(plan, plan.recv_meta);
  ExpertRows rows;
  rows.dense = Tensor::empty({plan.expert_rows(), codec.cols}, DType::F32, x.device());
  decode_rows(recv, plan.to_expert_rows, codec, rows.dense);
  return rows;
}

Tensor decode_slots(const Tensor& received, const RowCodec& codec) {
  Tensor out = Tensor::empty({received.size(0), codec.cols}, DType::F32, received.device());
  decode_rows(received, RowMap(), codec, out);
  return out;
}

Tensor ExpertParallel::combine(const ExchangePlan& plan, const Tensor& y, const RowCodec& codec, Tensor* received) {
  if (!plan.recv_meta.defined()) fail("expert parallel combine: the plan has not dispatched yet");
  if (y.dim() != 2 || y.size(0) != plan.expert_rows())
    fail("expert parallel combine: y must hold the {} expert rows, got {}", plan.expert_rows(), y.str());
  // Each row goes back with the metadata it arrived with, which its source checks.
  const Tensor payload = encode_rows(y, plan.to_expert_rows, plan.recv_meta, codec);
  const Tensor recv = to_sources(plan, payload, codec.row_bytes());
  if (verifies(recv)) verify_echo(read_meta(recv, RowMap(), plan.slots), plan.slot_meta, "combine");
  if (received) *received = recv;
  return decode_slots(recv, codec);
}

Tensor ExpertParallel::dispatch_grad(const ExchangePlan& plan, const Tensor& dy, const RowCodec& codec) {
  if (!plan.recv_meta.defined()) fail("expert parallel dispatch_grad: the plan has not dispatched yet");
  if (dy.dim() != 2 || dy.size(0) != plan.slots)
    fail("expert parallel dispatch_grad: dy must hold this rank's {} slots, got {}", plan.slots, dy.str());
  const Tensor payload = encode_rows(dy, RowMap(), plan.slot_meta, codec);
  const Tensor recv = to_experts(plan, payload, codec.row_bytes());
  if (verifies(recv)) verify_echo(read_meta(recv, RowMap(), plan.expert_rows()), plan.recv_meta, "dispatch_grad");
  Tensor out = Tensor::empty({plan.expert_rows(), codec.cols}, DType::F32, dy.device());
  decode_rows(recv, plan.to_expert_rows, codec, out);
  return out;
}

}  // namespace fourbit::dist
