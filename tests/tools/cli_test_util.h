// defines: CliRun, run_cli, lines_of, snapshot — running the built `fourbit` binary from a test.
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace fourbit::clitest {

struct CliRun {
  int status = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs FOURBIT_CLI with `args` (shell syntax) and extra environment assignments `env` (e.g.
// "FOURBIT_TEST_RAISE=..."), capturing stdout/stderr in files under `dir`. One OpenMP thread: the
// test models are tiny, and on a shared machine spinning threads make a run far slower (results
// do not depend on the thread count).
inline CliRun run_cli(const std::string& dir, const std::string& args, const std::string& env = "") {
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  const std::string cmd = "OMP_NUM_THREADS=1 " + env + (env.empty() ? "" : " ") + "'" + FOURBIT_CLI + "' " + args +
                          " >'" + out + "' 2>'" + err + "'";
  const int raw = std::system(cmd.c_str());
  CliRun r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

inline std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Every file under dir (relative path -> bytes): compared before and after a command that must
// leave a run untouched.
inline std::map<std::string, std::string> snapshot(const std::string& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = slurp(e.path().string());
  return out;
}

}  // namespace fourbit::clitest
