// defines: the gpu_quant benchmark (main)
// GPU quantizer throughput: each CUDA quantizer on a 16384 x 8192 float32 input (512 MiB, far
// above the H200's 60 MB L2), timed with CUDA events (warm-up, median of --reps runs), next to a
// device-to-device cudaMemcpy of the same input bytes in the same run. GB/s counts the bytes a
// kernel must read and write at least once (input + codes + scales + outer scales); quantizers
// with tensor-wide scales read their input twice (amax pass, then quantize), which the ratio
// charges to them. The ratio is to the copy's read + write GB/s.
// Usage: gpu_quant [--rows R --cols C --reps N --case NAME] [--json FILE]
// (--case runs only the named row, e.g. under a profiler.)
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/gpu_bench_util.h"
#include "fourbit/numerics/philox.h"
#include "fourbit/model/recipe.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"

using namespace fourbit;

namespace {
// The backward's requantize target, as nvfp4-fwd's recipe gives it (MXFP8 E4M3, RCEIL, SR).
const QuantSpec& kRequantTarget = recipe_by_name("nvfp4-fwd").expert.dgrad.b;
}  // namespace
using bench::median_ms;

namespace {

// N(0,1)-like values (sum of four uniforms, rescaled) from Philox counters: fast to make for
// 134M values, the same on every run.
std::vector<float> make_input(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < n; ++g) {
    const num::Philox4x32 r = num::random_bits4(2024, 1, uint64_t(g));
    float s = 0.0f;
    for (uint32_t w : r.v) s += float(w) * 2.3283064365386963e-10f;  // [0, 1)
    v[size_t(g)] = (s - 2.0f) * 1.7320508f;                          // mean 0, variance 1
  }
  return v;
}

