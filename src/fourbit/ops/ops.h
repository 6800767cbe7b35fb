// defines: RngKey, QuantReport, quantize, outer_amax, quantize_segments, FormOut, row_col_one_pass, RowColQuant,
//          quantize_row_col, quantize_row_col_device_offsets, gather_quantize_row_col,
//          gather_quantize_row_col_device_offsets, moe_combine_backward_row_col,
//          moe_combine_backward_row_col_device_offsets, swiglu_forward_row_col,
//          swiglu_forward_row_col_device_offsets, swiglu_backward_row_col,
//          swiglu_backward_row_col_device_offsets, BothAxes, quantize_both, BothJob, quantize_both_each, dequantize,
//          quantize_both_each_into, requantize_transposed,
//          requantize_transposed_segments, with_decode, Operand, gemm, GemmJob, gemm_batch, gemm_batch_grouped, grouped_gemm,
//          grouped_gemm_device_offsets, WgradSet, grouped_wgrad_device_offsets, grouped_wgrad_device_offsets_calls, grouped_gemm_reads_device_offsets, route_plan_finish, check_index_errors,
//          DeferIndexChecks, check_index_errors_later, load_balance_term, load_balance_dprobs, count_targets,
//          rope_qkv_to_cache, rope_fused_qkv_to_cache, attention_step,
//          RowQuant, the layer ops (embedding, rmsnorm, add_rmsnorm, rmsnorm_input_wgrad, rope, attention, swiglu, cross_entropy, router,
//          DrawSpec, draw_tokens,
//          MoE permutation), adamw_step, Lanes and the small tensor utilities (running_segment_amax).
// Every operator fourbit runs, declared once. A call dispatches on the device of its tensors to
// ops/cpu/ or ops/cuda/, which implement the same functions with the same numerics (the
// quantizers bit for bit; GEMMs and reductions within documented tolerances).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "fourbit/numerics/formats.h"
#include "fourbit/tensor/qtensor.h"
#include "fourbit/tensor/tensor.h"

namespace fourbit::ops {

// Where stochastic rounding draws its bits: sr_bits(seed, stream, storage element index).
struct RngKey {
  uint64_t seed = 0;
  uint64_t stream = 0;
};

// Counts a quantizer can report. Non-finite inputs are never silently mapped: they are counted
// here and in the process-wide sticky flag (nonfinite_seen), which the trainer checks each step.
struct QuantReport {
  int64_t values = 0;
  int64_t nonfinite = 0;
  int64_t blocks = 0;
  int64_t blocks_chose_four = 0;  // Four Over Six picked the 1.5x scale
};

// ---- quantization (NUMERICS.md; layouts in docs/numerics.md) ----------------------------------
// What a quantizer writes of one form for the GEMMs of a linear layer (quantize,
// requantize_transposed, quantize_row_col, quantize_both, swiglu_backward_row_col): its codes (Codes); its codes and their exact BF16
// decode, QTensor::bf16 (CodesAndBf16: a GEMM reads the decode next, and the codes are kept for a
// later reader); or the decode alone (Bf16: only the GEMMs that run next read the form, and its
// codes would be written for nothing). Only the GPU writes decodes: on the CPU every form is its
// codes. A QTensor without codes (Bf16 on the GPU) is read by the GEMMs alone: gemm, gemm_batch
// and grouped_gemm take its decode; qtensor_rows and qtensor_slice view it; nothing else does.
enum class FormOut : uint8_t { Codes, CodesAndBf16, Bf16 };

// x: F32 [R, C] or [S, R, C] (S slices, e.g. experts). Blocks run along C for BlockAxis::Row and
// along R for BlockAxis::Col (stored transposed). Sizes that are not a multiple of the block are
// padded with zeros (code 0) to a whole block. group_amax (NVFP4 with an outer scale only): the
// amax of each outer-scale group, F32 [groups] on x's device (outer_amax), used instead of x's own
// (w1 and w3 of an expert share one outer scale: NUMERICS "NVFP4"). form: what the result holds
// (FormOut; on the GPU NVFP4's kernels write the decode beside the codes, other formats take a
// decode pass after them).
QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng = {},
                 QuantReport* report = nullptr, const Tensor* group_amax = nullptr, FormOut form = FormOut::Codes);

// The amax of each outer-scale group of spec over all of xs (tensors of one shape): F32 [groups]
// on their device, groups = 1 (Tensor), slices (PerSlice) or storage rows (PerRow), taken over
// the values quantize would quantize (the rotated ones behind an RHT). spec: NVFP4 with an outer
// scale. An expert's w1 and w3 together give their shared group amax.
Tensor outer_amax(const std::vector<Tensor>& xs, const QuantSpec& spec);

// Exact dequantization to F32 in the logical shape; undo_hadamard applies the inverse RHT
// for QTensors quantized behind one (otherwise the values stay in the rotated basis, which is
// what a GEMM of two rotated operands wants).
Tensor dequantize(const QTensor& q, bool undo_hadamard = true);

// NVFP4 -> exact dequantize -> transpose -> MXFP8 as `target` says (the recipe's dgrad.b /
// wgrad.b: E4M3 or E5M2, RCEIL scales, SR or RNE; requantize_transposed_spec checks it). The
// result is the same logical tensor quantized along the other axis: blocks now run along the old
// rows. form: what the result holds (FormOut; the GPU kernel writes the decode from its codes).
QTensor requantize_transposed(const QTensor& q, const QuantSpec& target, RngKey rng, FormOut form = FormOut::Codes);

// quantize(x.slice_rows(offsets[i], offsets[i + 1]), spec, rngs[i]) for every row segment i of a
// 2-D x (G + 1 non-decreasing offsets from 0 to x's rows, G keys; an empty segment gives an empty
// QTensor), bit for bit, in one pass where the backend has a kernel for it (CUDA: MXFP8 on the
// Col axis, the experts' weight-gradient operands; otherwise segment by segment).
std::vector<QTensor> quantize_segments(const Tensor& x, const std::vector<int64_t>& offsets,
                                       const QuantSpec& spec, const std::vector<RngKey>& rngs);

