// defines: cuda::quantize, cuda::outer_amax, cuda::quantize_segments, cuda::quantize_row_col,
//          cuda::quantize_both, cuda::dequantize, cuda::requantize_transposed, cuda::requantize_transposed_segments,
//          cuda::take_nonfinite_flag, cuda::nonfinite_flag_address, cuda::quantize_kernel_for, cuda::quantize_kernel_names,
//          cuda::requantize_kernel_for
// The GPU quantizers' dispatch. Each format has an ordered list of kernels, {name, accepts(spec,
// input), launch}; a quantize call takes the first entry that accepts it, and every list ends with
// the generic tile kernel, which accepts every spec. The kernels live one to a file in cast/
// (cast/README.md); every value they produce goes through the numerics/ functions the CPU
// quantizer calls (or fast_quant.h's forms, proven equal to them), with the CPU's block amaxes,
// group scales and SR counters, so GPU bytes equal CPU bytes (tests/ops/cuda_quantize_test.cpp
// compares them for every entry of every list). docs/cuda.md has the instruction counts and the
// H200 throughput of each kernel.
#include <cuda_runtime.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "fourbit/ops/cuda/cast/cast_common.cuh"
#include "fourbit/ops/cuda/cast/dequantize_tile.cuh"
#include "fourbit/ops/cuda/cast/fast_common.cuh"
#include "fourbit/ops/cuda/cast/mxfp8_col_fast.cuh"
#include "fourbit/ops/cuda/cast/mxfp8_row_col.cuh"
#include "fourbit/ops/cuda/cast/mxfp8_row_fast.cuh"
#include "fourbit/ops/cuda/cast/nvfp4_row_fast.cuh"
#include "fourbit/ops/cuda/cast/quantize_tile.cuh"
#include "fourbit/ops/cuda/cast/requantize_transposed.cuh"

