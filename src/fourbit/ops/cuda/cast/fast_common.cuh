// defines: kWarps, kFastRunBlocks, kNvfp4FastMaxWarps, FastRowParams, stage_swizzle, stage_offset, load_run,
//          shared_address, read_run_address, read_run_at, read_run, stage_run,
//          finite_amax_counting, mxfp8_generic_block, store_mx_codes, mxfp8_sr_word,
//          mxfp8_sr_block, opaque_ptr,
//          prefetch_run, mxfp8_fast_words, mxfp8_fast_block, nvfp4_row_block_scales, nvfp4_row_block,
//          fast_row_input, fast_row_params, with_mxfp8_variant
// What the register-resident kernels share (nvfp4_row_fast, mxfp8_row_fast, mxfp8_col_fast and
// requantize_transposed): warp runs of 32 blocks staged through swizzled shared memory, the
// cp.async copies, and the MXFP8 block encoders (fast_quant.h's forms, the generic quantizer for
// blocks holding NaN/Inf).
#pragma once
#include "fourbit/ops/cuda/cast/quantize_tile.cuh"
#include "fourbit/ops/cuda/mma.cuh"

namespace fourbit::ops::cuda {
namespace {

// ---- register-resident fast paths: Row axis, no RHT ------------------------------------------------
//
// Shape (both kernels): a warp takes runs of 32 consecutive blocks of one storage row, and lane l
// ends up owning block l of each run in registers, quantizing it alone with the
// numerics/fast_quant.h functions (proven equal to the generic block quantizers). A run is read
// with coalesced 16-byte loads, lane l taking float4s l, l + 32, ... (MXFP8: every load of the
// thread issued before the first is used; NVFP4: cp.async copies of the next row group, issued
// before the current one is computed), and handed over through a per-warp shared buffer (2 KB a
// run for NVFP4, 4 KB for MXFP8) whose chunk order is XOR-swizzled, so that both the coalesced
// stores and the block-owning reads are free of bank conflicts. Codes leave as one 8-byte (NVFP4)
// or two 16-byte (MXFP8) stores per lane: a warp writes a contiguous run. A block holding a NaN or
// an Inf (found by a NaN-propagating max, one instruction per element) takes the generic numerics
// on a local copy, and is counted as the tile kernel counts it. Inputs must be float4-loadable
// (cols % 4 == 0, 16-byte aligned); padding past cols is loaded as zeros, as in the tile kernel.

constexpr int kWarps = kThreads / 32;
constexpr int kFastRunBlocks = 32;      // blocks per warp run: one per lane
constexpr int kNvfp4FastMaxWarps = 16;  // per CTA: one row of up to 16384 columns
static_assert(kFastRunBlocks == 32, "a run is one block per lane of a warp");
static_assert(kNvfp4FastMaxWarps * 2 * kFastRunBlocks * num::kNvfp4Block == kFusedMaxCols,
              "a team of the most warps with two runs each covers the widest per-token row");
static_assert(32 % num::kSrPerCall == 0 && num::kMxBlock % num::kSrPerCall == 0,
              "an MXFP8 block's SR draws are whole Philox calls");

struct FastRowParams {
  const float* x;          // storage rows [rows, cols], contiguous
  int64_t rows, cols, padded_cols, nb;
  uint8_t* codes;          // [rows, code_row_bytes]; NVFP4: null for a form of its BF16 decode alone
  uint8_t* scales;         // [rows, nb]
  __nv_bfloat16* bf16;     // NVFP4: the BF16 decode [rows, padded_cols] (ops::FormOut), or null
  float* outer;            // NVFP4: S_dec per row (written here)
  float* row_amax;         // NVFP4: each row's amax (QTensor::row_amax), or null
  int team_warps;          // NVFP4: warps sharing one row (and its amax)
  int64_t runs_per_row;    // MXFP8: warps per row (one run each)
  num::MxScaleRule mx_rule;
  uint64_t seed, stream;
  bool report;
};

// Chunk c (a float4) of block b of a run lives at float B * b + 4 * (c ^ stage_swizzle(b)): a
// quarter-warp's eight 16-byte accesses then fall on eight different 4-bank groups, both when
// consecutive lanes store consecutive chunks and when each lane reads chunk c of its own block.
template <int B>
__device__ __forceinline__ int stage_swizzle(int b) {
  return B == 16 ? (b >> 1) & 3 : b & 7;
}

// Where float4 l + 32 j of a run (columns 4 (l + 32 j) .. + 3, as lane l loads it) lives in the
// run's shared buffer: chunk l % (B / 4) of block l / (B / 4) + j * (32 / (B / 4)), in floats.
template <int B>
__device__ __forceinline__ int stage_offset(int l, int j) {
  constexpr int kChunks = B / 4;
  const int b = l / kChunks + j * (32 / kChunks), c = l % kChunks;
  return B * b + 4 * (c ^ stage_swizzle<B>(b));
}

// Loads the run starting at column col0 of `row`: float4 j of lane l is float4 l + 32 j of the run.
template <int B>
__device__ __forceinline__ void load_run(const float* row, int64_t cols, int64_t col0, bool live,
                                         float4 (&raw)[B / 4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < B / 4; ++j) {
    const int64_t col = col0 + 4 * (lane + 32 * j);
    raw[j] = live && col < cols ? __ldg(reinterpret_cast<const float4*>(row + col))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// The 16 values of block `lane` of a run at shared-window address a (from read_run_address): chunk
// c at a ^ 16 c, as blocks are 64-byte aligned (the caller declares the buffer so) and the swizzle
// XORs bits 4-5 of the address: one LOP3 a chunk, where read_run forms every address anew. offset:
// a multiple of 64 (another run, another half), added after the XOR (the load's immediate).
// Volatile, clobbering memory: the loads stay between the __syncwarp()s around them and are redone
// for every row (the address repeats every other row).
__device__ __forceinline__ uint32_t shared_address(const float* q) {
  uint32_t a = uint32_t(__cvta_generic_to_shared(q));
  asm("mov.b32 %0, %0;" : "+r"(a));  // opaque: kept in a register, not formed anew every row
  return a;
}
__device__ __forceinline__ uint32_t read_run_address(const float* buf) {
  const int lane = threadIdx.x & 31;
  return shared_address(buf + 16 * lane + 4 * stage_swizzle<16>(lane));
}
__device__ __forceinline__ void read_run_at(uint32_t a, uint32_t offset, float (&v)[16]) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v[4 * c]), "=f"(v[4 * c + 1]), "=f"(v[4 * c + 2]), "=f"(v[4 * c + 3])
                 : "r"((a ^ (16u * c)) + offset)
                 : "memory");
}

// The B values of block `lane` of a run in the warp's shared buffer.
template <int B>
__device__ __forceinline__ void read_run(const float* buf, float (&v)[B]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int c = 0; c < B / 4; ++c) {
    const float4 f = *reinterpret_cast<const float4*>(buf + B * lane + 4 * (c ^ stage_swizzle<B>(lane)));
    v[4 * c] = f.x;
    v[4 * c + 1] = f.y;
    v[4 * c + 2] = f.z;
    v[4 * c + 3] = f.w;
  }
}