// x quantized along both axes for the GEMMs of one linear layer: the Row-axis form under
// row_spec (a GEMM's X or dY; stream row_rng) and the Col-axis forms of the row segments under
// col_spec (the weight gradient's X^T or dY^T: quantize_segments(x, offsets, col_spec, col_rngs);
// offsets {0, rows} for the whole tensor) — bit for bit quantize(x, row_spec, row_rng) and that
// quantize_segments. On the GPU, MXFP8 on both axes (one element format, no RHT) is one pass that
// reads x once and writes what row_out / col_out ask (FormOut). Otherwise the two ops run, codes
// only.
// Whether a backend with the one-pass kernel makes these two forms in one pass: MXFP8 of one
// element format, no RHT (other block-scaled pairs keep their separate quantizers).
bool row_col_one_pass(const QuantSpec& row_spec, const QuantSpec& col_spec);
struct RowColQuant {
  QTensor row;
  std::vector<QTensor> col;  // per segment (empty segments: empty QTensors)
  // The *_device_offsets forms' Col forms: their BF16 decodes in the rows' layout, [rows, cols]
  // (row r of segment g holds its values as segment g's Col form decodes them); col stays empty.
  Tensor col_rows;
};
RowColQuant quantize_row_col(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                             const std::vector<int64_t>& offsets, const std::vector<RngKey>& col_rngs,
                             FormOut row_out = FormOut::Codes, FormOut col_out = FormOut::Codes);

// quantize_row_col with the segments given as offsets, an I32 [G + 1] tensor on x's device (a
// route plan's device_offsets, which the host does not have yet), the Col forms coming back as
// out.col_rows: the layout in which grouped_wgrad_device_offsets reads a weight gradient's
// operands on the same offsets. On the GPU, where quantize_row_col's one pass takes the specs,
// that pass finds each segment on the GPU and nothing comes back (a step that runs it can be
// captured in a graph); elsewhere the offsets are read back (bad ones fail) and quantize_row_col's
// Col forms are decoded into those rows. The same values either way.
RowColQuant quantize_row_col_device_offsets(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng,
                                            const QuantSpec& col_spec, const Tensor& offsets,
                                            const std::vector<RngKey>& col_rngs, FormOut row_out = FormOut::Codes);

// quantize_row_col of gather_rows(x, token_of_slot) (x F32 [N, D], token_of_slot I32 [M]: the
// experts' dispatched tokens), bit for bit. On the GPU, where quantize_row_col's one pass takes
// the specs, that pass reads each row where gather_rows would: x_perm is never written. An id
// outside [0, N) is reported as gather_rows reports one (check_index_errors), its row read as zeros.
RowColQuant gather_quantize_row_col(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec,
                                    RngKey row_rng, const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                    const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out);
// ... with the segments as quantize_row_col_device_offsets takes them.
RowColQuant gather_quantize_row_col_device_offsets(const Tensor& x, const Tensor& token_of_slot,
                                                   const QuantSpec& row_spec, RngKey row_rng,
                                                   const QuantSpec& col_spec, const Tensor& offsets,
                                                   const std::vector<RngKey>& col_rngs,
                                                   FormOut row_out = FormOut::Codes);

// moe_combine_backward(dout, y_perm, slot_of, w, dy_perm, dw) followed by quantize_row_col of
// dy_perm (F32 [M, D]; offsets over its M slots), bit for bit: dw written, dy_perm returned
// quantized. On the GPU, where quantize_row_col's one pass takes the specs, that pass computes
// dy_perm's rows where it reads them (each slot's dout row times its routing weight): dy_perm is
// never written in F32. Bad slot_of entries are reported as moe_combine_backward reports them.
RowColQuant moe_combine_backward_row_col(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                                         const Tensor& w, Tensor& dw, const QuantSpec& row_spec, RngKey row_rng,
                                         const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                         const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out);
// ... with the segments as quantize_row_col_device_offsets takes them.
RowColQuant moe_combine_backward_row_col_device_offsets(const Tensor& dout, const Tensor& y_perm,
                                                        const Tensor& slot_of, const Tensor& w, Tensor& dw,
                                                        const QuantSpec& row_spec, RngKey row_rng,
                                                        const QuantSpec& col_spec, const Tensor& offsets,
                                                        const std::vector<RngKey>& col_rngs,
                                                        FormOut row_out = FormOut::Codes);

// swiglu_forward's a of h1 and h3 (F32 [rows, F]) quantized as quantize_row_col quantizes it, the
// bits of swiglu_forward followed by that call; offsets empty: its Row-axis form alone (the bits of
// quantize(a, row_spec, row_rng); col_spec names the pair's Col-axis spec all the same). On the
// GPU, where quantize_row_col's one pass takes the specs, one pass computes a and quantizes it
// where it was computed: a is never written in F32. Otherwise that sequence.
RowColQuant swiglu_forward_row_col(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, RngKey row_rng,
                                   const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                   const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out);
// ... with the segments as quantize_row_col_device_offsets takes them.
RowColQuant swiglu_forward_row_col_device_offsets(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                                                  RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                                  const std::vector<RngKey>& col_rngs,
                                                  FormOut row_out = FormOut::Codes);

// swiglu_backward's dh1 and dh3 of da, h1 and h3 (F32 [rows, F]) quantized as quantize_row_col
// quantizes each (output o: row_rngs[o], col_rngs[o]), the bits of swiglu_backward followed by
// the two quantize_row_col calls. On the GPU, where quantize_row_col's one pass takes the specs,
// one pass computes both from da, h1 and h3 and quantizes them where they were computed: dh1 and
// dh3 are never written in F32 nor read back. Otherwise that sequence.
std::array<RowColQuant, 2> swiglu_backward_row_col(const Tensor& da, const Tensor& h1, const Tensor& h3,
                                                   const QuantSpec& row_spec, const std::array<RngKey, 2>& row_rngs,
                                                   const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                                                   const std::array<std::vector<RngKey>, 2>& col_rngs,
                                                   FormOut row_out, FormOut col_out);