int64_t qbytes(const QTensor& q) { return q.nbytes(); }

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("gpu_quant: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  int64_t R = 16384, C = 8192;
  int reps = 25;
  std::string only;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--case") only = argv[i + 1];
    if (std::string(argv[i]) == "--rows") R = std::stoll(argv[i + 1]);
    if (std::string(argv[i]) == "--cols") C = std::stoll(argv[i + 1]);
    if (std::string(argv[i]) == "--reps") reps = std::max(1, std::stoi(argv[i + 1]));
  }
  const int64_t in_bytes = R * C * 4;
  const std::vector<float> host = make_input(R * C);
  const Tensor x = Tensor::from_host(host.data(), {R, C}, DType::F32, Device::CUDA);

  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

  // The device-to-device copy of the input bytes: the bandwidth ceiling (read + write).
  Tensor dst = Tensor::empty({R, C}, DType::F32, Device::CUDA);
  const double copy_ms = median_ms([&] {
    BENCH_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), x.raw(), size_t(in_bytes), cudaMemcpyDeviceToDevice, 0));
  }, reps);
  const double copy_gbs = 2.0 * double(in_bytes) / (copy_ms * 1e6);

  auto spec = [](Format f, BlockAxis axis, OuterScale o, bool fos, num::Rounding r, int had = 0) {
    QuantSpec s;
    s.fmt = f;
    s.axis = axis;
    s.outer = o;
    s.four_over_six = fos;
    s.rounding = r;
    s.hadamard = had;
    s.hadamard_signs = 0x9E3779B9u;
    return s;
  };
  using num::Rounding;
  struct Case {
    std::string name;
    QuantSpec spec;
  };
  const std::vector<Case> cases = {
      {"nvfp4 tensor rne", spec(Format::NVFP4, BlockAxis::Row, OuterScale::Tensor, false, Rounding::RNE)},
      {"nvfp4 4/6 per-token", spec(Format::NVFP4, BlockAxis::Row, OuterScale::PerRow, true, Rounding::RNE)},
      {"nvfp4 per-token rne", spec(Format::NVFP4, BlockAxis::Row, OuterScale::PerRow, false, Rounding::RNE)},
      {"nvfp4 per-token sr", spec(Format::NVFP4, BlockAxis::Row, OuterScale::PerRow, false, Rounding::SR)},
      {"nvfp4 tensor col rne", spec(Format::NVFP4, BlockAxis::Col, OuterScale::Tensor, false, Rounding::RNE)},
      {"mxfp8-e4m3 row", spec(Format::MXFP8_E4M3, BlockAxis::Row, OuterScale::None, false, Rounding::RNE)},
      {"mxfp8-e4m3 row sr", spec(Format::MXFP8_E4M3, BlockAxis::Row, OuterScale::None, false, Rounding::SR)},
      {"mxfp8-e4m3 col", spec(Format::MXFP8_E4M3, BlockAxis::Col, OuterScale::None, false, Rounding::RNE)},
      {"mxfp8-e4m3 col sr", spec(Format::MXFP8_E4M3, BlockAxis::Col, OuterScale::None, false, Rounding::SR)},
      {"mxfp8-e5m2 row sr", spec(Format::MXFP8_E5M2, BlockAxis::Row, OuterScale::None, false, Rounding::SR)},
      {"mxfp4 row", spec(Format::MXFP4, BlockAxis::Row, OuterScale::None, false, Rounding::RNE)},
      {"s2f6", spec(Format::S2F6, BlockAxis::Row, OuterScale::None, false, Rounding::RNE)},
      {"s2f6 rht32", spec(Format::S2F6, BlockAxis::Row, OuterScale::None, false, Rounding::RNE, 32)},
  };

  bench::BenchTable table;
  table.name = fmt::format("GPU quantize throughput, {}x{} float32 ({:.0f} MiB), {}", R, C,
                           double(in_bytes) / (1 << 20), prop.name);
  table.columns = {"kernel", "ms", "GB/s", "ratio to D2D copy"};
  for (const Case& c : cases) {  // every case is a spec the registry accepts
    if (const std::string err = validate(c.spec); !err.empty()) {
      std::fprintf(stderr, "gpu_quant: case %s: %s\n", c.name.c_str(), err.c_str());
      return 1;
    }
  }
  auto add = [&](const std::string& name, double ms, int64_t bytes) {
    const double gbs = double(bytes) / (ms * 1e6);
    table.add({{"kernel", name}, {"ms", ms}, {"GB/s", gbs}, {"ratio to D2D copy", gbs / copy_gbs},
               {"bytes", bytes}});
  };
  table.add({{"kernel", "D2D copy (read+write)"}, {"ms", copy_ms}, {"GB/s", copy_gbs},
             {"ratio to D2D copy", 1.0}, {"bytes", 2 * in_bytes}});

  auto wanted = [&](const std::string& name) { return only.empty() || only == name; };
  for (const Case& c : cases) {
    if (!wanted(c.name)) continue;
    const int64_t out_bytes = qbytes(ops::quantize(x, c.spec, {1, 2}));
    const double ms = median_ms([&] { (void)ops::quantize(x, c.spec, {1, 2}); }, reps);
    add(c.name, ms, in_bytes + out_bytes);
  }

  // Both axes of one input, as a linear layer's X or dY needs them: the two single-axis kernels in
  // turn, then quantize_row_col's one pass (without and with both BF16 decodes, which the
  // separate path leaves to a decode pass before each GEMM).
  {
    const QuantSpec row = cases[5].spec, col = cases[7].spec;  // mxfp8-e4m3 row, col (RNE)
    const std::vector<int64_t> whole = {0, R};
    const std::vector<ops::RngKey> keys = {{5, 6}};
    const int64_t pair_bytes = qbytes(ops::quantize(x, row, {1, 2})) + qbytes(ops::quantize(x, col, {1, 2}));
    if (wanted("mxfp8-e4m3 row, then col")) {
      const double ms = median_ms([&] {
        (void)ops::quantize(x, row, {1, 2});
        (void)ops::quantize(x, col, {5, 6});
      }, reps);
      add("mxfp8-e4m3 row, then col", ms, 2 * in_bytes + pair_bytes);
    }
    if (wanted("mxfp8-e4m3 row+col one pass")) {
      const double ms = median_ms([&] { (void)ops::quantize_row_col(x, row, {1, 2}, col, whole, keys); }, reps);
      add("mxfp8-e4m3 row+col one pass", ms, in_bytes + pair_bytes);
    }
    if (wanted("mxfp8-e4m3 row+col one pass +bf16")) {
      const double ms = median_ms([&] { (void)ops::quantize_row_col(x, row, {1, 2}, col, whole, keys, ops::FormOut::CodesAndBf16,
                                                                  ops::FormOut::CodesAndBf16); }, reps);
      add("mxfp8-e4m3 row+col one pass +bf16", ms, in_bytes + pair_bytes + 2 * 2 * R * C);
    }
    if (wanted("mxfp8-e4m3 row+col one pass, bf16 alone")) {  // a training step's dY pair
      const double ms = median_ms([&] { (void)ops::quantize_row_col(x, row, {1, 2}, col, whole, keys, ops::FormOut::Bf16,
                                                                  ops::FormOut::Bf16); }, reps);
      add("mxfp8-e4m3 row+col one pass, bf16 alone", ms, in_bytes + 2 * 2 * R * C);
    }
    // An FFN's SwiGLU in training, [R, C / 2] each: a from h1 and h3 on both axes as the backward's
    // recomputation needs it (its Row form's BF16 decode alone, its Col form's codes), and dh1 and
    // dh3 from da, h1 and h3, each on both axes as the training step's dY pairs are (BF16 decodes
    // alone): written in F32 by the SwiGLU and then read by quantize_row_col, or quantized where
    // they are computed (swiglu_forward_row_col, swiglu_backward_row_col). Bytes: what each way
    // moves at the least.
    const int64_t F = C / 2;
    if (only.empty() || only.rfind("swiglu", 0) == 0) {
      const Tensor da = x.view(0, {R, F}), h1 = x.view(R * F, {R, F});
      const Tensor h3 = dst.view(0, {R, F});
      Tensor dh1 = Tensor::empty({R, F}, DType::F32, Device::CUDA), dh3 = Tensor::empty({R, F}, DType::F32, Device::CUDA);
      const std::array<std::vector<ops::RngKey>, 2> both = {keys, keys};
      const int64_t outs = 2 * 2 * 2 * R * F;  // two outputs, two BF16 forms each
      if (wanted("swiglu_backward, then two row+col")) {
        const double ms = median_ms([&] {
          ops::swiglu_backward(da, h1, h3, dh1, dh3);
          (void)ops::quantize_row_col(dh1, row, {1, 2}, col, whole, keys, ops::FormOut::Bf16, ops::FormOut::Bf16);
          (void)ops::quantize_row_col(dh3, row, {1, 3}, col, whole, keys, ops::FormOut::Bf16, ops::FormOut::Bf16);
        }, reps);
        add("swiglu_backward, then two row+col", ms, 3 * 4 * R * F + 2 * 4 * R * F + 2 * 4 * R * F + outs);
      }
      if (wanted("swiglu_forward, then row+col")) {  // the backward's recomputed a: w2's X and X^T
        const double ms = median_ms([&] {
          ops::swiglu_forward(h1, h3, dh1);
          (void)ops::quantize_row_col(dh1, row, {1, 2}, col, whole, keys, ops::FormOut::Bf16, ops::FormOut::Codes);
        }, reps);
        add("swiglu_forward, then row+col", ms, 2 * 4 * R * F + 4 * R * F + 4 * R * F + 3 * R * F);
      }
      if (wanted("swiglu_forward_row_col")) {
        const double ms = median_ms([&] {
          (void)ops::swiglu_forward_row_col(h1, h3, row, {1, 2}, col, whole, keys, ops::FormOut::Bf16,
                                            ops::FormOut::Codes);
        }, reps);
        add("swiglu_forward_row_col", ms, 2 * 4 * R * F + 3 * R * F);
      }
      if (wanted("swiglu_backward_row_col")) {
        const double ms = median_ms([&] {
          (void)ops::swiglu_backward_row_col(da, h1, h3, row, {ops::RngKey{1, 2}, ops::RngKey{1, 3}}, col, whole, both,
                                             ops::FormOut::Bf16, ops::FormOut::Bf16);
        }, reps);
        add("swiglu_backward_row_col", ms, 3 * 4 * R * F + outs);
      }
    }
  }

  // The backward's NVFP4 -> MXFP8 (transposed, SR) and the decoder, on a per-token NVFP4 tensor.
  const QTensor nv = ops::quantize(x, cases[1].spec, {1, 2});
  if (wanted("requantize_transposed")) {
    const int64_t out_bytes = qbytes(ops::requantize_transposed(nv, kRequantTarget, {3, 4}));
    const double ms = median_ms([&] { (void)ops::requantize_transposed(nv, kRequantTarget, {3, 4}); }, reps);
    add("requantize_transposed", ms, qbytes(nv) + out_bytes);
  }
  if (wanted("dequantize nvfp4")) {
    const double ms = median_ms([&] { (void)ops::dequantize(nv, true); }, reps);
    add("dequantize nvfp4", ms, qbytes(nv) + in_bytes);
  }
  device_synchronize();

  table.meta = {{"rows", R},
                {"cols", C},
                {"reps", reps},
                {"device", prop.name},
                {"note", "GB/s = (input bytes read once + output bytes written) / time; ratio is to "
                         "the D2D copy's (read + write) GB/s"}};
  table.print();
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
