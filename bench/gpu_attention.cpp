// defines: the gpu_attention benchmark (main)
// Causal GQA attention on the GPU: the fused kernels (flash_attention.cu; on Hopper both tile
// engines, wgmma and mma.sync) against the materialized path (attention.cu: scores in memory,
// cuBLASLt GEMMs), forward and backward, in the same process, on configs/gpu-small.toml's attention shape by default (8 x 1024 tokens, 16 query
// heads, 4 KV heads, hd 64). TFLOP/s counts the causal half of the products (forward 2 GEMMs,
// backward 5 with the recompute of S: 4 B H T^2 hd / 2 and 10 B H T^2 hd / 2). Both paths first
// run once and are compared by similarity, so a fast wrong kernel cannot look good here.
// "fused ms" is the engine the model runs (wgmma where available).
// Usage: gpu_attention [--batch B --seq T --heads Hq --kv-heads Hkv --head-dim hd --reps N] [--json FILE]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
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
  Buffers fused = buffers(), mat = buffers(), sync = buffers();
  const bool engines = ops::cuda::wgmma_available();
  auto fused_fwd_into = [&](Buffers& b) {
    if (!ops::cuda::flash_attention_forward(q, k, v, 0, b.out, b.lse))
      fail("gpu_attention: the fused kernels do not take hd {}", hd);
  };
  auto fused_bwd_into = [&](Buffers& b) { ops::attention_backward(dout, q, k, v, b.out, b.lse, b.dq, b.dk, b.dv); };
  auto fused_fwd = [&] { fused_fwd_into(fused); };
  auto fused_bwd = [&] { fused_bwd_into(fused); };
  // the mma.sync engine (set_flash_wgmma(false)), on a Hopper device only
  auto sync_fwd = [&] {
    ops::cuda::set_flash_wgmma(false);
    fused_fwd_into(sync);
    ops::cuda::set_flash_wgmma(true);
  };
  auto sync_bwd = [&] {
    ops::cuda::set_flash_wgmma(false);
    fused_bwd_into(sync);
    ops::cuda::set_flash_wgmma(true);
  };
  auto mat_fwd = [&] { ops::cuda::materialized_attention_forward(q, k, v, 0, mat.out, mat.lse); };
  auto mat_bwd = [&] {
    ops::cuda::materialized_attention_backward(dout, q, k, v, mat.out, mat.lse, mat.dq, mat.dk, mat.dv);
  };
  fused_fwd();
  mat_fwd();
  fused_bwd();
  mat_bwd();
  if (engines) {
    sync_fwd();
    sync_bwd();
  }
  device_synchronize();
  const double gap_out = similarity_gap(fused.out, mat.out), gap_dq = similarity_gap(fused.dq, mat.dq),
               gap_dk = similarity_gap(fused.dk, mat.dk), gap_dv = similarity_gap(fused.dv, mat.dv);
  const double engine_gap = engines ? std::max({similarity_gap(fused.out, sync.out), similarity_gap(fused.dq, sync.dq),
                                                similarity_gap(fused.dk, sync.dk), similarity_gap(fused.dv, sync.dv)})
                                    : 0.0;

  const double causal = double(B) * Hq * double(T) * double(T) * double(hd) / 2.0;
  const double fwd_flop = 4.0 * causal, bwd_flop = 10.0 * causal;
  bench::BenchTable table;
  table.name = fmt::format("causal GQA attention, B={} T={} Hq={} Hkv={} hd={} (median of {})", B, T, Hq, Hkv, hd, reps);
  table.columns = {"pass", "materialized ms", "mma.sync ms", "fused ms", "speed-up", "fused TFLOP/s", "of 786 (BF16 dense)"};
  auto add = [&](const char* pass, double mat_ms, double sync_ms, double fused_ms, double flop) {
    const double tflops = flop / (fused_ms * 1e9);
    table.add({{"pass", pass},
               {"materialized ms", mat_ms},
               {"mma.sync ms", sync_ms},
               {"fused ms", fused_ms},
               {"speed-up", mat_ms / fused_ms},
               {"fused TFLOP/s", tflops},
               {"of 786 (BF16 dense)", tflops / 786.0}});
  };
  const double mf = median_ms(mat_fwd, reps), ff = median_ms(fused_fwd, reps);
  const double mb = median_ms(mat_bwd, reps), fb = median_ms(fused_bwd, reps);
  const double sf = engines ? median_ms(sync_fwd, reps) : ff, sb = engines ? median_ms(sync_bwd, reps) : fb;
  add("forward", mf, sf, ff, fwd_flop);
  add("backward", mb, sb, fb, bwd_flop);
  add("both", mf + mb, sf + sb, ff + fb, fwd_flop + bwd_flop);
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  table.meta = {{"B", B}, {"T", T}, {"Hq", Hq}, {"Hkv", Hkv}, {"hd", hd}, {"reps", reps}, {"device", prop.name},
                {"similarity_gap_out", gap_out}, {"similarity_gap_dq", gap_dq}, {"similarity_gap_dk", gap_dk},
                {"similarity_gap_dv", gap_dv}, {"engines", engines ? "wgmma (fused), mma.sync" : "mma.sync only"},
                {"similarity_gap_wgmma_vs_mma_sync", engine_gap},
                {"note", "backward times include the rowsum(dO * O) pass both paths share; 786 TFLOP/s is the "
                         "H200's measured cuBLAS BF16 GEMM ceiling"}};
  table.print();
  std::printf("fused vs materialized similarity gap: out %.2e  dq %.2e  dk %.2e  dv %.2e; wgmma vs mma.sync %.2e\n",
              gap_out, gap_dq, gap_dk, gap_dv, engine_gap);
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