// ... with the segments as quantize_row_col_device_offsets takes them.
std::array<RowColQuant, 2> swiglu_backward_row_col_device_offsets(
    const Tensor& da, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
    const std::array<RngKey, 2>& row_rngs, const QuantSpec& col_spec, const Tensor& offsets,
    const std::array<std::vector<RngKey>, 2>& col_rngs, FormOut row_out = FormOut::Codes);

// x ([R, C], or [S, R, C]: a stack of expert weights) quantized on both axes, each with one
// stream: bit for bit quantize(x, row_spec, row_rng) and quantize(x, col_spec, col_rng) (a
// weight's fprop and dgrad operands), in quantize_row_col's one pass on the GPU where it takes the
// specs (writing what row_out / col_out ask); otherwise the two quantize calls.
struct BothAxes {
  QTensor row, col;
};
BothAxes quantize_both(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                       RngKey col_rng, FormOut row_out = FormOut::Codes, FormOut col_out = FormOut::Codes);
// quantize_both of each job, bit for bit. On the GPU, where quantize_both's one pass takes every
// job, one launch for all of them (one per MXFP8 element format and rounding pair): a training
// step's MXFP8 weights, ~120 tensors of which most are too small to fill the GPU alone.
struct BothJob {
  Tensor x;
  QuantSpec row_spec;
  RngKey row_rng;
  QuantSpec col_spec;
  RngKey col_rng;
  FormOut row_out = FormOut::Codes, col_out = FormOut::Codes;
};
std::vector<BothAxes> quantize_both_each(const std::vector<BothJob>& jobs);
// quantize_both_each of jobs written into `into`: the forms a quantize_both_each of jobs with the
// same tensors' shapes, specs and outputs returned (checked), their storage kept, so that a CUDA
// graph that reads them reads the new forms (a training step's weights, rewritten after each
// update). On the GPU, where quantize_both_each's one launch takes the jobs, written in place;
// otherwise made and copied in.
void quantize_both_each_into(const std::vector<BothJob>& jobs, std::vector<BothAxes>& into);

// requantize_transposed(qtensor_rows(q, offsets[i], offsets[i + 1]), target, rngs[i], form) for
// every row segment i of a single-slice Row-axis q (the experts' tokens of a saved NVFP4
// activation; an empty segment gives an empty QTensor), bit for bit, in one pass on the GPU.
std::vector<QTensor> requantize_transposed_segments(const QTensor& q, const std::vector<int64_t>& offsets,
                                                    const QuantSpec& target, const std::vector<RngKey>& rngs,
                                                    FormOut form = FormOut::Codes);

// q with its BF16 decode (QTensor::bf16) on the GPU: the GEMMs' decode pass, run once for every
// GEMM that reads q next (a GEMM decodes an operand without one for itself, once a call). q as it
// is on the CPU, or where it has its decode already.
QTensor with_decode(QTensor q);

// Sticky flag raised by any quantizer that met NaN/Inf; read-and-clear.
bool nonfinite_seen(bool clear = true);

// Rows [begin, end) of a Row-axis QTensor's storage (a view: codes, scales and per-row outer
// scales share memory), and slice s of a multi-slice QTensor (its outer scale becomes a tensor
// scale). Used to hand one expert's tokens or one expert's weight to a GEMM.
QTensor qtensor_rows(const QTensor& q, int64_t begin, int64_t end);
QTensor qtensor_slice(const QTensor& q, int64_t s);

// ---- GEMM on any pair of formats ----------------------------------------------------------------
// A GEMM operand in "NT" form: a matrix R x K whose K (reduction) dimension is contiguous.
//  - dense: F32, F64 or BF16 tensor [R, K], or [K, R] with trans = true;
//  - quantized: a QTensor's storage [rows, cols] (blocks run along K). NVFP4 outer scales are
//    applied after the sum (NUMERICS "GEMMs"): per tensor as a scalar, per row as a row (A) or
//    column (B) scale of C.
class Operand {
 public:
  Operand(const Tensor& t, bool trans = false) : dense_(&t), trans_(trans) {}
  Operand(const QTensor& q) : q_(&q) {}
  const Tensor* dense() const { return dense_; }
  const QTensor* q() const { return q_; }
  bool trans() const { return trans_; }
  int64_t rows() const;
  int64_t k() const;
  Device device() const;

 private:
  const Tensor* dense_ = nullptr;
  const QTensor* q_ = nullptr;
  bool trans_ = false;
};

// C[m, n] = sum_k A(m, k) * B(n, k), C F32 [M, N] (F64 when both operands are F64); with
// accumulate, C += that sum (one rounding). Every C[m, n] is reduced in one fixed order that does
// not depend on M, N or the thread count: rows are batch invariant and results deterministic.
void gemm(const Operand& a, const Operand& b, Tensor& c, bool accumulate = false);

// One GEMM per group of rows (a MoE layer's experts, with the router's per-expert token counts):
// rows offsets[g] .. offsets[g+1] of A and C use slice g of B,  C[rows] (+)= A[rows] . B_g^T.
// b: a QTensor of G slices, a dense [G, N, K] tensor or a dense [G * N, K] one; a: a Row-axis
// QTensor or a dense [M, K] tensor; offsets: G + 1 non-decreasing values from 0 to M. A group's
// rows get the bits they get when it is the only group with rows, whatever M (the sampler and the
// trainer rely on it). On the CPU, and on the GPU for FP32 operands (or a transposed dense BF16 B
// off Hopper), that is bit for bit one gemm per group; on the GPU, BF16 and block-scaled operands
// are decoded once and every group runs in one launch of the grouped kernel (cuda/grouped_mma.cu:
// its own fixed K order, within the GEMM tolerance of gemm; a transposed BF16 B, a dgrad's forward
// weight, read in place with the bits of its untransposed copy), and NVFP4 outer scales are
// applied in one pass.
void grouped_gemm(const Operand& a, const Operand& b, const std::vector<int64_t>& offsets, Tensor& c,
                  bool accumulate = false);
