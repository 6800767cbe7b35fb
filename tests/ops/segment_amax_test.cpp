// defines: the SegmentAmax tests: ops::running_segment_amax (the recorded input amax behind a
//          calibration-free NVFP4 input_scale) against a brute-force max on the CPU, with and
//          without a row index, empty segments, NaN/Inf skipped, a running max that only grows,
//          argument errors; and the CUDA backend bit for bit against the CPU (skipped without a GPU).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fourbit/ops/ops.h"
#include "fourbit/tensor/device_memory.h"
#include "test_util.h"

using namespace fourbit;
using fourbit::testutil::error_of;

namespace {

Tensor random_rows(int64_t R, int64_t C, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(size_t(R * C));
  for (auto& x : v) x = n(rng) * float(1 + (rng() % 7));
  return Tensor::from_host(v.data(), {R, C}, DType::F32);
}

std::vector<float> brute(const Tensor& x, const std::vector<int32_t>& rows, const std::vector<int64_t>& off,
                         std::vector<float> start) {
  const int64_t C = x.size(1);
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t j = off[g]; j < off[g + 1]; ++j) {
      const int64_t r = rows.empty() ? j : rows[size_t(j)];
      for (int64_t c = 0; c < C; ++c) {
        const float a = std::fabs(x.data<float>()[r * C + c]);
        if (std::isfinite(a)) start[g] = std::max(start[g], a);
      }
    }
  return start;
}

std::vector<float> host_floats(const Tensor& t) {
  const Tensor h = t.to(Device::CPU);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

}  // namespace

TEST(SegmentAmax, MatchesBruteForceWithRowIndexAndEmptySegments) {
  const Tensor x = random_rows(13, 40, 1);
  const std::vector<int32_t> rows = {3, 0, 12, 7, 7, 1, 5, 9, 2, 11};  // a token can repeat (top-k)
  const std::vector<int64_t> off = {0, 3, 3, 8, 10};                     // segment 1 is empty
  Tensor amax = Tensor::zeros({4}, DType::F32);
  ops::running_segment_amax(x, Tensor::from_host(rows.data(), {10}, DType::I32), off, amax);
  EXPECT_EQ(host_floats(amax), brute(x, rows, off, {0, 0, 0, 0}));
  EXPECT_EQ(host_floats(amax)[1], 0.0f) << "an empty segment keeps its value";
}

TEST(SegmentAmax, IsARunningMaxWithoutIndexAndSkipsNonFinite) {
  Tensor x = random_rows(6, 33, 2);
  x.data<float>()[5] = std::numeric_limits<float>::infinity();
  x.data<float>()[40] = std::nanf("");
  x.data<float>()[100] = -1e30f;  // finite: counts
  const std::vector<int64_t> off = {0, 2, 6};
  std::vector<float> start = {1e31f, 0.5f};  // segment 0 keeps its larger value
  Tensor amax = Tensor::from_host(start.data(), {2}, DType::F32);
  ops::running_segment_amax(x, Tensor(), off, amax);
  const std::vector<float> got = host_floats(amax);
  EXPECT_EQ(got, brute(x, {}, off, start));
  EXPECT_EQ(got[0], 1e31f);
  EXPECT_EQ(got[1], 1e30f);
}

TEST(SegmentAmax, RejectsBadArguments) {
  const Tensor x = random_rows(4, 8, 3);
  Tensor amax = Tensor::zeros({2}, DType::F32);
  EXPECT_NE(error_of([&] { ops::running_segment_amax(x, Tensor(), {0, 2, 3}, amax); }).find("offsets must run from 0 to M=4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::running_segment_amax(x, Tensor(), {0, 3, 2, 4}, amax); }).find("offsets decrease"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::running_segment_amax(x, Tensor(), {0, 1, 2, 4}, amax); }).find("amax must be f32[G]=[3]"),
            std::string::npos);
  const std::vector<int32_t> bad = {0, 4};
  EXPECT_NE(error_of([&] {
              ops::running_segment_amax(x, Tensor::from_host(bad.data(), {2}, DType::I32), {0, 1, 2}, amax);
            }).find("rows[1] = 4 is outside [0, R=4)"),
            std::string::npos);
}

// Rows of a warp's width and more (a warp a row), and narrower ones (a lane a row, the lanes of a
// segment folded first: the quantizers' one-float row amaxes), through an index and without one,
// NaN and Inf among the values.
TEST(SegmentAmax, CudaEqualsCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device is visible";
  for (const int64_t C : {int64_t(96), int64_t(1), int64_t(5)}) {
    for (const bool indexed : {true, false}) {
      SCOPED_TRACE(std::to_string(C) + (indexed ? " columns, indexed" : " columns"));
      Tensor x = random_rows(600, C, 4 + uint64_t(C));
      x.data<float>()[7 * C] = std::numeric_limits<float>::quiet_NaN();
      x.data<float>()[11 * C] = -std::numeric_limits<float>::infinity();
      std::vector<int32_t> rows(600);
      std::mt19937_64 rng(5);
      for (auto& r : rows) r = int32_t(rng() % 600);
      std::vector<int64_t> off = {0};
      for (int g = 0; g < 300; ++g) off.push_back(std::min<int64_t>(600, off.back() + int64_t(rng() % 5)));
      off.back() = 600;  // 300 segments: more than one launch's worth
      const Tensor idx = indexed ? Tensor::from_host(rows.data(), {600}, DType::I32) : Tensor();
      Tensor cpu = Tensor::zeros({300}, DType::F32);
      ops::running_segment_amax(x, idx, off, cpu);
      Tensor gpu = Tensor::zeros({300}, DType::F32, Device::CUDA);
      ops::running_segment_amax(x.to(Device::CUDA), indexed ? idx.to(Device::CUDA) : Tensor(), off, gpu);
      EXPECT_EQ(host_floats(gpu), host_floats(cpu));
      EXPECT_EQ(host_floats(cpu), brute(x, indexed ? rows : std::vector<int32_t>{}, off, std::vector<float>(300, 0.0f)));
    }
    // a row outside x: recorded on the device, reported by check_index_errors as the CPU reports it
    const std::vector<int32_t> bad = {0, 600};
    Tensor amax = Tensor::zeros({2}, DType::F32, Device::CUDA);
    ops::running_segment_amax(random_rows(600, C, 9).to(Device::CUDA),
                              Tensor::from_host(bad.data(), {2}, DType::I32).to(Device::CUDA), {0, 1, 2}, amax);
    EXPECT_NE(error_of([] { ops::check_index_errors(Device::CUDA); }).find("rows[1] = 600 is outside [0, R=600)"),
              std::string::npos);
  }
}
