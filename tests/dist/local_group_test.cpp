// defines: the LocalGroup tests: the collectives (all-to-all-v with uneven and empty segments,
// the fixed-order all-reduce against a left fold whose order matters, broadcast, barrier,
// split), and failures: a rank that throws, a rank that leaves, a rank that stalls, collectives
// out of step and mismatched counts end every rank promptly with a message naming the culprit.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fourbit/dist/local_group.h"

using namespace fourbit;
using namespace fourbit::dist;
using namespace std::chrono_literals;

namespace {

// Byte b of the message rank s sends rank d.
uint8_t payload_byte(int s, int d, int64_t b) { return uint8_t(s * 31 + d * 7 + b); }
int64_t bytes_between(int s, int d) { return (s + 2 * d) % 3 == 0 ? 0 : 5 + 3 * s + d; }  // some empty

TEST(LocalGroup, AllToAllMovesEverySegment) {
  for (int n : {1, 2, 3, 4}) {
    LocalGroup::run(n, [&](Communicator& comm) {
      const int r = comm.rank();
      std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
      int64_t st = 0, rt = 0;
      for (int p = 0; p < n; ++p) {
        send[size_t(p)] = bytes_between(r, p);
        recv[size_t(p)] = bytes_between(p, r);
        st += send[size_t(p)];
        rt += recv[size_t(p)];
      }
      Tensor s = Tensor::empty({st}, DType::U8), d = Tensor::zeros({rt}, DType::U8);
      int64_t o = 0;
      for (int p = 0; p < n; ++p)
        for (int64_t b = 0; b < send[size_t(p)]; ++b) s.data<uint8_t>()[o++] = payload_byte(r, p, b);
      comm.all_to_all_v(s, send, d, recv);
      o = 0;
      for (int p = 0; p < n; ++p)
        for (int64_t b = 0; b < recv[size_t(p)]; ++b)
          ASSERT_EQ(d.data<uint8_t>()[o++], payload_byte(p, r, b)) << "rank " << r << " from " << p << " byte " << b;
    });
  }
}

TEST(LocalGroup, AllReduceIsTheLeftFoldInRankOrder) {
  // float addition is not associative: 1e8 + 1 - 1e8 depends on the order; every rank must get
  // ((x0 + x1) + x2) + x3 exactly, the same bits as one process adding the buffers in turn.
  const int n = 4;
  const float vals[n][3] = {{1e8f, 1.0f, 0.1f}, {1.0f, -1e8f, 0.2f}, {-1e8f, 1e8f, 0.3f}, {3.0f, 1.0f, 0.4f}};
  float want[3];
  for (int i = 0; i < 3; ++i) {
    float acc = vals[0][i];
    for (int r = 1; r < n; ++r) acc = acc + vals[r][i];
    want[i] = acc;
  }
  EXPECT_NE(want[0], ((vals[0][0] + vals[1][0]) + (vals[2][0] + vals[3][0])));  // the order shows
  std::vector<std::vector<float>> got(static_cast<size_t>(n));
  LocalGroup::run(n, [&](Communicator& comm) {
    Tensor x = Tensor::from_host(vals[comm.rank()], {3}, DType::F32);
    comm.all_reduce_sum(x);
    got[size_t(comm.rank())].assign(x.data<float>(), x.data<float>() + 3);
    std::vector<double> dv{double(comm.rank()) + 0.5, 1e300};
    Tensor xd = Tensor::from_host(dv.data(), {2}, DType::F64);
    comm.all_reduce_sum(xd);
    EXPECT_EQ(xd.data<double>()[0], 0.5 + 1.5 + 2.5 + 3.5);
    EXPECT_EQ(xd.data<double>()[1], 4e300);
  });
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 3; ++i) EXPECT_EQ(std::memcmp(&got[size_t(r)][size_t(i)], &want[i], 4), 0) << r << " " << i;
}