// grouped_gemm with the offsets an I32 [G + 1] tensor on the output's device: on the GPU the
// grouped kernel reads them there (dense BF16 operands, or block-scaled ones of one format, where
// grouped_gemm_reads_device_offsets), so the GEMM may be queued before the host has the router's
// counts (RoutePlan::device_offsets); elsewhere (the CPU, FP32 operands) they are read back first
// and grouped_gemm runs. The bits of grouped_gemm with the same offsets.
void grouped_gemm_device_offsets(const Operand& a, const Operand& b, const Tensor& offsets, Tensor& c,
                                 bool accumulate = false);
// The experts' weight gradients with the offsets an I32 [G + 1] tensor on the outputs' device: for
// every set {a, b, c} and every group g, c[g] (+)= a_g^T . b_g, where a_g and b_g are rows
// offsets[g] .. offsets[g + 1] of a [M, R] and b [M, C] (token-major: a MoE layer's dY and X rows in
// expert order; one dtype, BF16, F32 or F64, and one M, R and C for all sets) and c is F32 [G, R, C]
// (F64 for F64 operands); a group without rows gets c[g] = 0 (accumulate: unchanged). On Hopper,
// BF16 operands with R and C multiples of 8, the grouped kernel's K-grouped form reads the offsets
// where they are, every set's problems in one launch (cuda::grouped_gemm_k_device_offsets: nothing
// comes back, so a step that runs it can be captured in a graph; bad offsets are recorded for
// check_index_errors); elsewhere they are read back (bad ones fail at once) and gemm_batch_grouped
// runs one GEMM a group with rows. Both give gemm_batch_grouped's bits on those groups' transposed
// row ranges.
struct WgradSet {
  const Tensor* a;
  const Tensor* b;
  Tensor* c;
};
void grouped_wgrad_device_offsets(const std::vector<WgradSet>& sets, const Tensor& offsets, bool accumulate = false);
// How many grouped_wgrad_device_offsets calls the process has made, on any device (tests check
// that a path took them).
int64_t grouped_wgrad_device_offsets_calls();
void grouped_wgrad_device_offsets(const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& c,
                                  bool accumulate = false);
// Whether grouped_gemm_device_offsets on `device` reads the offsets where they are for `groups`
// groups and a reduction of k values, BF16 or block-scaled operands (else it reads them back
// first: the GPU's grouped kernel takes up to 128 groups and K a multiple of 8; the CPU always
// reads them).
bool grouped_gemm_reads_device_offsets(Device device, int64_t groups, int64_t k);

// One GEMM of a batch: c (+)= a . b^T, as ops::gemm(a, b, *c, accumulate).
struct GemmJob {
  Operand a, b;
  Tensor* c;
  bool accumulate;
};
// ops::gemm for every job, bit for bit. The jobs are independent: no output may overlap another
// job's output or operands; an operand may appear in several jobs (a MoE layer's experts'
// weight-gradient GEMMs, W1 and W3 sharing X). The CUDA backend decodes each distinct quantized
// operand once (NVFP4/MXFP8 with K a multiple of 8: up to 32 of a format in one launch; others one
// by one) and spreads the GEMMs over the GPU lanes.
void gemm_batch(const std::vector<GemmJob>& jobs);

// gemm_batch for jobs that may run as one grouped GEMM (a MoE layer's expert weight gradients, K
// running over each expert's tokens): each job's output its own bits, deterministic and within
// gemm's tolerance, but not necessarily gemm's bits. On the CPU, and on the GPU where it does not
// apply, gemm_batch. On a Hopper GPU, jobs whose outputs share one F32 [m, n] shape and whose
// operands are BF16 without outer scales (dense, or block-scaled ones decoded exactly), all
// transposed dense operands or all read along K, run in one launch of the grouped kernel's
// K-grouped form (cuda::grouped_gemm_k): every element one FP32 sum over K in a fixed order.
void gemm_batch_grouped(const std::vector<GemmJob>& jobs);

// Whether GEMMs on `device` may take NVFP4 x NVFP4 and MXFP8 x MXFP8 operands packed, on
// block-scaled tensor cores (Blackwell, when cuBLASLt offers an algorithm for the shape), instead
// of decoding them exactly to BF16 first (Hopper; the CPU). Same products, FP32 sums in another
// order.
bool native_block_scaled_gemm(Device device);

// Independent pieces of GPU work (the CUDA gemm_batch's and grouped_gemm's GEMMs) run concurrently:
// work issued after use(i) goes to lane i % n, the destructor joins every lane into the default
// stream (device_memory.h). Each piece must write its own outputs; results are the same bits as
// issuing the pieces one after the other. Does nothing on the CPU, or inside other lanes (the
// work then stays on the enclosing lane's stream).
class Lanes {
 public:
  Lanes(Device device, int n);
  // lanes_end. While an exception unwinds the stack its errors are dropped (the one in flight is
  // the first); otherwise they are thrown.
  ~Lanes() noexcept(false);
  Lanes(const Lanes&) = delete;
  Lanes& operator=(const Lanes&) = delete;
  void use(int64_t i);

 private:
  bool active_;
};

// ---- tensor utilities ---------------------------------------------------------------------------
void convert(const Tensor& src, Tensor& dst);          // F32 <-> BF16 (RNE) <-> F64, same numel
// dst[i] = convert(src[i]) for every i, the same bits; on the GPU the F32 -> BF16 ones in one
// launch (a step's BF16 weight copies: one launch instead of one a weight).
void convert_each(const std::vector<Tensor>& src, std::vector<Tensor>& dst);
// Every tensor zeroed (Tensor::zero_ each); on the GPU in one launch where all are 16-byte aligned
// (the weight-gradient slices of experts without tokens: one launch instead of one each).
void zero_each(std::vector<Tensor>& ts);
void add_(Tensor& dst, const Tensor& src);             // dst += src
void add(const Tensor& a, const Tensor& b, Tensor& out);  // out = a + b (add_'s bits; out may be a)
void scale_(Tensor& t, double s);                      // t *= s
double sum_squares(const Tensor& t);                   // fixed-order sum of t^2, as double
// sum_squares of each tensor (one device, in order; the same bits each), with one host
// synchronisation for all of them on the GPU instead of one each.
std::vector<double> sum_squares_each(const std::vector<Tensor>& ts);
void fill_(Tensor& t, double v);
// amax[g] = max(amax[g], max |x[r, c]|) over the rows r of segment g: entries offsets[g] ..
// offsets[g + 1] of `rows` (I32 row indices of x), or rows offsets[g] .. offsets[g + 1] of x
// when `rows` is undefined. x: F32 [R, C]; amax: F32 [G] (G + 1 offsets) on x's device, values
// >= 0. NaN/Inf are skipped (the quantizers report them). A max: exact in any order.
void running_segment_amax(const Tensor& x, const Tensor& rows, const std::vector<int64_t>& offsets,
                          Tensor& amax);