namespace fourbit::ops::cuda {
namespace {

// What an entry's accepts() sees: the spec and the input's layout, no device memory (the tests
// ask which entry a case takes without a GPU).
struct QuantInput {
  QuantSpec spec;
  int64_t slices, rows, cols;  // logical
  bool vec4;                   // float4 loads along the contiguous dimension (cols % 4, 16-byte base)
  bool group_amax;             // the caller gives the outer scales' group amax
  int block() const { return spec.block(); }
  bool col() const { return spec.axis == BlockAxis::Col; }
  int64_t srows() const { return col() ? cols : rows; }  // storage rows per slice
  int64_t scols() const { return col() ? rows : cols; }
  int64_t total_rows() const { return slices * srows(); }
  int64_t padded_cols() const { return (scols() + block() - 1) / block() * block(); }
};

// What launch() gets: the input, the allocated output, and the tile kernels' parameters with
// everything but the geometry filled in.
struct QuantLaunch {
  QuantInput in;
  const QTensor& q;
  QuantParams p;
  RngKey rng;
  const Tensor* group_amax;
};

struct QuantizeKernel {
  const char* name;
  bool (*accepts)(const QuantInput&);
  void (*launch)(QuantLaunch&);
  bool bf16;  // writes the form's BF16 decode itself (QuantParams::bf16), and no codes where null
};

bool accepts_any(const QuantInput&) { return true; }

// The generic tile kernel: NVFP4 outer scales from a pre-pass over the input (or the caller's
// group amax), then one CTA per storage tile.
template <Kind K>
void launch_tiles(QuantLaunch& l) {
  QuantParams& p = l.p;
  const QTensor& q = l.q;
  const int B = q.block();
  const bool col = l.in.col();
  p.geom = col ? col_geom(B, q.rows, p.padded_cols) : row_geom(B, q.rows, p.padded_cols);
  Tensor gamax;
  if (K == Kind::Nvfp4 && q.outer != OuterScale::None) {
    const int64_t groups = outer_groups(q);
    // amaxes are non-negative floats: their bits order as the values do (atomicMax, S_enc)
    const uint32_t* amax_bits = nullptr;
    if (l.group_amax) {
      amax_bits = reinterpret_cast<const uint32_t*>(l.group_amax->data<float>());
    } else {
      gamax = Tensor::empty({groups}, DType::U32, Device::CUDA);
      outer_amax_prepass(p, col, groups, gamax.data<uint32_t>(), l.in.rows, l.in.cols, true);
      amax_bits = gamax.data<uint32_t>();
      if (p.row_amax)  // per-row groups: the rows' amaxes (float bits)
        FOURBIT_CUDA_CHECK(cudaMemcpyAsync(p.row_amax, amax_bits, size_t(groups) * sizeof(float),
                                           cudaMemcpyDeviceToDevice, stream()));
    }
    outer_scale_kernel<<<grid_for(groups, kThreads), kThreads, 0, stream()>>>(amax_bits, groups,
                                                                 l.in.spec.four_over_six, p.outer);
    FOURBIT_LAUNCH_CHECK();
    p.group_amax = amax_bits;
  }
  if (p.padded_cols > 0) launch_quantize<K>(p, col);
}  // gamax is freed after the launches are queued: the allocator reuses in stream order

// NVFP4 per-token scales whose rows fit one tile: whole-row tiles, the row amax reduced in shared
// memory, the input read once.
bool accepts_nvfp4_tile_row_amax(const QuantInput& in) {
  return !in.group_amax && !in.col() && in.spec.outer == OuterScale::PerRow && !in.spec.tile_2d &&
         in.padded_cols() > 0 && in.padded_cols() <= kFusedMaxCols;
}
void launch_nvfp4_tile_row_amax(QuantLaunch& l) {
  l.p.geom = fused_geom(l.q.block(), l.q.rows, l.p.padded_cols);
  l.p.fused_row_amax = true;
  launch_quantize<Kind::Nvfp4>(l.p, false);
}

// Per-token RNE (the activations): the register-resident one-pass kernel (it takes each row's
// amax itself, so not with a given group amax).
bool accepts_nvfp4_row_fast(const QuantInput& in) {
  return !in.group_amax && !in.col() && in.spec.hadamard == 0 && in.vec4 && in.padded_cols() > 0 &&
         in.total_rows() > 0 && in.spec.outer == OuterScale::PerRow && !in.spec.tile_2d &&
         in.spec.rounding == num::Rounding::RNE && in.padded_cols() <= kFusedMaxCols;
}
void launch_nvfp4_row_fast_entry(QuantLaunch& l) {
  launch_nvfp4_row_fast(fast_row_params(l.p, l.q.total_rows()), l.in.spec.four_over_six, l.in.spec.metric);
}

bool accepts_mxfp8_col_fast(const QuantInput& in) { return mxfp8_col_fast(in.spec); }
void launch_mxfp8_col_fast_entry(QuantLaunch& l) {  // one segment per slice; SR counters run on over the slices
  const QTensor& q = l.q;
  std::vector<QTensor> views;
  std::vector<ColSegmentOut> segs;
  for (int64_t sl = 0; sl < q.slices; ++sl) views.push_back(qtensor_slice(q, sl));
  for (int64_t sl = 0; sl < q.slices; ++sl) segs.push_back({sl * q.cols, q.cols, &views[size_t(sl)], sl * q.rows, l.rng});
  launch_mxfp8_col_fast(l.p.in.x, q.rows, segs, l.in.spec.fmt == Format::MXFP8_E5M2,
                        l.in.spec.rounding == num::Rounding::SR, l.in.spec.mx_rule, l.p.report);
}

bool accepts_mxfp8_row_fast(const QuantInput& in) {
  return !in.col() && in.spec.hadamard == 0 && in.vec4 && in.padded_cols() > 0 && in.total_rows() > 0;
}
void launch_mxfp8_row_fast_entry(QuantLaunch& l) {
  launch_mxfp8_row_fast(fast_row_params(l.p, l.q.total_rows()), l.in.spec.fmt == Format::MXFP8_E5M2,
                        l.in.spec.rounding == num::Rounding::SR);
}

constexpr QuantizeKernel kNvfp4Kernels[] = {
    {"nvfp4_row_fast_kernel", accepts_nvfp4_row_fast, launch_nvfp4_row_fast_entry, true},
    {"nvfp4_tile_row_amax", accepts_nvfp4_tile_row_amax, launch_nvfp4_tile_row_amax, true},
    {"quantize_tile_kernel", accepts_any, launch_tiles<Kind::Nvfp4>, true},
};
constexpr QuantizeKernel kMxfp8Kernels[] = {
    {"mxfp8_col_fast_kernel", accepts_mxfp8_col_fast, launch_mxfp8_col_fast_entry, false},
    {"mxfp8_row_fast_kernel", accepts_mxfp8_row_fast, launch_mxfp8_row_fast_entry, false},
    {"quantize_tile_kernel", accepts_any, launch_tiles<Kind::Mx>, false},
};
constexpr QuantizeKernel kS2f6Kernels[] = {{"quantize_tile_kernel", accepts_any, launch_tiles<Kind::S2f6>, false}};
constexpr QuantizeKernel kMxfp4Kernels[] = {{"quantize_tile_kernel", accepts_any, launch_tiles<Kind::Mxfp4>, false}};

struct KernelList {
  const QuantizeKernel* begin;
  int n;
};
template <size_t N>
constexpr KernelList list_of(const QuantizeKernel (&k)[N]) {
  return {k, int(N)};
}

KernelList kernels_for(Format f) {
  switch (f) {
    case Format::NVFP4: return list_of(kNvfp4Kernels);
    case Format::MXFP8_E4M3:
    case Format::MXFP8_E5M2: return list_of(kMxfp8Kernels);
    case Format::S2F6: return list_of(kS2f6Kernels);
    case Format::MXFP4: return list_of(kMxfp4Kernels);
    default: fail("cuda quantize: no kernels for format {}", format_name(f));
  }
}

const QuantizeKernel& pick(const QuantInput& in) {
  const KernelList l = kernels_for(in.spec.fmt);
  for (int i = 0; i < l.n; ++i)
    if (l.begin[i].accepts(in)) return l.begin[i];
  fail("cuda quantize: no kernel accepts {}", describe(in.spec));  // the lists end with accepts_any
}

}  // namespace

const char* quantize_kernel_for(const QuantSpec& spec, int64_t slices, int64_t rows, int64_t cols, bool vec4,
                                bool group_amax) {
  return pick(QuantInput{spec, slices, rows, cols, vec4, group_amax}).name;
}

std::vector<std::string> quantize_kernel_names(Format f) {
  std::vector<std::string> out;
  const KernelList l = kernels_for(f);
  for (int i = 0; i < l.n; ++i) out.emplace_back(l.begin[i].name);
  return out;
}

const char* requantize_kernel_for(const QTensor& q, const QuantSpec& spec) {
  return requantize_kernel_takes(q, spec) ? "requantize_transposed_kernel" : "dequantize_then_quantize";
}

QTensor quantize(const Tensor& x, const QuantSpec& spec, RngKey rng, QuantReport* report, const Tensor* group_amax,
                 FormOut form) {
  check_cuda_tensor(x, "quantize", "x");
  const QuantShape shape = quant_shape(x, spec);
  // float4 loads run along the input's contiguous dimension: logical C (= scols on the Row
  // axis, srows on the Col axis); every row then starts 16-byte aligned.
  const QuantInput in{spec, shape.slices, shape.rows, shape.cols, shape.cols % 4 == 0 && aligned(x.data<float>(), 16),
                      group_amax != nullptr};
  const QuantizeKernel& kernel = pick(in);
  // a kernel that writes the decode itself skips the codes of a decode-alone form (their outer
  // scales stay: the GEMM's epilogue applies them); another writes codes for the decode pass
  const bool codes = writes_codes(form) || !kernel.bf16, kernel_decode = writes_bf16(form) && kernel.bf16;
  QTensor q = alloc_qtensor(spec, shape, Device::CUDA);
  if (!codes) q.codes = q.block_scales = Tensor{};
  if (kernel_decode) q.bf16 = Tensor::empty({q.total_rows(), q.padded_cols()}, DType::BF16, Device::CUDA);
  // per-row scales from the rows' own amax: those amaxes travel with the codes (QTensor::row_amax;
  // every NVFP4 entry writes them)
  if (keeps_row_amax(spec, group_amax != nullptr))
    q.row_amax = Tensor::empty({q.total_rows()}, DType::F32, Device::CUDA);
  QuantLaunch l{in, q, QuantParams{}, rng, group_amax};
  QuantParams& p = l.p;
  p.in.x = x.data<float>();
  p.in.srows = q.rows;
  p.in.scols = q.cols;
  p.in.vec4 = in.vec4;
  p.slices = q.slices;
  p.padded_cols = q.padded_cols();
  p.nb = q.blocks_per_row();
  p.code_row_bytes = q.code_row_bytes();
  p.codes = codes ? q.codes.data<uint8_t>() : nullptr;
  p.scales = codes ? q.block_scales.data<uint8_t>() : nullptr;
  p.bf16 = kernel_decode ? q.bf16.data<__nv_bfloat16>() : nullptr;
  p.outer = q.outer_scales.defined() ? q.outer_scales.data<float>() : nullptr;
  p.row_amax = q.row_amax.defined() ? q.row_amax.data<float>() : nullptr;
  p.outer_kind = q.outer;
  p.tile_2d = spec.tile_2d;
  p.four_over_six = spec.four_over_six;
  p.metric = spec.metric;
  p.rounding = spec.rounding;
  p.mx_rule = spec.mx_rule;
  p.elem = spec.fmt == Format::MXFP8_E5M2 ? num::kE5M2 : num::kE4M3;
  p.hadamard = spec.hadamard;
  p.hadamard_signs = spec.hadamard_signs;
  p.seed = rng.seed;
  p.stream = rng.stream;
  p.report = report != nullptr;
  if (report) reset_counters();
  kernel.launch(l);
  if (report) add_counters(report);
  if (writes_bf16(form) && !kernel.bf16) {  // the codes' decode pass, then only what the form keeps
    q.bf16 = decode_bf16(q);
    if (!writes_codes(form)) q.codes = q.block_scales = Tensor{};
  }
  return q;
}

Tensor outer_amax(const std::vector<Tensor>& xs, const QuantSpec& spec) {
  Tensor gamax;
  for (const Tensor& x : xs) {
    check_cuda_tensor(x, "outer_amax", "x");
    const QuantShape shape = quant_shape(x, spec);
    const QTensor q = alloc_qtensor(spec, shape, Device::CUDA);  // for its layout (no kernel writes it)
    const int64_t groups = outer_groups(q);
    if (!gamax.defined()) {
      gamax = Tensor::empty({groups}, DType::F32, Device::CUDA);
      FOURBIT_CUDA_CHECK(cudaMemsetAsync(gamax.data<float>(), 0, size_t(groups) * sizeof(float), stream()));
    }
    QuantParams p{};
    p.in.x = x.data<float>();
    p.in.srows = q.rows;
    p.in.scols = q.cols;
    p.in.vec4 = shape.cols % 4 == 0 && aligned(p.in.x, 16);
    p.slices = q.slices;
    p.padded_cols = q.padded_cols();
    p.nb = q.blocks_per_row();
    p.outer_kind = q.outer;
    p.hadamard = spec.hadamard;
    p.hadamard_signs = spec.hadamard_signs;
    const bool col = spec.axis == BlockAxis::Col;
    p.geom = col ? col_geom(q.block(), q.rows, p.padded_cols) : row_geom(q.block(), q.rows, p.padded_cols);
    if (p.padded_cols > 0)
      outer_amax_prepass(p, col, groups, reinterpret_cast<uint32_t*>(gamax.data<float>()), shape.rows, shape.cols,
                         false);
  }
  return gamax;
}

bool quantize_segments(const Tensor& x, const std::vector<int64_t>& offsets, const QuantSpec& spec,
                       const std::vector<RngKey>& rngs, std::vector<QTensor>& out) {
  if (!mxfp8_col_fast(spec)) return false;
  check_cuda_tensor(x, "quantize_segments", "x");
  if (x.dtype() != DType::F32) fail("cuda quantize_segments: x must be f32, got {}", x.str());
  const size_t G = rngs.size();
  out.assign(G, QTensor{});
  std::vector<ColSegmentOut> segs;
  for (size_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    if (r0 == r1) continue;
    out[g] = alloc_qtensor(spec, quant_shape(x.slice_rows(r0, r1), spec), Device::CUDA);
    segs.push_back({r0, r1 - r0, &out[g], 0, rngs[g]});
  }
  launch_mxfp8_col_fast(x.data<float>(), x.size(1), segs, spec.fmt == Format::MXFP8_E5M2,
                        spec.rounding == num::Rounding::SR, spec.mx_rule, false);
  return true;
}

namespace {
// Whether mxfp8_row_col_kernel takes x on these two axes (ops::row_col_one_pass, F32 input).
bool row_col_kernel_takes(const Tensor& x, const QuantSpec& row_spec, const QuantSpec& col_spec) {
  return ops::row_col_one_pass(row_spec, col_spec) && x.dtype() == DType::F32;
}
}  // namespace

namespace {
// One output of quantize_row_col's kernel ([R, C] values): its Row form in out.row and each
// non-empty segment's Col form in out.col, as views of one buffer per kind (codes, scales,
// decodes: three allocations instead of three per expert, which cost the host more than the
// kernel's launch), with what row_out / col_out ask; offsets empty: no Col forms.
PairOutput alloc_row_col(int64_t R, int64_t C, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                         const std::vector<int64_t>& offsets, FormOut row_out, FormOut col_out, RowColQuant& out) {
  out.row = qtensor_layout(row_spec, QuantShape{1, R, C});
  if (writes_codes(row_out)) out.row = alloc_qtensor(row_spec, QuantShape{1, R, C}, Device::CUDA);
  if (writes_bf16(row_out)) out.row.bf16 = Tensor::empty({R, out.row.padded_cols()}, DType::BF16, Device::CUDA);
  const size_t G = offsets.empty() ? 0 : offsets.size() - 1;
  out.col.assign(G, QTensor{});
  const QTensor meta = qtensor_layout(col_spec, QuantShape{1, 0, C});  // a segment sets cols: its rows
  int64_t padded_total = 0;
  for (size_t g = 0; g < G; ++g) padded_total += (offsets[g + 1] - offsets[g] + num::kMxBlock - 1) / num::kMxBlock * num::kMxBlock;
  const bool codes_out = G > 0 && writes_codes(col_out), bf16_out = G > 0 && writes_bf16(col_out);
  const Tensor codes = codes_out ? Tensor::empty({C * padded_total}, DType::U8, Device::CUDA) : Tensor{};
  const Tensor scales = codes_out ? Tensor::empty({C * padded_total / num::kMxBlock}, DType::U8, Device::CUDA) : Tensor{};
  const Tensor decodes = bf16_out ? Tensor::empty({C * padded_total}, DType::BF16, Device::CUDA) : Tensor{};
  int64_t at = 0;  // padded rows of the segments before g
  for (size_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    if (r0 == r1) continue;
    QTensor& q = out.col[g];
    q = meta;
    q.cols = r1 - r0;
    const int64_t pr = q.padded_cols();
    if (codes.defined()) {
      q.codes = codes.view(C * at, {C, q.code_row_bytes()});
      q.block_scales = scales.view(C * at / num::kMxBlock, {C, q.blocks_per_row()});
    }
    if (decodes.defined()) q.bf16 = decodes.view(C * at, {C, pr});
    at += pr;
  }
  return PairOutput{&out.row, row_rng, static_cast<uint8_t*>(raw_or_null(codes)),
                    static_cast<uint8_t*>(raw_or_null(scales)), static_cast<__nv_bfloat16*>(raw_or_null(decodes))};
}

// The kernel's segments for offsets (one key an output each: keys[o][g]).
std::vector<PairSegmentOut> row_col_segments(const std::vector<int64_t>& offsets,
                                             const std::vector<const std::vector<RngKey>*>& keys) {
  std::vector<PairSegmentOut> segs;
  int64_t at = 0;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t r0 = offsets[g], r1 = offsets[g + 1];
    if (r0 == r1) continue;
    PairSegmentOut so{r0, r1 - r0, at, 0, {}};
    for (size_t o = 0; o < keys.size(); ++o) so.rng[o] = (*keys[o])[g];
    segs.push_back(so);
    at += (r1 - r0 + num::kMxBlock - 1) / num::kMxBlock * num::kMxBlock;
  }
  return segs;
}
}  // namespace

