// defines: the gpu_chain benchmark (main)
// What one link of a chain of dependent GPU steps costs: the floor under a decode step of ~200
// small kernels whatever bytes its weights take (docs/cuda.md, "The ceiling of a step of ~200
// kernels"), and what a persistent decode kernel would pay per dependency instead. Each of L links
// reads the rows the link before wrote (a 1024-float row a CTA: a one-row RMSNorm's traffic),
// reduces each row and writes new rows. Timed, per link (the chain's median time / L):
//   - kernels: a launch a link, as the host issues them (eager), as a CUDA graph, and as a graph of
//     programmatic dependent launches (launch_dependent / dependent_launch_prologue: the decode
//     step's form);
//   - one persistent kernel (a cooperative launch, every CTA resident): the links as phases
//     separated by a grid-wide barrier (every CTA arrives on a counter, the last one releases the
//     others), or each link on the next CTA, handed over by a flag (the least a dependency between
//     two SMs costs: what a dataflow megakernel pays per edge at best), or all links on one CTA
//     (the work alone, no hand-over);
// with one CTA and with a CTA on every SM. Every form must leave the same rows as the eager
// kernels (checked bit for bit), so a form that skipped work cannot look fast.
// Usage: gpu_chain [--links L] [--reps N] [--json FILE]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/gpu_bench_util.h"
#include "fourbit/ops/cuda/cuda_ops.h"
#include "fourbit/ops/cuda/dependent_launch.cuh"
#include "fourbit/tensor/device_memory.h"

using namespace fourbit;

