// defines: the gpu_attention benchmark (main)
// Causal GQA attention on the GPU: the fused kernels (flash_attention.cu: mma.sync, and on Hopper
// wgmma in each CTA shape) against the materialized path (attention.cu: scores in memory,
// cuBLASLt GEMMs), forward and backward, in the same process, on configs/gpu-small.toml's
// attention shape by default (8 x 1024 tokens, 16 query heads, 4 KV heads, hd 64). TFLOP/s counts
// the causal half of the products (forward 2 GEMMs, backward 5 with the recompute of S:
// 4 B H T^2 hd / 2 and 10 B H T^2 hd / 2). Every path's outputs are compared with the
// materialized ones by similarity, and the run fails on a gap over 1e-4, so a fast wrong kernel
// cannot look good here.
// Usage: gpu_attention [--batch B --seq T --heads Hq --kv-heads Hkv --head-dim hd --reps N] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
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

Tensor randn_cuda(const Shape& s, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = nd(g);
  return Tensor::from_host(v.data(), s, DType::F32, Device::CUDA);
}

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("gpu_attention: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  int64_t B = 8, T = 1024, Hq = 16, Hkv = 4, hd = 64;
  int reps = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--batch") B = std::stoll(argv[i + 1]);
    if (a == "--seq") T = std::stoll(argv[i + 1]);
    if (a == "--heads") Hq = std::stoll(argv[i + 1]);
    if (a == "--kv-heads") Hkv = std::stoll(argv[i + 1]);
    if (a == "--head-dim") hd = std::stoll(argv[i + 1]);
    if (a == "--reps") reps = std::max(1, std::stoi(argv[i + 1]));
  }
  const Tensor q = randn_cuda({B, T, Hq, hd}, 1), k = randn_cuda({B, T, Hkv, hd}, 2), v = randn_cuda({B, T, Hkv, hd}, 3),
               dout = randn_cuda({B, T, Hq, hd}, 4);
  struct Buffers {
    Tensor out, lse, dq, dk, dv;
  };
  auto buffers = [&] {
    return Buffers{Tensor::empty(q.shape(), DType::F32, Device::CUDA), Tensor::empty({B, Hq, T}, DType::F32, Device::CUDA),
                   Tensor::empty(q.shape(), DType::F32, Device::CUDA), Tensor::empty(k.shape(), DType::F32, Device::CUDA),
                   Tensor::empty(k.shape(), DType::F32, Device::CUDA)};
  };
  // The variants: the materialized path, then the fused kernels on mma.sync and (Hopper) on wgmma in
  // each CTA shape; the last is the default the model runs (and stays selected).
  struct Variant {
    std::string name;
    bool materialized, wgmma;
    int wg, stages;
    Buffers buf;
    double fwd_ms = 0, bwd_ms = 0, gap = 0;
  };
  std::vector<Variant> variants;
  variants.push_back({"materialized", true, false, 0, 0, buffers()});
  variants.push_back({"fused, mma.sync", false, false, 1, 2, buffers()});
  if (ops::cuda::wgmma_available() && (hd == 64 || hd == 128))  // the wgmma engine's head sizes
    for (const auto& [wg, st] : {std::pair<int, int>{2, 2}, {1, 3}, {2, 3}, {1, 2}})
      variants.push_back({fmt::format("fused, wgmma, {} warpgroup{}, {} stages", wg, wg > 1 ? "s" : "", st), false,
                          true, wg, st, buffers()});
  auto select = [&](const Variant& x) {
    ops::cuda::set_flash_wgmma(x.wgmma);
    if (x.wgmma) ops::cuda::set_flash_cta(x.wg, x.stages);
  };
  auto fwd = [&](Variant& x) {
    if (x.materialized) return ops::cuda::materialized_attention_forward(q, k, v, 0, x.buf.out, x.buf.lse);
    if (!ops::cuda::flash_attention_forward(q, k, v, 0, x.buf.out, x.buf.lse))
      fail("gpu_attention: the fused kernels do not take hd {}", hd);
  };
  auto bwd = [&](Variant& x) {
    if (x.materialized)
      return ops::cuda::materialized_attention_backward(dout, q, k, v, x.buf.out, x.buf.lse, x.buf.dq, x.buf.dk, x.buf.dv);
    ops::attention_backward(dout, q, k, v, x.buf.out, x.buf.lse, x.buf.dq, x.buf.dk, x.buf.dv);
  };
  for (Variant& x : variants) {
    select(x);
    fwd(x);
    bwd(x);
    x.fwd_ms = median_ms([&] { fwd(x); }, reps);
    x.bwd_ms = median_ms([&] { bwd(x); }, reps);
  }
  device_synchronize();
  const Buffers& mat = variants.front().buf;
  for (Variant& x : variants) {
    x.gap = std::max({similarity_gap(x.buf.out, mat.out), similarity_gap(x.buf.dq, mat.dq),
                      similarity_gap(x.buf.dk, mat.dk), similarity_gap(x.buf.dv, mat.dv)});
    // both paths are BF16 attention (~2e-6 apart); a timing of wrong results is no measurement
    if (!(x.gap < 1e-4)) fail("gpu_attention: {} is {:.1e} from the materialized path (expected ~2e-6)", x.name, x.gap);
  }

  const double causal = double(B) * Hq * double(T) * double(T) * double(hd) / 2.0;
  const double fwd_flop = 4.0 * causal, bwd_flop = 10.0 * causal;
  bench::BenchTable table;
  table.name = fmt::format("causal GQA attention, B={} T={} Hq={} Hkv={} hd={} (median of {})", B, T, Hq, Hkv, hd, reps);
  table.columns = {"path",          "forward ms", "backward ms", "both ms", "speed-up vs materialized",
                   "TFLOP/s (both)", "of 786 (BF16 dense)", "gap vs materialized"};
  const double mat_both = variants.front().fwd_ms + variants.front().bwd_ms;
  for (const Variant& x : variants) {
    const double both = x.fwd_ms + x.bwd_ms, tflops = (fwd_flop + bwd_flop) / (both * 1e9);
    table.add({{"path", x.name},
               {"forward ms", x.fwd_ms},
               {"backward ms", x.bwd_ms},
               {"both ms", both},
               {"speed-up vs materialized", mat_both / both},
               {"TFLOP/s (both)", tflops},
               {"of 786 (BF16 dense)", tflops / 786.0},
               {"gap vs materialized", fmt::format("{:.1e}", x.gap)}});
  }
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  table.meta = {{"B", B}, {"T", T}, {"Hq", Hq}, {"Hkv", Hkv}, {"hd", hd}, {"reps", reps}, {"device", prop.name},
                {"note", "backward times include the rowsum(dO * O) pass both paths share; 786 TFLOP/s is the "
                         "H200's measured cuBLAS BF16 GEMM ceiling; gap: the largest 1 - similarity over out, dq, dk, "
                         "dv"}};
  table.print();
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