namespace {
// Whether the one-pass kernel takes the SwiGLU's F32 inputs (h1, h3) and the specs, the inputs
// and specs then checked as op's; and the same for the SwiGLU's gradients (da, h1, h3).
// Whether the one-pass kernel takes the F32 values x (`name` in op's messages) and the specs, x and
// the specs then checked.
bool pair_takes(const char* op, const char* name, const Tensor& x, const QuantSpec& row_spec,
                const QuantSpec& col_spec) {
  if (!row_col_kernel_takes(x, row_spec, col_spec)) return false;
  check_cuda_tensor(x, op, name);
  (void)quant_shape(x, row_spec);  // validates the specs
  (void)quant_shape(x, col_spec);
  return true;
}
bool swiglu_pair_takes(const char* op, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                       const QuantSpec& col_spec) {
  if (h3.dtype() != DType::F32 || !pair_takes(op, "h1", h1, row_spec, col_spec)) return false;
  check_cuda_tensor(h3, op, "h3");
  return true;
}
bool swiglu_grads_pair_takes(const char* op, const Tensor& da, const Tensor& h1, const Tensor& h3,
                             const QuantSpec& row_spec, const QuantSpec& col_spec) {
  if (h1.dtype() != DType::F32 || h3.dtype() != DType::F32 || !pair_takes(op, "da", da, row_spec, col_spec))
    return false;
  check_cuda_tensor(h1, op, "h1");
  check_cuda_tensor(h3, op, "h3");
  return true;
}
}  // namespace

