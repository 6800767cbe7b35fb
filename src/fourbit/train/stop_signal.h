// defines: StopSignals, signal_name, test_signal_point
// SIGINT (Ctrl-C) and SIGTERM (what schedulers and `kill` send) ask a training run to stop
// cleanly: the handler only records the signal; the loop finishes the step it is in, writes a
// checkpoint and returns, and the command exits 128 + signal (130, 143) saying how to resume. A
// second signal while that happens ends the process at once (the default action): checkpoints
// are written atomically, so at worst the step in flight is lost.
//
// Tests raise the signal at a chosen point through the environment variable
//   FOURBIT_TEST_RAISE=SIGNAL:POINT:STEP     e.g. SIGINT:step:3, SIGTERM:checkpoint:2
// POINT "step": inside optimizer step STEP (1-based, after its first micro-batch's backward);
// POINT "checkpoint": inside the writing of the checkpoint of step STEP (after model.safetensors,
// before optim.safetensors and the rename). The signal is sent with raise(), so it takes the same
// path as one from outside.
#pragma once
#include <cstdint>

namespace fourbit {

class StopSignals {
 public:
  StopSignals();   // installs the SIGINT and SIGTERM handlers (one instance at a time)
  ~StopSignals();  // restores the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received since construction (SIGINT or SIGTERM), or 0.
  int requested() const;
};

// "SIGINT", "SIGTERM", or "signal N".
const char* signal_name(int sig);

// Raises the signal FOURBIT_TEST_RAISE names when `point` and `step` match it; otherwise nothing.
// A malformed FOURBIT_TEST_RAISE is an error naming the variable.
void test_signal_point(const char* point, int64_t step);

}  // namespace fourbit
