// defines: kReqRows, kReqCols, RequantParams, lds_reload, requantize_tile,
//          requantize_transposed_kernel, kReqSegsPerLaunch, RequantSegments,
//          requantize_segments_kernel, requant_params, requantize_kernel_takes
// NVFP4 -> exact decode -> transpose -> MXFP8 E4M3 RCEIL with SR (nvfp4-fwd's backward target) in
// one kernel, over one tensor or up to kReqSegsPerLaunch row segments a launch.
#pragma once
#include "fourbit/ops/cuda/cast/fast_common.cuh"

namespace fourbit::ops::cuda {
namespace {

// ---- NVFP4 -> MXFP8 E4M3 (transposed), one kernel -----------------------------------------------
//
// Shape: a CTA takes a tile of kReqRows input storage rows (old rows: 8 output blocks of 32) x
// kReqCols input storage cols (2 NVFP4 blocks; 32 output storage rows). Phase 1: thread t decodes
// old row t's two blocks (16 code bytes, one load, four registers) exactly (fl(fl(E2M1 * E4M3) *
// S_dec), as nvfp4_dequant, by Nvfp4DecodeWord) and writes the 32 values down a tile column: the
// 32 lanes of a warp write 32 consecutive old rows, one bank each. Phase 2: thread t owns output
// block t % 8 of output row t / 8, reads its 32 values with eight 16-byte shared loads (blocks
// kReqBlockStride floats apart: conflict-free), and quantizes them with RCEIL scales and
// elementwise SR (E4m3SrWords; Mxfp8Sr for a block holding a value below E4M3's normals), one
// Philox-4x32-10 call per 8 consecutive counters (16 bits an element, NUMERICS). A warp writes
// four output rows of 256 contiguous code bytes.
//
// Instructions (SASS, sm_90a, nvdisasm; scripts/sass_hot_path.py CUBIN requantize_transposed
// [--by-function | --by-line]: one thread's path from entry to EXIT for a whole tile of finite
// values, divided by its 32 elements): 27.5 per element (880 a thread):
//   Philox          5.7   one call per 8 elements; each 32x32 -> 64-bit product one IMAD.WIDE,
//                         the keys from the constant bank (made on the host)
//   exact decode    ~6    4 bit moves + 2 FMUL + 1 STS an element (Nvfp4DecodeWord: no multiply by
//                         2^126, the codes in registers)
//   SR encode       ~5    FMUL, VIADDMNMX (the wide-path test), PRMT (the element's 16 random bits
//                         into place) + LEA, 7/4 PRMT and LOP3 to pack codes and signs, the signs'
//                         shared reload
//   amax, scale     ~1.5
//   the rest        ~9    tile coordinates (32-bit divisions), addresses, loads, shared loads and
//                         stores, the transposing stores
// What bounds it: the kernel moves only ~1.6 bytes per element (0.56 in, 1.03 out), so 75% of an
// H200 copy (~2.9 TB/s) is ~1.8e12 elements/s, which at ~33e12 thread-instructions/s leaves ~18
// instructions per element; Philox is ~6 of them under the SR contract, decode and encode ~11, so
// the ceiling stays below 0.75 (docs/cuda.md has the measured ratio).
constexpr int kReqRows = 256;
constexpr int kReqCols = 32;
constexpr int kReqBlockStride = 36;  // floats between the output blocks of a tile row
constexpr int kReqRs = (kReqRows / num::kMxBlock) * kReqBlockStride;  // 288 floats per output row

struct RequantParams {
  DecodeArgs dec;           // the NVFP4 input (storage [S * rows, cols])
  bool vec16;               // two blocks (16 code bytes) of a tile row load as one uint4
  int64_t in_cols;          // input storage cols (unpadded) = output storage rows per slice
  uint32_t row_tiles, col_tiles;  // per slice (a launch's CTAs are < 2^31: so are these)
  uint8_t* codes;           // output storage [S * in_cols, out_padded_cols], or null (bf16 alone)
  uint8_t* scales;
  __nv_bfloat16* bf16;      // the output's BF16 decode, same storage shape (ops::FormOut), or null
  int64_t out_padded_cols, out_nb;
  uint64_t seed, stream;
};

// A 16-byte shared-memory load the compiler must issue again (volatile): reading a value back
// instead of holding it in a register from an earlier load.
__device__ __forceinline__ float4 lds_reload(const float4* p) {
  float4 f;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(f.x), "=f"(f.y), "=f"(f.z), "=f"(f.w)
               : "r"(uint32_t(__cvta_generic_to_shared(p))));
  return f;
}

// Tile t of p (slices x row tiles x col tiles), by the CTA.
// keys = philox_keys(p.seed).
__device__ __forceinline__ void requantize_tile(const RequantParams& p, int64_t t, const num::PhiloxKeys& keys) {
  constexpr int B = num::kMxBlock;
  static_assert(kReqRows == kThreads && kReqCols == 32 && kReqCols * (kReqRows / B) == kThreads);
  __shared__ __align__(16) float tile[kReqCols * kReqRs];  // output-row major, 36 KB

  // t < 2^31 (one launch's CTAs): 32-bit divisions
  const uint32_t t32 = uint32_t(t), ct = t32 % p.col_tiles, t_rs = t32 / p.col_tiles;
  const int64_t rt = t_rs % p.row_tiles, s = t_rs / p.row_tiles;
  const int64_t i0 = rt * kReqRows;  // first input storage row (in the slice)
  const int64_t j0 = ct * kReqCols;  // first input storage col
  const int64_t in_rows = p.dec.srows;

  // Phase 1: decode old row i0 + t. Rows past the input are zeros (the output's padding); an
  // input block past the row holds no output rows and is skipped.
  {
    const int ii = int(threadIdx.x);
    float* dst = tile + (ii / B) * kReqBlockStride + ii % B;  // + jj * kReqRs
    const int64_t blk0 = j0 / 16;
    const int nblk = int(min64(2, p.dec.nb - blk0));
    if (i0 + ii < in_rows) {
      const int64_t row = s * in_rows + i0 + ii;
      const uint8_t* src = p.dec.codes + row * p.dec.code_row_bytes + blk0 * 8;
      uint32_t words[4] = {0, 0, 0, 0};  // element k in nibble k % 8 of words[k / 8]
      if (p.vec16 && nblk == 2) {
        const uint4 c = *reinterpret_cast<const uint4*>(src);
        words[0] = c.x, words[1] = c.y, words[2] = c.z, words[3] = c.w;
      } else {
#pragma unroll
        for (int b = 0; b < 2; ++b) {  // unrolled: words stays in registers
          if (b >= nblk) break;
          uint64_t packed = 0;
          if (p.dec.vec) {
            packed = reinterpret_cast<const uint64_t*>(src)[b];
          } else {
            for (int k = 0; k < 8; ++k) packed |= uint64_t(src[8 * b + k]) << (8 * k);
          }
          words[2 * b] = uint32_t(packed), words[2 * b + 1] = uint32_t(packed >> 32);
        }
      }
      const float s_dec = p.dec.outer ? p.dec.outer[group_in_slice(p.dec.outer_kind, row, s)] : 1.0f;
      if (__builtin_expect(num::Nvfp4DecodeWord::exact_for(s_dec), 1)) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          if (b >= nblk) break;
          const num::Nvfp4DecodeWord d(num::ue4m3_decode_fast(p.dec.scales[row * p.dec.nb + blk0 + b]), s_dec);
#pragma unroll
          for (int e = 0; e < 16; ++e) dst[(16 * b + e) * kReqRs] = d.at(words[2 * b + e / 8], e % 8);
        }
      } else {  // |S_dec| >= 2^120: nvfp4_dequant itself (a rolled loop: the selects keep words in registers)
        for (int b = 0; b < nblk; ++b) {
          const uint8_t sb = p.dec.scales[row * p.dec.nb + blk0 + b];
          for (int e = 0; e < 16; ++e) {
            const uint32_t code = (b == 0 ? (e < 8 ? words[0] : words[1]) : (e < 8 ? words[2] : words[3])) >> (4 * (e % 8));
            dst[(16 * b + e) * kReqRs] = num::nvfp4_dequant(code & 0xFu, sb, s_dec);
          }
        }
      }
    } else {
#pragma unroll
      for (int jj = 0; jj < kReqCols; ++jj) dst[jj * kReqRs] = 0.0f;
    }
  }
  __syncthreads();

  // Phase 2: output block ob of output storage row j0 + jj (old rows i0 + 32 ob ...).
  unsigned nonfinite = 0;
  const int jj = int(threadIdx.x) / (kReqRows / B), ob = int(threadIdx.x) % (kReqRows / B);
  const int64_t j = j0 + jj;
  const int64_t col = i0 + int64_t(ob) * B;  // output storage col
  if (j < p.in_cols && col < in_rows) {
    float v[B];
    const float* src = tile + jj * kReqRs + ob * kReqBlockStride;
#pragma unroll
    for (int c = 0; c < B / 4; ++c) {
      const float4 f = reinterpret_cast<const float4*>(src)[c];
      v[4 * c] = f.x;
      v[4 * c + 1] = f.y;
      v[4 * c + 2] = f.z;
      v[4 * c + 3] = f.w;
    }
    const int64_t row = s * p.in_cols + j;  // output storage row
    const uint64_t index0 = uint64_t(row * p.out_padded_cols + col);
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < B; ++e) a = num::max_abs_nan(a, v[e]);
    uint32_t w[B / 4];
    uint8_t scale;
    if (num::is_finite_bits(a)) {
      scale = num::ue8m0_scale_for_max(a, num::kE4M3Max);  // mxfp8_scale(a, E4M3, RCEIL)
      // RCEIL: every |v| * 2^(127 - scale) <= 448, as E4m3SrWords needs
      using Sr = num::E4m3SrWords;
      const float xs8 = Sr::x_scale8(scale);
      uint32_t y8[B], low = ~0u;  // low: the least nonzero y8, less 1 (zeros wrap to ~0)
#pragma unroll
      for (int e = 0; e < B; ++e) {
        y8[e] = Sr::scaled(v[e], xs8);
        low = min(low, y8[e] - 1u);
      }
      // v is not kept past here (registers: 32 more spilled): the signs and the rare path read
      // the tile again
      const float4* src4 = reinterpret_cast<const float4*>(src);
      if (__builtin_expect(!Sr::needs_wide(low + 1u), 1)) {
        // index0 is a multiple of 32 (padded cols and col are), so the call index0 / 8 + g is
        // (index0 / 8) | g: the same counter without a 64-bit add
#pragma unroll
        for (int g = 0; g < B / num::kSrPerCall; ++g) {
          const num::Philox4x32 r = num::random_bits4_fast(keys, p.stream, (index0 >> 3) | uint64_t(g));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int q = 2 * g + h;  // output word: elements 4q .. 4q + 3, draws 4h .. 4h + 3 of r
            const float4 x = lds_reload(src4 + q);
            w[q] = Sr::pack(Sr::code_at_24(y8[4 * q], Sr::random_at_8(r, 4 * h)),
                            Sr::code_at_24(y8[4 * q + 1], Sr::random_at_8(r, 4 * h + 1)),
                            Sr::code_at_24(y8[4 * q + 2], Sr::random_at_8(r, 4 * h + 2)),
                            Sr::code_at_24(y8[4 * q + 3], Sr::random_at_8(r, 4 * h + 3)), num::bits_of(x.x),
                            num::bits_of(x.y), num::bits_of(x.z), num::bits_of(x.w));
          }
        }
      } else {  // a value below E4M3's smallest normal (rare): Mxfp8Sr's general form
        float x[B];
#pragma unroll
        for (int c = 0; c < B / 4; ++c) {
          const float4 f = lds_reload(src4 + c);
          x[4 * c] = f.x, x[4 * c + 1] = f.y, x[4 * c + 2] = f.z, x[4 * c + 3] = f.w;
        }
        mxfp8_sr_block<4>(x, num::pow2f(127 - int(scale)), keys, p.stream, index0, w);
      }
    } else {  // a non-finite decoded value (a NaN scale byte, or an overflowing S_dec)
      a = finite_amax_counting(v, nonfinite);
      scale = mxfp8_generic_block(v, int(min64(B, in_rows - col)), a, num::e4m3_spec(), num::MxScaleRule::RCEIL,
                                  num::Rounding::SR, p.seed, p.stream, index0, w);
    }
    if (p.codes) {
      store_mx_codes(p.codes + row * p.out_padded_cols + col, w);
      p.scales[row * p.out_nb + col / B] = scale;
    }
    if (p.bf16) {  // the decode pass's bits (decode8_bits), from the codes in registers
      const float sv = decode8_scale<Format::MXFP8_E4M3>(scale);
      uint4* d = reinterpret_cast<uint4*>(p.bf16 + row * p.out_padded_cols + col);
#pragma unroll
      for (int u = 0; u < B / 8; ++u) d[u] = decode8_bits<Format::MXFP8_E4M3>(make_uint2(w[2 * u], w[2 * u + 1]), sv, nullptr);
    }
  }
  flush_counts(false, 0u, nonfinite, 0u, 0u);
}

