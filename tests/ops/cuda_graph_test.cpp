// defines: GPU tests of CUDA graph capture (skipped without a GPU): a replay runs the recorded ops
//          on what the fixed input buffers hold at the time, with the capture's temporaries kept
//          apart from the shared cache and counted in use until the graph goes; two graphs sharing
//          one pool hold one set of temporaries and keep their bits; a read-back, a leftover buffer
//          or a nested capture fails the capture by name and leaves the eager path working; and
//          attention_step's kernel, which reads each row's position on the GPU, gives the bits of
//          one launch per row.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "ops/op_test_util.h"
#if FOURBIT_HAS_CUDA
#include "fourbit/ops/cuda/cuda_ops.h"
#endif

using namespace fourbit;
using namespace fourbit::optest;

namespace {

bool have_gpu() { return cuda_device_count() > 0; }

Tensor uniform(const Shape& s, uint64_t seed) { return random_tensor(s, DType::F32, seed, -2.0, 2.0); }

// The work captured below: a = silu(x) * x2 through a temporary, then a's BF16 copy back in F32.
void work(const Tensor& x, const Tensor& x2, Tensor& out) {
  Tensor a = Tensor::empty(x.shape(), DType::F32, x.device());
  ops::swiglu_forward(x, x2, a);
  Tensor a16 = Tensor::empty(x.shape(), DType::BF16, x.device());
  ops::convert(a, a16);
  ops::convert(a16, out);
}

}  // namespace

TEST(CudaGraphs, ReplayRunsTheRecordedOpsOnTheBuffersOfTheTime) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Shape shape{333, 7};
  Tensor x = Tensor::zeros(shape, DType::F32, Device::CUDA), x2 = Tensor::zeros(shape, DType::F32, Device::CUDA);
  std::unique_ptr<DeviceGraph> graph;
  Tensor out;
  {  // the kernels run once eagerly first (loaded before a capture, as the sampler's first step does)
    Tensor warm = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(x, x2, warm);
  }
  const int64_t in_use = device_bytes_in_use();
  {
    GraphCapture capture;
    EXPECT_TRUE(graph_capturing());
    out = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(x, x2, out);
    graph = capture.finish({out});
  }
  EXPECT_FALSE(graph_capturing());
  // the capture's temporaries (a, a16) are the graph's while it lives, and counted in use
  EXPECT_GE(device_bytes_in_use() - in_use, out.nbytes() + shape[0] * shape[1] * (4 + 2));
  for (uint64_t r = 0; r < 3; ++r) {
    SCOPED_TRACE("replay " + std::to_string(r));
    x.copy_from(uniform(shape, 10 + r));
    x2.copy_from(uniform(shape, 20 + r));
    graph->replay();
    // eager work between replays takes blocks from the shared cache, never the graph's
    Tensor want = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(x, x2, want);
    EXPECT_TRUE(bitwise_equal(out.to(Device::CPU), want.to(Device::CPU)));
  }
  graph.reset();
  out = Tensor();
  EXPECT_EQ(device_bytes_in_use(), in_use) << "the graph's blocks went back with it";
}

