// defines: the Rendezvous tests, over real TCP on 127.0.0.1: ranks meet and all_gather (threads
// of this process); a rank that aborts, and a process that dies without a goodbye (a forked
// child that exits, or is killed, mid-run), end every other rank's wait with a message naming
// it; a missing rank is named at the timeout; a connection from another job is refused without
// disturbing the run; ranks launched with different world sizes are stopped.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fourbit/dist/rendezvous.h"

using namespace fourbit;
using namespace fourbit::dist;
using namespace std::chrono_literals;

namespace {

// A port nobody listens on now (the kernel's choice for an ephemeral bind).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

LaunchInfo info(int rank, int world, int port, const std::string& key = "job-1") {
  LaunchInfo li;
  li.launcher = "test";
  li.rank = rank;
  li.world = world;
  li.local_world = world;
  li.rdzv_host = "127.0.0.1";
  li.rdzv_port = port;
  li.job_key = key;
  return li;
}

// Runs body(rank) for the given ranks on threads; returns each rank's error ("" for none).
std::vector<std::string> on_threads(const std::vector<int>& ranks, const std::function<void(int)>& body) {
  std::vector<std::string> errors(ranks.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < ranks.size(); ++i)
    ts.emplace_back([&, i] {
      try {
        body(ranks[i]);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

// Waits up to 10 s for health to fail; returns its message ("" if it never did).
std::string failure_of(const Health& h) {
  for (int i = 0; i < 1000 && !h.failed(); ++i) std::this_thread::sleep_for(10ms);
  return h.failed() ? h.message() : "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(Rendezvous, RanksMeetAndGather) {
  const int port = free_port(), world = 3;
  std::vector<std::vector<std::string>> got(world);
  const auto errors = on_threads({0, 1, 2}, [&](int r) {
    auto health = std::make_shared<Health>();
    auto rz = Rendezvous::connect(info(r, world, port), health, 20s);
    got[size_t(r)] = rz->all_gather("id-of-" + std::to_string(r));
    rz->start_watchdog();
    // ranks leave at different times: a goodbye is not a failure for those still running
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + 150 * r));
    EXPECT_FALSE(health->failed()) << health->message();
    rz->goodbye();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[size_t(r)], "");
    EXPECT_EQ(got[size_t(r)], (std::vector<std::string>{"id-of-0", "id-of-1", "id-of-2"}));
  }
}

TEST(Rendezvous, AnAbortReachesEveryRank) {
  const int port = free_port(), world = 3;
  std::vector<std::string> seen(world);
  on_threads({0, 1, 2}, [&](int r) {
    auto health = std::make_shared<Health>();
    auto rz = Rendezvous::connect(info(r, world, port), health, 20s);
    rz->all_gather("");
    rz->start_watchdog();
    if (r == 2) rz->abort("the loss became NaN at step 17");
    seen[size_t(r)] = failure_of(*health);
  });
  for (int r = 0; r < world; ++r)
    EXPECT_TRUE(contains(seen[size_t(r)], "rank 2 failed: the loss became NaN at step 17")) << r << ": " << seen[size_t(r)];
}

TEST(Rendezvous, AFailureFoundLocallyIsPassedOn) {
  // The NCCL monitor fails the process's Health; the watchdog tells the other ranks.
  const int port = free_port(), world = 2;
  std::vector<std::string> seen(world);
  on_threads({0, 1}, [&](int r) {
    auto health = std::make_shared<Health>();
    auto rz = Rendezvous::connect(info(r, world, port), health, 20s);
    rz->all_gather("");
    rz->start_watchdog();
    if (r == 1) health->fail("rank 1: NCCL all_to_all_v: did not complete within 600 s");
    seen[size_t(r)] = failure_of(*health);
  });
  EXPECT_TRUE(contains(seen[0], "rank 1: NCCL all_to_all_v")) << seen[0];
}

// A forked child plays rank `child_rank`: joins, gathers, then dies without a goodbye (_exit with
// its Rendezvous alive, or SIGKILL). The threads of this process play the other ranks and must learn of it.
void dies_without_goodbye(int child_rank, bool kill_it) {
  const int port = free_port(), world = 3;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      auto rz = Rendezvous::connect(info(child_rank, world, port), std::make_shared<Health>(), 20s);
      rz->all_gather("");
      if (kill_it) ::raise(SIGKILL);
      std::this_thread::sleep_for(100ms);
      ::_exit(3);  // with rz alive: no destructor, no goodbye, a crash as the others see it
    } catch (...) {
      ::_exit(2);
    }
  }
  std::vector<int> others;
  for (int r = 0; r < world; ++r)
    if (r != child_rank) others.push_back(r);
  std::vector<std::string> seen(world);
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = on_threads(others, [&](int r) {
    auto health = std::make_shared<Health>();
    auto rz = Rendezvous::connect(info(r, world, port), health, 20s);
    rz->all_gather("");
    rz->start_watchdog();
    seen[size_t(r)] = failure_of(*health);
  });
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (kill_it) {
    EXPECT_TRUE(WIFSIGNALED(status));
  } else {
    EXPECT_EQ(WEXITSTATUS(status), 3);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  for (size_t i = 0; i < others.size(); ++i) {
    const int r = others[i];
    EXPECT_EQ(errors[i], "");
    EXPECT_TRUE(contains(seen[size_t(r)], "rank " + std::to_string(child_rank) + " exited or lost its connection"))
        << "rank " << r << ": " << seen[size_t(r)];
  }
}

TEST(Rendezvous, ARankThatExitsIsNamedEverywhere) { dies_without_goodbye(1, false); }
TEST(Rendezvous, RankZeroKilledIsNamedEverywhere) { dies_without_goodbye(0, true); }

TEST(Rendezvous, AMissingRankIsNamedAtTheTimeout) {
  const int port = free_port(), world = 3;
  // rank 1 waits longer than rank 0, so what it reports is rank 0's verdict
  const auto errors = on_threads({0, 1}, [&](int r) {
    Rendezvous::connect(info(r, world, port), std::make_shared<Health>(), r == 0 ? 700ms : 10000ms);
  });
  EXPECT_TRUE(contains(errors[0], "rank(s) 2 never joined the rendezvous at 127.0.0.1:" + std::to_string(port)))
      << errors[0];
  EXPECT_TRUE(contains(errors[1], "never joined")) << errors[1];  // rank 0's verdict reached rank 1
}

TEST(Rendezvous, AnotherJobIsRefusedAndTheRunGoesOn) {
  const int port = free_port(), world = 2;
  std::string stray_error;
  const auto errors = on_threads({0, 1, 100}, [&](int r) {
    if (r == 100) {  // a process of another job that found the same port
      try {
        Rendezvous::connect(info(1, world, port, "job-2"), std::make_shared<Health>(), 5s);
      } catch (const DistError& e) {
        stray_error = e.what();
      }
      return;
    }
    if (r == 1) std::this_thread::sleep_for(1000ms);  // let the stray come first
    auto rz = Rendezvous::connect(info(r, world, port), std::make_shared<Health>(), 20s);
    EXPECT_EQ(rz->all_gather(std::to_string(r)), (std::vector<std::string>{"0", "1"}));
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_TRUE(contains(stray_error, "belongs to another job")) << stray_error;
}

TEST(Rendezvous, WorldSizesMustAgree) {
  const int port = free_port();
  const auto errors = on_threads({0, 1}, [&](int r) {
    Rendezvous::connect(info(r, r == 0 ? 2 : 3, port), std::make_shared<Health>(), 5s);
  });
  EXPECT_TRUE(contains(errors[0], "rank 1 was launched with a world of 3 processes, rank 0 with 2")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "world of 3")) << errors[1];
}

}  // namespace