namespace {

constexpr int kRow = 1024;         // floats a CTA reads and writes a link
constexpr int kThreads = kRow / 4;  // a float4 a thread

// One link's work: row `to` of out = 0.5 x + 1 - mean(x) / 4 of row `from` of in, whose values
// settle near 4/3 (no overflow or underflow however long the chain). The mean is a fixed tree
// (warp shuffles, then the 8 warps' sums in order), so every form computes the same bits. Reading
// another CTA's row makes each link depend on the whole link before it, as a layer's op does.
__device__ __forceinline__ void link_work(const float* in, float* out, int from, int to) {
  __shared__ float warp_sums[kThreads / 32];
  const float4 v = reinterpret_cast<const float4*>(in + size_t(from) * kRow)[threadIdx.x];
  float s = (v.x + v.y) + (v.z + v.w);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  const float c = 1.0f - 0.25f * (total / float(kRow));
  reinterpret_cast<float4*>(out + size_t(to) * kRow)[threadIdx.x] =
      make_float4(0.5f * v.x + c, 0.5f * v.y + c, 0.5f * v.z + c, 0.5f * v.w + c);
  __syncthreads();  // warp_sums is read by every thread before the next link writes it
}

// The row CTA b of an n-CTA link reads: its neighbour's.
__device__ __forceinline__ int source_row() { return int((blockIdx.x + 1) % gridDim.x); }

// A link as a kernel: CTA b writes row b.
__global__ void __launch_bounds__(kThreads) link_kernel(const float* in, float* out) {
  ops::cuda::dependent_launch_prologue();
  link_work(in, out, source_row(), int(blockIdx.x));
}

// Every CTA of the grid arrives; the last to arrive resets the count and moves the generation on,
// which the others wait for. Each CTA's writes before the barrier are visible to every CTA after
// it (the fences around the arrival and the release).
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* generation) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = *reinterpret_cast<volatile unsigned*>(generation);
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {
      *reinterpret_cast<volatile unsigned*>(count) = 0u;
      __threadfence();
      atomicAdd(generation, 1u);
    } else {
      while (*reinterpret_cast<volatile unsigned*>(generation) == gen) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// The links as phases of one kernel, a grid-wide barrier after each; CTA b writes row b.
__global__ void __launch_bounds__(kThreads) barrier_chain_kernel(float* a, float* b, int links, unsigned* count,
                                                                 unsigned* generation) {
  for (int i = 0; i < links; ++i) {
    link_work(i % 2 ? b : a, i % 2 ? a : b, source_row(), int(blockIdx.x));
    grid_barrier(count, generation);
  }
}

// Link i on CTA i % gridDim.x, row 0 only: it waits until `done` (links finished) reaches i, works,
// then publishes i + 1. With one CTA this is the links' work alone.
__global__ void __launch_bounds__(kThreads) flag_chain_kernel(float* a, float* b, int links, unsigned* done) {
  for (int i = int(blockIdx.x); i < links; i += int(gridDim.x)) {
    if (threadIdx.x == 0)
      while (*reinterpret_cast<volatile unsigned*>(done) < unsigned(i)) {
      }
    __syncthreads();
    __threadfence();  // the previous link's row, written on another SM, is read after its flag
    link_work(i % 2 ? b : a, i % 2 ? a : b, 0, 0);
    if (threadIdx.x == 0) {
      __threadfence();
      *reinterpret_cast<volatile unsigned*>(done) = unsigned(i + 1);
    }
  }
}

struct Buffers {
  float* a = nullptr;
  float* b = nullptr;
  unsigned* sync = nullptr;  // count, generation, done
  int ctas = 0;
  explicit Buffers(int ctas_) : ctas(ctas_) {
    BENCH_CUDA_CHECK(cudaMalloc(&a, sizeof(float) * kRow * size_t(ctas)));
    BENCH_CUDA_CHECK(cudaMalloc(&b, sizeof(float) * kRow * size_t(ctas)));
    BENCH_CUDA_CHECK(cudaMalloc(&sync, 3 * sizeof(unsigned)));
  }
  ~Buffers() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(sync);
  }
  // Rows of 1.0 in a (the chain's input), b and the counters zero: every timed run starts alike.
  void reset() const {
    std::vector<float> ones(size_t(kRow) * ctas, 1.0f);
    BENCH_CUDA_CHECK(cudaMemcpy(a, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
    BENCH_CUDA_CHECK(cudaMemset(b, 0, ones.size() * sizeof(float)));
    BENCH_CUDA_CHECK(cudaMemset(sync, 0, 3 * sizeof(unsigned)));
  }
  // The chain's output rows (in a after an even number of links, else in b), `rows` of them.
  std::vector<float> result(int links, int rows) const {
    std::vector<float> out(size_t(kRow) * rows);
    BENCH_CUDA_CHECK(cudaMemcpy(out.data(), links % 2 ? b : a, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  }
};

void kernel_chain(const Buffers& buf, int links) {
  for (int i = 0; i < links; ++i)
    ops::cuda::launch_dependent(link_kernel, dim3(unsigned(buf.ctas)), dim3(kThreads), 0,
                                const_cast<const float*>(i % 2 ? buf.b : buf.a), i % 2 ? buf.a : buf.b);
}

// One launch of a persistent kernel, every CTA resident at once (a cooperative launch fails
// rather than leave one waiting on a barrier no CTA can reach). The counters are buf.sync's.
template <typename... Counters>
void cooperative(void (*kernel)(float*, float*, int, Counters...), const Buffers& buf, int links,
                 Counters... counters) {
  float* a = buf.a;
  float* b = buf.b;
  void* args[] = {&a, &b, &links, &counters...};
  BENCH_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(unsigned(buf.ctas)),
                                               dim3(kThreads), args, 0, ops::cuda::stream()));
}

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("gpu_chain: no CUDA device visible, nothing to measure\n");
    return 0;
  }
  int links = 200, reps = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--links") == 0) links = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::stoi(argv[i + 1]);
  }
  if (links < 2 || reps < 1) fail("gpu_chain: --links must be at least 2 and --reps at least 1");
  const int sms = ops::cuda::device_sm_count();
  cudaDeviceProp prop{};
  BENCH_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

  bench::BenchTable table;
  table.name = fmt::format("a chain of {} dependent links ({} floats a CTA a link), median of {}", links, kRow, reps);
  table.columns = {"form", "CTAs", "chain us", "us a link", "same rows"};
  table.meta = {{"device", prop.name}, {"links", links}, {"reps", reps}, {"sms", sms}};

  for (const int ctas : {1, sms}) {
    const Buffers buf(ctas);
    // The reference: the eager kernels' rows after the chain.
    buf.reset();
    ops::cuda::set_dependent_launches(false);
    kernel_chain(buf, links);
    BENCH_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> want = buf.result(links, ctas);

    auto add = [&](const char* form, const std::function<void()>& run, int rows) {
      buf.reset();
      run();
      BENCH_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> got = buf.result(links, rows);
      const bool same = std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0;
      // The counters restart from zero before every timed run (the flag chain waits on them),
      // outside the events.
      const double ms = bench::median_event_ms(reps, [&](cudaEvent_t start, cudaEvent_t stop) {
        BENCH_CUDA_CHECK(cudaMemsetAsync(buf.sync, 0, 3 * sizeof(unsigned), 0));
        BENCH_CUDA_CHECK(cudaEventRecord(start, 0));
        run();
        BENCH_CUDA_CHECK(cudaEventRecord(stop, 0));
        return 1;
      });
      table.add({{"form", form}, {"CTAs", ctas}, {"chain us", ms * 1e3}, {"us a link", ms * 1e3 / links},
                 {"same rows", same ? "yes" : "NO"}});
    };

    add("kernels, eager", [&] { kernel_chain(buf, links); }, ctas);
    for (const bool dependent : {false, true}) {
      ops::cuda::set_dependent_launches(dependent);
      std::unique_ptr<DeviceGraph> graph;
      {
        GraphCapture capture;
        kernel_chain(buf, links);
        graph = capture.finish({});
      }
      add(dependent ? "kernels, graph, dependent launches" : "kernels, graph", [&] { graph->replay(); }, ctas);
    }
    ops::cuda::set_dependent_launches(true);
    const auto barriers = [&] { cooperative(barrier_chain_kernel, buf, links, buf.sync, buf.sync + 1); };
    add("persistent, grid barrier a link", barriers, ctas);
    // The flag chain works on row 0 only: its rows are the 1-CTA chain's.
    const auto flags = [&] { cooperative(flag_chain_kernel, buf, links, buf.sync + 2); };
    add(ctas == 1 ? "persistent, one CTA (the work alone)" : "persistent, a flag a link, the next CTA", flags, 1);
  }
  table.print();
  table.write_json(bench::json_path_arg(argc, argv));
  return 0;
}
