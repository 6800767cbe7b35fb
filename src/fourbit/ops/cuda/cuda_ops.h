// defines: the CUDA backend's entry points (same signatures and semantics as ops.h, CUDA tensors),
//          take_nonfinite_flag, nonfinite_flag_address, native_block_scaled_gemm, grouped_gemm, grouped_gemm_bf16,
//          grouped_gemm_reads_device_offsets, grouped_gemm_device_offsets, GroupedOperand, grouped_gemm_rows,
//          grouped_rows_per_group, device_rows_per_group, packed_operand,
//          KGroupedProblem, grouped_gemm_k, KDeviceSet, grouped_gemm_k_device_offsets, convert_each, zero_each,
//          set_grouped_kernel, set_grouped_transposed_b,
//          set_fused_dequant, set_grouped_wgmma, set_skinny_wgrad, set_grouped_tma, set_grouped_decode_width, set_grouped_tile_band,
//          set_grouped_tma_persistent, set_grouped_tma_tile, set_grouped_wgrad_tma_tile, set_grouped_tma_pingpong,
//          set_grouped_tma_pingpong_mn_major, set_grouped_wgrad_tma_pingpong, set_grouped_wgrad_tma,
//          set_grouped_narrow_tiles, set_grouped_tma_store_probe,
//          grouped_tma_launches, grouped_wgrad_tma_launches, grouped_wgrad_device_calls,
//          set_dependent_launches, wgmma_available,
//          check_recorded_index_errors, recorded_index_errors_later, route_plan_read_backs, gemm_batch, quantize_segments, quantize_row_col, gather_quantize_row_col,
//          quantize_row_col_device_offsets, gather_quantize_row_col_device_offsets,
//          moe_combine_backward_row_col_device_offsets, swiglu_forward_row_col_device_offsets,
//          swiglu_backward_row_col_device_offsets,
//          moe_combine_backward_owners, moe_combine_backward_row_col, swiglu_forward_row_col, swiglu_backward_row_col, quantize_both, quantize_both_each,
//          requantize_transposed_segments, decode_bf16,
//          quantize_kernel_for, quantize_kernel_names,
//          requantize_kernel_for, set_flash_wgmma, set_flash_cta, set_flash_head_rows, rope_qkv_to_cache,
//          rope_fused_qkv_to_cache, rmsnorm_forward_quantized, add_rmsnorm_forward_quantized, rmsnorm_input_wgrad,
//          swiglu_forward_fused_quantized, row_quant_fused, flash_attention_forward, flash_attention_step,
//          attention_step_quant_fused,
//          flash_attention_backward, materialized_attention_forward, materialized_attention_backward
// Plain C++ (no CUDA syntax): ops.cpp, compiled by the host compiler, includes it. Kernels run on
// cuda::stream() (the default stream, or the current GPU lane's); results that the host reads
// (losses, counts) synchronise.
#pragma once
#include <string>
#include <vector>

#include "fourbit/ops/ops.h"

