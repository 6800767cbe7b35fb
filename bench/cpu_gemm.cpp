// defines: the cpu_gemm benchmark (main)
// The CPU GEMM (fixed reduction order, batch invariant) against OpenBLAS sgemm on the same
// shapes in the same process: GFLOP/s and the ratio, on one thread and on all threads.
// Shapes: the configs/tiny.toml training GEMMs (2048 tokens) and square sizes.
// Usage: cpu_gemm [--json FILE]
#include <cblas.h>
#include <omp.h>

#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "fourbit/ops/ops.h"

extern "C" void openblas_set_num_threads(int);

using namespace fourbit;

int main(int argc, char** argv) {
  struct Shape3 {
    const char* what;
    int64_t M, N, K;
  };
  const std::vector<Shape3> shapes = {
      {"tiny qkv fprop", 2048, 256, 128},  {"tiny expert w1 (per expert)", 512, 128, 128},
      {"tiny wgrad (K=tokens)", 128, 128, 2048}, {"tiny lm_head", 2048, 260, 128},
      {"square 512", 512, 512, 512},        {"square 1024", 1024, 1024, 1024},
  };
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  bench::BenchTable table;
  table.name = "CPU GEMM: fourbit (fixed-order FMA chains) vs OpenBLAS sgemm, same process";
  table.columns = {"shape", "threads", "fourbit GFLOP/s", "openblas GFLOP/s", "fourbit/openblas"};
  const int max_threads = omp_get_max_threads();
  for (int threads : {1, max_threads}) {
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    for (const Shape3& s : shapes) {
      std::vector<float> a(size_t(s.M * s.K)), b(size_t(s.N * s.K));
      for (auto& v : a) v = nd(rng);
      for (auto& v : b) v = nd(rng);
      const Tensor A = Tensor::from_host(a.data(), {s.M, s.K}, DType::F32);
      const Tensor B = Tensor::from_host(b.data(), {s.N, s.K}, DType::F32);
      Tensor C = Tensor::empty({s.M, s.N}, DType::F32);
      std::vector<float> c(size_t(s.M * s.N));
      const double flops = 2.0 * double(s.M) * double(s.N) * double(s.K);
      const int reps = flops > 1e9 ? 3 : 10;
      const double t_ours = bench::median_seconds([&] { ops::gemm(A, B, C); }, reps);
      const double t_blas = bench::median_seconds([&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(s.M), int(s.N), int(s.K), 1.0f, a.data(),
                    int(s.K), b.data(), int(s.K), 0.0f, c.data(), int(s.N));
      }, reps);
      table.add({{"shape", fmt::format("{} {}x{}x{}", s.what, s.M, s.N, s.K)}, {"threads", threads},
                 {"fourbit GFLOP/s", flops / t_ours / 1e9}, {"openblas GFLOP/s", flops / t_blas / 1e9},
                 {"fourbit/openblas", t_blas / t_ours}});
    }
  }
  table.meta = {{"max_threads", max_threads}, {"gemm", "C[M,N] = A[M,K] . B[N,K]^T, f32"}};
  table.print();
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