// A second capture that shares the first graph's pool takes the first's temporaries' blocks instead
// of its own; each graph still gives its bits when the two replay in turn, and a block of the pool
// that the second graph's output held goes back to the pool, not to eager work, while the first
// graph (which writes it) lives.
TEST(CudaGraphs, GraphsThatShareAPoolHoldOneSetOfTemporaries) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Shape shape{333, 7};
  const int64_t f32_block = (shape[0] * shape[1] * 4 + 511) / 512 * 512;  // the allocator's 512-byte granules
  Tensor x = Tensor::zeros(shape, DType::F32, Device::CUDA), x2 = Tensor::zeros(shape, DType::F32, Device::CUDA);
  Tensor y = Tensor::zeros(shape, DType::F32, Device::CUDA), y2 = Tensor::zeros(shape, DType::F32, Device::CUDA);
  {
    Tensor warm = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(x, x2, warm);
  }
  const int64_t in_use0 = device_bytes_in_use();
  std::unique_ptr<DeviceGraph> first, second;
  Tensor out1, out2;
  {
    GraphCapture capture;
    out1 = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(x, x2, out1);
    first = capture.finish({out1});
  }
  const int64_t in_use1 = device_bytes_in_use();
  {
    GraphCapture capture(first.get());
    out2 = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(y, y2, out2);
    second = capture.finish({out2});
  }
  // out2 took the first graph's F32 temporary and the BF16 one was there to take: one block more
  EXPECT_EQ(device_bytes_in_use() - in_use1, f32_block);
  auto expect_work = [&](const Tensor& a, const Tensor& b, const Tensor& out, const char* what) {
    Tensor want = Tensor::empty(shape, DType::F32, Device::CUDA);
    work(a, b, want);
    EXPECT_TRUE(bitwise_equal(out.to(Device::CPU), want.to(Device::CPU))) << what;
  };
  for (uint64_t r = 0; r < 3; ++r) {
    SCOPED_TRACE("round " + std::to_string(r));
    x.copy_from(uniform(shape, 10 + r));
    x2.copy_from(uniform(shape, 20 + r));
    y.copy_from(uniform(shape, 30 + r));
    y2.copy_from(uniform(shape, 40 + r));
    // a graph's outputs are read before another of its pool replays (to_device's copy is queued behind it)
    if (r % 2 == 0) {
      first->replay();
      expect_work(x, x2, out1, "first");
      second->replay();
      expect_work(y, y2, out2, "second");
    } else {
      second->replay();
      expect_work(y, y2, out2, "second");
      first->replay();
      expect_work(x, x2, out1, "first");
    }
  }
  const int64_t in_use2 = device_bytes_in_use();
  second.reset();
  out2 = Tensor();
  EXPECT_EQ(device_bytes_in_use(), in_use2) << "the second graph's blocks stay the pool's while the first lives";
  // eager work now gets none of them: a buffer made now keeps its bytes through the first's replays
  const Tensor pattern = uniform(shape, 99);
  Tensor other = Tensor::empty(shape, DType::F32, Device::CUDA);
  other.copy_from(pattern);
  x.copy_from(uniform(shape, 50));
  first->replay();
  expect_work(x, x2, out1, "first, after the second went");
  EXPECT_TRUE(bitwise_equal(other.to(Device::CPU), pattern)) << "a replay wrote a block handed to eager work";
  first.reset();
  out1 = Tensor();
  other = Tensor();
  EXPECT_EQ(device_bytes_in_use(), in_use0) << "the pool's blocks went back with its last graph";
}

TEST(CudaGraphs, WhatACaptureCannotRecordFailsByName) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const Shape shape{64};
  const Tensor x = uniform(shape, 1).to(Device::CUDA);
  {
    Tensor warm = Tensor::empty(shape, DType::F32, Device::CUDA);
    ops::swiglu_forward(x, x, warm);
  }
  {
    GraphCapture capture;
    Tensor t = Tensor::empty(shape, DType::F32, Device::CUDA);
    ops::swiglu_forward(x, x, t);
    expect_error([&] { t.to(Device::CPU); }, "a GPU-to-host copy while a CUDA graph is being captured");
    expect_error([&] { device_synchronize(); }, "device_synchronize while a CUDA graph is being captured");
    expect_error([] { GraphCapture nested; }, "a CUDA graph is already being captured: captures do not nest");
  }  // discarded
  EXPECT_FALSE(graph_capturing());
  {
    GraphCapture capture;
    Tensor kept = Tensor::empty(shape, DType::F32, Device::CUDA), left = Tensor::empty(shape, DType::F32, Device::CUDA);
    ops::swiglu_forward(x, x, kept);
    ops::swiglu_forward(x, x, left);
    expect_error([&] { capture.finish({kept}); },
                 "a GPU buffer of 512 bytes taken during the capture is still in use and is not one of the graph's "
                 "outputs");
  }
  EXPECT_FALSE(graph_capturing());
  // the eager path is intact
  Tensor y = Tensor::empty(shape, DType::F32, Device::CUDA);
  ops::swiglu_forward(x, x, y);
  Tensor want = Tensor::empty(shape, DType::F32);
  ops::swiglu_forward(x.to(Device::CPU), x.to(Device::CPU), want);
  EXPECT_TRUE(bitwise_equal(y.to(Device::CPU), want));
}