// ---- layers (F32; the CPU backend also runs F64 for gradient checks) ----------------------------
// BF16 outputs: rmsnorm_forward's y, swiglu_forward's a, swiglu_backward's dh1 and dh3 and
// moe_combine_backward's dy_perm may be BF16 tensors for F32 inputs, when the output's only readers
// are BF16 GEMM operands (the bf16 recipe's): each element is then the F32 value the op would write,
// rounded to BF16 (RNE), i.e. the bits of convert() of the F32 output, without writing that output
// and converting it in a second pass. The CPU reference computes the F32 output and converts it.
// Quantized outputs: rmsnorm_forward's and add_rmsnorm_forward's y, swiglu_forward_fused's a and
// attention_step's out (as [B, Hq * hd] rows) may be quantized along their rows by the op that
// writes them, for an output whose next reader is a GEMM taking it as a block-scaled fprop
// operand: *out = quantize(output, spec, rng), bit for bit (spec's axis Row), with the F32 output
// written as well. Where the backend has a kernel for the spec the row is quantized where it was
// computed, one launch instead of two: CUDA's norms and SwiGLU for MXFP8 E4M3/E5M2 and per-row
// NVFP4, rounded to nearest, no RHT, rows of up to 16384 values, a multiple of 4 (from the shared
// memory that computed the row); its attention step for MXFP8 E4M3/E5M2 rounded to nearest, no
// RHT, hd a multiple of 32 (each head's blocks in the epilogue of the CTA that computed the head).
// Otherwise the op runs, then quantize.
struct RowQuant {
  QuantSpec spec;
  RngKey rng;
  QTensor* out = nullptr;
};
// tokens: I32 [N]; table [V, D]; out [N, D]. Backward accumulates into dtable, rows in token order.
// An id outside [0, V) is an error naming it. tokens_checked: these tokens already went through
// embedding_forward's check (a model's backward of its own forward), so the GPU's backward does
// not wait to read its error record again (a host round trip at the end of every backward); its
// kernels still leave bad ids out.
void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable, bool tokens_checked = false);

// y = x / sqrt(mean(x^2) + eps) * w over the last dim of x [N, D]; rstd [N] saved for backward.
// Backward: dx = (w*dy - y_hat * mean(w*dy*y_hat)) * rstd; dw += sum over rows of dy * y_hat.
// dx_accumulate: dx += that instead (the residual stream's gradient; the bits of writing it to a
// temporary and add_ing it). dw_accumulate false: dw = the sum (a stale gradient's first write,
// ParamStore::grad_accumulate), the bits of adding it to zeros; dw's old values are not read.
// y_bf16 (optional, for an F32 y): y rounded to BF16 as well (a second output, for a y that both
// an F32 reader and BF16 GEMMs read: the MoE router and the experts).
// yq (optional, for an F32 y): y quantized along its rows as well (ops.h "Quantized outputs").
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd, Tensor* y_bf16 = nullptr,
                     const RowQuant* yq = nullptr);
// The residual stream's add and the next norm: sum = a + b (F32, add's bits), then
// rmsnorm_forward(sum, w, eps, y, rstd, y_bf16, yq), the bits of the two ops; one pass on the GPU,
// which reads the sum back from its own writes instead of a second kernel reading it again.
void add_rmsnorm_forward(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& y,
                         Tensor& rstd, Tensor* y_bf16 = nullptr, const RowQuant* yq = nullptr);
// The weight gradient of an F32 linear layer whose input is x's RMSNorm and was not kept (the
// MoE router): dw (+)= dy^T . y for y = rmsnorm_forward(x, w, eps)'s output, dy F32 [N, M], x F32
// [N, D], dw F32 [M, D]; rstd is what rmsnorm_forward stores for x (the forward's saved one). The
// bits of rmsnorm_forward then gemm(Operand(dy, true), Operand(y, true), dw, accumulate). On the
// GPU, for M <= 32 and N >= 256 (the router's dlogits over the tokens), each y is computed where
// the GEMM reads it, from x, rstd and w, rather than written by a norm pass and read back.
void rmsnorm_input_wgrad(const Tensor& dy, const Tensor& x, const Tensor& w, float eps, const Tensor& rstd, Tensor& dw,
                         bool accumulate);
// dx_bf16 (optional): dx's new values rounded to BF16 as well (the residual stream's gradient is
// the next linear's dY: a BF16 GEMM operand in the bf16 recipe).
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      Tensor& dx, Tensor& dw, bool dx_accumulate = false, bool dw_accumulate = true,
                      Tensor* dx_bf16 = nullptr);

// Rotary embedding, rotate-half convention (pairs i and i + hd/2), in place on x [N, H, hd]
// with positions I32 [N]. table F32 [max_pos, hd] holds cos in [:, :hd/2], sin in [:, hd/2:]
// (built once by rope_table, in double, rounded to float). backward = rotation by -angle.
// x_bf16 (optional, x's shape, BF16, for F32 x): also the rotated values rounded to BF16 (RNE),
// the bits of convert() of the rotated x, written in the same pass (the attention kernels' and
// BF16 GEMMs' operand; the CPU reference rotates, then converts). bf16_only (with x_bf16): only
// that copy is written and x keeps its values, where nothing reads the rotated F32 values (the
// GPU step's q, k, dq and dk): a 4-byte store an element saved.
Tensor rope_table(int64_t max_pos, int64_t head_dim, double theta, Device device);
void rope_forward(Tensor& x, const Tensor& positions, const Tensor& table, Tensor* x_bf16 = nullptr,
                  bool bf16_only = false);
