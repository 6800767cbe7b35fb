// defines: the source-tree check that code built without CUDA names nothing of the CUDA backend
// A build without CUDA (CI's `make test-asan`, a machine without nvcc) compiles every test, tool
// and library source outside ops/cuda/. A call into `ops::cuda::` (or an include of a header that
// includes cuda_ops.h) outside an `#if FOURBIT_HAS_CUDA` block compiles where CUDA is built, so
// `make test` passes, and fails only in that other build. This check runs in `make test` and
// names each such line; a synthetic file shows it finds one.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tools/cli_test_util.h"

namespace fs = std::filesystem;

namespace {

struct Line {
  int number;
  std::string text;  // code only: the comment and string literals removed
  bool guarded;      // inside an #if FOURBIT_HAS_CUDA branch
};

// The lines of a source with, for each, whether a CUDA-built-only branch holds it: an #if whose
// condition names FOURBIT_HAS_CUDA positively opens one; its #else / #elif branches do not.
std::vector<Line> scan(const std::string& source) {
  std::vector<Line> out;
  std::vector<bool> stack;
  std::istringstream in(source);
  std::string raw;
  static const std::regex strings(R"("([^"\\]|\\.)*")");
  for (int n = 1; std::getline(in, raw); ++n) {
    const size_t first = raw.find_first_not_of(" \t");
    const std::string s = first == std::string::npos ? "" : raw.substr(first);
    if (s.rfind("#if", 0) == 0) {
      const bool cuda = s.find("FOURBIT_HAS_CUDA") != std::string::npos && s.find('!') == std::string::npos &&
                        s.find("== 0") == std::string::npos;
      stack.push_back(cuda);
      continue;
    }
    if (s.rfind("#el", 0) == 0) {
      if (!stack.empty()) stack.back() = false;
      continue;
    }
    if (s.rfind("#endif", 0) == 0) {
      if (!stack.empty()) stack.pop_back();
      continue;
    }
    bool guarded = false;
    for (bool b : stack) guarded = guarded || b;
    std::string code = s.substr(0, s.find("//"));
    if (code.rfind("#include", 0) != 0) code = std::regex_replace(code, strings, "\"\"");
    out.push_back({n, code, guarded});
  }
  return out;
}

const std::regex& cuda_call() {
  static const std::regex r(R"((^|[^A-Za-z0-9_])cuda::)");
  return r;
}

// The CUDA backend's header, included outside a guard: the file itself is built only with CUDA.
bool includes_cuda_ops(const std::vector<Line>& lines) {
  for (const Line& l : lines)
    if (!l.guarded && l.text.rfind("#include", 0) == 0 && l.text.find("fourbit/ops/cuda/cuda_ops.h") != std::string::npos)
      return true;
  return false;
}

// "line: text" for each unguarded use of the CUDA backend in a file built without CUDA: a call into
// a cuda:: namespace, or an include of one of the CUDA-only headers.
std::vector<std::string> violations(const std::vector<Line>& lines, const std::set<std::string>& cuda_headers) {
  std::vector<std::string> out;
  for (const Line& l : lines) {
    if (l.guarded) continue;
    bool bad = std::regex_search(l.text, cuda_call());
    if (l.text.rfind("#include", 0) == 0)
      for (const std::string& h : cuda_headers) bad = bad || l.text.find("\"" + h + "\"") != std::string::npos;
    if (bad) out.push_back(std::to_string(l.number) + ": " + l.text);
  }
  return out;
}

}  // namespace

// The check itself finds a call after the guard's #endif (the shape of the test that broke CI's
// sanitizer build once), one in an #else branch, and an include of a CUDA-only header, and passes
// the same calls inside a guard and in comments and strings.
TEST(SourceTree, GuardCheckFindsUnguardedCudaCalls) {
  const std::string file =
      "#include \"ops/op_test_util.h\"\n"
      "#if FOURBIT_HAS_CUDA\n"
      "#include \"fourbit/ops/cuda/cuda_ops.h\"\n"
      "void a() { ops::cuda::set_flash_wgmma(true); }\n"
      "#endif\n"
      "void b() { ops::cuda::set_flash_head_rows(true); }\n"
      "// ops::cuda::in_a_comment();\n"
      "void c() { fail(\"cuda::in_a_string\"); }\n"
      "#if FOURBIT_HAS_CUDA\n"
      "#else\n"
      "void d() { cuda::flash_attention_forward(); }\n"
      "#endif\n"
      "#include \"ops/cuda_grouped_util.h\"\n";
  const std::vector<std::string> v = violations(scan(file), {"ops/cuda_grouped_util.h"});
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0], "6: void b() { ops::cuda::set_flash_head_rows(true); }");
  EXPECT_EQ(v[1], "11: void d() { cuda::flash_attention_forward(); }");
  EXPECT_EQ(v[2], "13: #include \"ops/cuda_grouped_util.h\"");
}

// Every file that a build without CUDA compiles names the CUDA backend only inside a guard. Files
// built only with CUDA are left out: ops/cuda/, .cu and .cuh files, the gpu_ benchmarks
// (bench/CMakeLists.txt), the NCCL communicator (CMakeLists.txt), and headers that include
// cuda_ops.h unguarded (whose own includes must then be guarded, as cuda_ops.h's must).
TEST(SourceTree, CudaOnlyCodeIsGuarded) {
  const fs::path root = FOURBIT_SOURCE_DIR;
  std::vector<std::pair<std::string, std::vector<Line>>> files;
  for (const char* dir : {"src", "tests", "tools", "bench"})
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h")) continue;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      if (rel.find("/ops/cuda/") != std::string::npos || rel.rfind("bench/gpu_", 0) == 0 ||
          rel == "src/fourbit/dist/nccl_communicator.cpp")
        continue;
      files.emplace_back(rel, scan(fourbit::clitest::slurp(e.path().string())));
    }
  ASSERT_GT(files.size(), 100u) << "the tree under " << root << " was not found";
  // CUDA-only headers, named as the tree's includes name them (from tests/, from src/)
  auto cuda_only_header = [](const std::string& rel, const std::vector<Line>& lines) {
    return rel.ends_with(".h") && includes_cuda_ops(lines);
  };
  std::set<std::string> cuda_headers{"fourbit/ops/cuda/cuda_ops.h"};
  for (const auto& [rel, lines] : files)
    if (cuda_only_header(rel, lines)) {
      if (rel.rfind("tests/", 0) == 0) cuda_headers.insert(rel.substr(6));
      else if (rel.rfind("src/", 0) == 0) cuda_headers.insert(rel.substr(4));
    }
  std::string report;
  for (const auto& [rel, lines] : files) {
    if (cuda_only_header(rel, lines)) continue;
    for (const std::string& v : violations(lines, cuda_headers)) report += rel + ":" + v + "\n";
  }
  EXPECT_TRUE(report.empty()) << "CUDA backend code outside #if FOURBIT_HAS_CUDA (a build without CUDA fails on "
                              << "it):\n"
                              << report;
}
