// defines: the gpu_grouped_gemm benchmark (main)
// The grouped BF16 expert GEMM with device-side offsets (cuda::grouped_gemm_bf16, one launch, no
// host read-back; its wgmma main loop on Hopper, and the portable mma.sync one for comparison) against what the step runs today on the same BF16 operands (ops::grouped_gemm:
// one cuBLASLt GEMM per expert on GPU lanes, offsets on the host) and against one dense cuBLASLt
// BF16 GEMM of the same M x N x K (every row against one expert's weights: the same FLOPs without
// the grouping, the ceiling the issue measures against). Shapes: gpu-small's expert GEMMs (16
// experts, 8192 tokens top-2, d_model = d_expert = 1024; balanced and skewed routing, and for the weight
// gradients four experts without tokens; w1|w3 fused),
// decode-sized groups, and 8192^3 as one group. Each case first compares the grouped result with
// the per-expert cuBLAS one (similarity gap), so a fast wrong kernel cannot look good here.
// A second table runs the same kernel family on packed block-scaled operands (NVFP4 with the
// nvfp4-fwd recipe's outer scales, MXFP8 E4M3), dequantized in the kernel, against the decode path
// it replaces (BF16 copies, the BF16 kernel, the scale epilogue; the same bits, checked here) and
// against the BF16 kernel on the same shape, with the expert weights' read bandwidth at decode
// sizes (B bytes / time, against the measured copy bandwidth of 4.1-4.3 TB/s). A third table runs
// the experts' weight gradients (K over each expert's tokens) through the kernel's K-grouped form
// (ops::gemm_batch_grouped) against per-expert cuBLASLt on lanes (ops::gemm_batch), on the bf16
// recipe's token-major BF16 operands and on Col-axis MXFP8 ones, and the BF16 ones with the offsets
// on the GPU (ops::grouped_wgrad_device_offsets, checked bit-equal). A fourth runs the bf16 recipe's
// expert input gradients dX = dY . W_e, the forward's [E, K, N] weights read MN-major in place by
// the grouped kernel (ops::grouped_gemm with a transposed B), against per-expert cuBLASLt on lanes
// and against the grouped kernel on a K-major copy of the weights (the same bits, checked).
// Usage: gpu_grouped_gemm [--reps N] [--decode-only] [--json FILE]
// --decode-only: only the decode-sized cases of the block-scaled and decode tables (quick, and a
// short run to profile the decode tiles in).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/gpu_bench_util.h"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"

using namespace fourbit;
using bench::median_ms;
using bench::similarity_gap;

namespace {

Tensor random_f32(const Shape& s, uint64_t seed, float scale) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = nd(g) * scale;
  return Tensor::from_host(v.data(), s, DType::F32, Device::CUDA);
}
Tensor random_bf16(const Shape& s, uint64_t seed, float scale) {
  Tensor out = Tensor::empty(s, DType::BF16, Device::CUDA);
  ops::convert(random_f32(s, seed, scale), out);
  return out;
}

QuantSpec block_spec(Format f, OuterScale outer) {
  QuantSpec s;
  s.fmt = f;
  s.outer = outer;
  return s;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return std::memcmp(ha.raw(), hb.raw(), size_t(ha.nbytes())) == 0;
}

struct Case {
  std::string name;
  int64_t N, K;
  std::vector<int64_t> rows;  // per group
};

