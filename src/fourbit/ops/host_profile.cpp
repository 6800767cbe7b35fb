// defines: HostOpTimer (host_profile.h)
#include "fourbit/ops/host_profile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace fourbit::ops {
namespace {

struct Totals {
  std::mutex mu;
  std::map<const char*, std::pair<int64_t, int64_t>> by_op;  // ns, calls
  std::map<const char*, int64_t> self_ns;                    // outermost timers only
};
thread_local int t_depth = 0;  // nesting of this thread's timers now running

Totals& totals() {
  static Totals* t = new Totals();  // printed at exit, never destroyed
  return *t;
}

void report() {
  Totals& t = totals();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::pair<const char*, std::pair<int64_t, int64_t>>> rows(t.by_op.begin(), t.by_op.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  int64_t outer = 0;
  for (const auto& [op, ns] : t.self_ns) outer += ns;
  std::fprintf(stderr, "\nhost profile: %.1f ms in outermost ops\n%10s %10s %9s %10s  %s\n", outer * 1e-6, "ms",
               "calls", "us/call", "outer ms", "op");
  for (const auto& [op, v] : rows) {
    const auto it = t.self_ns.find(op);
    std::fprintf(stderr, "%10.2f %10lld %9.2f %10.2f  %s\n", v.first * 1e-6, static_cast<long long>(v.second),
                 v.first * 1e-3 / double(v.second), it == t.self_ns.end() ? 0.0 : it->second * 1e-6, op);
  }
}

bool enabled() {
  static const bool on = [] {
    const char* e = std::getenv("FOURBIT_HOST_PROFILE");
    if (!e || std::string(e) == "0") return false;
    std::atexit(report);
    return true;
  }();
  return on;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

HostOpTimer::HostOpTimer(const char* op) : op_(enabled() ? op : nullptr), t0_(0) {
  if (!op_) return;
  ++t_depth;
  t0_ = now_ns();
}

HostOpTimer::~HostOpTimer() {
  if (!op_) return;
  const int64_t ns = now_ns() - t0_;
  Totals& t = totals();
  std::lock_guard<std::mutex> lock(t.mu);
  auto& e = t.by_op[op_];
  e.first += ns;
  e.second += 1;
  if (--t_depth == 0) t.self_ns[op_] += ns;
}

}  // namespace fourbit::ops
