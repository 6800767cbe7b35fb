// defines: ExpertShard, MoeCodecs, moe_codecs, payload_rht_signs, ExchangePlan, ExpertRows, decode_slots,
//          ExpertParallel
// Expert parallelism for one MoE layer over a Communicator (DESIGN "Expert parallelism"). Experts
// are split over the ranks in contiguous blocks. Each rank routes its own tokens; its slots are
// already sorted by expert (ops::route_plan), so the slots for one rank's experts are one
// contiguous run and dispatch sends that run. A rank assembles its experts' rows expert-major,
// and within an expert in (source rank, token) order: with ranks' tokens taken as consecutive
// micro-batches, every expert sees its rows in the order one rank running all micro-batches
// would, and per (expert, source) segments line up with that rank's per-expert segments. Combine
// returns each row to its source in its own slot order, where ops::moe_combine sums a token's k
// contributions by rank of choice (never by arrival).
//
// The same codecs run when the group has one rank (no bytes move, but rows are encoded and
// decoded exactly as they would travel): the recipe defines the payloads, not the topology, so
// an ep = 2 run can equal an ep = 1 run bit for bit (docs/distributed.md "Equivalence").
#pragma once
#include <cstdint>
#include <vector>

#include "fourbit/dist/codec.h"
#include "fourbit/dist/communicator.h"
#include "fourbit/numerics/formats.h"
#include "fourbit/ops/ops.h"

namespace fourbit::dist {

// Rank `rank` of `ep` holds experts [first(), first() + per_rank()).
struct ExpertShard {
  int64_t n_experts = 0;
  int ep = 1;
  int rank = 0;
  int64_t per_rank() const { return n_experts / ep; }
  int64_t first() const { return int64_t(rank) * per_rank(); }
  int owner(int64_t expert) const { return int(expert / per_rank()); }
};

// The four payloads of a MoE layer (docs/distributed.md "What travels"):
//  dispatch       token rows -> experts: the expert fprop A operand itself (NVFP4 or MXFP8 rows
//                 packed verbatim, so the expert GEMM consumes them as they arrive) or its dense
//                 format (F32, BF16);
//  combine        expert outputs -> sources: S2F6 after RHT-32 (8.25 bits/value), or BF16 / F32;
//  grad_dispatch  dY rows -> experts: the dgrad A operand's rows (MXFP8 E4M3, RCEIL, RNE: what the
//                 dgrad GEMM consumes) or its dense format; an operand that is not per-row
//                 (NVFP4 with a tensor scale) travels as BF16 and is quantized by the expert;
//  grad_combine   dX rows -> sources: the combine format (a sum of expert contributions in the
//                 model dimension, like the forward's outputs), with its own RHT signs.
struct MoeCodecs {
  RowCodec dispatch, combine, grad_dispatch, grad_combine;
};

// The codecs of a layer whose expert GEMMs quantize X as fprop_a and dY as dgrad_a, with outputs
// combined in combine_fmt (S2F6 applies RHT-32 with the given signs; BF16 or F32 rows as they are).
MoeCodecs moe_codecs(const QuantSpec& fprop_a, const QuantSpec& dgrad_a, Format combine_fmt, int64_t d_model,
                     uint32_t combine_signs, uint32_t grad_combine_signs);

// The RHT-32 signs of layer `layer`'s combine payload (grad = false) or dX payload (grad = true):
// num::rht_signs(seed, stream) on a stream of their own, so a run's seed fixes them (NUMERICS:
// "fixed per run and layer; recorded in the checkpoint" through the seed).
uint32_t payload_rht_signs(uint64_t seed, int64_t layer, bool grad);

// Who sends what to whom in one MoE layer's exchanges, forward and backward. Built once per
// layer and forward pass (ExpertParallel::plan), kept for the backward.
struct ExchangePlan {
  ExpertShard shard;
  int64_t slots = 0;                     // this rank's token assignments, N * k
  std::vector<int64_t> send_rows;        // [ep]: this rank's slots for rank p's experts
  std::vector<int64_t> recv_rows;        // [ep]: rows rank p sends this rank
  std::vector<int64_t> counts;           // [ep * local]: rows from source p for local expert e at p * local + e
  std::vector<int64_t> expert_offsets;   // [local + 1]: local expert e's rows, expert-major
  std::vector<int64_t> segment_offsets;  // [local * ep + 1]: segment e * ep + p = expert e's rows from source p
  RowMap to_expert_rows;                 // received (source-major) row i <-> expert-major row
  Tensor token_of_slot;                  // the route plan's slot -> token gather
  Tensor slot_meta;                      // I32 [slots, 3]: (token, expert, k) of every slot
  Tensor recv_meta;                      // I32 [expert rows, 3] in received order; set by dispatch

