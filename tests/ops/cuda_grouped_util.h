// defines: MainLoop
// What the grouped-kernel tests share (CUDA builds only).
#pragma once
#include <gtest/gtest.h>

#include "fourbit/ops/cuda/cuda_ops.h"

namespace fourbit::optest {

// Runs the grouped kernel's wgmma (Hopper) or mma.sync main loop in its scope (on GPUs other than
// Hopper both are the mma.sync one), naming it in failures.
struct MainLoop {
  explicit MainLoop(bool wgmma) : trace(__FILE__, __LINE__, wgmma ? "wgmma main loop" : "mma.sync main loop") {
    ops::cuda::set_grouped_wgmma(wgmma);
  }
  ~MainLoop() { ops::cuda::set_grouped_wgmma(true); }
  MainLoop(const MainLoop&) = delete;
  MainLoop& operator=(const MainLoop&) = delete;
  testing::ScopedTrace trace;
};

}  // namespace fourbit::optest