// keys: philox_keys(p.seed), made on the host, so that the rounds read them from the constant
// bank (made in the kernel they were rematerialized, one add per key and Philox call, for want of
// registers: 38.4 instructions per element instead of 32.4).
__global__ void __launch_bounds__(kThreads, 3) requantize_transposed_kernel(const RequantParams p,
                                                                            const num::PhiloxKeys keys) {
  requantize_tile(p, blockIdx.x, keys);
}

// Several single-slice inputs (the experts' token ranges of one saved operand) in one launch: CTA
// c runs tile c - cta0[i] of segment i, the last segment whose first CTA is at or before c.
constexpr int kReqSegsPerLaunch = 16;
struct RequantSegments {
  RequantParams seg[kReqSegsPerLaunch];
  int64_t cta0[kReqSegsPerLaunch];
  int n;
};

__global__ void __launch_bounds__(kThreads, 3) requantize_segments_kernel(const __grid_constant__ RequantSegments p) {
  const int64_t cta = blockIdx.x;
  int si = 0;
  while (si + 1 < p.n && p.cta0[si + 1] <= cta) ++si;  // uniform over the CTA
  // the keys made here: 16 segments' keys would take the parameters past 4 KB
  requantize_tile(p.seg[si], cta - p.cta0[si], num::philox_keys(p.seg[si].seed));
}