// Passes a loaded run through the warp's shared buffer: v = the B values of block `lane`.
template <int B>
__device__ __forceinline__ void stage_run(float* buf, const float4 (&raw)[B / 4], float (&v)[B]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < B / 4; ++j) *reinterpret_cast<float4*>(buf + stage_offset<B>(lane, j)) = raw[j];
  __syncwarp();
  read_run<B>(buf, v);
  __syncwarp();  // the buffer is reused by the next run
}

// max_abs_finite over a block, with its non-finite values counted (the rare path).
template <int B>
__device__ __forceinline__ float finite_amax_counting(const float (&v)[B], unsigned& nonfinite) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < B; ++i) {
    a = num::max_abs_finite(a, v[i]);
    nonfinite += num::is_finite_bits(v[i]) ? 0u : 1u;
  }
  return a;
}

// The fast MXFP8 paths' fallback for a block holding a non-finite value: the generic block
// quantizer on a copy of v (n values, codes past n stay 0), its 32 codes packed four to a word.
// Inlined on purpose: a call would take v's and w's addresses, which moves the hot path's block
// out of registers into local memory (368 bytes of stack: MXFP8 row RNE measured 0.54 of a copy's
// rate as a call, 1.00 inlined).
__device__ __forceinline__ uint8_t mxfp8_generic_block(const float (&v)[num::kMxBlock], int n, float amax,
                                                    num::MiniFloatSpec elem, num::MxScaleRule rule,
                                                    num::Rounding rounding, uint64_t seed, uint64_t stream,
                                                    uint64_t index0, uint32_t (&w)[num::kMxBlock / 4]) {
  constexpr int B = num::kMxBlock;
  float copy[B];
  uint8_t c[B];
#pragma unroll
  for (int i = 0; i < B; ++i) {
    copy[i] = v[i];
    c[i] = 0;
  }
  const uint8_t scale = num::mxfp8_quantize_block(copy, n, amax, elem, rule, rounding, seed, stream, index0, c);
#pragma unroll
  for (int g = 0; g < B / 4; ++g)
    w[g] = uint32_t(c[4 * g]) | uint32_t(c[4 * g + 1]) << 8 | uint32_t(c[4 * g + 2]) << 16 | uint32_t(c[4 * g + 3]) << 24;
  return scale;
}

