// defines: CPU tests of the lockstep drift comparison (tests/model/lockstep.h) that the GPU
//          training test relies on: the CPU against itself drifts by exactly zero, and a candidate
//          with a planted defect (a learning rate 10% low: each of its steps gives up a little loss)
//          shows a drift well above the 0.5% the GPU test allows, so that bound can fail.
#include <gtest/gtest.h>

#include <cstdio>

#include "model/lockstep.h"
#include "model/model_test_util.h"

using namespace fourbit;
using namespace fourbit::modeltest;

namespace {

RunConfig lockstep_config() {
  RunConfig cfg = tiny_run_config(2, 64);
  cfg.train.batch_size = 4;
  cfg.train.seq_len = 16;
  cfg.train.steps = 20;
  cfg.train.warmup_steps = 5;
  return cfg;
}

TEST(Lockstep, CpuAgainstItselfDriftsByExactlyZero) {
  const OmpThreads one(1);
  const RunConfig cfg = lockstep_config();
  const LockstepDrift d = lockstep_drift(cfg, "nvfp4-fwd", Device::CPU, cfg.train, 8);
  ASSERT_EQ(d.delta.size(), 8u);
  for (size_t s = 0; s < d.delta.size(); ++s) {
    EXPECT_EQ(d.loss_rel[s], 0.0) << "step " << s;
    EXPECT_EQ(d.delta[s], 0.0) << "step " << s;
  }
}

TEST(Lockstep, PlantedSlowLearnerShowsDrift) {
  const OmpThreads one(1);
  const RunConfig cfg = lockstep_config();
  TrainConfig slow = cfg.train;
  slow.lr *= 0.9;
  const LockstepDrift d = lockstep_drift(cfg, "bf16", Device::CPU, slow, 20);
  std::printf("  0.9x-LR candidate: drift %+.4f over %zu steps, worst step loss diff %.2e\n", d.drift(),
              d.delta.size(), d.worst_loss_rel());
  EXPECT_EQ(d.worst_loss_rel(), 0.0);  // the forward on the reference weights is the same
  EXPECT_GT(d.drift(), 0.01);          // and its steps give up loss: above the GPU bound
}

}  // namespace
