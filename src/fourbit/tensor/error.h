// defines: Error, FOURBIT_CHECK, fail
// One exception type for everything a user can cause (bad config, bad file, bad shape) and for
// broken invariants. Messages name the file/field and what was expected; the CLI prints what()
// on one line and exits non-zero (STYLE: fail loudly and helpfully, no assert for user input).
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace fourbit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace fourbit

// Internal invariant with a message; for user input prefer an explicit check and fail().
#define FOURBIT_CHECK(cond, ...)                                                        \
  do {                                                                                  \
    if (!(cond))                                                                        \
      ::fourbit::fail("{}:{}: check failed ({}): {}", __FILE__, __LINE__, #cond,        \
                      ::fmt::format(__VA_ARGS__));                                      \
  } while (0)