// 32 MXFP8 codes (eight words) to dst with two 16-byte stores (dst is 16-byte aligned).
__device__ __forceinline__ void store_mx_codes(uint8_t* dst, const uint32_t (&w)[num::kMxBlock / 4]) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(w[0], w[1], w[2], w[3]);
  d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// Four codes of an MXFP8 block under SR as one word: y[i] = bits of x[i] * x_scale (exact where
// it matters, see Mxfp8Sr; x's sign kept, so the block's inputs need not stay live), r the Philox
// call of counter group q / 2 (8 elements a call: word q holds its elements 4 (q % 2) .. + 3).
template <int kExpBits, bool kWide>
__device__ __forceinline__ uint32_t mxfp8_sr_word(const uint32_t (&y)[32], int q,
                                                  const num::Philox4x32& r) {
  using Sr = num::Mxfp8Sr<kExpBits>;
  uint32_t word = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t u = y[4 * q + e] & 0x7fffffffu;
    const uint32_t r16 = num::sr_bits_of(r, 4 * (q % 2) + e);
    const uint32_t code = kWide ? Sr::code_wide(u, r16) : Sr::code_normal(u, r16);
    word |= (code | ((y[4 * q + e] >> 24) & 0x80u)) << (8 * e);
  }
  return word;
}

// The 32 codes of an MXFP8 block under SR, as 8 words, one Philox call per 8 codes (fast_quant.h:
// the draws of sr_bits and the codes of mxfp8_encode with SR; index0 is a multiple of 8, as a
// block's first counter always is). The common form serves values that are zero or normal in
// the target; a group of four holding a value below (rare: about one Gaussian value in 10^4)
// takes the general form, in a branch that costs nothing otherwise.
template <int kExpBits>
__device__ __forceinline__ void mxfp8_sr_block(const float (&v)[32], float x_scale,
                                               const num::PhiloxKeys& keys, uint64_t stream,
                                               uint64_t index0, uint32_t (&w)[8]) {
  uint32_t y[32], wide = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    y[i] = num::bits_of(num::mul_rn(v[i], x_scale));
    wide |= uint32_t(num::Mxfp8Sr<kExpBits>::needs_wide(y[i] & 0x7fffffffu)) << i;
  }
#pragma unroll
  for (int g = 0; g < 32 / num::kSrPerCall; ++g) {
    const num::Philox4x32 r = num::random_bits4_fast(keys, stream, index0 / num::kSrPerCall + uint64_t(g));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = 2 * g + h;
      if (__builtin_expect(((wide >> (4 * q)) & 0xfu) != 0, 0))
        w[q] = mxfp8_sr_word<kExpBits, true>(y, q, r);
      else
        w[q] = mxfp8_sr_word<kExpBits, false>(y, q, r);
    }
  }
}