bool quantize_row_col(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                      const std::vector<int64_t>& offsets, const std::vector<RngKey>& col_rngs, FormOut row_out,
                      FormOut col_out, RowColQuant& out) {
  if (!pair_takes("quantize_row_col", "x", x, row_spec, col_spec)) return false;
  const int64_t R = x.size(0), C = x.size(1);
  const PairOutput o = alloc_row_col(R, C, row_spec, row_rng, col_spec, offsets, row_out, col_out, out);
  if (C > 0)
    launch_mxfp8_row_col(PlainSource{x.data<float>(), C}, C, {o}, row_spec, col_spec,
                         row_col_segments(offsets, {&col_rngs}));
  return true;
}

bool gather_quantize_row_col(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec, RngKey row_rng,
                             const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                             const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out, RowColQuant& out) {
  const char* op = "gather_quantize_row_col";
  if (!pair_takes(op, "x", x, row_spec, col_spec)) return false;
  check_cuda_tensor(token_of_slot, op, "token_of_slot");
  const int64_t M = token_of_slot.size(0), N = x.size(0), D = x.size(1);
  const PairOutput o = alloc_row_col(M, D, row_spec, row_rng, col_spec, offsets, row_out, col_out, out);
  if (D > 0)
    launch_mxfp8_row_col(GatherSource{x.data<float>(), token_of_slot.data<int32_t>(), D, N, index_error_record()}, D,
                         {o}, row_spec, col_spec, row_col_segments(offsets, {&col_rngs}));
  return true;
}

