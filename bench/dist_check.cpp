// defines: the dist_check program: the multi-process checks of the dist layer that need real
// processes and GPUs, run under a launcher (docs/distributed.md "On the GPU machine"):
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/dist_check --device cuda
//  1. collectives: all-to-all-v of known bytes (uneven, some empty), the ordered all-reduce (F32
//     and F64) against the left fold of every rank's data regenerated here, broadcast, barrier,
//     split;
//  2. a MoE layer's exchanges (NVFP4 dispatch, S2F6 combine, MXFP8 dY, S2F6 dX) of GPU tensors
//     over NCCL against the same ranks run as LocalGroup threads on this process's CPU: every
//     received and decoded byte equal;
//  3. bucketed gradient reduction against the left fold;
// and with --fail-rank R --fail-mode exit|throw|hang, a failure drill: rank R dies without a
// goodbye, throws, or stops answering after step 1; every other rank must end with a message
// naming it (exit code 3 when it did, 1 otherwise) instead of waiting forever.
// On the CPU, --device cpu --ranks N runs the same checks over LocalGroup threads.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "fourbit/dist/expert_parallel.h"
#include "fourbit/dist/grad_reduce.h"
#include "fourbit/dist/local_group.h"
#include "fourbit/dist/process_group.h"
#include "fourbit/ops/ops.h"

using namespace fourbit;
using namespace fourbit::dist;

namespace {

struct Args {
  Device device = Device::CPU;
  int ranks = 2;
  int fail_rank = -1;
  std::string fail_mode = "exit";
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) fail("dist_check: {} needs a value", k);
      return argv[++i];
    };
    if (k == "--device") a.device = next() == "cuda" ? Device::CUDA : Device::CPU;
    else if (k == "--ranks") a.ranks = std::stoi(next());
    else if (k == "--fail-rank") a.fail_rank = std::stoi(next());
    else if (k == "--fail-mode") a.fail_mode = next();
    else fail("dist_check: unknown argument {} (--device cpu|cuda, --ranks N, --fail-rank R, --fail-mode exit|throw|hang)", k);
  }
  if (a.fail_mode != "exit" && a.fail_mode != "throw" && a.fail_mode != "hang")
    fail("dist_check: --fail-mode exit|throw|hang, got {}", a.fail_mode);
  return a;
}

void say(const Communicator& c, const std::string& what) {
  if (c.rank() != 0) return;
  std::printf("dist_check: %s\n", what.c_str());
  std::fflush(stdout);
}

void expect_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  const Tensor a = got.to(Device::CPU), b = want.to(Device::CPU);
  if (a.nbytes() != b.nbytes() || std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())) != 0)
    throw Error(fmt::format("dist_check: {} differs", what));
}

Tensor rank_values(int rank, int64_t n, DType dt) {
  std::mt19937_64 gen(uint64_t(1000 + rank));
  std::normal_distribution<double> nd;
  Tensor t = Tensor::empty({n}, dt);
  for (int64_t i = 0; i < n; ++i) {
    const double v = std::ldexp(nd(gen), int(gen() % 41) - 20);
    if (dt == DType::F64) t.data<double>()[i] = v;
    else t.data<float>()[i] = float(v);
  }
  return t;
}

Tensor left_fold(int world, int64_t n, DType dt) {
  Tensor acc = rank_values(0, n, dt);
  for (int r = 1; r < world; ++r) {
    const Tensor v = rank_values(r, n, dt);
    for (int64_t i = 0; i < n; ++i) {
      if (dt == DType::F64) acc.data<double>()[i] = acc.data<double>()[i] + v.data<double>()[i];
      else acc.data<float>()[i] = acc.data<float>()[i] + v.data<float>()[i];
    }
  }
  return acc;
}

