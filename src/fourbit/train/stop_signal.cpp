// defines: StopSignals, signal_name, test_signal_point (stop_signal.h)
#include "fourbit/train/stop_signal.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fourbit/tensor/error.h"

namespace fourbit {
namespace {

volatile std::sig_atomic_t g_requested = 0;
std::atomic<bool> g_installed{false};
struct sigaction g_prev_int, g_prev_term;

void on_stop_signal(int sig) {
  if (g_requested != 0) {
    // The second signal: the user means now. Default action, re-raised (async-signal-safe).
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_requested = sig;
  static const char kMsg[] =
      "\nfourbit: stopping after this step and writing a checkpoint (send the signal again to quit now)\n";
  const ssize_t unused = ::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
  (void)unused;
}

}  // namespace

StopSignals::StopSignals() {
  if (g_installed.exchange(true)) fail("StopSignals: only one training loop can own the stop signals at a time");
  g_requested = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // interrupted reads and writes continue
  ::sigaction(SIGINT, &sa, &g_prev_int);
  ::sigaction(SIGTERM, &sa, &g_prev_term);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGINT, &g_prev_int, nullptr);
  ::sigaction(SIGTERM, &g_prev_term, nullptr);
  g_installed = false;
}

int StopSignals::requested() const { return int(g_requested); }

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "signal";
  }
}

void test_signal_point(const char* point, int64_t step) {
  const char* env = std::getenv("FOURBIT_TEST_RAISE");
  if (!env || !*env) return;
  const std::string spec = env;
  const size_t a = spec.find(':'), b = a == std::string::npos ? a : spec.find(':', a + 1);
  if (b == std::string::npos)
    fail("FOURBIT_TEST_RAISE='{}': expected SIGNAL:POINT:STEP, e.g. SIGINT:step:3", spec);
  const std::string sig_name = spec.substr(0, a), where = spec.substr(a + 1, b - a - 1);
  const std::string step_text = spec.substr(b + 1);
  int sig = 0;
  if (sig_name == "SIGINT") sig = SIGINT;
  else if (sig_name == "SIGTERM") sig = SIGTERM;
  else fail("FOURBIT_TEST_RAISE='{}': the signal must be SIGINT or SIGTERM", spec);
  if (where != "step" && where != "checkpoint")
    fail("FOURBIT_TEST_RAISE='{}': the point must be step or checkpoint", spec);
  char* end = nullptr;
  const long long at = std::strtoll(step_text.c_str(), &end, 10);
  if (step_text.empty() || *end != '\0' || at < 1)
    fail("FOURBIT_TEST_RAISE='{}': the step must be a positive integer", spec);
  if (where == point && at == step) std::raise(sig);
}

}  // namespace fourbit
