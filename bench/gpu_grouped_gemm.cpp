// defines: the gpu_grouped_gemm benchmark (main)
// The grouped BF16 expert GEMM with device-side offsets (cuda::grouped_gemm_bf16, one launch, no
// host read-back) against what the step runs today on the same BF16 operands (ops::grouped_gemm:
// one cuBLASLt GEMM per expert on GPU lanes, offsets on the host) and against one dense cuBLASLt
// BF16 GEMM of the same M x N x K (every row against one expert's weights: the same FLOPs without
// the grouping, the ceiling the issue measures against). Shapes: gpu-small's expert GEMMs (16
// experts, 8192 tokens top-2, d_model = d_expert = 1024; balanced and skewed routing; w1|w3 fused),
// decode-sized groups, and 8192^3 as one group. Each case first compares the grouped result with
// the per-expert cuBLAS one (similarity gap), so a fast wrong kernel cannot look good here.
// Usage: gpu_grouped_gemm [--reps N] [--json FILE]
#include <cuda_runtime.h>

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

Tensor random_bf16(const Shape& s, uint64_t seed, float scale) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(size_t(shape_numel(s)));
  for (auto& x : v) x = nd(g) * scale;
  Tensor out = Tensor::empty(s, DType::BF16, Device::CUDA);
  ops::convert(Tensor::from_host(v.data(), s, DType::F32, Device::CUDA), out);
  return out;
}

struct Case {
  std::string name;
  int64_t N, K;
  std::vector<int64_t> rows;  // per group
};

std::vector<int64_t> balanced(int64_t M, int64_t G) { return std::vector<int64_t>(size_t(G), M / G); }

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("gpu_grouped_gemm: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  int reps = 20;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--reps") reps = std::max(1, std::stoi(argv[i + 1]));
  std::vector<int64_t> skewed(16, 768);
  skewed[0] = 16384 - 15 * 768;  // one expert with 4864 rows
  const std::vector<Case> cases = {
      {"gpu-small expert (w1, w3, w2, dgrad), balanced", 1024, 1024, balanced(16384, 16)},
      {"gpu-small expert, skewed (one expert 4864 rows)", 1024, 1024, skewed},
      {"gpu-small w1|w3 fused (N = 2048)", 2048, 1024, balanced(16384, 16)},
      {"decode, batch 64 top-2 (8 rows an expert)", 1024, 1024, balanced(128, 16)},
      {"decode, batch 256 top-2 (32 rows an expert)", 1024, 1024, balanced(512, 16)},
      {"8192^3 as one group", 8192, 8192, {8192}},
  };
  bench::BenchTable table;
  table.name = fmt::format("grouped BF16 GEMM, FP32 out (median of {})", reps);
  table.columns = {"case",          "M",     "grouped ms", "grouped TFLOP/s", "per-expert cuBLAS ms", "dense cuBLAS ms",
                   "grouped / dense speed", "vs per-expert", "gap"};
  for (const Case& c : cases) {
    const int64_t G = int64_t(c.rows.size());
    std::vector<int64_t> off{0};
    for (int64_t r : c.rows) off.push_back(off.back() + r);
    const int64_t M = off.back();
    std::vector<int32_t> off32(off.begin(), off.end());
    const Tensor offsets = Tensor::from_host(off32.data(), {G + 1}, DType::I32, Device::CUDA);
    const Tensor a = random_bf16({M, c.K}, 1, 1.0f), b = random_bf16({G, c.N, c.K}, 2, 0.03f);
    Tensor out = Tensor::empty({M, c.N}, DType::F32, Device::CUDA), ref = out.clone(), dense = out.clone();
    auto grouped = [&] { ops::cuda::grouped_gemm_bf16(a, b, offsets, out, false); };
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
    const double g_ms = median_ms(grouped, reps), p_ms = median_ms(per_expert, reps), d_ms = median_ms(one_gemm, reps);
    const double flop = 2.0 * double(M) * double(c.N) * double(c.K);
    table.add({{"case", c.name},
               {"M", M},
               {"grouped ms", g_ms},
               {"grouped TFLOP/s", flop / (g_ms * 1e9)},
               {"per-expert cuBLAS ms", p_ms},
               {"dense cuBLAS ms", d_ms},
               {"grouped / dense speed", d_ms / g_ms},
               {"vs per-expert", p_ms / g_ms},
               {"gap", fmt::format("{:.1e}", gap)}});
  }
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  table.meta = {{"reps", reps},
                {"device", prop.name},
                {"kernel", "mma.sync m16n8k16 BF16, 128x128x32 tiles, 4-stage cp.async, 8 warps (grouped_mma.cu)"},
                {"note", "speeds are ratios of times on the same shape (>1: the grouped kernel is faster); gap is "
                         "1 - 2<x,y>/(|x|^2+|y|^2) between the grouped and per-expert results"}};
  table.print();
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
