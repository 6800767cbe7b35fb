// defines: the Launcher tests: rank, world, local rank and the rendezvous address from the
// environments torchrun, Open MPI's and MPICH's mpirun and Slurm's srun set (as those launchers
// document them), their precedence, Slurm host lists, the topology rule, and a message naming
// the variable for every malformed or inconsistent value.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "fourbit/dist/launcher.h"
#include "fourbit/dist/process_group.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::dist;

namespace {

using Env = std::map<std::string, std::string>;

LaunchInfo from(const Env& env) {
  return launch_info([&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_from(const Env& env) {
  try {
    from(env);
  } catch (const DistError& e) {
    return e.what();
  }
  return "";
}

TEST(Launcher, NoLauncherIsOneProcess) {
  const LaunchInfo li = from({{"PATH", "/usr/bin"}});
  EXPECT_EQ(li.launcher, "single");
  EXPECT_EQ(li.rank, 0);
  EXPECT_EQ(li.world, 1);
}

TEST(Launcher, Torchrun) {
  // torchrun --standalone --nproc-per-node 2 --no-python ...: rank 1 of 2
  const LaunchInfo li = from({{"RANK", "1"},
                              {"WORLD_SIZE", "2"},
                              {"LOCAL_RANK", "1"},
                              {"LOCAL_WORLD_SIZE", "2"},
                              {"MASTER_ADDR", "127.0.0.1"},
                              {"MASTER_PORT", "29400"},
                              {"TORCHELASTIC_RUN_ID", "abc"}});
  EXPECT_EQ(li.launcher, "torchrun");
  EXPECT_EQ(li.rank, 1);
  EXPECT_EQ(li.world, 2);
  EXPECT_EQ(li.local_rank, 1);
  EXPECT_TRUE(li.single_node);
  EXPECT_EQ(li.rdzv_host, "127.0.0.1");
  EXPECT_EQ(li.rdzv_port, 29401);  // torchrun's store is on MASTER_PORT
  EXPECT_EQ(li.job_key, "abc");
  // two nodes of 4: not single-node; FOURBIT_* override the address
  const LaunchInfo two = from({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                               {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
                               {"FOURBIT_MASTER_ADDR", "10.0.0.1"}, {"FOURBIT_RDZV_PORT", "31000"}});
  EXPECT_EQ(two.launcher, "env");
  EXPECT_FALSE(two.single_node);
  EXPECT_EQ(two.rdzv_host, "10.0.0.1");
  EXPECT_EQ(two.rdzv_port, 31000);
}

TEST(Launcher, OpenMpi) {
  const LaunchInfo li = from({{"OMPI_COMM_WORLD_RANK", "3"},
                              {"OMPI_COMM_WORLD_SIZE", "4"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                              // mpirun inside a Slurm allocation: the MPI ranks count
                              {"SLURM_PROCID", "0"},
                              {"SLURM_NTASKS", "1"},
                              {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(li.launcher, "openmpi");
  EXPECT_EQ(li.rank, 3);
  EXPECT_EQ(li.world, 4);
  EXPECT_EQ(li.rdzv_host, "127.0.0.1");  // one node: this host
  EXPECT_EQ(li.rdzv_port, 29511);
  // across nodes without MASTER_ADDR: told what to set
  EXPECT_NE(error_from({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                        {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}})
                .find("set MASTER_ADDR"),
            std::string::npos);
}

TEST(Launcher, MpichPmi) {
  const LaunchInfo li = from({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"},
                              {"MASTER_ADDR", "gpu7"}});
  EXPECT_EQ(li.launcher, "pmi");
  EXPECT_EQ(li.local_rank, 1);
  EXPECT_EQ(li.rdzv_host, "gpu7");
}

TEST(Launcher, SlurmSrun) {
  // srun -N 2 --ntasks-per-node 4: rank 6 runs as local task 2 of the second node
  const LaunchInfo li = from({{"SLURM_PROCID", "6"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_LOCALID", "2"},
                              {"SLURM_STEP_NUM_NODES", "2"},
                              {"SLURM_STEP_NODELIST", "gpu[07-08]"},
                              {"SLURM_JOB_ID", "4242"},
                              {"SLURM_STEP_ID", "1"}});
  EXPECT_EQ(li.launcher, "slurm");
  EXPECT_EQ(li.rank, 6);
  EXPECT_EQ(li.local_rank, 2);
  EXPECT_FALSE(li.single_node);
  EXPECT_EQ(li.rdzv_host, "gpu07");
  EXPECT_EQ(li.rdzv_port, 20000 + (4242 * 7 + 1) % 30000);
  EXPECT_EQ(li.job_key, "4242.1");
}

TEST(Launcher, SlurmHostLists) {
  EXPECT_EQ(first_slurm_host("node[01-04,07]"), "node01");
  EXPECT_EQ(first_slurm_host("a1,b2"), "a1");
  EXPECT_EQ(first_slurm_host("gpu[3-4]-ib,cpu1"), "gpu3-ib");
  EXPECT_EQ(first_slurm_host("rack[1,5]"), "rack1");
  EXPECT_EQ(first_slurm_host("solo"), "solo");
  EXPECT_NE(testutil::error_of([] { first_slurm_host("bad[1-2"); }).find("unbalanced"), std::string::npos);
}

TEST(Launcher, MalformedValuesNameTheVariable) {
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos ? testing::AssertionSuccess()
                                               : testing::AssertionFailure() << "'" << msg << "' lacks '" << part << "'";
  };
  EXPECT_TRUE(has(error_from({{"RANK", "two"}, {"WORLD_SIZE", "2"}}), "RANK=two is not a non-negative integer"));
  EXPECT_TRUE(has(error_from({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}}),
                  "RANK=2 is not below WORLD_SIZE=2"));
  EXPECT_TRUE(has(error_from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}), "LOCAL_RANK is not set"));
  EXPECT_TRUE(has(error_from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}), "set MASTER_PORT"));
  EXPECT_TRUE(has(error_from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "65535"}}),
                  "outside 1..65535"));
  EXPECT_TRUE(has(error_from({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                  "OMPI_COMM_WORLD_LOCAL_RANK=2 does not fit"));
  EXPECT_TRUE(has(error_from({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}}), "SLURM_NPROCS is not set"));
}

TEST(Launcher, TopologyRule) {
  check_topology(2, 1, 2, 32);
  check_topology(2, 4, 8, 16);
  using testutil::error_of;
  EXPECT_NE(error_of([] { check_topology(2, 2, 2, 32); }).find("launcher started 2 process(es)"), std::string::npos);
  EXPECT_NE(error_of([] { check_topology(3, 1, 3, 32); }).find("does not divide model.n_experts = 32"), std::string::npos);
  EXPECT_NE(error_of([] { check_topology(0, 1, 0, 32); }).find("at least 1"), std::string::npos);
}

}  // namespace
