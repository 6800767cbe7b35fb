// defines: data_test_dir, write_file, error_message, batch_of, Batch (helpers for tests/train)
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/data.h"

namespace fourbit::data::testing {

// A fresh, empty directory for the running test (ctest runs tests as parallel processes).
inline std::string data_test_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(FOURBIT_TEST_DATA_DIR) / "data_tests" /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline std::string write_file(const std::string& dir, const std::string& name,
                              const std::string& bytes) {
  const std::string path = dir + "/" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  EXPECT_TRUE(f.good()) << "cannot write " << path;
  return path;
}

using fourbit::testutil::error_of;
inline std::string error_message(const std::function<void()>& fn) { return error_of(fn); }

struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> tokens, targets;
  std::vector<int32_t> row(int64_t b) const {
    return {tokens.begin() + b * T, tokens.begin() + (b + 1) * T};
  }
};

inline Batch batch_of(const TokenSource& src, int64_t index, int64_t B, int64_t T) {
  Batch out{B, T, std::vector<int32_t>(size_t(B * T), -7), std::vector<int32_t>(size_t(B * T), -7)};
  src.batch(index, B, T, out.tokens.data(), out.targets.data());
  return out;
}

}  // namespace fourbit::data::testing
