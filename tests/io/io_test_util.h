// defines: test_dir, write_raw, read_raw, error_of, list_dir (helpers for the io/ and CLI tests)
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "test_util.h"
#include "fourbit/tensor/error.h"

namespace fourbit::testing_io {

// A fresh, empty directory for the running test: tests run as separate processes in parallel.
inline std::string test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(FOURBIT_TEST_DATA_DIR) / "io_tests" /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(f.good()) << "cannot write " << path;
}

inline std::string read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

using fourbit::testutil::error_of;

inline std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace fourbit::testing_io

// Expects `msg` to contain each of the given substrings.
#define EXPECT_MSG_HAS(msg, ...)                                        \
  do {                                                                  \
    const std::string fourbit_msg_ = (msg);                             \
    for (const std::string& s_ : std::vector<std::string>{__VA_ARGS__}) \
      EXPECT_NE(fourbit_msg_.find(s_), std::string::npos)               \
          << "message lacks '" << s_ << "': " << fourbit_msg_;          \
  } while (0)