// Group offsets 0, r0, r0 + r1, ... of groups of `rows` rows.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> off{0};
  for (int64_t r : rows) off.push_back(off.back() + r);
  return off;
}
std::vector<int64_t> balanced(int64_t M, int64_t G) { return std::vector<int64_t>(size_t(G), M / G); }

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("gpu_grouped_gemm: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  int reps = 20;
  bool decode_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) reps = std::max(1, std::stoi(argv[i + 1]));
    if (std::string(argv[i]) == "--decode-only") decode_only = true;
  }
  std::vector<int64_t> skewed(16, 768);
  skewed[0] = 16384 - 15 * 768;  // one expert with 4864 rows
  std::vector<int64_t> sparse(16, 0);  // as a gpu-small step often routes: experts 1, 5, 9, 13 get no tokens
  for (int64_t g = 0, left = 12, rows = 16384; g < 16; ++g)
    if (g % 4 != 1) rows -= (sparse[size_t(g)] = rows / left--);
  const std::vector<Case> cases = {
      {"gpu-small expert (w1, w3, w2, dgrad), balanced", 1024, 1024, balanced(16384, 16)},
      {"gpu-small expert, skewed (one expert 4864 rows)", 1024, 1024, skewed},
      {"gpu-small w1|w3 fused (N = 2048)", 2048, 1024, balanced(16384, 16)},
      {"decode, batch 64 top-2 (8 rows an expert)", 1024, 1024, balanced(128, 16)},
      {"decode, batch 256 top-2 (32 rows an expert)", 1024, 1024, balanced(512, 16)},
      {"8192^3 as one group", 8192, 8192, {8192}},
  };
  // decode: batch B top-2 spread over the 16 experts (B = 1: two experts with a row each)
  auto decode_rows = [](int64_t rows) {
    std::vector<int64_t> r(16, 0);
    for (int64_t i = 0; i < rows; ++i) ++r[size_t(i % 16)];
    return r;
  };
  const std::vector<Case> block_cases = {
      {"gpu-small expert, balanced", 1024, 1024, balanced(16384, 16)},
      {"gpu-small w1|w3 fused (N = 2048)", 2048, 1024, balanced(16384, 16)},
      {"decode batch 1, w1|w3", 2048, 1024, decode_rows(2)},
      {"decode batch 16, w1|w3", 2048, 1024, decode_rows(32)},
      {"decode batch 64, w1|w3", 2048, 1024, decode_rows(128)},
      {"decode batch 256, w1|w3", 2048, 1024, decode_rows(512)},
  };
  bench::BenchTable table;
  table.name = fmt::format("grouped BF16 GEMM, FP32 out (median of {})", reps);
  table.columns = {"case",          "M",     "grouped ms", "grouped TFLOP/s", "per-expert cuBLAS ms", "dense cuBLAS ms",
                   "grouped / dense speed", "vs per-expert", "128x256 tile ms", "128x256 / dense speed",
                   "128x256 same bits", "256x128 tile ms", "256x128 / dense speed", "256x128 same bits",
                   "ping-pong ms", "ping-pong / dense speed", "ping-pong same bits", "128x256 main loop ms",
                   "256x128 main loop ms", "ping-pong main loop ms", "cp.async ms", "launch-order ms",
                   "a cluster a tile ms", "mma.sync ms", "gap", "mma.sync gap"};
  for (const Case& c : cases) {
    if (decode_only) break;
    const int64_t G = int64_t(c.rows.size());
    const std::vector<int64_t> off = offsets_of(c.rows);
    const int64_t M = off.back();
    std::vector<int32_t> off32(off.begin(), off.end());
    const Tensor offsets = Tensor::from_host(off32.data(), {G + 1}, DType::I32, Device::CUDA);
    const Tensor a = random_bf16({M, c.K}, 1, 1.0f), b = random_bf16({G, c.N, c.K}, 2, 0.03f);
    Tensor out = Tensor::empty({M, c.N}, DType::F32, Device::CUDA), ref = out.clone(), dense = out.clone();
    auto grouped = [&] { ops::cuda::grouped_gemm_bf16(a, b, offsets, out, false); };
    Tensor portable_out = out.clone();
    auto portable = [&] {  // the portable mma.sync main loop of the same kernel
      ops::cuda::set_grouped_wgmma(false);
      ops::cuda::grouped_gemm_bf16(a, b, offsets, portable_out, false);
      ops::cuda::set_grouped_wgmma(true);
    };
    auto per_expert = [&] {  // the path before the grouped kernel: one cuBLASLt GEMM per expert on lanes
      ops::cuda::set_grouped_kernel(false);
      ops::grouped_gemm(ops::Operand(a), ops::Operand(b), off, ref, false);
      ops::cuda::set_grouped_kernel(true);
    };
    const Tensor b0 = b.view(0, {c.N, c.K});
    auto one_gemm = [&] { ops::gemm(ops::Operand(a), ops::Operand(b0), dense, false); };
    grouped();
    per_expert();
    device_synchronize();
    ops::cuda::check_recorded_index_errors();
    const double gap = similarity_gap(out, ref);
    portable();
    const double gap_portable = similarity_gap(portable_out, ref);
    const double g_ms = median_ms(grouped, reps), p_ms = median_ms(per_expert, reps), d_ms = median_ms(one_gemm, reps);
    const double m_ms = median_ms(portable, reps);
    Tensor cp_out = out.clone();
    auto cp_async = [&] {  // the wgmma loop's training tile fed by cp.async instead of TMA clusters
      ops::cuda::set_grouped_tma(false);
      ops::cuda::grouped_gemm_bf16(a, b, offsets, cp_out, false);
      ops::cuda::set_grouped_tma(true);
    };
    const double c_ms = median_ms(cp_async, reps);
    auto launch_order = [&] {  // the TMA form with its tiles in launch order (no bands of column pairs)
      ops::cuda::set_grouped_tile_band(0);
      ops::cuda::grouped_gemm_bf16(a, b, offsets, cp_out, false);
      ops::cuda::set_grouped_tile_band(8);
    };
    const double l_ms = median_ms(launch_order, reps);
    auto cluster_a_tile = [&] {  // the TMA form launching a cluster a tile instead of persistent clusters
      ops::cuda::set_grouped_tma_persistent(false);
      ops::cuda::grouped_gemm_bf16(a, b, offsets, cp_out, false);
      ops::cuda::set_grouped_tma_persistent(true);
    };
    const double t_ms = median_ms(cluster_a_tile, reps);
    // the TMA form's tiles whatever K (the default takes the ping-pong one where K <= 4096):
    // 128 x 256 on two warpgroups of m64n256k16, 256 x 128 on four of m64n128k16, and the ping-pong
    // form's 128 x 128 taken whole by two warpgroups in turn
    auto on_tile = [&](int tile, bool pp, auto&& run) {
      const int tile_before = ops::cuda::set_grouped_tma_tile(tile);
      const int pp_before = ops::cuda::set_grouped_tma_pingpong(pp ? 1 << 30 : 0);
      run();
      ops::cuda::set_grouped_tma_tile(tile_before);
      ops::cuda::set_grouped_tma_pingpong(pp_before);
    };
    struct TileTime {
      double ms, loop_ms;
      bool same;
    };
    auto time_tile = [&](int tile, bool pp) {
      Tensor t_out = out.clone();
      auto run = [&] { on_tile(tile, pp, [&] { ops::cuda::grouped_gemm_bf16(a, b, offsets, t_out, false); }); };
      run();
      device_synchronize();
      TileTime r{median_ms(run, reps), 0.0, same_bits(t_out, out)};
      // the main loop alone: the probe skips the epilogue's stores (t_out is left unwritten)
      ops::cuda::set_grouped_tma_store_probe(true);
      r.loop_ms = median_ms(run, reps);
      ops::cuda::set_grouped_tma_store_probe(false);
      return r;
    };
    const TileTime flat = time_tile(256, false), tall = time_tile(128, false), pp = time_tile(256, true);
    const double flop = 2.0 * double(M) * double(c.N) * double(c.K);
    table.add({{"case", c.name},
               {"M", M},
               {"grouped ms", g_ms},
               {"grouped TFLOP/s", flop / (g_ms * 1e9)},
               {"per-expert cuBLAS ms", p_ms},
               {"dense cuBLAS ms", d_ms},
               {"grouped / dense speed", d_ms / g_ms},
               {"vs per-expert", p_ms / g_ms},
               {"128x256 tile ms", flat.ms},
               {"128x256 / dense speed", d_ms / flat.ms},
               {"128x256 same bits", flat.same ? "yes" : "NO"},
               {"256x128 tile ms", tall.ms},
               {"256x128 / dense speed", d_ms / tall.ms},
               {"256x128 same bits", tall.same ? "yes" : "NO"},
               {"ping-pong ms", pp.ms},
               {"ping-pong / dense speed", d_ms / pp.ms},
               {"ping-pong same bits", pp.same ? "yes" : "NO"},
               {"128x256 main loop ms", flat.loop_ms},
               {"256x128 main loop ms", tall.loop_ms},
               {"ping-pong main loop ms", pp.loop_ms},
               {"cp.async ms", c_ms},
               {"launch-order ms", l_ms},
               {"a cluster a tile ms", t_ms},
               {"mma.sync ms", m_ms},
               {"gap", fmt::format("{:.1e}", gap)},
               {"mma.sync gap", fmt::format("{:.1e}", gap_portable)}});
  }
  bench::BenchTable block;
  block.name = fmt::format("grouped block-scaled GEMM, packed operands dequantized in the kernel (median of {})", reps);
  // B GB/s: the weights of the experts with rows (codes and block scales, or BF16) over the time
  block.columns = {"format", "case", "M", "fused ms", "decode path ms", "bf16 kernel ms", "vs decode path",
                   "vs bf16 kernel", "fused / dense bf16 speed", "B GB/s", "bf16 B GB/s", "same bits"};
  // Decode-sized groups (at most 64 rows on average), GPU time only (median_queued_ms: the calls
  // queued behind an 8192^3 GEMM, as a CUDA graph would issue them), each decode tile of the
  // wgmma loop: the 64 x 256 one of two warpgroups, the weight-streaming 64 x WN ones of one, and
  // the streaming kernel (weights decoded in registers as mma.sync's A operand; "stream") —
  // set_grouped_decode_width; "chosen": what the kernel picks. B GB/s (the weights of the
  // experts with rows, read once) and the speed against the BF16 weights are the chosen tile's;
  // "B ÷ copy": against a device-to-device copy measured in the same run.
  bench::BenchTable decode;
  decode.name = fmt::format("decode-sized grouped GEMMs, GPU time per call (queued, median of {})", reps);
  decode.columns = {"format", "case", "M", "64 x 256 us", "64 x 128 us", "64 x 32 us", "stream us", "chosen us",
                    "B GB/s", "B ÷ copy", "speed vs bf16"};
  const double copy_gbs = bench::copy_bandwidth_gbs(reps);
  const Tensor busy_a = random_f32({8192, 8192}, 9, 1.0f);
  Tensor busy16 = Tensor::empty(busy_a.shape(), DType::BF16, Device::CUDA);
  ops::convert(busy_a, busy16);
  Tensor busy_c = Tensor::empty({8192, 8192}, DType::F32, Device::CUDA);
  auto busy = [&] { ops::gemm(ops::Operand(busy16), ops::Operand(busy16), busy_c, false); };
  // the queued GPU time of run (microseconds) on each decode configuration: -1 (64 x 256), 128, 32,
  // 16 (the streaming kernel), chosen
  auto decode_widths = [&](auto&& run) {
    std::vector<double> us;
    for (int width : {-1, 128, 32, 16, 0}) {
      ops::cuda::set_grouped_decode_width(width);
      us.push_back(1e3 * bench::median_queued_ms(run, busy, reps));
    }
    ops::cuda::set_grouped_decode_width(0);
    return us;
  };
  auto decode_row = [&](const char* format, const std::string& name, int64_t M, const std::vector<double>& us,
                        int64_t bytes, double bf16_us) {
    const double gbs = double(bytes) / (us[4] * 1e3);
    decode.add({{"format", format}, {"case", name}, {"M", M}, {"64 x 256 us", us[0]}, {"64 x 128 us", us[1]},
                {"64 x 32 us", us[2]}, {"stream us", us[3]}, {"chosen us", us[4]}, {"B GB/s", gbs},
                {"B ÷ copy", gbs / copy_gbs}, {"speed vs bf16", bf16_us / us[4]}});
  };
  for (const Case& c : block_cases) {
    const int64_t G = int64_t(c.rows.size());
    const std::vector<int64_t> off = offsets_of(c.rows);
    if (decode_only && ops::cuda::grouped_rows_per_group(off) > 64) continue;
    const int64_t M = off.back();
    const Tensor a = random_f32({M, c.K}, 3, 1.0f), b = random_f32({G, c.N, c.K}, 4, 0.03f);
    Tensor a16 = Tensor::empty(a.shape(), DType::BF16, Device::CUDA), b16 = Tensor::empty(b.shape(), DType::BF16, Device::CUDA);
    ops::convert(a, a16);
    ops::convert(b, b16);
    Tensor out = Tensor::empty({M, c.N}, DType::F32, Device::CUDA), ref = out.clone(), dense = out.clone();
    auto bf16 = [&] { ops::grouped_gemm(ops::Operand(a16), ops::Operand(b16), off, dense, false); };
    const double b_ms = median_ms(bf16, reps);
    const bool decode_sized = ops::cuda::grouped_rows_per_group(off) <= 64;
    int64_t b16_bytes = 0;  // the BF16 weights of the experts with rows
    for (int64_t r : c.rows)
      if (r > 0) b16_bytes += c.N * c.K * 2;
    double bf16_us = 0.0;
    if (decode_sized) {
      const std::vector<double> us = decode_widths(bf16);
      bf16_us = us[4];
      decode_row("bf16", c.name, M, us, b16_bytes, bf16_us);
    }
    const Tensor b0 = b16.view(0, {c.N, c.K}), a_all = a16;
    auto one_gemm = [&] { ops::gemm(ops::Operand(a_all), ops::Operand(b0), dense, false); };
    const double d_ms = median_ms(one_gemm, reps);
    for (const auto& [name, fmt, ao, bo] :
         {std::tuple{"nvfp4", Format::NVFP4, OuterScale::PerRow, OuterScale::PerSlice},
          std::tuple{"mxfp8 e4m3", Format::MXFP8_E4M3, OuterScale::None, OuterScale::None}}) {
      const QTensor aq = ops::quantize(a, block_spec(fmt, ao)), bq = ops::quantize(b, block_spec(fmt, bo));
      auto fused = [&] { ops::grouped_gemm(ops::Operand(aq), ops::Operand(bq), off, out, false); };
      auto decode_path = [&] {
        ops::cuda::set_fused_dequant(false);
        ops::grouped_gemm(ops::Operand(aq), ops::Operand(bq), off, ref, false);
        ops::cuda::set_fused_dequant(true);
      };
      fused();
      decode_path();
      device_synchronize();
      const bool same = same_bits(out, ref);
      const double f_ms = median_ms(fused, reps), p_ms = median_ms(decode_path, reps);

      int64_t b_bytes = 0;  // the weights of the experts with rows: codes and block scales
      for (int64_t r : c.rows)
        if (r > 0) b_bytes += (bq.codes.nbytes() + bq.block_scales.nbytes()) / G;
      nlohmann::json row = {{"format", name},
                 {"case", c.name},
                 {"M", M},
                 {"fused ms", f_ms},
                 {"decode path ms", p_ms},
                 {"bf16 kernel ms", b_ms},
                 {"vs decode path", p_ms / f_ms},
                 {"vs bf16 kernel", b_ms / f_ms},
                 {"fused / dense bf16 speed", d_ms / f_ms},
                 {"B GB/s", double(b_bytes) / (f_ms * 1e6)},
                 {"bf16 B GB/s", double(b16_bytes) / (b_ms * 1e6)},
                 {"same bits", same ? "yes" : "NO"}};
      block.add(row);
      if (decode_sized) decode_row(name, c.name, M, decode_widths(fused), b_bytes, bf16_us);
    }
  }
  // The experts' weight gradients dW_e (+)= dY_e^T X_e: K runs over each expert's tokens.
  bench::BenchTable wgrad;
  wgrad.name = fmt::format("grouped weight gradients, K-grouped kernel vs per-expert cuBLASLt (median of {})", reps);
  // grouped ms: accumulating into the gradients (a second micro-batch); stored ms: the first write
  // after zero_grad, which stores instead (the step's, with lazily zeroed gradients)
  wgrad.columns = {"operands",      "case",          "GEMMs",         "grouped ms",           "stored ms",
                   "grouped TFLOP/s", "cp.async form ms", "256x128 tile ms", "per-expert ms",   "dense cuBLAS ms",
                   "vs per-expert", "grouped / dense speed", "256x128 / dense speed", "ping-pong ms",
                   "ping-pong / dense speed", "ping-pong same bits", "device offsets ms", "device offsets same bits",
                   "gap"};
  struct WgradCase {
    std::string name;
    std::vector<int64_t> rows;
    int sets;  // 2: w1 and w3 sharing X, as the step runs them
  };
  for (const WgradCase& c : {WgradCase{"gpu-small w2, balanced", balanced(16384, 16), 1},
                             WgradCase{"gpu-small w1 + w3, balanced", balanced(16384, 16), 2},
                             WgradCase{"gpu-small w2, skewed", skewed, 1},
                             WgradCase{"gpu-small w1 + w3, 4 of 16 experts empty", sparse, 2}}) {
    if (decode_only) break;
    const int64_t D = 1024, G = int64_t(c.rows.size());
    const std::vector<int64_t> off = offsets_of(c.rows);
    const bool empties = std::find(c.rows.begin(), c.rows.end(), 0) != c.rows.end();
    const int64_t T = off.back();
    const Tensor dy32 = random_f32({T, D}, 5, 1.0f), x32 = random_f32({T, D}, 6, 1.0f);
    Tensor dy = Tensor::empty(dy32.shape(), DType::BF16, Device::CUDA), x = Tensor::empty(x32.shape(), DType::BF16, Device::CUDA);
    ops::convert(dy32, dy);
    ops::convert(x32, x);
    QuantSpec col = block_spec(Format::MXFP8_E4M3, OuterScale::None);
    col.axis = BlockAxis::Col;
    // (MXFP8 operands only where every expert has tokens)
    const std::vector<QTensor> qdy = empties ? std::vector<QTensor>{}
                                             : ops::quantize_segments(dy32, off, col, std::vector<ops::RngKey>(size_t(G))),
                               qx = empties ? std::vector<QTensor>{}
                                            : ops::quantize_segments(x32, off, col, std::vector<ops::RngKey>(size_t(G)));
    std::vector<Tensor> dys, xs;
    for (int64_t g = 0; g < G; ++g) {
      dys.push_back(dy.slice_rows(off[size_t(g)], off[size_t(g) + 1]));
      xs.push_back(x.slice_rows(off[size_t(g)], off[size_t(g) + 1]));
    }
    Tensor dense = Tensor::empty({D, D}, DType::F32, Device::CUDA);
    auto one_gemm = [&] { ops::gemm(ops::Operand(dy, true), ops::Operand(x, true), dense, false); };
    const double d_ms = median_ms(one_gemm, reps) * c.sets;
    for (const bool mx : {false, true}) {
      if (mx && empties) continue;
      Tensor grad = Tensor::zeros({c.sets * G, D, D}, DType::F32, Device::CUDA), ref = grad.clone();
      std::vector<Tensor> outs, refs;
      std::vector<ops::GemmJob> jobs, ref_jobs;
      std::vector<int64_t> slot;  // each job's problem: set s, expert g at s * G + g
      for (int s = 0; s < c.sets; ++s)
        for (int64_t g = 0; g < G; ++g) {
          outs.push_back(grad.view((s * G + g) * D * D, {D, D}));
          refs.push_back(ref.view((s * G + g) * D * D, {D, D}));
        }
      for (int s = 0; s < c.sets; ++s)
        for (int64_t g = 0; g < G; ++g) {
          const size_t i = size_t(s * G + g);
          if (c.rows[size_t(g)] == 0) continue;  // as the step: an empty expert's gradient is left as it is
          const ops::Operand a = mx ? ops::Operand(qdy[size_t(g)]) : ops::Operand(dys[size_t(g)], true);
          const ops::Operand b = mx ? ops::Operand(qx[size_t(g)]) : ops::Operand(xs[size_t(g)], true);
          jobs.push_back({a, b, &outs[i], true});
          slot.push_back(int64_t(i));
          ref_jobs.push_back({a, b, &refs[i], true});
        }
      auto grouped = [&] { ops::gemm_batch_grouped(jobs); };
      auto per_expert = [&] { ops::gemm_batch(ref_jobs); };
      grouped();
      per_expert();
      device_synchronize();
      const double gap = similarity_gap(grad, ref);
      const double g_ms = median_ms(grouped, reps), p_ms = median_ms(per_expert, reps);
      std::vector<ops::GemmJob> store_jobs = jobs;
      for (ops::GemmJob& j : store_jobs) j.accumulate = false;
      const double s_ms = median_ms([&] { ops::gemm_batch_grouped(store_jobs); }, reps);
      // the cp.async form (the TMA form is the default for both layouts; the same bits)
      ops::cuda::set_grouped_wgrad_tma(false);
      const double c_ms = median_ms(grouped, reps);
      ops::cuda::set_grouped_wgrad_tma(true);
      const int tile_before = ops::cuda::set_grouped_wgrad_tma_tile(128);  // the TMA form's 256 x 128 tile
      const double f_ms = median_ms(grouped, reps);
      ops::cuda::set_grouped_wgrad_tma_tile(tile_before);
      // the ping-pong form: 128 x 128 tiles taken by two warpgroups in turn, from the same C
      Tensor pp_grad = Tensor::zeros(grad.shape(), DType::F32, Device::CUDA), pp_ref = pp_grad.clone();
      std::vector<ops::GemmJob> pp_jobs = jobs, pp_ref_jobs = jobs;
      std::vector<Tensor> pp_outs, pp_refs;
      for (size_t i = 0; i < jobs.size(); ++i) {
        pp_outs.push_back(pp_grad.view(int64_t(i) * D * D, {D, D}));
        pp_refs.push_back(pp_ref.view(int64_t(i) * D * D, {D, D}));
      }
      for (size_t i = 0; i < jobs.size(); ++i) {
        pp_jobs[i].c = &pp_outs[i];
        pp_ref_jobs[i].c = &pp_refs[i];
      }
      ops::gemm_batch_grouped(pp_ref_jobs);
      const bool pp_before = ops::cuda::set_grouped_wgrad_tma_pingpong(true);
      ops::gemm_batch_grouped(pp_jobs);
      device_synchronize();
      const bool pp_same = same_bits(pp_grad, pp_ref);
      const double pp_ms = median_ms(grouped, reps);
      ops::cuda::set_grouped_wgrad_tma_pingpong(pp_before);
      // bf16: the offsets on the GPU (ops::grouped_wgrad_device_offsets: the problems' arguments
      // and maps made by a kernel, every set in one launch), against the host's from the same zeros
      double dev_ms = 0;
      std::string dev_same = "n/a";
      if (!mx) {
        const std::vector<int32_t> off32(off.begin(), off.end());
        const Tensor dev_off = Tensor::from_host(off32.data(), {G + 1}, DType::I32, Device::CPU).to(Device::CUDA);
        Tensor dev_grad = Tensor::zeros(grad.shape(), DType::F32, Device::CUDA), dev_ref = dev_grad.clone();
        std::vector<Tensor> dev_cs, dev_refs;
        dev_cs.reserve(size_t(c.sets));  // the sets point at them
        for (int s = 0; s < c.sets; ++s) dev_cs.push_back(dev_grad.view(s * G * D * D, {G, D, D}));
        std::vector<ops::WgradSet> sets;
        for (int s = 0; s < c.sets; ++s) sets.push_back({&dy, &x, &dev_cs[size_t(s)]});
        std::vector<ops::GemmJob> dev_ref_jobs = jobs;
        for (size_t i = 0; i < jobs.size(); ++i) dev_refs.push_back(dev_ref.view(slot[i] * D * D, {D, D}));
        for (size_t i = 0; i < jobs.size(); ++i) dev_ref_jobs[i].c = &dev_refs[i];
        ops::gemm_batch_grouped(dev_ref_jobs);
        ops::grouped_wgrad_device_offsets(sets, dev_off, true);
        device_synchronize();
        dev_same = same_bits(dev_grad, dev_ref) ? "yes" : "NO";
        dev_ms = median_ms([&] { ops::grouped_wgrad_device_offsets(sets, dev_off, true); }, reps);
      }
      const double flop = 2.0 * double(c.sets) * double(T) * double(D) * double(D);
      wgrad.add({{"operands", mx ? "mxfp8 e4m3, Col axis (decoded)" : "bf16, token-major (transposed)"},
                 {"case", c.name},
                 {"GEMMs", c.sets * G},
                 {"grouped ms", g_ms},
                 {"stored ms", s_ms},
                 {"grouped TFLOP/s", flop / (g_ms * 1e9)},
                 {"cp.async form ms", c_ms},
                 {"256x128 tile ms", f_ms},
                 {"256x128 / dense speed", d_ms / f_ms},
                 {"per-expert ms", p_ms},
                 {"dense cuBLAS ms", d_ms},
                 {"vs per-expert", p_ms / g_ms},
                 {"grouped / dense speed", d_ms / g_ms},
                 {"ping-pong ms", pp_ms},
                 {"ping-pong / dense speed", d_ms / pp_ms},
                 {"ping-pong same bits", pp_same ? "yes" : "NO"},
                 {"device offsets ms", dev_ms},
                 {"device offsets same bits", dev_same},
                 {"gap", fmt::format("{:.1e}", gap)}});
    }
  }
  // The experts' input gradients dX_e = dY_e . W_e with W_e the forward's [K, N] slice (w2: K = D,
  // N = F; w1|w3 fused: K = 2F, N = D).
  bench::BenchTable dgrad;
  dgrad.name = fmt::format("expert dgrad, forward weights read MN-major in place (median of {})", reps);
  dgrad.columns = {"case",          "M",        "grouped ms", "grouped TFLOP/s", "per-expert ms", "K-major copy ms",
                   "dense cuBLAS ms", "vs per-expert", "grouped / dense speed", "128x256 tile ms",
                   "128x256 / dense speed", "256x128 tile ms", "256x128 / dense speed", "ping-pong ms",
                   "ping-pong / dense speed", "same bits as K-major", "gap"};
  for (const Case& c : {Case{"gpu-small w2 dgrad, balanced", 1024, 1024, balanced(16384, 16)},
                        Case{"gpu-small w2 dgrad, skewed", 1024, 1024, skewed},
                        Case{"gpu-small w1|w3 dgrad (K = 2048)", 1024, 2048, balanced(16384, 16)}}) {
    if (decode_only) break;
    const int64_t G = int64_t(c.rows.size());
    const std::vector<int64_t> off = offsets_of(c.rows);
    const int64_t M = off.back();
    const Tensor dy = random_bf16({M, c.K}, 7, 1.0f), w = random_bf16({G, c.K, c.N}, 8, 0.03f);
    const Tensor wh = w.to(Device::CPU);  // W_e^T, K-major: the same BF16 values transposed
    std::vector<uint16_t> t(size_t(wh.numel()));
    const auto* wv = static_cast<const uint16_t*>(wh.raw());
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k = 0; k < c.K; ++k)
        for (int64_t n = 0; n < c.N; ++n) t[size_t((g * c.N + n) * c.K + k)] = wv[(g * c.K + k) * c.N + n];
    const Tensor wk = Tensor::from_host(t.data(), {G, c.N, c.K}, DType::BF16, Device::CUDA);
    Tensor out = Tensor::empty({M, c.N}, DType::F32, Device::CUDA), ref = out.clone(), kout = out.clone(),
           dense = out.clone();
    auto grouped = [&] { ops::grouped_gemm(ops::Operand(dy), ops::Operand(w, true), off, out); };
    auto kmajor = [&] { ops::grouped_gemm(ops::Operand(dy), ops::Operand(wk), off, kout); };
    auto per_expert = [&] {
      ops::cuda::set_grouped_kernel(false);
      ops::grouped_gemm(ops::Operand(dy), ops::Operand(w, true), off, ref);
      ops::cuda::set_grouped_kernel(true);
    };
    const Tensor w0 = w.view(0, {c.K, c.N});
    auto one_gemm = [&] { ops::gemm(ops::Operand(dy), ops::Operand(w0, true), dense, false); };
    grouped();
    kmajor();
    per_expert();
    device_synchronize();
    bool same = same_bits(out, kout);
    const double gap = similarity_gap(out, ref);
    const double g_ms = median_ms(grouped, reps), k_ms = median_ms(kmajor, reps), p_ms = median_ms(per_expert, reps),
                 d_ms = median_ms(one_gemm, reps);
    // each TMA tile whatever K (the default takes the ping-pong one where K <= 4096): the same bits
    auto time_tile = [&](int tile, bool pp) {
      const int tile_before = ops::cuda::set_grouped_tma_tile(tile);
      const int pp_before = ops::cuda::set_grouped_tma_pingpong(pp ? 1 << 30 : 0);
      grouped();
      device_synchronize();
      same = same && same_bits(out, kout);
      const double ms = median_ms(grouped, reps);
      ops::cuda::set_grouped_tma_tile(tile_before);
      ops::cuda::set_grouped_tma_pingpong(pp_before);
      return ms;
    };
    const double flat_ms = time_tile(256, false), f_ms = time_tile(128, false), pp_ms = time_tile(256, true);
    const double flop = 2.0 * double(M) * double(c.N) * double(c.K);
    dgrad.add({{"case", c.name},
               {"M", M},
               {"grouped ms", g_ms},
               {"grouped TFLOP/s", flop / (g_ms * 1e9)},
               {"per-expert ms", p_ms},
               {"K-major copy ms", k_ms},
               {"dense cuBLAS ms", d_ms},
               {"vs per-expert", p_ms / g_ms},
               {"grouped / dense speed", d_ms / g_ms},
               {"128x256 tile ms", flat_ms},
               {"128x256 / dense speed", d_ms / flat_ms},
               {"256x128 tile ms", f_ms},
               {"256x128 / dense speed", d_ms / f_ms},
               {"ping-pong ms", pp_ms},
               {"ping-pong / dense speed", d_ms / pp_ms},
               {"same bits as K-major", same ? "yes" : "NO"},
               {"gap", fmt::format("{:.1e}", gap)}});
  }
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  table.meta = {{"reps", reps},
                {"device", prop.name},
                {"kernel", "grouped_mma.cu: on Hopper wgmma BF16 fed by TMA in 2-CTA clusters multicasting A, "
                           "persistent: where K <= 4096 128x128 tiles taken whole by 2 warpgroups in turn (ping-pong, "
                           "m64n128k16), else 128x256 tiles on 2 warpgroups of m64n256k16; tiles in bands of 8 "
                           "128-wide column pairs "
                           "(cp.async ms: 256x128 tiles of m64n128k16 fed by cp.async; launch-order ms: TMA, a row "
                           "tile's columns before the next's; a cluster a tile ms: TMA, not persistent; 256x128 tile "
                           "ms: TMA, 256x128 tiles on 4 warpgroups of m64n128k16; 128x256 and ping-pong ms: those "
                           "tiles whatever K; main loop ms: TMA with the "
                           "epilogue's stores skipped); for decode-sized groups the streaming kernel (a warp per 16 "
                           "weight rows decoded in registers as mma.sync's A operand, tokens in n8 blocks) up to 16 "
                           "rows a group (64 for packed operands), else 64x128 or 64x32 tiles of one warpgroup; "
                           "64-wide K tiles; mma.sync m16n8k16 main loop for comparison"},
                {"note", "speeds are ratios of times on the same shape (>1: the grouped kernel is faster); gap is "
                         "1 - 2<x,y>/(|x|^2+|y|^2) between the grouped and per-expert results"}};
  if (!decode_only) table.print();
  block.meta = table.meta;
  block.print();
  decode.meta = table.meta;
  decode.print();
  const std::string json = bench::json_path_arg(argc, argv);
  const std::string stem = json.empty() ? "" : json.substr(0, json.rfind('.'));
  if (!decode_only) table.write_json(json);
  if (!json.empty()) block.write_json(stem + "_block.json");
  if (!json.empty()) decode.write_json(stem + "_decode.json");
  if (decode_only) return 0;
  wgrad.meta = table.meta;
  wgrad.meta["note"] = "weight gradients accumulate into zeroed gradients, repeatedly while timed; mxfp8 times include "
                       "the BF16 decodes both paths run; dense cuBLAS: one BF16 GEMM over all tokens (the same FLOPs)";
  wgrad.print();
  if (!json.empty()) wgrad.write_json(stem + "_wgrad.json");
  dgrad.meta = table.meta;
  dgrad.print();
  if (!json.empty()) dgrad.write_json(stem + "_dgrad.json");
  return 0;
}
