// defines: WindowSource, read_data_file, train_split_tokens
// What the file-backed sources share: a flat stream of tokens split into train (the first
// 1 - eval_fraction) and eval (the rest), and windows of T+1 tokens at offsets drawn from
// (seed, split, sequence number), so batch `index` is random access like the synthetic source.
#pragma once
#include <cstdint>
#include <string>

#include "fourbit/train/data.h"

namespace fourbit::data {

// The whole file; fails naming the path when it is missing, a directory, not a regular file
// (a device such as /dev/zero) or unreadable.
std::string read_data_file(const std::string& path);

// floor(total * (1 - eval_fraction)): the number of tokens of the train split.
int64_t train_split_tokens(int64_t total_tokens, double eval_fraction);

class WindowSource : public TokenSource {
 public:
  void batch(int64_t index, int64_t B, int64_t T, int32_t* tokens,
             int32_t* targets) const override;

  // Position in the file's token stream of the first token of row b of batch `index`. Fails,
  // naming the file, split and sizes, when the split holds fewer than T+2 tokens (a window needs
  // T+1, and a split with a single window would repeat one sequence forever).
  int64_t window_start(int64_t index, int64_t B, int64_t b, int64_t T) const;

  int64_t split_begin() const { return begin_; }
  int64_t split_end() const { return end_; }
  int64_t total_tokens() const { return total_; }

 protected:
  // path names the file in messages; the split covers tokens [begin, end) of total_tokens.
  WindowSource(std::string path, Split split, uint64_t seed, int64_t total_tokens,
               double eval_fraction);
  // Tokens [pos, pos + n) of the file's token stream as ids.
  virtual void read_tokens(int64_t pos, int64_t n, int32_t* out) const = 0;

  const std::string& path() const { return path_; }
  Split split() const { return split_; }
  // "train split: tokens [0, 950) of 1000"
  std::string split_description() const;

 private:
  std::string path_;
  Split split_;
  uint64_t seed_;
  int64_t total_, begin_, end_;
  double eval_fraction_;
};

}  // namespace fourbit::data
