// defines: nccl_available, nccl_unique_id, make_nccl_communicator (nccl_communicator.h) for builds
//          without NCCL: they say so, and how to build with it
#include "fourbit/dist/nccl_communicator.h"

namespace fourbit::dist {
namespace {
[[noreturn]] void no_nccl() {
  throw DistError(
      "this fourbit was built without NCCL, which multi-GPU runs need: configure with CUDA where nccl.h and "
      "libnccl are found (the CUDA toolkit, NCCL_ROOT, .carry/nccl, or the nvidia-nccl-cu13 Python wheel; "
      "docs/distributed.md \"Building\")");
}
}  // namespace

bool nccl_available() { return false; }
std::string nccl_unique_id() { no_nccl(); }
std::unique_ptr<Communicator> make_nccl_communicator(int, int, const std::string&, int, std::shared_ptr<Health>,
                                                     std::chrono::milliseconds) {
  no_nccl();
}

}  // namespace fourbit::dist