void rope_backward(Tensor& dx, const Tensor& positions, const Tensor& table, Tensor* dx_bf16 = nullptr,
                   bool bf16_only = false);
// A cached forward call's attention inputs in one pass (model/kv_cache.h, a BF16 cache): q [N, Hq, hd]
// and k [N, Hkv, hd] rotated at `positions` and rounded to BF16, v [N, Hkv, hd] rounded to BF16;
// q's into q_bf16 [N, Hq, hd], k's and v's into rows dst_rows[n] of k_cache and v_cache
// ([R, Hkv, hd] BF16). The bits of rope_forward(q, positions, table, &q_bf16, true), the same for
// k into a BF16 copy, convert(v) and scatter_rows of both copies (which the CPU runs; the GPU
// runs one kernel: a decode step's five launches a layer were host time).
void rope_qkv_to_cache(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& table,
                       const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache);
// The same from the fused q|k|v projection (one GEMM on wq, wk and wv's rows stacked): qkv F32
// [N, Hq + 2 Hkv, hd], each row q's Hq heads, then k's Hkv, then v's Hkv (Hq = n_heads; Hkv the
// caches'). The bits of rope_qkv_to_cache on the three parts; the GPU reads them in place.
void rope_fused_qkv_to_cache(const Tensor& qkv, int64_t n_heads, const Tensor& positions, const Tensor& table,
                             const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache);

// Causal attention with grouped-query heads. q [B, T, Hq, hd] holds positions pos0 .. pos0+T-1;
// k, v [B, S, Hkv, hd] hold positions 0 .. S-1 (S >= pos0 + T; a KV cache or this batch's own
// K/V). Query at absolute position p attends to keys 0..p; head h reads kv head h / (Hq / Hkv).
// out [B, T, Hq, hd]; lse [B, Hq, T] (log-sum-exp of the scaled scores) saved for backward.
// Keys are reduced in ascending position in fixed chunks aligned to absolute positions, so a
// token's output is the same in training, prefill and decode, alone or in a batch.
// out_bf16 (optional, out's shape, BF16): also out rounded to BF16 (RNE), the bits of convert()
// of out (the output projection's BF16 operand), written by the GPU's fused kernel in its epilogue.
//
// BF16 operands: where attention_reads_bf16(device) (the GPU: its kernels multiply BF16 operands;
// the CPU reference computes in double from F32/F64), q, k and v may be passed as BF16 tensors, the
// RNE rounding of their F32 values, with the same results bit for bit: their producers then write
// them (rope_forward's x_bf16) instead of the op converting them at every call, and a backward pass
// keeps half the bytes. dout and out stay F32 (D = rowsum(dout * out) reads them); the GPU rounds
// dout to BF16 in the pass that computes D.
bool attention_reads_bf16(Device device);
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0,
                       Tensor& out, Tensor& lse, Tensor* out_bf16 = nullptr);
// One query per sequence, each at its own position: q [B, 1, Hq, hd], sequence b's query at
// position positions[b] (I32 [B] on q's device) over keys 0 .. positions[b] of k, v [B, S, Hkv, hd];
// out [B, 1, Hq, hd], lse [B, Hq, 1]. Row b is the bits of attention_forward of that row alone at
// pos0 = positions[b]. The GPU reads the positions in its kernel, so a decode step over sequences
// at different positions is one launch, and a CUDA graph of it replays with new positions written
// into the same tensor; elsewhere (the CPU, shapes the fused kernel does not take) the positions
// are read on the host and runs of equal positions go to attention_forward.
// oq (optional, for an F32 out): out's [B, Hq * hd] rows quantized as well ("Quantized outputs").
void attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, Tensor& out,
                    Tensor& lse, Tensor* out_bf16 = nullptr, const RowQuant* oq = nullptr);
// Gradients for pos0 == 0 and S == T (training). dq, dk, dv (F32) are overwritten.
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv);

// a = silu(h1) * h3 elementwise (silu(z) = z * sigmoid(z)).
void swiglu_forward(const Tensor& h1, const Tensor& h3, Tensor& a);
// SwiGLU of an FFN's fused gate|up GEMM (one GEMM on w1 and w3's rows stacked): h13 [..., 2F]
// holds w1's outputs in its first F columns and w3's in its last F; a [..., F] (F32, or BF16 as
// swiglu_forward's a). The bits of swiglu_forward on the two halves.
void swiglu_forward_fused(const Tensor& h13, Tensor& a, const RowQuant* aq = nullptr);
void swiglu_backward(const Tensor& da, const Tensor& h1, const Tensor& h3, Tensor& dh1, Tensor& dh3);

// Softmax cross-entropy over logits [N, V] with targets I32 [N] (-1 = ignored). Writes the
// per-row loss into losses [N] (0 for ignored rows) and, when dlogits is defined, the gradient
// of grad_scale * sum(losses): (softmax - onehot) * grad_scale (0 rows for ignored targets).
// With `weights` (F32 [N], on the logits' device) the gradient is of
// grad_scale * sum(weights * losses): row n is scaled by grad_scale * weights[n] (weights may be
// negative: RL advantages). The losses stay unweighted. Without weights the results are the
// same bits as before weights existed.
// With `scale` (F32 [1] on the logits' device, count_targets'), the gradient scale is read there and
// grad_scale is not used: a forward whose target count stays on the GPU.
void cross_entropy(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor* dlogits,
                   double grad_scale, const Tensor* weights = nullptr, const Tensor* scale = nullptr);