  int64_t expert_rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
  int64_t local_experts() const { return shard.per_rank(); }
  // Source rank and global expert of segment `s` (segment_offsets' order).
  int segment_source(int64_t s) const { return int(s % shard.ep); }
  int64_t segment_expert(int64_t s) const { return shard.first() + s / shard.ep; }
};

// The experts' input rows, expert-major: a Row-axis QTensor (packed dispatch) or F32 rows.
struct ExpertRows {
  QTensor q;
  Tensor dense;
  bool is_quantized() const { return q.codes.defined(); }
};

// The rows of a payload combine() received, decoded again in slot order (bit for bit what
// combine returned).
Tensor decode_slots(const Tensor& received, const RowCodec& codec);

class ExpertParallel {
 public:
  // comm: the expert-parallel group (size ep); n_experts must be a multiple of ep. Every received
  // row's routing metadata is checked: always for CPU tensors; for GPU tensors (a copy to the
  // host per exchange) only with FOURBIT_DIST_VERIFY=1, or when verify_metadata says so.
  ExpertParallel(Communicator& comm, int64_t n_experts);
  ExpertParallel(Communicator& comm, int64_t n_experts, bool verify_metadata);
  const ExpertShard& shard() const { return shard_; }
  Communicator& comm() { return comm_; }

  // Exchanges this rank's per-expert slot counts (one all-to-all of ep x local integers: the one
  // host sync this adds to a MoE layer) and lays out every later exchange of the layer.
  ExchangePlan plan(const ops::RoutePlan& route, const Tensor& topk_idx);

  // Forward dispatch. x: this rank's N tokens as the fprop operand (a Row-axis NVFP4/MXFP8 QTensor
  // with one row per token, packed in slot order) or F32 rows [N, D] (encoded with codec). Returns
  // this rank's experts' rows, expert-major; F32 rows come back decoded. A group of one skips
  // packing a QTensor (it is lossless: the rows gathered by slot are the same bytes).
  ExpertRows dispatch(ExchangePlan& plan, const QTensor& x, const RowCodec& codec);
  ExpertRows dispatch(ExchangePlan& plan, const Tensor& x, const RowCodec& codec);

  // Experts -> sources: y F32 [expert rows, D] (expert-major) encoded with codec, returned to the
  // sources, decoded into this rank's slot order: F32 [slots, D]. The forward's combine (expert
  // outputs) and the backward's dX both take this path. With `received`, also the payload as it
  // arrived (U8 [slots, row bytes]): the forward keeps it (8.25 bits a value for S2F6) and
  // decode_slots gives the backward the same rows again (moe_combine_backward needs them).
  Tensor combine(const ExchangePlan& plan, const Tensor& y, const RowCodec& codec, Tensor* received = nullptr);

  // Backward dispatch: dy F32 [slots, D] (this rank's slots) encoded with codec and sent to the
  // experts; returns the decoded rows, expert-major F32 [expert rows, D].
  Tensor dispatch_grad(const ExchangePlan& plan, const Tensor& dy, const RowCodec& codec);

 private:
  Tensor to_experts(const ExchangePlan& plan, const Tensor& payload, int64_t row_bytes);
  Tensor to_sources(const ExchangePlan& plan, const Tensor& payload, int64_t row_bytes);
  bool verifies(const Tensor& t) const;
  void verify_arrival(const ExchangePlan& plan, const Tensor& recv_meta) const;
  void verify_echo(const Tensor& got, const Tensor& expected, const char* what) const;

  Communicator& comm_;
  ExpertShard shard_;
  enum class Verify { Auto, Always, Never } verify_;
};

}  // namespace fourbit::dist