namespace {
// The Row form as row_out asks and the Col forms' decodes in the rows' layout, [R, C], for a
// launch on device offsets; the segments' keys (their rows are the GPU's).
PairOutput alloc_row_col_rows(int64_t R, int64_t C, const QuantSpec& row_spec, RngKey row_rng,
                              const QuantSpec& col_spec, FormOut row_out, RowColQuant& out) {
  PairOutput o = alloc_row_col(R, C, row_spec, row_rng, col_spec, {}, row_out, FormOut::Codes, out);
  out.col_rows = Tensor::empty({R, C}, DType::BF16, Device::CUDA);
  o.col_bf16_rows = static_cast<__nv_bfloat16*>(out.col_rows.raw());
  return o;
}
std::vector<PairSegmentOut> key_segments(const std::vector<const std::vector<RngKey>*>& keys) {
  std::vector<PairSegmentOut> segs(keys[0]->size());
  for (size_t g = 0; g < segs.size(); ++g)
    for (size_t o = 0; o < keys.size(); ++o) segs[g].rng[o] = (*keys[o])[g];
  return segs;
}
}  // namespace

bool quantize_row_col_device_offsets(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng,
                                     const QuantSpec& col_spec, const Tensor& offsets,
                                     const std::vector<RngKey>& col_rngs, FormOut row_out, RowColQuant& out) {
  const char* op = "quantize_row_col_device_offsets";
  if (!pair_takes(op, "x", x, row_spec, col_spec)) return false;
  check_cuda_tensor(offsets, op, "offsets");
  const int64_t R = x.size(0), C = x.size(1);
  const PairOutput o = alloc_row_col_rows(R, C, row_spec, row_rng, col_spec, row_out, out);
  if (R > 0 && C > 0)
    launch_mxfp8_row_col(PlainSource{x.data<float>(), C}, C, {o}, row_spec, col_spec, key_segments({&col_rngs}),
                         &offsets, R);
  return true;
}

bool gather_quantize_row_col_device_offsets(const Tensor& x, const Tensor& token_of_slot, const QuantSpec& row_spec,
                                            RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                            const std::vector<RngKey>& col_rngs, FormOut row_out, RowColQuant& out) {
  const char* op = "gather_quantize_row_col_device_offsets";
  if (!pair_takes(op, "x", x, row_spec, col_spec)) return false;
  check_cuda_tensor(token_of_slot, op, "token_of_slot");
  check_cuda_tensor(offsets, op, "offsets");
  const int64_t M = token_of_slot.size(0), N = x.size(0), D = x.size(1);
  const PairOutput o = alloc_row_col_rows(M, D, row_spec, row_rng, col_spec, row_out, out);
  if (M > 0 && D > 0)
    launch_mxfp8_row_col(GatherSource{x.data<float>(), token_of_slot.data<int32_t>(), D, N, index_error_record()}, D,
                         {o}, row_spec, col_spec, key_segments({&col_rngs}), &offsets, M);
  return true;
}

bool moe_combine_backward_row_col(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of, const Tensor& w,
                                  Tensor& dw, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                                  const std::vector<int64_t>& offsets, const std::vector<RngKey>& col_rngs,
                                  FormOut row_out, FormOut col_out, RowColQuant& out) {
  if (!row_col_kernel_takes(dout, row_spec, col_spec) || y_perm.dtype() != DType::F32) return false;
  const Tensor owner = moe_combine_backward_owners(dout, y_perm, slot_of, w, dw);  // checks the arguments
  const int64_t M = owner.size(0), D = dout.size(1), k = slot_of.size(1);
  const PairOutput o = alloc_row_col(M, D, row_spec, row_rng, col_spec, offsets, row_out, col_out, out);
  if (D > 0)
    launch_mxfp8_row_col(CombineGradSource{dout.data<float>(), owner.data<int32_t>(), w.data<float>(), D, k}, D, {o},
                         row_spec, col_spec, row_col_segments(offsets, {&col_rngs}));
  return true;
}

