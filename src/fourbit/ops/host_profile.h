// defines: HostOpTimer
// Host time per op, for finding where a GPU step is bound by the host issuing work: with
// FOURBIT_HOST_PROFILE=1 in the environment, every op dispatched through ops.cpp is timed on the
// host (its checks, allocations and launches; an op that calls others counts their time too) and
// the totals per op are printed to stderr at exit. The time includes any wait for the GPU inside
// the op: a read-back, or a launch that blocks because the GPU's launch queue is full (the host
// then runs far ahead of the GPU, so the op where it blocks says nothing about its own cost).
// Unset, a timer costs one test of a flag.
#pragma once
#include <cstdint>

namespace fourbit::ops {

class HostOpTimer {
 public:
  explicit HostOpTimer(const char* op);  // op: a string literal (its address is the key)
  ~HostOpTimer();
  HostOpTimer(const HostOpTimer&) = delete;
  HostOpTimer& operator=(const HostOpTimer&) = delete;

 private:
  const char* op_;
  int64_t t0_;
};

}  // namespace fourbit::ops