void check_collectives(Communicator& c, Device dev) {
  const int n = c.size(), r = c.rank();
  auto bytes = [](int s, int d) { return int64_t((s + 2 * d) % 3 == 0 ? 0 : 1000 + 37 * s + d); };
  std::vector<int64_t> sb(static_cast<size_t>(n)), rb(static_cast<size_t>(n));
  int64_t st = 0, rt = 0;
  for (int p = 0; p < n; ++p) {
    sb[size_t(p)] = bytes(r, p);
    rb[size_t(p)] = bytes(p, r);
    st += sb[size_t(p)];
    rt += rb[size_t(p)];
  }
  Tensor s = Tensor::empty({std::max<int64_t>(st, 1)}, DType::U8);
  int64_t o = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t b = 0; b < sb[size_t(p)]; ++b) s.data<uint8_t>()[o++] = uint8_t(r * 31 + p * 7 + b);
  Tensor d = Tensor::zeros({std::max<int64_t>(rt, 1)}, DType::U8, dev);
  c.all_to_all_v(s.to(dev), sb, d, rb);
  c.wait_host();
  const Tensor h = d.to(Device::CPU);
  o = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t b = 0; b < rb[size_t(p)]; ++b)
      if (h.data<uint8_t>()[o++] != uint8_t(p * 31 + r * 7 + b))
        throw Error(fmt::format("dist_check: all_to_all_v: byte {} from rank {} is wrong", b, p));
  for (DType dt : {DType::F32, DType::F64}) {
    if (dev == Device::CUDA && dt == DType::F64) continue;  // GPU tensors are f32 (and bf16)
    for (int64_t len : {int64_t(1), int64_t(1001), int64_t(3 << 20)}) {
      Tensor x = rank_values(r, len, dt).to(dev);
      c.all_reduce_sum(x);
      expect_equal(x, left_fold(n, len, dt), fmt::format("all_reduce_sum of {} {}", len, dtype_name(dt)));
    }
  }
  float v = float(100 + r);
  Tensor bt = Tensor::from_host(&v, {1}, DType::F32, dev);
  c.broadcast(bt, n - 1);
  expect_equal(bt, Tensor::from_host(std::vector<float>{float(100 + n - 1)}.data(), {1}, DType::F32), "broadcast");
  c.barrier();
  if (n >= 2) {  // two groups: even and odd ranks
    auto sub = c.split(r % 2, r);
    Tensor x = rank_values(r, 64, DType::F32).to(dev);
    sub->all_reduce_sum(x);
    Tensor want = rank_values(r % 2, 64, DType::F32);
    for (int p = r % 2 + 2; p < n; p += 2) {
      const Tensor add = rank_values(p, 64, DType::F32);
      for (int64_t i = 0; i < 64; ++i) want.data<float>()[i] = want.data<float>()[i] + add.data<float>()[i];
    }
    expect_equal(x, want, "all_reduce_sum within a split group");
  }
}

// ---- a MoE layer's exchanges --------------------------------------------------------------------

struct LayerData {
  Tensor topk, x, y, dy, dx;  // per rank, on the CPU
};
constexpr int64_t kTokens = 700, kD = 256, kK = 2;
int64_t experts_for(int world) { return 4 * world; }