// load_run + the stores of stage_run in one: the loads go straight into the swizzled shared buffer
// (same layout and lane assignment, columns past cols zero-filled); read_run (read_run_at for the
// NVFP4 kernel) then takes them out.
// Columns are 32-bit (rows of at most kFusedMaxCols) and the row pointer is formed once, opaque to
// the compiler (which would otherwise redo the row's 64-bit offset arithmetic for every chunk): a
// source address is then one wide multiply-add. A column past the row reads nothing (zero fill)
// from the row's start.
__device__ __forceinline__ const float* opaque_ptr(const float* q) {
  asm("mov.b64 %0, %0;" : "+l"(q));
  return q;
}
template <int B>
__device__ __forceinline__ void prefetch_run(float* buf, const float* row, int cols, int col0, bool live) {
  const int lane = threadIdx.x & 31;
  row = opaque_ptr(row);
#pragma unroll
  for (int j = 0; j < B / 4; ++j) {
    const int col = col0 + 4 * (lane + 32 * j);
    const bool in = live && col < cols;
    cp_async16(buf + stage_offset<B>(lane, j), row + uint32_t(col < cols ? col : 0), in ? 16 : 0);
  }
}

// One MXFP8 block of the fast paths: v holds the block's values (zeros past n), index0 its
// first SR counter; the 32 codes go to w (eight words, lowest index in the lowest byte) and the
// scale byte is returned. RNE converts pairs in hardware (cvt.rn.satfinite.e4m3x2 / e5m2x2, as
// mxfp8_encode does); SR spends one Philox-4x32-10 call on eight consecutive counters. A block
// holding NaN/Inf takes the generic quantizer and counts its non-finite values into `nonfinite`.
template <int kExpBits, bool kSR>
__device__ __forceinline__ uint8_t mxfp8_fast_words(const float (&v)[num::kMxBlock], int n, num::MxScaleRule rule,
                                                    uint64_t seed, uint64_t stream, uint64_t index0,
                                                    uint32_t (&w)[num::kMxBlock / 4], unsigned& nonfinite) {
  constexpr int B = num::kMxBlock;
  const num::MiniFloatSpec elem = kExpBits == 4 ? num::e4m3_spec() : num::e5m2_spec();
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < B; ++i) a = num::max_abs_nan(a, v[i]);
  uint8_t scale;
  if (num::is_finite_bits(a)) {
    scale = num::mxfp8_scale(a, elem, rule);
    const float x_scale = num::pow2f(127 - int(scale));
    if constexpr (kSR) {
      mxfp8_sr_block<kExpBits>(v, x_scale, num::philox_keys(seed), stream, index0, w);
    } else {
#pragma unroll
      for (int g = 0; g < B / 4; ++g)
        w[g] = num::mxfp8_encode_rne_x2<kExpBits>(v[4 * g], v[4 * g + 1], scale, x_scale) |
               (num::mxfp8_encode_rne_x2<kExpBits>(v[4 * g + 2], v[4 * g + 3], scale, x_scale) << 16);
    }
  } else {  // a NaN or Inf in the block: the generic quantizer on a copy
    a = finite_amax_counting(v, nonfinite);
    scale = mxfp8_generic_block(v, n, a, elem, rule, kSR ? num::Rounding::SR : num::Rounding::RNE, seed, stream,
                                index0, w);
  }
  return scale;
}

// mxfp8_fast_words with the 32 codes stored to dst (16-byte aligned).
template <int kExpBits, bool kSR>
__device__ __forceinline__ uint8_t mxfp8_fast_block(const float (&v)[num::kMxBlock], int n, num::MxScaleRule rule,
                                                    uint64_t seed, uint64_t stream, uint64_t index0, uint8_t* dst,
                                                    unsigned& nonfinite) {
  uint32_t w[num::kMxBlock / 4];
  const uint8_t scale = mxfp8_fast_words<kExpBits, kSR>(v, n, rule, seed, stream, index0, w, nonfinite);
  store_mx_codes(dst, w);
  return scale;
}

// ---- per-token NVFP4 blocks (nvfp4_row_fast_kernel and the producers' row quantizers) ------------------