// requantize_transposed_kernel's arguments for q (no RHT) into a freshly allocated *out, with what
// form asks (codes, the BF16 decode, or both); returns the number of CTAs.
int64_t requant_params(const QTensor& q, const QuantSpec& spec, RngKey rng, FormOut form, QTensor* out,
                       RequantParams& p) {
  p = RequantParams{};
  p.dec = decode_args(q, "requantize_transposed");
  // Either axis: the output's storage is the per-slice transpose of the input's storage.
  const QuantShape logical = q.axis == BlockAxis::Row ? QuantShape{q.slices, q.rows, q.cols}
                                                      : QuantShape{q.slices, q.cols, q.rows};
  *out = writes_codes(form) ? alloc_qtensor(spec, logical, Device::CUDA) : qtensor_layout(spec, logical);
  if (writes_bf16(form))
    out->bf16 = Tensor::empty({out->total_rows(), out->padded_cols()}, DType::BF16, Device::CUDA);
  // Two blocks of a tile row are 16 bytes at a multiple of 16 past the row start.
  p.vec16 = aligned(p.dec.codes, 16) && p.dec.code_row_bytes % 16 == 0;
  p.in_cols = q.cols;
  const int64_t row_tiles = (q.rows + kReqRows - 1) / kReqRows, col_tiles = (q.cols + kReqCols - 1) / kReqCols;
  p.row_tiles = uint32_t(row_tiles);  // exact whenever the CTA count passes grid_of (< 2^31)
  p.col_tiles = uint32_t(col_tiles);
  p.codes = out->codes.defined() ? out->codes.data<uint8_t>() : nullptr;
  p.scales = out->block_scales.defined() ? out->block_scales.data<uint8_t>() : nullptr;
  p.bf16 = out->bf16.defined() ? out->bf16.data<__nv_bfloat16>() : nullptr;
  p.out_padded_cols = out->padded_cols();
  p.out_nb = out->blocks_per_row();
  p.seed = rng.seed;
  p.stream = rng.stream;
  return q.slices * row_tiles * col_tiles;
}

// Whether requantize_transposed_kernel takes q to spec: E4M3 with SR (nvfp4-fwd's backward), no
// RHT on q. Other targets take the composition that defines the op (cpu::requantize_transposed),
// on the GPU: exact dequantize, then the quantizer's own dispatch.
bool requantize_kernel_takes(const QTensor& q, const QuantSpec& spec) {
  return q.hadamard == 0 && spec.fmt == Format::MXFP8_E4M3 && spec.rounding == num::Rounding::SR &&
         spec.mx_rule == num::MxScaleRule::RCEIL;
}

}  // namespace
}  // namespace fourbit::ops::cuda
