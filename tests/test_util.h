// defines: error_of, EXPECT_HAS — shared by the test suites' helper headers.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fourbit/tensor/error.h"

// A failure unless the string `msg` contains `needle`; the message shows both.
#define EXPECT_HAS(msg, needle) \
  EXPECT_NE((msg).find(needle), std::string::npos) << "'" << (msg) << "' lacks '" << (needle) << "'"

namespace fourbit::testutil {

// The message of the fourbit::Error that fn throws; a test failure when it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const fourbit::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a fourbit::Error";
  return "";
}

}  // namespace fourbit::testutil