bool swiglu_forward_row_col(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec, RngKey row_rng,
                            const QuantSpec& col_spec, const std::vector<int64_t>& offsets,
                            const std::vector<RngKey>& col_rngs, FormOut row_out, FormOut col_out, RowColQuant& out) {
  if (!swiglu_pair_takes("swiglu_forward_row_col", h1, h3, row_spec, col_spec)) return false;
  const int64_t R = h1.size(0), F = h1.size(1);
  // no offsets: the Row form alone, the kernel's CTAs over one segment of every row
  const std::vector<int64_t> whole = {0, R};
  const std::vector<int64_t>& segs = offsets.empty() ? whole : offsets;
  const std::vector<RngKey> none(1);
  const PairOutput o = alloc_row_col(R, F, row_spec, row_rng, col_spec, offsets, row_out, col_out, out);
  if (F > 0)
    launch_mxfp8_row_col(SwigluSource{h1.data<float>(), h3.data<float>(), F}, F, {o}, row_spec, col_spec,
                         row_col_segments(segs, {offsets.empty() ? &none : &col_rngs}));
  return true;
}

bool swiglu_backward_row_col(const Tensor& da, const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                             const std::array<RngKey, 2>& row_rngs, const QuantSpec& col_spec,
                             const std::vector<int64_t>& offsets, const std::array<std::vector<RngKey>, 2>& col_rngs,
                             FormOut row_out, FormOut col_out, std::array<RowColQuant, 2>& out) {
  if (!swiglu_grads_pair_takes("swiglu_backward_row_col", da, h1, h3, row_spec, col_spec)) return false;
  const int64_t R = da.size(0), F = da.size(1);
  std::vector<PairOutput> outs;
  for (int o = 0; o < 2; ++o)
    outs.push_back(alloc_row_col(R, F, row_spec, row_rngs[size_t(o)], col_spec, offsets, row_out, col_out, out[size_t(o)]));
  if (F > 0)
    launch_mxfp8_row_col(SwigluGradSource{da.data<float>(), h1.data<float>(), h3.data<float>(), F}, F, outs, row_spec,
                         col_spec, row_col_segments(offsets, {&col_rngs[0], &col_rngs[1]}));
  return true;
}

bool moe_combine_backward_row_col_device_offsets(const Tensor& dout, const Tensor& y_perm, const Tensor& slot_of,
                                                 const Tensor& w, Tensor& dw, const QuantSpec& row_spec,
                                                 RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                                 const std::vector<RngKey>& col_rngs, FormOut row_out,
                                                 RowColQuant& out) {
  if (!row_col_kernel_takes(dout, row_spec, col_spec) || y_perm.dtype() != DType::F32) return false;
  check_cuda_tensor(offsets, "moe_combine_backward_row_col_device_offsets", "offsets");
  const Tensor owner = moe_combine_backward_owners(dout, y_perm, slot_of, w, dw);  // checks the arguments
  const int64_t M = owner.size(0), D = dout.size(1), k = slot_of.size(1);
  const PairOutput o = alloc_row_col_rows(M, D, row_spec, row_rng, col_spec, row_out, out);
  if (M > 0 && D > 0)
    launch_mxfp8_row_col(CombineGradSource{dout.data<float>(), owner.data<int32_t>(), w.data<float>(), D, k}, D, {o},
                         row_spec, col_spec, key_segments({&col_rngs}), &offsets, M);
  return true;
}

bool swiglu_forward_row_col_device_offsets(const Tensor& h1, const Tensor& h3, const QuantSpec& row_spec,
                                           RngKey row_rng, const QuantSpec& col_spec, const Tensor& offsets,
                                           const std::vector<RngKey>& col_rngs, FormOut row_out, RowColQuant& out) {
  const char* op = "swiglu_forward_row_col_device_offsets";
  if (!swiglu_pair_takes(op, h1, h3, row_spec, col_spec)) return false;
  check_cuda_tensor(offsets, op, "offsets");
  const int64_t R = h1.size(0), F = h1.size(1);
  const PairOutput o = alloc_row_col_rows(R, F, row_spec, row_rng, col_spec, row_out, out);
  if (R > 0 && F > 0)
    launch_mxfp8_row_col(SwigluSource{h1.data<float>(), h3.data<float>(), F}, F, {o}, row_spec, col_spec,
                         key_segments({&col_rngs}), &offsets, R);
  return true;
}

bool swiglu_backward_row_col_device_offsets(const Tensor& da, const Tensor& h1, const Tensor& h3,
                                            const QuantSpec& row_spec, const std::array<RngKey, 2>& row_rngs,
                                            const QuantSpec& col_spec, const Tensor& offsets,
                                            const std::array<std::vector<RngKey>, 2>& col_rngs, FormOut row_out,
                                            std::array<RowColQuant, 2>& out) {
  const char* op = "swiglu_backward_row_col_device_offsets";
  if (!swiglu_grads_pair_takes(op, da, h1, h3, row_spec, col_spec)) return false;
  check_cuda_tensor(offsets, op, "offsets");
  const int64_t R = da.size(0), F = da.size(1);
  std::vector<PairOutput> outs;
  for (int o = 0; o < 2; ++o)
    outs.push_back(alloc_row_col_rows(R, F, row_spec, row_rngs[size_t(o)], col_spec, row_out, out[size_t(o)]));
  if (R > 0 && F > 0)
    launch_mxfp8_row_col(SwigluGradSource{da.data<float>(), h1.data<float>(), h3.data<float>(), F}, F, outs, row_spec,
                         col_spec, key_segments({&col_rngs[0], &col_rngs[1]}), &offsets, R);
  return true;
}