LayerData layer_data(int rank, int world) {
  const int64_t E = experts_for(world);
  std::mt19937_64 gen(uint64_t(77 + rank));
  std::normal_distribution<float> nd;
  std::vector<int32_t> idx(static_cast<size_t>(kTokens * kK));
  for (int64_t n = 0; n < kTokens; ++n) {
    idx[size_t(n * kK)] = int32_t(gen() % uint64_t(E));
    idx[size_t(n * kK + 1)] = int32_t((idx[size_t(n * kK)] + 1 + int64_t(gen() % uint64_t(E - 1))) % E);
  }
  auto rows = [&](int64_t m) {
    Tensor t = Tensor::empty({m, kD}, DType::F32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(gen) * float(1 + i % 7);
    return t;
  };
  LayerData d;
  d.topk = Tensor::from_host(idx.data(), {kTokens, kK}, DType::I32);
  d.x = rows(kTokens);
  d.dy = rows(kTokens * kK);
  return d;
}

// What one rank's exchanges produce: dispatched QTensor bytes, combined rows, dY rows, dX rows.
std::vector<Tensor> run_exchanges(Communicator& c, Device dev) {
  const int world = c.size(), r = c.rank();
  const int64_t E = experts_for(world);
  const LayerData d = layer_data(r, world);
  QuantSpec xs;
  xs.fmt = Format::NVFP4;
  xs.outer = OuterScale::PerRow;
  xs.four_over_six = true;
  QuantSpec dys;
  dys.fmt = Format::MXFP8_E4M3;
  dys.outer = OuterScale::None;
  const MoeCodecs codecs = moe_codecs(xs, dys, Format::S2F6, kD, payload_rht_signs(5, 0, false), payload_rht_signs(5, 0, true));
  ExpertParallel ep(c, E, true);
  const Tensor topk = d.topk.to(dev);
  const ops::RoutePlan route = ops::route_plan(topk, E);
  ExchangePlan plan = ep.plan(route, topk);
  const ExpertRows rows = ep.dispatch(plan, ops::quantize(d.x.to(dev), xs), codecs.dispatch);
  // expert outputs: a function of the received rows, so every rank's y is reproducible
  const Tensor y = ops::dequantize(rows.q);
  const Tensor back = ep.combine(plan, y, codecs.combine);
  const Tensor dy_rows = ep.dispatch_grad(plan, d.dy.to(dev), codecs.grad_dispatch);
  const Tensor dx = ep.combine(plan, dy_rows, codecs.grad_combine);
  return {rows.q.codes, rows.q.block_scales, rows.q.outer_scales, back, dy_rows, dx};
}

void check_exchanges(Communicator& c, Device dev) {
  const std::vector<Tensor> got = run_exchanges(c, dev);
  std::vector<std::vector<Tensor>> ref(static_cast<size_t>(c.size()));
  LocalGroup::run(c.size(), [&](Communicator& lc) { ref[size_t(lc.rank())] = run_exchanges(lc, Device::CPU); });
  const char* names[] = {"dispatched codes", "dispatched block scales", "dispatched outer scales",
                         "combined expert outputs", "dispatched dY rows", "combined dX rows"};
  for (size_t i = 0; i < got.size(); ++i)
    expect_equal(got[i], ref[size_t(c.rank())][i], std::string(names[i]) + " (against LocalGroup on the CPU)");
}

void check_gradient_reducer(Communicator& c, Device dev) {
  const int64_t n = (5 << 20) + 3;
  Tensor g = rank_values(c.rank(), n, DType::F32).to(dev);
  GradientReducer red(c, g, 1 << 20);
  for (int64_t end = n; end > 0; end -= 700000) red.mark_ready(std::max<int64_t>(0, end - 700000), end);
  red.finish();
  expect_equal(g, left_fold(c.size(), n, DType::F32), "bucketed gradient reduction");
}

// The failure drill: the failing rank goes away after the first checks, the others carry on
// into the next collectives and must be stopped with a message naming it. As processes: exit
// without a goodbye (a crash), throw (the rank reports its error), or hang (alive, silent: the
// others' collectives time out, FOURBIT_DIST_TIMEOUT_S). As LocalGroup threads: leave the group,
// throw, or stall for the timeout and then leave. Returns true on the failing rank, done.
bool drill(Communicator& c, const Args& a, bool processes) {
  if (c.rank() != a.fail_rank) return false;
  std::fprintf(stderr, "dist_check: rank %d: injected failure (%s)\n", c.rank(), a.fail_mode.c_str());
  if (a.fail_mode == "throw") throw Error("injected failure");
  if (a.fail_mode == "exit") {
    if (processes) ::_exit(17);  // no goodbye, no destructors: a crash
    return true;                  // a thread leaves its group
  }
  if (processes)
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  std::this_thread::sleep_for(dist_timeout() + std::chrono::seconds(1));
  return true;
}

int run(Communicator& c, const Args& a, Device dev, bool processes) {
  check_collectives(c, dev);
  say(c, "collectives ok (all_to_all_v, ordered all_reduce_sum, broadcast, barrier, split)");
  if (a.fail_rank >= 0) {
    if (drill(c, a, processes)) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      for (int i = 0; i < 1000; ++i) check_collectives(c, dev);
    } catch (const DistError& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "dist_check: rank %d stopped after %.1f s: %s\n", c.rank(), s, e.what());
      return 3;
    }
    std::fprintf(stderr, "dist_check: rank %d never learned that rank %d failed\n", c.rank(), a.fail_rank);
    return 1;
  }
  check_exchanges(c, dev);
  say(c, "MoE exchanges ok (NVFP4 dispatch, S2F6 combine, MXFP8 dY, S2F6 dX equal LocalGroup on the CPU)");
  check_gradient_reducer(c, dev);
  say(c, "bucketed gradient reduction ok (equals the left fold)");
  say(c, fmt::format("all checks passed on {} rank(s)", c.size()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (a.device == Device::CPU) {
    int code = 0;
    try {
      LocalGroup::run(
          a.ranks,
          [&](Communicator& c) {
            const int rc = run(c, a, Device::CPU, false);
            if (c.rank() == 0) code = rc;
          },
          dist_timeout());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dist_check: %s\n", e.what());
      return a.fail_rank >= 0 ? 3 : 1;
    }
    return code;
  }
  ProcessGroup pg;
  try {
    pg = init_process_group(Device::CUDA);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_check: %s\n", e.what());
    return 1;
  }
  int code = 1;
  try {
    code = run(*pg.world, a, Device::CUDA, true);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_check: rank %d: %s\n", pg.info.rank, e.what());
    if (pg.rendezvous) pg.rendezvous->abort(e.what());
    // a failed NCCL communicator is aborted, not finalized: leave without waiting on it
    std::fflush(stderr);
    ::_exit(a.fail_rank >= 0 ? 3 : 1);
  }
  if (code != 0) {
    std::fflush(stderr);
    ::_exit(code);
  }
  if (pg.rendezvous) pg.rendezvous->goodbye();
  return 0;
}
