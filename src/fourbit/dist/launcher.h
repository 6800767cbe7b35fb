// defines: LaunchInfo, EnvLookup, launch_info, launch_info_from_environment, first_slurm_host
// Who this process is in a distributed run, read from the environment the launcher set (docs/
// distributed.md "Launching"): one process per GPU, started by
//   torchrun --no-python (or any env:// launcher): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//                     MASTER_ADDR, MASTER_PORT (torchrun's own store sits on MASTER_PORT, so the
//                     rendezvous listens on MASTER_PORT + 1)
//   mpirun (Open MPI): OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   mpirun (MPICH, Intel MPI: PMI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   srun (Slurm):      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NUM_NODES,
//                      SLURM_STEP_NODELIST (rank 0 runs on its first host)
// checked in that order (mpirun inside a Slurm allocation sets both; the MPI ranks are the ones
// that count). FOURBIT_MASTER_ADDR and FOURBIT_RDZV_PORT override the rendezvous address; a run
// with none of these is a single process.
#pragma once
#include <functional>
#include <optional>
#include <string>

namespace fourbit::dist {

struct LaunchInfo {
  std::string launcher = "single";  // torchrun | env | openmpi | pmi | slurm | single
  int rank = 0;
  int world = 1;
  int local_rank = 0;    // selects the GPU
  int local_world = 1;   // processes on this node
  bool single_node = true;
  std::string rdzv_host;  // where rank 0 listens for the rendezvous
  int rdzv_port = 0;
  std::string job_key;    // a connection from another job is refused
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Fails with the variables' names and values when they are malformed or inconsistent.
LaunchInfo launch_info(const EnvLookup& env);
LaunchInfo launch_info_from_environment();  // launch_info over getenv

// The first host of a Slurm host list: "node[01-04,07]" -> "node01", "a1,b2" -> "a1",
// "gpu[3-4]-ib" -> "gpu3-ib".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace fourbit::dist
