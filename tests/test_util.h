// defines: error_of — shared by the test suites' helper headers.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fourbit/tensor/error.h"

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