namespace fourbit::ops::cuda {

#include "fourbit/ops/backend_ops.inc"  // NOLINT(bugprone-suspicious-include)

// The device-side sticky flag the quantize kernels raise on NaN/Inf input (synchronises).
bool take_nonfinite_flag(bool clear);
// That flag's device address (grad_norm_gate takes it on the device, without a host read).
unsigned int* nonfinite_flag_address();

// ops::grouped_gemm on CUDA operands (checked by the caller; B's groups are n x k): BF16 and decoded
// block-scaled groups in one launch of grouped_gemm_bf16_rows, FP32 ones and a transposed dense B as
// one cuBLASLt GEMM per group on lanes; false when it does not apply (more than 128 groups, native
// block-scaled GEMMs, a transposed B that would need a conversion), and the caller runs one gemm
// per group.
bool grouped_gemm(const Operand& a, const Operand& b, const std::vector<int64_t>& offsets, int64_t n, int64_t k,
                  Tensor& c, bool accumulate);

// C[M, N] (F32) (+)= for each group g: A[offsets[g] .. offsets[g+1], k_begin .. k_end) (BF16 [M, K])
// . B[g][:, k_begin .. k_end)^T (BF16 [G, N, K]), with offsets an I32 CUDA tensor [G + 1] read on
// the GPU: no host read-back, one launch for every group (grouped_mma.cu). Each output element is
// summed over K in one fixed order whatever M and the grouping (no split-K), so a row's bits depend
// only on its A row and its group's B. K, k_begin and k_end are multiples of 8 (k_end = -1: K);
// the K range is for tests (a split-K negative control). Rows outside every group are left
// untouched. Offsets outside [0, M] or decreasing are recorded and reported by the next
// check_recorded_index_errors() (or the next MoE route plan), never read or written past.
void grouped_gemm_bf16(const Tensor& a, const Tensor& b, const Tensor& offsets, Tensor& c, bool accumulate,
                       int64_t k_begin = 0, int64_t k_end = -1);
// ops::grouped_gemm_device_offsets on CUDA (operands checked by the caller; B's groups n x k):
// dense BF16 operands by grouped_gemm_bf16, block-scaled ones (one format for A and B) as
// grouped_gemm runs them with host offsets (packed into the kernel where the groups average at most
// 64 rows, else decoded to BF16 first), reading the offsets on the GPU; where the grouped kernel
// takes the groups (grouped_gemm_reads_device_offsets). false (nothing done) where it would not:
// then ops::grouped_gemm's other path gives the bits.
bool grouped_gemm_reads_device_offsets(int64_t groups, int64_t k);
bool grouped_gemm_device_offsets(const Operand& a, const Operand& b, const Tensor& offsets, int64_t n, int64_t k,
                                 Tensor& c, bool accumulate);

// One operand of grouped_gemm_rows: BF16 values or block-scaled codes (rows ld_bytes apart; B's
// group g starts g * slice_bytes in), block scales (scale_ld bytes a row, B's group g at
// g * scale_slice), NVFP4 outer scales (A: row m's at outer[m * outer_stride]; B: column n of group
// g at outer[g * outer_group_stride + n * outer_stride]; null: none).
struct GroupedOperand {
  Format fmt = Format::BF16;
  const void* data = nullptr;
  int64_t ld_bytes = 0, slice_bytes = 0;
  const uint8_t* block_scales = nullptr;
  int64_t scale_ld = 0, scale_slice = 0;
  const float* outer = nullptr;
  int outer_stride = 0;
  int64_t outer_group_stride = 0;
  // B only, BF16 (Hopper): MN-major, each group stored [K, N] with K rows ld_bytes apart (a dgrad's
  // forward weight, read in place)
  bool trans = false;
  // BF16 rows ld elements apart, groups slice elements apart.
  static GroupedOperand bf16(const void* data, int64_t ld, int64_t slice) {
    GroupedOperand o;
    o.data = data;
    o.ld_bytes = 2 * ld;
    o.slice_bytes = 2 * slice;
    return o;
  }
};

// The same kernel family with offsets known on the host (passed by value, offsets[0] = 0,
// M = offsets[G]), C F32 rows ldc apart, K = k values (block-scaled: padded to whole blocks): BF16
// x BF16, or NVFP4 x NVFP4 / MXFP8 x MXFP8 (one format for both) dequantized in the kernel with the
// outer scales applied in its epilogue, NUMERICS' order (the bits of decoding to BF16, one BF16
// GEMM and the scale epilogue). false (nothing done) where it does not apply: more than 128
// groups, other formats or two different ones, K not a multiple of 8 (BF16) or 32, rows or slices
// not 16-byte multiples, data not 16-byte aligned, block-scale rows or slices not 4-byte multiples,
// an MN-major B (b.trans) other than BF16 on a Hopper GPU's wgmma loop, or with N not a multiple
// of 8 (it gives the bits of its K-major copy). ops::grouped_gemm runs every BF16 and block-scaled grouped GEMM through it, the sampler's and
// the trainer's alike.
bool grouped_gemm_rows(const GroupedOperand& a, const GroupedOperand& b, const std::vector<int64_t>& offsets,
                       int64_t n, int64_t k, float* c, int64_t ldc, bool accumulate);
// The same with the offsets an I32 [groups + 1] array on the GPU (its last value m, which the caller
// gives), read by the kernel: no read-back. The row tile and decode configuration are picked by the
// average rows a group (device_rows_per_group); every configuration gives the same bits, so these
// are the host-offset form's bits. Offsets outside [0, m] or decreasing are recorded as index
// errors (grouped_gemm_bf16).
bool grouped_gemm_rows(const GroupedOperand& a, const GroupedOperand& b, const int32_t* device_offsets,
                       int64_t groups, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc, bool accumulate);

// One GEMM of grouped_gemm_k: C (F32 [m, n], rows ldc apart) (+)= A . B^T over k values, A and B
// BF16, K-major (A [m, k], B [n, k], rows lda / ldb elements apart) or MN-major (stored [k, m] and
// [k, n], K rows lda / ldb elements apart).
struct KGroupedProblem {
  const void* a;
  const void* b;
  float* c;
  int64_t lda, ldb, k;
};
// The grouped kernel's K-grouped form (a MoE layer's expert weight gradients, K running over each
// expert's tokens): every problem, one output shape, all operands K-major or all MN-major, in one
// launch (64 problems a launch) of a Hopper wgmma kernel (128 x 256 or 256 x 128 tiles). An element is the
// FP32 sum of its k products in a fixed order: deterministic, whatever the other problems (not
// batch invariant: a weight gradient's K is the batch). k = 0: C = 0 (accumulate: C untouched).
// false (nothing done) where it does not apply: not a Hopper device with the wgmma loop on
// (set_grouped_wgmma), n or ldc odd, MN-major m or n not multiples of 8, K-major k not a multiple
// of 8, lda / ldb not multiples of 8, operands not 16-byte or outputs not 8-byte aligned.
bool grouped_gemm_k(bool mn_major, const std::vector<KGroupedProblem>& problems, int64_t m, int64_t n, int64_t ldc,
                    bool accumulate);
// grouped_gemm_k with the problems' K ranges in device offsets (ops::grouped_wgrad_device_offsets):
// for each set s of operands and each group g, one problem: K rows offsets[g] .. offsets[g + 1] (I32
// [groups + 1] on the device) of MN-major A_s (BF16 [rows, m], K rows lda elements apart) and B_s
// ([rows, n], ldb), its C [m, n] at c_s + g m n. The host reads no offset: a kernel writes each
// problem's arguments and TMA maps where the GPU has the offsets, then one launch of the K-grouped
// form (its tile as set_grouped_wgrad_tma_tile / _pingpong say) runs every problem; the bits of
// grouped_gemm_k on the same problems. Bad offsets are recorded as grouped_gemm's index errors
// (ops::check_index_errors). false (nothing done) where grouped_gemm_k would decline the MN-major
// problems, or m or n is not a multiple of 8, or sets x groups is outside 1 .. 65535.
struct KDeviceSet {
  const void* a;
  const void* b;
  float* c;
};
bool grouped_gemm_k_device_offsets(const std::vector<KDeviceSet>& sets, int64_t lda, int64_t ldb, int64_t rows,
                                   const int32_t* offsets, int64_t groups, int64_t m, int64_t n, bool accumulate);

// The rows a non-empty group holds on average (rounded up; 0 without rows): what the grouped kernel
// picks its row tile by, and ops::grouped_gemm its path for block-scaled operands.
int64_t grouped_rows_per_group(const std::vector<int64_t>& offsets);
// Where the offsets stay on the GPU: m rows over all groups, the empty ones included (rounded up).
int64_t device_rows_per_group(int64_t groups, int64_t m);

// A block-scaled CUDA QTensor as grouped_gemm_rows reads it, packed (as B, its slices are the groups).
GroupedOperand packed_operand(const QTensor& q);

// Whether ops::grouped_gemm runs BF16 groups through the grouped kernel (the default) or one
// cuBLASLt GEMM per group on lanes (the path before it), process-wide: for benchmarks that compare
// the two in one process (train_bench --expert-gemms both). The two give different bits, so a
// sampler and the trainer it must match never run under different settings.
void set_grouped_kernel(bool on);
// Whether a transposed dense B (the bf16 recipe's expert dgrad weights) goes through the grouped
// kernel read MN-major (the default, on Hopper) or to cuBLASLt group by group on lanes, with
// set_grouped_kernel on: a backward-only choice (the sampler never meets it), for benchmarks.
void set_grouped_transposed_b(bool on);

// Whether block-scaled groups are dequantized inside the grouped kernel (the default) or decoded
// to BF16 copies first, then summed by the same kernel and scaled by a separate epilogue (the
// path before it): the same bits, so tests compare the two; benchmarks time them.
void set_fused_dequant(bool on);

// The threads of cross_entropy's block a row: by V (0, the default: the smallest of 128, 256 and
// 512 with a thread for every 4 logits, else 1024), or forced (128, 256, 512 or 1024; one too
// small for V's groups runs 1024), for the test that checks every size gives the same bits.
void set_cross_entropy_threads(int threads);
int cross_entropy_threads(int64_t V);

// Whether the grouped kernel runs its Hopper main loop (wgmma, the default on compute capability
// 9.x) or the portable mma.sync one, process-wide: for benchmarks and tests that compare the two.
// They sum in different orders (different bits), so a sampler and its trainer share one setting.
void set_grouped_wgmma(bool on);

// Whether the router's FP32 weight gradient (at most 32 rows over at least 256 tokens: gemm's
// skinny_f32_wgrad, and rmsnorm_input_wgrad with its input made in the kernels) runs
// skinny_gemm.cu's chunked kernels (on, the default) or cuBLASLt after a norm pass (off, the path
// before them), process-wide; returns the previous setting. For the tests and the benchmarks'
// A/B.
bool set_skinny_wgrad(bool on);

// Whether the Hopper loop's training tile on BF16 groups is fed by TMA in two-CTA clusters that
// multicast their shared A tile (the default) or by cp.async from every thread, process-wide: the
// same bits, for tests and benchmarks that compare the two.
void set_grouped_tma(bool on);
// Groups of at most 64 rows on average (the sampler's decode) run a kernel that streams the
// weights over all of K: by default (0) the streaming kernel where groups average at most 16 rows,
// 64 for packed block-scaled operands (each warp 16 weight rows, decoded in registers as the MMA's
// A operand), else 64 x WN tiles of
// one warpgroup, WN = 128 where that gives every SM a CTA, else 32. Forced: 16 (the streaming
// kernel), 32 or 128, or -1 for the 64 x 256 tile of two warpgroups. The same bits every way; for
// benchmarks and the tests.
void set_grouped_decode_width(int width);
// Whether groups of more than 64 rows, at most 1024 rows in all, whose 256 x 128 training tiles
// would number fewer than the SMs (host offsets: a linear layer's one group of a few hundred rows
// at decode or prefill) run the 64 x 128 tiles of one warpgroup instead (the default),
// process-wide: the same bits, for the tests that compare them with the training tile.
void set_grouped_narrow_tiles(bool on);
// The TMA form's tile order: its two-CTA clusters walk bands of `pairs` column-tile pairs, row tiles
// fastest within a band (default 8); 0 walks a row tile's column tiles before the next row tile's.
// The same bits in any order; for benchmarks.
void set_grouped_tile_band(int pairs);
// The TMA form's tile, process-wide: 256 (the default) for 128 x 256 on two warpgroups of
// m64n256k16, 128 for 256 x 128 on four of m64n128k16. The same bits either way; returns the
// previous setting. For tests and benchmarks.
int set_grouped_tma_tile(int n);
// The same choice for the K-grouped form's TMA tiles (the experts' weight gradients).
int set_grouped_wgrad_tma_tile(int n);
// Where the row-grouped TMA form takes its ping-pong tiles instead of set_grouped_tma_tile's,
// process-wide: 128 x 128 tiles that two warpgroups take in turn, one's epilogue under the other's
// MMAs, for GEMMs whose K is at most max_k (default 4096, gpu-small's training shapes; 0: never;
// above it the flat tile, faster where the epilogue is a small part of the time). The same bits;
// returns the previous setting. For tests and benchmarks.
int set_grouped_tma_pingpong(int max_k);
// Whether a row-grouped GEMM with an MN-major B (the bf16 recipe's expert dgrads) takes those
// ping-pong tiles too (true, the default) or the set_grouped_tma_tile one. The same bits; returns
// the previous setting. For benchmarks.
bool set_grouped_tma_pingpong_mn_major(bool on);
// The K-grouped form (the experts' weight gradients) on ping-pong tiles (off by default: on an
// H100 the step was within ~0.25 ms either way, and gpu_grouped_gemm timed these calls ~1.9x
// slower, not yet explained). The same bits; returns the previous setting.
bool set_grouped_wgrad_tma_pingpong(bool on);
// A probe for benchmarks only: with no_store, the row-grouped TMA form runs its main loop and
// skips its epilogue, leaving C unwritten (wrong results), so that a benchmark can time the main
// loop alone against the whole kernel. Off by default; never for results.
void set_grouped_tma_store_probe(bool no_store);
// Whether the TMA form is persistent (the default: as many clusters as fit on the device at once,
// each looping over its tiles with one ring of stages) or launches a cluster a tile. The same bits;
// for tests and benchmarks.
void set_grouped_tma_persistent(bool on);
// How many launches took the TMA form so far in this process (tests check that it ran).
int64_t grouped_tma_launches();
// Whether grouped_gemm_k's problems (the expert weight gradients: MN-major for the bf16 recipe,
// K-major decoded MXFP8 for the quantized ones) run in the TMA form (the default: persistent, one
// producer thread, a pair of tensor maps a problem that zero-fill the K past its tokens) or the
// cp.async one. The same bits; for tests and
// benchmarks. grouped_wgrad_tma_launches: how many launches took the TMA form in this process.
void set_grouped_wgrad_tma(bool on);
int64_t grouped_wgrad_tma_launches();
// How many calls of grouped_gemm_k_device_offsets ran (returned true) in this process: tests that
// a step took the device-offset path.
int64_t grouped_wgrad_device_calls();

// Whether the kernels of a decode step (the streaming GEMM, norms, attention step, router, MoE
// gathers and combine, SwiGLU, the row quantizers, cross-entropy, token draws) are launched as
// programmatic dependent launches (dependent_launch.cuh; the default, on compute capability 9.0+):
// each may be scheduled while the kernel before it runs and waits for it on the device, so kernels
// of a few microseconds do not each pay a launch between them. The same bits either way; for the
// benchmarks' A/B and the tests. A CUDA graph keeps the setting it was captured with.
void set_dependent_launches(bool on);

// Whether this device runs that Hopper loop at all: compute capability 9.x and a build with sm_90a
// code (the default CMAKE_CUDA_ARCHITECTURES); elsewhere the grouped kernel is the mma.sync one.
bool wgmma_available();

// Synchronises and fails with the op's message if a kernel recorded a bad index (index_errors.cuh).
void check_recorded_index_errors();
// ops::check_index_errors_later on the GPU.
std::function<void()> recorded_index_errors_later();
// route_plan_begin calls that read the counts back, since the process started (for tests: a
// forward that should read nothing back).
int64_t route_plan_read_backs();

// ops::gemm_batch (grouped: ops::gemm_batch_grouped) on CUDA operands (checked by the caller);
// false when it does not apply (native block-scaled GEMMs), and the caller runs one gemm per job.
bool gemm_batch(const std::vector<GemmJob>& jobs, bool grouped);

// ops::convert_each's F32 -> BF16 pairs in one launch; false (nothing done) if a pair is not one.
bool convert_each(const std::vector<Tensor>& src, std::vector<Tensor>& dst);
// ops::zero_each in one launch; false (nothing done) if a tensor is not 16-byte aligned in
// address and size.
bool zero_each(std::vector<Tensor>& ts);

// q's BF16 decode (QTensor::bf16: code x block scale, outer scales left to the GEMM), BF16
// [q.total_rows(), q.padded_cols()]: the decode pass the GEMMs run on codes. quantize's forms
// (FormOut): NVFP4's kernels and requantize_transposed_kernel write the decode from the codes in
// their registers (and skip the codes for FormOut::Bf16); other kernels write codes, then this.
Tensor decode_bf16(const QTensor& q);

// ops::quantize_segments on a CUDA tensor (checked by the caller) into out; false when the spec
// has no batched kernel, and the caller quantizes segment by segment.
bool quantize_segments(const Tensor& x, const std::vector<int64_t>& offsets, const QuantSpec& spec,
                       const std::vector<RngKey>& rngs, std::vector<QTensor>& out);

// ops::quantize_row_col on a CUDA tensor (2-D, axes and offsets checked by the caller) into out,
// in one pass of mxfp8_row_col_kernel; false (nothing done) unless both specs are MXFP8 of one
// element format without an RHT and x is F32 and contiguous.
bool quantize_row_col(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                      const std::vector<int64_t>& offsets, const std::vector<RngKey>& col_rngs, FormOut row_out,
                      FormOut col_out, RowColQuant& out);

// ops::gather_quantize_row_col on CUDA tensors (checked by the caller) into out, in one pass of
// mxfp8_row_col_kernel reading x's rows through token_of_slot; false (nothing done) where
// quantize_row_col's conditions do not hold for x.
bool gather_quantize_row_col(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec, RngKey row_rng,
                             const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                             const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out, RowColQuant& out);

// ops::quantize_row_col_device_offsets and ops::gather_quantize_row_col_device_offsets on CUDA
// tensors (checked by the caller) into out, in one pass of mxfp8_row_col_kernel finding each
// segment from the offsets on the GPU; false (nothing done) where quantize_row_col's conditions do
// not hold for x.
bool quantize_row_col_device_offsets(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng,
                                     const QuantSpec& col_spec, const Tensor& offsets,
                                     const std::vector<RngKey>& col_rngs, FormOut row_out, RowColQuant& out);
bool gather_quantize_row_col_device_offsets(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec,
                                            RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                            const std::vector<RngKey>& col_rngs, FormOut row_out, RowColQuant& out);
// ... and the combine gradient's and the SwiGLU's one-pass sources likewise (checked as their
// host-offset forms check them; false where those would be).
bool moe_combine_backward_row_col_device_offsets(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                                                 const Tensor& w, Tensor& dw, const QuantSpec& row_spec,
                                                 RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                                 const std::vector<RngKey>& col_rngs, FormOut row_out,
                                                 RowColQuant& out);
bool swiglu_forward_row_col_device_offsets(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                                           RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                           const std::vector<RngKey>& col_rngs, FormOut row_out, RowColQuant& out);
bool swiglu_backward_row_col_device_offsets(const Tensor& da, const Tensor& h1, const Tensor& h3,
                                            const QuantSpec& row_spec, const std::array<RngKey, 2>& row_rngs,
                                            const QuantSpec& col_spec, const Tensor& offsets,
                                            const std::array<std::vector<RngKey>, 2>& col_rngs, FormOut row_out,
                                            std::array<RowColQuant, 2>& out);

// moe_combine_backward's dw (checked as it checks its arguments), and in place of dy_perm each
// slot's assignment a (slot_of[a] = slot; -1 where none): I32 [M], from which dy_perm's row is
// w[a] dout[a / k] (ops::moe_combine_backward_row_col).
Tensor moe_combine_backward_owners(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of, const Tensor& w,
                                   Tensor& dw);
// ops::moe_combine_backward_row_col on CUDA tensors (checked by the caller) into out: the owners,
// then one pass of mxfp8_row_col_kernel computing dy_perm's rows; false (nothing done) where
// quantize_row_col's conditions do not hold for dout.
bool moe_combine_backward_row_col(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of, const Tensor& w,
                                  Tensor& dw, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                                  const std::vector<int64_t>& offsets, const std::vector<RngKey>& col_rngs,
                                  FormOut row_out, FormOut col_out, RowColQuant& out);

// ops::swiglu_forward_row_col on CUDA tensors (shapes, axes and offsets checked by the caller)
// into out, in one pass of mxfp8_row_col_kernel from h1 and h3; false (nothing done) where
// quantize_row_col's conditions do not hold for F32 inputs.
bool swiglu_forward_row_col(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, RngKey row_rng,
                            const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                            const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out, RowColQuant& out);

// ops::swiglu_backward_row_col on CUDA tensors (shapes, axes and offsets checked by the caller)
// into out, in one pass of mxfp8_row_col_kernel from da, h1 and h3; false (nothing done) where
// quantize_row_col's conditions do not hold for F32 inputs.
bool swiglu_backward_row_col(const Tensor& da, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                             const std::array<RngKey, 2>& row_rngs, const QuantSpec& col_spec,
                             const std::vector<int64_t>& offsets, const std::array<std::vector<RngKey>, 2>& col_rngs,
                             FormOut row_out, FormOut col_out, std::array<RowColQuant, 2>& out);

// ops::quantize_both on a CUDA tensor (axes checked by the caller) into row and col, in one pass
// of mxfp8_row_col_kernel (a segment per slice); false (nothing done) where quantize_row_col's
// conditions do not hold.
bool quantize_both(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                   RngKey col_rng, FormOut row_out, FormOut col_out, QTensor& row, QTensor& col);
// ops::quantize_both_each on CUDA tensors into out (one entry a job): every job's tensor in one
// launch of mxfp8_row_col_jobs_kernel per MXFP8 variant; false (nothing done) unless quantize_both's
// one pass takes every job.
// into: out holds the forms such a call returned (layouts checked), written in place.
bool quantize_both_each(const std::vector<BothJob>& jobs, std::vector<BothAxes>& out, bool into = false);

// ops::requantize_transposed_segments on a CUDA QTensor (checked by the caller) into out; false
// where requantize_transposed_kernel does not take q to target (behind an RHT, targets other than
// E4M3 with SR): the caller requantizes segment by segment.
bool requantize_transposed_segments(const QTensor& q, const std::vector<int64_t>& offsets, const QuantSpec& target,
                                    const std::vector<RngKey>& rngs, FormOut form, std::vector<QTensor>& out);

// The two GPU attention paths behind ops::attention_forward/backward (same arguments; the fused
// backward takes D = rowsum(dout * out) [B, Hq, T] and writes per-q-head gradients dk_heads,
// dv_heads [B, Hq, S, hd], which the caller sums over each group). The fused one (flash_attention.cu)
// returns false for shapes it does not take (hd other than 32, 64 or 128; unaligned outputs) and the
// materialized one (attention.cu: scores in memory, cuBLASLt GEMMs) runs instead. Both are here
// for the tests and bench/gpu_attention, which compare them.
// On a device with sm_90a code the fused kernels run on wgmma at hd 64 and 128 (flash_attention.cu);
// set_flash_wgmma(false) makes them use mma.sync, as elsewhere (tests and bench/gpu_attention
// compare the two).
void set_flash_wgmma(bool on);
// The wgmma kernels' CTA: 1 or 2 warpgroups (64 rows each) sharing a stream of blocks through 2 or
// 3 buffers. Every shape gives the same bits; the default (1, 2) is the fastest measured on the H200.
void set_flash_cta(int warpgroups, int stages);
// Whether a one-token forward step of grouped-query attention (T = 1, Hq / Hkv of 2 to 64: the
// sampler's decode) runs a CTA per kv head with the group's q heads as its rows (true, the default)
// or a CTA per q head, each reading the group's keys and values again; the same bits (tests and
// bench/gpu_sampler compare the two).
void set_flash_head_rows(bool on);
// ops::rope_qkv_to_cache in one kernel (arguments checked by the caller; positions and dst_rows
// are checked here and bad ones recorded as rope_forward and scatter_rows record them); false
// (nothing done) where it does not apply: an odd head size.
bool rope_qkv_to_cache(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& table,
                       const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache);
// The same for ops::rope_fused_qkv_to_cache: q, k and v read in place from the fused projection's rows.
bool rope_fused_qkv_to_cache(const Tensor& qkv, int64_t Hq, const Tensor& positions, const Tensor& table,
                             const Tensor& dst_rows, Tensor& q_bf16, Tensor& k_cache, Tensor& v_cache);
// ops::rmsnorm_forward, add_rmsnorm_forward and swiglu_forward_fused with a quantized output
// (ops.h "Quantized outputs") in one kernel each (arguments checked here, the RowQuant by the
// caller); false (nothing done) where the spec or the shapes are not the fused kernels' (then the
// op runs, then quantize).
bool rmsnorm_forward_quantized(const Tensor& x, const Tensor& w, float eps, Tensor& y, Tensor& rstd, Tensor* y_bf16,
                               const RowQuant& yq);
bool add_rmsnorm_forward_quantized(const Tensor& a, const Tensor& b, Tensor& sum, const Tensor& w, float eps, Tensor& y,
                                   Tensor& rstd, Tensor* y_bf16, const RowQuant& yq);
bool swiglu_forward_fused_quantized(const Tensor& h13, Tensor& a, const RowQuant& aq);
// Whether those kernels take spec for rows of `cols` values.
bool row_quant_fused(const QuantSpec& spec, int64_t cols);
// ops::rmsnorm_input_wgrad with each y computed where the weight-gradient GEMM reads it
// (skinny_gemm.cu), for F32 tensors, dw of at most 32 rows and at least 256 rows of x; false
// (nothing done) otherwise.
bool rmsnorm_input_wgrad(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, Tensor& dw,
                         bool accumulate);
// q, k, v (and the fused backward's dout) may be F32 or BF16 (ops.h "BF16 operands"): the kernels
// read BF16, and an F32 operand is converted first.
bool flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out, Tensor& lse,
                             Tensor* out_bf16 = nullptr);
