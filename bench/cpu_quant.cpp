// defines: the cpu_quant benchmark (main): CPU quantizers and requantize_transposed against memcpy
// CPU quantizer throughput: GB/s of float32 input for each quantizer, on one core and on all
// cores, next to a memcpy of the same bytes in the same run (the ratio is what to read).
// Usage: cpu_quant [--rows R --cols C] [--json FILE]
#include <omp.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "fourbit/model/recipe.h"
#include "fourbit/ops/ops.h"

using namespace fourbit;

namespace {
// The backward's requantize target, as nvfp4-fwd's recipe gives it (MXFP8 E4M3, RCEIL, SR).
const QuantSpec& kRequantTarget = recipe_by_name("nvfp4-fwd").expert.dgrad.b;
}  // namespace

int main(int argc, char** argv) {
  int64_t R = 4096, C = 4096;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--rows") R = std::stoll(argv[i + 1]);
    if (std::string(argv[i]) == "--cols") C = std::stoll(argv[i + 1]);
  }
  std::vector<float> host(size_t(R * C));
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  for (auto& v : host) v = nd(rng);
  const Tensor x = Tensor::from_host(host.data(), {R, C}, DType::F32);
  const double gb = double(R * C) * 4 / 1e9;

  struct Case {
    std::string name;
    QuantSpec spec;
  };
  auto spec = [](Format f, OuterScale o, bool fos) {
    QuantSpec s;
    s.fmt = f;
    s.outer = o;
    s.four_over_six = fos;
    return s;
  };
  std::vector<Case> cases = {
      {"nvfp4 tensor rne", spec(Format::NVFP4, OuterScale::Tensor, false)},
      {"nvfp4 4/6 per-token", spec(Format::NVFP4, OuterScale::PerRow, true)},
      {"mxfp8-e4m3 row", spec(Format::MXFP8_E4M3, OuterScale::None, false)},
      {"mxfp4 row", spec(Format::MXFP4, OuterScale::None, false)},
      {"s2f6", spec(Format::S2F6, OuterScale::None, false)},
  };
  for (const Case& c : cases)  // every case is a spec the format registry accepts
    if (const std::string err = validate(c.spec); !err.empty()) {
      std::fprintf(stderr, "cpu_quant: case %s: %s\n", c.name.c_str(), err.c_str());
      return 1;
    }
  const QTensor nv = ops::quantize(x, cases[0].spec);

  bench::BenchTable table;
  table.name = fmt::format("CPU quantize throughput, {}x{} float32 ({:.0f} MB)", R, C, gb * 1e3);
  table.columns = {"quantizer", "threads", "GB/s", "memcpy GB/s", "ratio to memcpy"};
  const int max_threads = omp_get_max_threads();
  std::vector<float> dst(host.size());
  for (int threads : {1, max_threads}) {
    omp_set_num_threads(threads);
    // memcpy with the same thread count, split in contiguous chunks
    const double t_copy = bench::median_seconds([&] {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < R; ++r) std::memcpy(dst.data() + r * C, host.data() + r * C, size_t(C) * 4);
    }, 5);
    const double copy_gbs = gb / t_copy;
    for (const Case& c : cases) {
      const double t = bench::median_seconds([&] { (void)ops::quantize(x, c.spec); }, 3);
      table.add({{"quantizer", c.name}, {"threads", threads}, {"GB/s", gb / t}, {"memcpy GB/s", copy_gbs},
                 {"ratio to memcpy", gb / t / copy_gbs}});
    }
    const double t_rq = bench::median_seconds([&] { (void)ops::requantize_transposed(nv, kRequantTarget, {1, 2}); }, 3);
    table.add({{"quantizer", "requantize_transposed"}, {"threads", threads}, {"GB/s", gb / t_rq},
               {"memcpy GB/s", copy_gbs}, {"ratio to memcpy", gb / t_rq / copy_gbs}});
  }
  table.meta = {{"rows", R}, {"cols", C}, {"max_threads", max_threads},
                {"note", "GB/s counts the float32 input bytes; memcpy moves the same bytes"}};
  table.print();
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