// The warp-converged part of a per-token NVFP4 block, run by every lane of the warp, live block
// or not: under Four Over Six the block's scales and whether every block of the warp's run stays
// below the saturation bound (fos_bounded), so that the unclamped quantizer serves all of them.
template <bool kFos>
__device__ __forceinline__ void nvfp4_row_block_scales(float amax, float s_enc, const num::FosGroup& grp,
                                                       num::FosBlockScales& scales, bool& bounded) {
  scales = num::FosBlockScales{};
  bounded = false;
  if constexpr (kFos) {
    scales = num::fos_block_scales(amax, s_enc, grp);
    bounded = __all_sync(0xffffffffu, num::fos_bounded(amax, scales));
  }
}

// One block of a per-token NVFP4 row, RNE, with or without Four Over Six: v its 16 values (zeros
// past n), amax their finite amax, scales and bounded from nvfp4_row_block_scales. generic: the
// block holds NaN/Inf or its row's group is outside FosGroup::exact, so the generic quantizer
// takes a copy; otherwise fast_quant.h's forms (proven equal to it). chose_four counts Four Over
// Six's 1.5x picks (one add in each branch: where the choice is made).
template <bool kFos, num::ScaleMetric kMetric>
__device__ __forceinline__ num::Nvfp4Block nvfp4_row_block(const float (&v)[num::kNvfp4Block], int n, float amax,
                                                          float s_enc, float s_dec, const num::FosBlockScales& scales,
                                                          bool bounded, bool generic, unsigned& chose_four) {
  constexpr int B = num::kNvfp4Block;
  num::Nvfp4Block out;
  if (!generic) {
    if constexpr (kFos) {
      if (bounded) {
        out = num::fos_quantize_block<kMetric, true>(v, scales);
        chose_four += unsigned(out.chose_four);
      } else {
        out = num::fos_quantize_block<kMetric, false>(v, scales);  // a run with a subnormal s_b
        chose_four += unsigned(out.chose_four);
      }
    } else {
      out = num::nvfp4_quantize_block_fast<false>(v, amax, s_enc, s_dec);
    }
  } else {
    float copy[B];
#pragma unroll
    for (int i = 0; i < B; ++i) copy[i] = v[i];
    out = num::nvfp4_quantize_block(copy, n, amax, s_enc, s_dec, kFos, kMetric, num::Rounding::RNE, 0, 0, 0);
    chose_four += unsigned(out.chose_four);
  }
  return out;
}

// ---- launching the register-resident fast paths ------------------------------------------------------

// Row-axis inputs without an RHT that float4 loads can read.
bool fast_row_input(const QuantSpec& spec, const QuantParams& p, int64_t rows) {
  return spec.axis == BlockAxis::Row && spec.hadamard == 0 && p.in.vec4 && p.padded_cols > 0 && rows > 0;
}

FastRowParams fast_row_params(const QuantParams& p, int64_t rows) {
  FastRowParams f{};
  f.x = p.in.x;
  f.rows = rows;
  f.cols = p.in.scols;
  f.padded_cols = p.padded_cols;
  f.nb = p.nb;
  f.codes = p.codes;
  f.scales = p.scales;
  f.bf16 = p.bf16;
  f.outer = p.outer;
  f.row_amax = p.row_amax;
  f.mx_rule = p.mx_rule;
  f.seed = p.seed;
  f.stream = p.stream;
  f.report = p.report;
  return f;
}

// launch(exp_bits, sr) with the element's exponent bits (4: E4M3, 5: E5M2) and the rounding as
// compile-time constants, for the fast MXFP8 kernels' template arguments.
template <typename Launch>
void with_mxfp8_variant(bool e5m2, bool sr, Launch&& launch) {
  using E4 = std::integral_constant<int, 4>;
  using E5 = std::integral_constant<int, 5>;
  if (e5m2) sr ? launch(E5{}, std::true_type{}) : launch(E5{}, std::false_type{});
  else sr ? launch(E4{}, std::true_type{}) : launch(E4{}, std::false_type{});
  FOURBIT_LAUNCH_CHECK();
}

}  // namespace
}  // namespace fourbit::ops::cuda