TEST(LocalGroup, BroadcastBarrierSplit) {
  const int n = 4;
  std::vector<int> sub_rank(static_cast<size_t>(n)), sub_size(static_cast<size_t>(n));
  std::vector<float> sub_sum(static_cast<size_t>(n));
  LocalGroup::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    float v = float(r * 10);
    Tensor x = Tensor::from_host(&v, {1}, DType::F32);
    comm.broadcast(x, 2);
    EXPECT_EQ(x.data<float>()[0], 20.0f);
    comm.barrier();
    // color = r % 2, key = -r: groups {0, 2} and {1, 3}, ordered by descending rank
    auto sub = comm.split(r % 2, -r);
    sub_rank[size_t(r)] = sub->rank();
    sub_size[size_t(r)] = sub->size();
    Tensor y = Tensor::from_host(&v, {1}, DType::F32);
    sub->all_reduce_sum(y);
    sub_sum[size_t(r)] = y.data<float>()[0];
  });
  EXPECT_EQ(sub_rank, (std::vector<int>{1, 1, 0, 0}));
  EXPECT_EQ(sub_size, (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(sub_sum, (std::vector<float>{20, 40, 20, 40}));
}

// Runs fn on n ranks and returns each rank's error message ("" for none) and the run's.
struct Outcome {
  std::vector<std::string> rank_errors;
  std::string run_error;
  double seconds;
};
Outcome run_failing(int n, std::chrono::milliseconds timeout, const std::function<void(Communicator&)>& fn) {
  Outcome o;
  o.rank_errors.assign(size_t(n), "");
  std::mutex mu;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    LocalGroup::run(
        n,
        [&](Communicator& comm) {
          try {
            fn(comm);
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lk(mu);
            o.rank_errors[size_t(comm.rank())] = e.what();
            throw;
          }
        },
        timeout);
  } catch (const DistError& e) {
    o.run_error = e.what();
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(LocalGroupFailures, ARankThatThrowsEndsEveryRank) {
  // Rank 2 fails before the second collective; the others are already waiting in it and must
  // fail at once (not at the 60 s timeout) with rank 2's message.
  const Outcome o = run_failing(4, 60s, [](Communicator& comm) {
    Tensor x = Tensor::zeros({4}, DType::F32);
    comm.all_reduce_sum(x);
    if (comm.rank() == 2) throw Error("checkpoint disk full");
    comm.all_reduce_sum(x);
  });
  EXPECT_LT(o.seconds, 10.0);
  EXPECT_TRUE(contains(o.run_error, "rank 2 failed: checkpoint disk full")) << o.run_error;
  for (int r : {0, 1, 3}) {
    EXPECT_TRUE(contains(o.rank_errors[size_t(r)], "all_reduce_sum")) << o.rank_errors[size_t(r)];
    EXPECT_TRUE(contains(o.rank_errors[size_t(r)], "checkpoint disk full")) << o.rank_errors[size_t(r)];
  }
}

TEST(LocalGroupFailures, ARankThatLeavesEndsTheWaiters) {
  // Rank 1 returns early (a process that exits): its peers' next collective fails naming it.
  const Outcome o = run_failing(3, 60s, [](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == 1) return;
    Tensor s = Tensor::zeros({3}, DType::U8), r = Tensor::zeros({3}, DType::U8);
    comm.all_to_all_v(s, {1, 1, 1}, r, {1, 1, 1});
  });
  EXPECT_LT(o.seconds, 10.0);
  EXPECT_TRUE(contains(o.run_error, "rank 1 left the group")) << o.run_error;
  EXPECT_TRUE(contains(o.rank_errors[0], "all_to_all_v")) << o.rank_errors[0];
  EXPECT_TRUE(contains(o.rank_errors[2], "rank 1 left")) << o.rank_errors[2];
}

TEST(LocalGroupFailures, AStalledRankTimesOutNamingIt) {
  std::atomic<bool> release{false};
  const Outcome o = run_failing(3, 300ms, [&](Communicator& comm) {
    if (comm.rank() == 2) {
      while (!release.load()) std::this_thread::sleep_for(5ms);  // stuck, then gone
      return;
    }
    try {
      comm.barrier();
    } catch (...) {
      release = true;
      throw;
    }
  });
  EXPECT_LT(o.seconds, 10.0);
  EXPECT_TRUE(contains(o.run_error, "timed out after 0.3 s in barrier")) << o.run_error;
  EXPECT_TRUE(contains(o.run_error, "waiting for rank(s) 2")) << o.run_error;
}

TEST(LocalGroupFailures, CollectivesOutOfStepAndBadCountsAreCaught) {
  Outcome o = run_failing(2, 60s, [](Communicator& comm) {
    if (comm.rank() == 0) comm.barrier();
    else {
      Tensor x = Tensor::zeros({1}, DType::F32);
      comm.all_reduce_sum(x);
    }
  });
  EXPECT_TRUE(contains(o.run_error, "out of step: rank 0 called barrier while rank 1 called all_reduce_sum"))
      << o.run_error;
  o = run_failing(2, 60s, [](Communicator& comm) {
    Tensor s = Tensor::zeros({8}, DType::U8), r = Tensor::zeros({8}, DType::U8);
    // rank 0 sends 3 bytes to rank 1, which expects 2
    const std::vector<int64_t> send = comm.rank() == 0 ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 1};
    const std::vector<int64_t> recv = comm.rank() == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
    comm.all_to_all_v(s, send, r, recv);
  });
  EXPECT_TRUE(contains(o.run_error, "rank 0 sends 3 bytes to rank 1, which expects 2")) << o.run_error;
}

TEST(LocalGroupFailures, AbortReachesEveryRank) {
  const Outcome o = run_failing(3, 60s, [](Communicator& comm) {
    if (comm.rank() == 0) comm.abort("NCCL reported an error on rank 0");
    comm.barrier();
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(contains(o.rank_errors[size_t(r)], "rank 0 aborted: NCCL reported an error")) << o.rank_errors[size_t(r)];
}

}  // namespace