namespace {
// quantize_both's outputs for x, allocated as row_out / col_out ask; x's shape.
QuantShape alloc_both(const Tensor& x, const QuantSpec& row_spec, const QuantSpec& col_spec, FormOut row_out,
                      FormOut col_out, QTensor& row, QTensor& col) {
  check_cuda_tensor(x, "quantize_both", "x");
  const QuantShape shape = quant_shape(x, row_spec);
  (void)quant_shape(x, col_spec);  // validates the spec
  const int64_t S = shape.slices, R = shape.rows, C = shape.cols;
  // slice s of the Col form: storage [C, padded R] at s * C rows
  row = writes_codes(row_out) ? alloc_qtensor(row_spec, shape, Device::CUDA) : qtensor_layout(row_spec, shape);
  col = writes_codes(col_out) ? alloc_qtensor(col_spec, shape, Device::CUDA) : qtensor_layout(col_spec, shape);
  if (writes_bf16(row_out)) row.bf16 = Tensor::empty({S * R, row.padded_cols()}, DType::BF16, Device::CUDA);
  if (writes_bf16(col_out)) col.bf16 = Tensor::empty({S * C, col.padded_cols()}, DType::BF16, Device::CUDA);
  return shape;
}

// alloc_both's layout checked against forms it made before (quantize_both_each's into): the same
// format, axis and shape, and buffers of the same shapes where row_out / col_out ask for them.
QuantShape reuse_both(const Tensor& x, const QuantSpec& row_spec, const QuantSpec& col_spec, FormOut row_out,
                      FormOut col_out, const QTensor& row, const QTensor& col, size_t job) {
  check_cuda_tensor(x, "quantize_both_each_into", "x");
  const QuantShape shape = quant_shape(x, row_spec);
  (void)quant_shape(x, col_spec);
  const auto fits = [&](const QTensor& have, const QuantSpec& spec, FormOut out) {
    const QTensor want = qtensor_layout(spec, shape);
    const auto sized = [](const Tensor& t, bool wanted, const Shape& s) {
      return wanted ? t.defined() && t.device() == Device::CUDA && t.shape() == s : !t.defined();
    };
    return have.fmt == want.fmt && have.axis == want.axis && have.slices == want.slices && have.rows == want.rows &&
           have.cols == want.cols && sized(have.codes, writes_codes(out), {want.total_rows(), want.code_row_bytes()}) &&
           sized(have.block_scales, writes_codes(out), {want.total_rows(), want.blocks_per_row()}) &&
           sized(have.bf16, writes_bf16(out), {want.total_rows(), want.padded_cols()});
  };
  if (!fits(row, row_spec, row_out) || !fits(col, col_spec, col_out))
    fail("quantize_both_each_into: job {}'s forms to write into are not those its tensor {} makes under {} and {}", job,
         x.str(), describe(row_spec), describe(col_spec));
  return shape;
}
}  // namespace

bool quantize_both(const Tensor& x, const QuantSpec& row_spec, RngKey row_rng, const QuantSpec& col_spec,
                   RngKey col_rng, FormOut row_out, FormOut col_out, QTensor& row, QTensor& col) {
  if (!row_col_kernel_takes(x, row_spec, col_spec)) return false;
  const QuantShape shape = alloc_both(x, row_spec, col_spec, row_out, col_out, row, col);
  const int64_t S = shape.slices, R = shape.rows, C = shape.cols;
  if (R == 0 || C == 0) return true;
  const int64_t pr = col.padded_cols();
  const PairOutput o{&row, row_rng, static_cast<uint8_t*>(raw_or_null(col.codes)),
                     static_cast<uint8_t*>(raw_or_null(col.block_scales)), static_cast<__nv_bfloat16*>(raw_or_null(col.bf16))};
  std::vector<PairSegmentOut> segs;
  for (int64_t sl = 0; sl < S; ++sl)  // one segment per slice, one stream: the 3-D quantizer's counters
    segs.push_back({sl * R, R, sl * pr, sl * C, {col_rng}});
  launch_mxfp8_row_col(PlainSource{x.data<float>(), C}, C, {o}, row_spec, col_spec, segs);
  return true;
}

