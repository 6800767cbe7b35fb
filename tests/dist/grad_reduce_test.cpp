// defines: the GradientReducer tests: dp = 2 and 3 bucketed reductions equal one process adding
// the ranks' gradient buffers in rank order, bit for bit, whatever the bucket size and whatever
// order the backward marks ranges ready in; buckets are reduced as soon as they are complete.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "fourbit/dist/grad_reduce.h"
#include "fourbit/dist/local_group.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::dist;

namespace {

Tensor rank_grads(int rank, int64_t n) {
  std::mt19937_64 gen(uint64_t(100 + rank));
  std::normal_distribution<float> nd;
  Tensor t = Tensor::empty({n}, DType::F32);
  // magnitudes spread over 2^-20 .. 2^20 so that the order of the sum shows in the bits
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = std::ldexp(nd(gen), int(gen() % 41) - 20);
  return t;
}

TEST(GradientBuckets, CoverTheBufferInOrder) {
  const auto b = gradient_buckets(10, 4);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::pair<int64_t, int64_t>{0, 4}));
  EXPECT_EQ(b[2], (std::pair<int64_t, int64_t>{8, 10}));
  EXPECT_TRUE(gradient_buckets(0, 4).empty());
}

TEST(GradientReducer, EqualsTheSumOfOneProcessBitForBit) {
  const int64_t n = 1000;
  for (int dp : {2, 3})
    for (int64_t bucket_bytes : {int64_t(4 * 64), int64_t(4 * 1000), int64_t(4 * 333)}) {
      Tensor want = rank_grads(0, n);
      for (int r = 1; r < dp; ++r) {
        const Tensor g = rank_grads(r, n);
        for (int64_t i = 0; i < n; ++i) want.data<float>()[i] = want.data<float>()[i] + g.data<float>()[i];
      }
      std::vector<Tensor> got(static_cast<size_t>(dp));
      LocalGroup::run(dp, [&](Communicator& comm) {
        Tensor g = rank_grads(comm.rank(), n);
        GradientReducer red(comm, g, bucket_bytes);
        // the backward finishes the buffer's tail first: mark ranges from the end, unevenly
        int64_t end = n;
        for (int64_t len : {17, 200, 3, 380}) {
          red.mark_ready(end - len, end);
          end -= len;
        }
        // every bucket inside the marked tail [end, n) was reduced as soon as it was complete
        int64_t complete = 0;
        for (const auto& [b, e] : gradient_buckets(n, bucket_bytes / 4)) complete += b >= end ? 1 : 0;
        EXPECT_EQ(red.reduced(), complete);
        if (bucket_bytes < 4 * 500) {
          EXPECT_GT(complete, 0);  // the case exercises overlap
        }
        red.finish();
        got[size_t(comm.rank())] = g;
      });
      for (int r = 0; r < dp; ++r)
        EXPECT_EQ(std::memcmp(got[size_t(r)].raw(), want.raw(), size_t(want.nbytes())), 0)
            << "dp " << dp << " bucket " << bucket_bytes << " rank " << r;
    }
}

TEST(GradientReducer, RefusesRangesMarkedTwice) {
  LocalGroup one(1);
  auto comm = one.communicator(0);
  GradientReducer red(*comm, Tensor::zeros({100}, DType::F32), 4 * 50);
  red.mark_ready(0, 10);
  EXPECT_NE(testutil::error_of([&] { red.mark_ready(5, 20); }).find("overlaps [0, 10)"), std::string::npos);
}

}  // namespace