// ops::attention_step's fused kernel: sequence b's one query at position positions[b], read on the
// GPU (a position outside [0, S) is recorded as an index error and its rows are left unwritten).
// oq (where attention_step_quant_fused(oq->spec, hd)): out's [B, Hq * hd] rows quantized in the
// kernel's epilogue as well (ops.h "Quantized outputs"), MXFP8 RNE, each 32-value block within a head.
bool flash_attention_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions, Tensor& out,
                          Tensor& lse, Tensor* out_bf16 = nullptr, const RowQuant* oq = nullptr);
bool attention_step_quant_fused(const QuantSpec& spec, int64_t hd);
bool flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                              const Tensor& D, Tensor& dq, Tensor& dk_heads, Tensor& dv_heads);
void materialized_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos0, Tensor& out,
                                    Tensor& lse, Tensor* out_bf16 = nullptr);
void materialized_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv);

// The quantize dispatch (quantize.cu): the name of the kernel a quantize call of spec over a
// logical [slices,] rows x cols input takes (vec4: float4-loadable; group_amax: the caller gives
// the outer scales' group amax), every entry of a format's list in order (the generic tile kernel
// last), and the kernel requantize_transposed takes from q to the (checked) target spec. Host
// code only, no device needed: the tests check that their cases reach every entry.
const char* quantize_kernel_for(const QuantSpec& spec, int64_t slices, int64_t rows, int64_t cols, bool vec4,
                                bool group_amax);
std::vector<std::string> quantize_kernel_names(Format f);
const char* requantize_kernel_for(const QTensor& q, const QuantSpec& spec);

// Whether this GPU multiplies NVFP4/MXFP8 operands natively (block-scaled tensor cores, sm_100+).
bool native_block_scaled_gemm();

}  // namespace fourbit::ops::cuda