// The targets that count (>= 0) in targets I32 [N], counted where they are: count (F64 [1], exact)
// and the cross-entropy's gradient scale of a micro-batch weighed loss_weight, scale (F32 [1]) =
// float(double(loss_weight) / count), 0 with none (the host's expression in Model::forward_queued).
// Both on the targets' device: on the GPU nothing comes back to the host.
void count_targets(const Tensor& targets, float loss_weight, Tensor& count, Tensor& scale);

// Token draws (rl/sampling.h's draw, in numerics/draw.h's arithmetic) for every row of logits
// [A, V] F32 at once, where the logits are, so that a GPU sampler reads back tokens instead of
// logits. Row a is keyed by keys[a] = (sequence id, position) (I64 [A, 2], on the logits' device)
// with the spec's seed and step; tokens I32 [A], logprobs F64 [A] (the log-probability the token
// was drawn with; 0 when greedy), status I32 [A]: kDrawOk, kDrawAllNegInf (no finite largest logit
// to draw from), or the id of the row's first NaN logit (the row's token is then 0). Every backend
// gives the same tokens and log-prob bits. On the GPU, rows of at most kGpuDrawMaxVocab logits.
struct DrawSpec {
  double temperature = 1.0;  // 0: greedy (the first largest logit); else finite and > 0
  int64_t top_k = 0;         // > 0: the k most likely tokens only
  double top_p = 1.0;        // in (0, 1]
  uint64_t seed = 0, step = 0;
};
inline constexpr int32_t kDrawOk = -1, kDrawAllNegInf = -2;
inline constexpr int64_t kGpuDrawMaxVocab = 2048;
void draw_tokens(const Tensor& logits, const DrawSpec& spec, const Tensor& keys, Tensor& tokens, Tensor& logprobs,
                 Tensor& status);

// Router: probs = softmax(logits [N, E]); top-k by probability (ties: lower expert index first),
// topk_idx I32 [N, k] in descending order, topk_w [N, k] = renormalised probabilities.
void router_topk(const Tensor& logits, int64_t k, Tensor& probs, Tensor& topk_idx, Tensor& topk_w);
// d_logits from d_topk_w [N, k] and an extra gradient on the probabilities d_probs [N, E], or
// [1, E] for one row every token shares (the load-balance loss's), through the renormalisation
// and the softmax.
void router_backward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_w,
                     const Tensor& d_topk_w, const Tensor& d_probs, Tensor& d_logits);

// ---- MoE permutation ---------------------------------------------------------------------------
// The assignment (token n, rank j) -> slot in the expert-sorted order: experts ascending, tokens
// ascending within an expert (stable, so the order never depends on arrival). offsets has E+1
// entries on the host (one read-back per MoE layer on the GPU); slot_of I32 [N, k] and
// token_of_slot I32 [N*k] live on the tensors' device. With probs (the router's probabilities
// [N, E], F32, or F64 on the CPU, on topk_idx's device), also prob_sums[e]: the sum over the
// tokens of probs[n, e] (the load-balance loss's P_e times N), in double in one fixed order on
// every backend: chunks of kProbSumChunk tokens each summed in token order, then the chunk sums
// in chunk order; on the GPU it comes back in the same read-back as the offsets.
constexpr int64_t kProbSumChunk = 64;
struct RoutePlan {
  std::vector<int64_t> offsets;  // empty until the plan is finished (route_plan_finish); E + 1 or
                                 // E + 2 entries (route_plan_begin's extra_rows)
  Tensor slot_of;
  Tensor token_of_slot;
  std::vector<double> prob_sums;  // with probs, else empty
  // I32 [E + 1] (E + 2 with extra rows): the offsets where the GPU made the plan, there from
  // route_plan_begin on, so that work queued before the host has the counts can read them
  // (grouped_gemm_device_offsets); undefined on the CPU, where the plan is complete at once.
  Tensor device_offsets;
  // F64 [E]: prob_sums where the GPU made them (with probs), there from route_plan_begin on, for
  // load_balance_term without a read-back; undefined on the CPU.
  Tensor device_prob_sums;
};
// route_plan in two halves: route_plan_begin queues the plan (on the GPU the sort and the
// read-back) and returns at once; route_plan_end waits for the read-back and completes it. Work
// queued between the two (a MoE layer's shared expert, which does not depend on the routing)
// keeps the GPU busy while the host waits.
struct PendingRoutePlan {
  RoutePlan plan;
  std::function<void(RoutePlan&)> finish;  // completes plan on the host; empty: already complete
};
// read_back false (GPU): nothing comes back (with probs, the sums stay in device_prob_sums), the
// host never waits for this plan (its offsets stay empty: work reads device_offsets), and a bad
// expert id stays in the device's index-error record until check_index_errors. The CPU's plan is
// complete either way.
// extra_rows (0 .. N): one more group after the experts' N k slots, tokens 0 .. extra_rows - 1 in
// order (a MoE layer's shared expert run as one more group of the routed experts' GEMMs):
// token_of_slot gets those extra_rows entries after the slots, and the offsets (host and device)
// E + 2 entries, the last group [N k, N k + extra_rows). slot_of and the sums are unchanged.
PendingRoutePlan route_plan_begin(const Tensor& topk_idx, int64_t n_experts, const Tensor& probs = Tensor(),
                                  bool read_back = true, int64_t extra_rows = 0);
