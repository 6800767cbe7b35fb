// defines: the dist_exchange benchmark: a MoE layer's token exchanges over ep ranks, fourbit's
// payloads (NVFP4 dispatch, RHT-32 + S2F6 combine, MXFP8 dY, S2F6 dX; quantization, packing and
// decoding included) against a BF16 all-to-all of the same rows, plus the bare all-to-alls of
// each payload's size (what the codecs cost on top of the transfer).
//
// On GPUs, one process per GPU (docs/distributed.md "Benchmarks"):
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/dist_exchange --device cuda
// a single GPU process measures the codecs alone (ep = 1: nothing moves). On the CPU, ranks run as
// threads of one process (LocalGroup) for a sanity check of the same code:
//   build/bench/dist_exchange --device cpu --ranks 2 --tokens 512 --d-model 256
// Targets on 2 x H200 (issue 16): dispatch >= 2.8x and combine >= 1.7x faster than BF16.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "fourbit/dist/expert_parallel.h"
#include "fourbit/dist/local_group.h"
#include "fourbit/dist/process_group.h"
#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#if FOURBIT_HAS_CUDA
#include <cuda_runtime.h>
#endif

using namespace fourbit;
using namespace fourbit::dist;

namespace {

struct Args {
  Device device = Device::CPU;
  int ranks = 2;              // CPU mode: threads
  int64_t tokens = 8192;      // per rank: gpu-small's 8 x 1024
  int64_t d_model = 1024;
  int64_t experts = 32;       // gpu-small scaled to 32 experts
  int64_t top_k = 2;
  int warmup = 3, iters = 20;
  std::string json;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail("dist_exchange: {} needs a value", k);
      return argv[++i];
    };
    if (k == "--device") {
      const std::string v = next();
      if (v != "cpu" && v != "cuda") fail("dist_exchange: --device cpu|cuda, got {}", v);
      a.device = v == "cuda" ? Device::CUDA : Device::CPU;
    } else if (k == "--ranks") a.ranks = std::stoi(next());
    else if (k == "--tokens") a.tokens = std::stoll(next());
    else if (k == "--d-model") a.d_model = std::stoll(next());
    else if (k == "--experts") a.experts = std::stoll(next());
    else if (k == "--top-k") a.top_k = std::stoll(next());
    else if (k == "--warmup") a.warmup = std::stoi(next());
    else if (k == "--iters") a.iters = std::stoi(next());
    else if (k == "--json") a.json = next();
    else
      fail("dist_exchange: unknown argument {} (--device, --ranks, --tokens, --d-model, --experts, --top-k, "
           "--warmup, --iters, --json)", k);
  }
  return a;
}

void sync(Device d) {
  if (d == Device::CUDA) device_synchronize();
}

// Median milliseconds of fn over iters runs, the ranks lined up by a barrier before each; GPU work
// is timed with events on the stream fourbit's kernels use (collectives order themselves on it).
double time_ms(Communicator& comm, Device dev, const Args& a, const std::function<void()>& fn) {
  for (int i = 0; i < a.warmup; ++i) fn();
  sync(dev);
  std::vector<double> ms;
  for (int i = 0; i < a.iters; ++i) {
    comm.barrier();
#if FOURBIT_HAS_CUDA
    if (dev == Device::CUDA) {
      cudaEvent_t s, e;
      cudaEventCreate(&s);
      cudaEventCreate(&e);
      cudaEventRecord(s, static_cast<cudaStream_t>(current_stream()));
      fn();
      cudaEventRecord(e, static_cast<cudaStream_t>(current_stream()));
      cudaEventSynchronize(e);
      float t = 0;
      cudaEventElapsedTime(&t, s, e);
      cudaEventDestroy(s);
      cudaEventDestroy(e);
      ms.push_back(t);
      continue;
    }
#endif
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

Tensor random_rows(int64_t rows, int64_t cols, uint64_t seed, Device dev) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> nd;
  Tensor t = Tensor::empty({rows, cols}, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(gen);
  return t.to(dev);
}

// k distinct experts per token, uniform: a 1 - 1/ep share of the rows crosses to other ranks.
Tensor random_topk(int64_t n, int64_t e, int64_t k, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int32_t> v(size_t(n * k));
  std::vector<int32_t> perm(static_cast<size_t>(e));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < e; ++i) perm[size_t(i)] = int32_t(i);
    for (int64_t j = 0; j < k; ++j) {
      std::swap(perm[size_t(j)], perm[size_t(j + int64_t(gen() % uint64_t(e - j)))]);
      v[size_t(t * k + j)] = perm[size_t(j)];
    }
  }
  return Tensor::from_host(v.data(), {n, k}, DType::I32);
}