bool quantize_both_each(const std::vector<BothJob>& jobs, std::vector<BothAxes>& out, bool into) {
  for (const BothJob& j : jobs)
    if (!row_col_kernel_takes(j.x, j.row_spec, j.col_spec)) return false;
  if (!into) out.assign(jobs.size(), BothAxes{});
  // one launch per MXFP8 variant (element format, row and col rounding), in the jobs' order
  std::map<std::tuple<bool, bool, bool>, std::vector<PairJob>> by_variant;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const BothJob& j = jobs[i];
    QTensor& row = out[i].row;
    QTensor& col = out[i].col;
    const QuantShape shape = into ? reuse_both(j.x, j.row_spec, j.col_spec, j.row_out, j.col_out, row, col, i)
                                  : alloc_both(j.x, j.row_spec, j.col_spec, j.row_out, j.col_out, row, col);
    PairJob pj{};
    pj.x = j.x.data<float>();
    pj.R = shape.rows;
    pj.C = shape.cols;
    pj.S = shape.slices;
    pj.row_padded_cols = row.padded_cols();
    pj.row_nb = row.blocks_per_row();
    pj.col_padded_rows = col.padded_cols();
    pj.row_rule = j.row_spec.mx_rule;
    pj.col_rule = j.col_spec.mx_rule;
    pj.out.row_codes = static_cast<uint8_t*>(raw_or_null(row.codes));
    pj.out.row_scales = static_cast<uint8_t*>(raw_or_null(row.block_scales));
    pj.out.row_bf16 = static_cast<__nv_bfloat16*>(raw_or_null(row.bf16));
    pj.out.row_seed = j.row_rng.seed;
    pj.out.row_stream = j.row_rng.stream;
    pj.out.col_codes = static_cast<uint8_t*>(raw_or_null(col.codes));
    pj.out.col_scales = static_cast<uint8_t*>(raw_or_null(col.block_scales));
    pj.out.col_bf16 = static_cast<__nv_bfloat16*>(raw_or_null(col.bf16));
    pj.col_seed = j.col_rng.seed;
    pj.col_stream = j.col_rng.stream;
    by_variant[{row.fmt == Format::MXFP8_E5M2, j.row_spec.rounding == num::Rounding::SR,
                j.col_spec.rounding == num::Rounding::SR}]
        .push_back(pj);
  }
  for (auto& [variant, pjobs] : by_variant)
    launch_mxfp8_row_col_jobs(pjobs, std::get<0>(variant), std::get<1>(variant), std::get<2>(variant));
  return true;
}

Tensor dequantize(const QTensor& q, bool undo_hadamard) {
  DequantParams p{};
  p.dec = decode_args(q, "dequantize");
  Tensor out = Tensor::empty(q.logical_shape(), DType::F32, Device::CUDA);
  if (out.numel() == 0) return out;
  const bool col = q.axis == BlockAxis::Col;
  const int B = q.block();
  p.geom = col ? col_geom(B, q.rows, q.padded_cols()) : row_geom(B, q.rows, q.padded_cols());
  p.scols = q.cols;
  p.hadamard = undo_hadamard ? q.hadamard : 0;
  p.hadamard_signs = q.hadamard_signs;
  p.out = out.data<float>();
  p.vec4 = (col ? q.rows : q.cols) % 4 == 0;  // out is a fresh (256-byte aligned) allocation
  switch (q.fmt) {
    case Format::NVFP4: launch_dequant<Kind::Nvfp4>(p, q.slices, col); break;
    case Format::MXFP8_E4M3:
    case Format::MXFP8_E5M2: launch_dequant<Kind::Mx>(p, q.slices, col); break;
    case Format::S2F6: launch_dequant<Kind::S2f6>(p, q.slices, col); break;
    case Format::MXFP4: launch_dequant<Kind::Mxfp4>(p, q.slices, col); break;
    default: fail("cuda dequantize: unsupported format {}", format_name(q.fmt));
  }
  return out;
}

QTensor requantize_transposed(const QTensor& q, const QuantSpec& target, RngKey rng, FormOut form) {
  const QuantSpec spec = requantize_transposed_spec(q, target);
  if (std::string(requantize_kernel_for(q, spec)) != "requantize_transposed_kernel")  // the composition
    return cuda::quantize(cuda::dequantize(q, true), spec, rng, nullptr, nullptr, form);
  RequantParams p;
  QTensor out;
  const int64_t ctas = requant_params(q, spec, rng, form, &out, p);
  if (ctas > 0) {
    requantize_transposed_kernel<<<grid_of(ctas, "requantize_transposed"), kThreads, 0, stream()>>>(
        p, num::philox_keys(rng.seed));
    FOURBIT_LAUNCH_CHECK();
  }
  return out;
}

bool requantize_transposed_segments(const QTensor& q, const std::vector<int64_t>& offsets, const QuantSpec& target,
                                    const std::vector<RngKey>& rngs, FormOut form, std::vector<QTensor>& out) {
  const QuantSpec spec = requantize_transposed_spec(q, target);
  if (std::string(requantize_kernel_for(q, spec)) != "requantize_transposed_kernel") return false;
  out.assign(rngs.size(), QTensor{});
  RequantSegments p{};
  int64_t ctas = 0;
  auto flush = [&] {
    if (ctas > 0) {
      requantize_segments_kernel<<<grid_of(ctas, "requantize_transposed"), kThreads, 0, stream()>>>(p);
      FOURBIT_LAUNCH_CHECK();
    }
    p.n = 0;
    ctas = 0;
  };
  for (size_t g = 0; g < rngs.size(); ++g) {
    if (offsets[g] == offsets[g + 1]) continue;
    p.cta0[p.n] = ctas;
    ctas += requant_params(qtensor_rows(q, offsets[g], offsets[g + 1]), spec, rngs[g], form, &out[g], p.seg[p.n]);
    if (++p.n == kReqSegsPerLaunch) flush();
  }
  flush();
  return true;
}

unsigned int* nonfinite_flag_address() {
  static unsigned int* const p = [] {
    void* a = nullptr;
    FOURBIT_CUDA_CHECK(cudaGetSymbolAddress(&a, g_nonfinite_flag));
    return static_cast<unsigned int*>(a);
  }();
  return p;
}

bool take_nonfinite_flag(bool clear) {
  unsigned int v = 0;
  // cudaMemcpyFromSymbol waits for the kernels queued on the default stream.
  FOURBIT_CUDA_CHECK(cudaMemcpyFromSymbol(&v, g_nonfinite_flag, sizeof v));
  if (clear && v) {
    const unsigned int zero = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpyToSymbol(g_nonfinite_flag, &zero, sizeof zero));
  }
  return v != 0;
}

}  // namespace fourbit::ops::cuda
