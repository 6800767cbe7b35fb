// defines: TextFileSource
// `text:FILE`: a UTF-8 text file whose bytes are the tokens (tokenizer.h ids 0..255). The file is
// validated strictly at load, so a Latin-1 or binary file is caught before training starts.
#pragma once
#include <string>

#include "fourbit/train/window_source.h"

namespace fourbit::data {

class TextFileSource : public WindowSource {
 public:
  // Fails: "FILE: cannot open data file", "FILE: empty data file",
  // "FILE: not valid UTF-8 at byte N (reason)".
  TextFileSource(const std::string& path, Split split, uint64_t seed, double eval_fraction);
  std::string describe() const override;

 protected:
  void read_tokens(int64_t pos, int64_t n, int32_t* out) const override;

 private:
  TextFileSource(const std::string& path, Split split, uint64_t seed, double eval_fraction,
                 std::string bytes);
  std::string bytes_;
};

}  // namespace fourbit::data