// Fails with the first bad index a GPU op recorded and has not reported yet (route_plan_begin
// without read_back, grouped_gemm_device_offsets' offsets): waits for the GPU's queued work. On the
// CPU every op fails at once, so nothing is left to check.
void check_index_errors(Device device);
// Within a DeferIndexChecks scope the GPU ops that check user indices at once (embedding_forward's
// tokens, cross_entropy's targets: one wait for the GPU each) leave a bad one in the device's
// record instead, for check_index_errors or check_index_errors_later to report with the same
// message. A training forward queues its micro-batch so, with no wait (Model::forward_queued). Nests;
// one host thread issues GPU work. The CPU checks at once whatever the scope.
class DeferIndexChecks {
 public:
  DeferIndexChecks();
  ~DeferIndexChecks();
  DeferIndexChecks(const DeferIndexChecks&) = delete;
  DeferIndexChecks& operator=(const DeferIndexChecks&) = delete;
};
bool index_checks_deferred();
// A read of the device's index-error record queued behind the work queued so far; calling the
// result waits for it and fails as check_index_errors does if a bad index was recorded by then.
// Empty (nothing to check) on the CPU.
std::function<void()> check_index_errors_later(Device device);
RoutePlan route_plan_end(PendingRoutePlan pending);
// route_plan_end in place: waits for the read-back and completes pending.plan (once).
void route_plan_finish(PendingRoutePlan& pending);
RoutePlan route_plan(const Tensor& topk_idx, int64_t n_experts, const Tensor& probs = Tensor());
// The Switch load-balance loss of one MoE layer from its plan where the plan is, so that a GPU's
// training forward needs no counts on the host (ops/load_balance_math.h has the one expression):
// terms[slot] = coef * E * sum_e f_e * prob_sums[e] / tokens, f_e = (offsets[e + 1] - offsets[e]) /
// assignments, the sum in expert order in double (terms F64, slot < its size; offsets I32 [E + 1],
// prob_sums F64 [E], all on one device);
void load_balance_term(const Tensor& offsets, const Tensor& prob_sums, int64_t tokens, int64_t assignments,
                       double coef, Tensor& terms, int64_t slot);
// and its gradient on the router's probabilities, one row every token shares (router_backward's
// [1, E] d_probs, F32 on the GPU, F32 or F64 on the CPU): d_probs[e] = loss_weight * coef * E * f_e / tokens.
void load_balance_dprobs(const Tensor& offsets, int64_t tokens, int64_t assignments, float loss_weight, double coef,
                         Tensor& d_probs);
// x_perm[s] = x[token_of_slot[s]]: dense rows, or a Row-axis QTensor's rows (codes, scales and
// per-row outer scales travel together: tokens are dispatched already quantized).
void gather_rows(const Tensor& x, const Tensor& token_of_slot, Tensor& x_perm);
QTensor gather_rows(const QTensor& x, const Tensor& token_of_slot);
// out[dst_rows[s]] = x[s] for every row s of x [M, D] (any dtype; out [N, D] of the same dtype,
// its other rows unchanged; dst_rows I32 [M], distinct, in [0, N)): the KV-cache write of the
// sampler (model/kv_cache.h), each new token's K or V row to its (sequence, position) row.
void scatter_rows(const Tensor& x, const Tensor& dst_rows, Tensor& out);
// dx[n] = sum over j in rank order of dx_perm[slot_of[n, j]] (no atomics: deterministic).
void gather_rows_backward(const Tensor& dx_perm, const Tensor& slot_of, Tensor& dx);
// out[n] = sum over j in rank order of w[n, j] * y_perm[slot_of[n, j]]  (overwrites out).
// plus (optional, out's dtype and shape): out[n] = that sum + plus[n], the bits of add_(out, *plus)
// after the sum (the shared expert's output, added in the same pass).
void moe_combine(const Tensor& y_perm, const Tensor& slot_of, const Tensor& w, Tensor& out,
                 const Tensor* plus = nullptr);
// dy_perm[slot_of[n, j]] = w[n, j] * dout[n]; dw[n, j] = <dout[n], y_perm[slot_of[n, j]]>.
void moe_combine_backward(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                          const Tensor& w, Tensor& dy_perm, Tensor& dw);

// ---- optimizer ------------------------------------------------------------------------------
// AdamW (decoupled weight decay) on one F32 parameter tensor and its state, step t >= 1:
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p).
struct AdamW {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;
  float grad_scale = 1.0f;  // the gradient is used as fl(grad * grad_scale) (clipping), grad unchanged
};
// With param_bf16 (BF16, param's element count, on its device) the updated parameter's BF16
// rounding is written there too: the bits of convert(param) after the step, without a second pass
// over the parameters (the bf16 recipe's weight copies, Optimizer::write_bf16_copies).
//
// With gate (grad_norm_gate's, on param's device; h.grad_scale must then be 1) the gradient is
// scaled by the gate's clip factor, and nothing is written where the gate says to skip: the
// update is queued before anyone has read the norm.
//
// With slice_amax (amax: F32 [param.numel() / slice] on param's device) the updated parameter's
// slices of `slice` elements each raise amax[s] to their max |p| over finite values
// (num::max_abs_finite, the NVFP4 outer-scale group amax of NUMERICS): the next forward's NVFP4
// weights take it instead of a pass over the weights (Optimizer::write_slice_amax). The caller
// zeroes amax; tensors raised into one amax get their joint amax (an FFN's w1 and w3). Written
// also where the gate skips the update, from the unchanged parameters.
struct SliceAmax {
  Tensor* amax = nullptr;
  int64_t slice = 0;
};
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& h,
                Tensor* param_bf16 = nullptr, const Tensor* gate = nullptr, const SliceAmax& slice_amax = {});

// The gate of one optimizer update, computed where the gradients are, so that the update can be
// queued without the host reading anything first (it reads the gate later, while the update
// runs). gate: F64 [kGateSize] on the gradients' device, written with
//   [kGateNorm]  the global norm: the square root of sum_squares_each(grads)'s totals added in
//                order (Optimizer::grad_norm's number, bit for bit);
//   [kGateClip]  the clip factor for the update, float(max_norm / norm) where max_norm > 0 and
//                norm > max_norm, else 1 (a float value);
//   [kGateQuantNonfinite] 1 where a quantizer met NaN/Inf since the sticky flag was last cleared
//                (nonfinite_seen), else 0; the gate takes the flag and clears it;
//   [kGateSkip]  1 where the update must not happen: the norm is not finite, or [kGateQuantNonfinite].
// No host synchronisation on the GPU.
enum GateField : int { kGateNorm = 0, kGateClip = 1, kGateQuantNonfinite = 2, kGateSkip = 3, kGateSize = 4 };
void grad_norm_gate(const std::vector<Tensor>& grads, double max_norm, Tensor& gate);

}  // namespace fourbit::ops