// One rank's measurements; rank 0 prints and writes them.
void run_rank(Communicator& comm, const Args& a) {
  const Device dev = a.device;
  const int ep_size = comm.size();
  const int64_t N = a.tokens, D = a.d_model, E = a.experts, K = a.top_k;
  ExpertParallel ep(comm, E, false);
  const Tensor topk = random_topk(N, E, K, 100 + uint64_t(comm.rank())).to(dev);
  const ops::RoutePlan route = ops::route_plan(topk, E);
  ExchangePlan plan = ep.plan(route, topk);

  QuantSpec x_spec;  // nvfp4-fwd's expert fprop A: per-token NVFP4 with Four Over Six
  x_spec.fmt = Format::NVFP4;
  x_spec.outer = OuterScale::PerRow;
  x_spec.four_over_six = true;
  QuantSpec dy_spec;
  dy_spec.fmt = Format::MXFP8_E4M3;
  dy_spec.outer = OuterScale::None;
  const MoeCodecs codecs = moe_codecs(x_spec, dy_spec, Format::S2F6, D, payload_rht_signs(1, 0, false),
                                      payload_rht_signs(1, 0, true));

  const Tensor x = random_rows(N, D, 200 + uint64_t(comm.rank()), dev);
  Tensor x_slots = Tensor::empty({plan.slots, D}, DType::F32, dev);
  ops::gather_rows(x, route.token_of_slot, x_slots);
  Tensor x_bf16 = Tensor::empty({plan.slots, D}, DType::BF16, dev);
  ops::convert(x_slots, x_bf16);
  ep.dispatch(plan, ops::quantize(x, x_spec), codecs.dispatch);  // sets the plan's received metadata
  const Tensor y = random_rows(plan.expert_rows(), D, 300 + uint64_t(comm.rank()), dev);
  Tensor y_bf16 = Tensor::empty({plan.expert_rows(), D}, DType::BF16, dev);
  ops::convert(y, y_bf16);

  // Bare all-to-alls of `row_bytes` per row, to the experts or back to the sources.
  auto a2a = [&](int64_t row_bytes, bool to_experts, const Tensor& send, Tensor& recv) {
    std::vector<int64_t> s(static_cast<size_t>(ep_size)), r(static_cast<size_t>(ep_size));
    for (int p = 0; p < ep_size; ++p) {
      const int64_t out = to_experts ? plan.send_rows[size_t(p)] : plan.recv_rows[size_t(p)];
      const int64_t in = to_experts ? plan.recv_rows[size_t(p)] : plan.send_rows[size_t(p)];
      s[size_t(p)] = out * row_bytes;
      r[size_t(p)] = in * row_bytes;
    }
    comm.all_to_all_v(send, s, recv, r);
  };
  const int64_t bf16_row = 2 * D;
  Tensor bf16_to_experts = Tensor::empty({plan.expert_rows(), bf16_row}, DType::U8, dev);
  Tensor bf16_to_sources = Tensor::empty({plan.slots, bf16_row}, DType::U8, dev);
  auto bare = [&](int64_t row_bytes, bool to_experts) {
    const int64_t src_rows = to_experts ? plan.slots : plan.expert_rows();
    const int64_t dst_rows = to_experts ? plan.expert_rows() : plan.slots;
    Tensor s = Tensor::zeros({src_rows, row_bytes}, DType::U8, dev), r = Tensor::empty({dst_rows, row_bytes}, DType::U8, dev);
    return time_ms(comm, dev, a, [&] { a2a(row_bytes, to_experts, s, r); });
  };

  struct Row {
    std::string flow;
    double ms, bf16_ms;
    int64_t bytes_sent;
  };
  std::vector<Row> rows;
  const int64_t cross = plan.slots - plan.send_rows[size_t(comm.rank())];  // rows leaving this rank
  const double bf16_dispatch = time_ms(comm, dev, a, [&] { a2a(bf16_row, true, x_bf16, bf16_to_experts); });
  const double bf16_combine = time_ms(comm, dev, a, [&] { a2a(bf16_row, false, y_bf16, bf16_to_sources); });
  rows.push_back({"bf16 all-to-all to experts (baseline)", bf16_dispatch, bf16_dispatch, cross * bf16_row});
  rows.push_back({"bf16 all-to-all to sources (baseline)", bf16_combine, bf16_combine,
                  (plan.expert_rows() - plan.recv_rows[size_t(comm.rank())]) * bf16_row});
  rows.push_back({"nvfp4 dispatch: quantize + pack + a2a + unpack",
                  time_ms(comm, dev, a, [&] { ep.dispatch(plan, ops::quantize(x, x_spec), codecs.dispatch); }),
                  bf16_dispatch, cross * codecs.dispatch.row_bytes()});
  rows.push_back({"  of which quantize", time_ms(comm, dev, a, [&] { ops::quantize(x, x_spec); }), bf16_dispatch, 0});
  rows.push_back({"  nvfp4-sized bare a2a", bare(codecs.dispatch.row_bytes(), true), bf16_dispatch,
                  cross * codecs.dispatch.row_bytes()});
  const int64_t back = plan.expert_rows() - plan.recv_rows[size_t(comm.rank())];
  rows.push_back({"s2f6 combine: rht + encode + a2a + decode",
                  time_ms(comm, dev, a, [&] { ep.combine(plan, y, codecs.combine); }), bf16_combine,
                  back * codecs.combine.row_bytes()});
  rows.push_back({"  s2f6-sized bare a2a", bare(codecs.combine.row_bytes(), false), bf16_combine,
                  back * codecs.combine.row_bytes()});
  rows.push_back({"mxfp8 dY dispatch: encode + a2a + decode",
                  time_ms(comm, dev, a, [&] { ep.dispatch_grad(plan, x_slots, codecs.grad_dispatch); }), bf16_dispatch,
                  cross * codecs.grad_dispatch.row_bytes()});
  rows.push_back({"s2f6 dX combine: rht + encode + a2a + decode",
                  time_ms(comm, dev, a, [&] { ep.combine(plan, y, codecs.grad_combine); }), bf16_combine,
                  back * codecs.grad_combine.row_bytes()});
  rows.push_back({"exchange plan (counts all-to-all)", time_ms(comm, dev, a, [&] { ep.plan(route, topk); }), 0, 0});

  if (comm.rank() != 0) return;
  bench::BenchTable t;
  t.name = fmt::format("dist_exchange: {} rank(s) on {}, {} tokens x top-{} per rank, d_model {}, {} experts "
                       "(rank 0, median of {})",
                       ep_size, device_name(dev), N, K, D, E, a.iters);
  t.columns = {"flow", "ms", "MB sent", "speedup vs bf16"};
  t.meta = {{"ranks", ep_size}, {"device", device_name(dev)}, {"tokens_per_rank", N}, {"d_model", D},
            {"experts", E}, {"top_k", K}, {"iters", a.iters},
            {"targets", {{"dispatch_speedup", 2.8}, {"combine_speedup", 1.7}}}};
  for (const Row& r : rows)
    t.add({{"flow", r.flow}, {"ms", r.ms}, {"MB sent", double(r.bytes_sent) / 1e6},
           {"speedup vs bf16", r.bf16_ms > 0 && r.ms > 0 ? r.bf16_ms / r.ms : 0.0}});
  t.print();
  t.write_json(a.json);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (a.device == Device::CPU) {
      LocalGroup::run(a.ranks, [&](Communicator& comm) { run_rank(comm, a); });
      return 0;
    }
    ProcessGroup pg = init_process_group(Device::CUDA);
    try {
      run_rank(*pg.world, a);
    } catch (const std::exception& e) {
      if (pg.rendezvous) pg.rendezvous->abort(e.what());
      throw;
    }
    if (pg.rendezvous) pg.rendezvous->goodbye();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_exchange: %s\n", e.what());
    return 1;
  }
}