// attention_step on the GPU: one launch over rows at scattered positions (a key block's first and
// last key, mid-block, the cache's end, repeats) gives each row the bits of attention_forward on
// that row alone, for both decode CTA forms (a CTA per kv head group or per q head), head sizes
// 64 and 128, with the BF16 copy; a position outside the cache is reported by check_index_errors.
TEST(CudaAttention, StepReadsEachRowsPositionOnTheGpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
#if FOURBIT_HAS_CUDA
  struct Restore {
    ~Restore() { ops::cuda::set_flash_head_rows(true); }
  } restore;
  const int64_t B = 7, S = 200, Hkv = 2, group = 4, Hq = Hkv * group;
  const std::vector<int32_t> pos{0, 63, 64, 199, 130, 130, 5};
  const Tensor positions = Tensor::from_host(pos.data(), {B}, DType::I32, Device::CUDA);
  for (const int64_t hd : {64, 128})
    for (const bool head_rows : {true, false}) {
      SCOPED_TRACE("hd=" + std::to_string(hd) + (head_rows ? " group CTAs" : " head CTAs"));
      ops::cuda::set_flash_head_rows(head_rows);
      const Tensor q = uniform({B, 1, Hq, hd}, 31).to(Device::CUDA), k = uniform({B, S, Hkv, hd}, 32).to(Device::CUDA),
                   v = uniform({B, S, Hkv, hd}, 33).to(Device::CUDA);
      Tensor out = Tensor::empty(q.shape(), DType::F32, Device::CUDA), lse = Tensor::empty({B, Hq, 1}, DType::F32, Device::CUDA),
             out16 = Tensor::empty(q.shape(), DType::BF16, Device::CUDA);
      ops::attention_step(q, k, v, positions, out, lse, &out16);
      const Tensor out_h = out.to(Device::CPU), lse_h = lse.to(Device::CPU), out16_h = out16.to(Device::CPU);
      for (int64_t b = 0; b < B; ++b) {
        Tensor o = Tensor::empty({1, 1, Hq, hd}, DType::F32, Device::CUDA), l = Tensor::empty({1, Hq, 1}, DType::F32, Device::CUDA),
               o16 = Tensor::empty({1, 1, Hq, hd}, DType::BF16, Device::CUDA);
        ops::attention_forward(q.slice_rows(b, b + 1), k.slice_rows(b, b + 1), v.slice_rows(b, b + 1), pos[size_t(b)], o,
                               l, &o16);
        EXPECT_TRUE(bitwise_equal_range(out_h, b * Hq * hd, o.to(Device::CPU), 0, Hq * hd)) << "row " << b;
        EXPECT_TRUE(bitwise_equal_range(lse_h, b * Hq, l.to(Device::CPU), 0, Hq)) << "row " << b;
        EXPECT_EQ(0, std::memcmp(static_cast<const char*>(out16_h.raw()) + b * Hq * hd * 2, o16.to(Device::CPU).raw(),
                                 size_t(Hq * hd * 2)))
            << "row " << b;
      }
      const std::vector<int32_t> bad{0, 63, 64, 200, 130, 130, 5};
      ops::attention_step(q, k, v, Tensor::from_host(bad.data(), {B}, DType::I32, Device::CUDA), out, lse, &out16);
      expect_error([] { ops::check_index_errors(Device::CUDA); }, "attention_step: positions[3] = 200 is outside [0, S=200)");
    }
#endif
}
