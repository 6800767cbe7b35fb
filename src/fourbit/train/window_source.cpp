// defines: WindowSource, read_data_file, train_split_tokens (window_source.h)
#include "fourbit/train/window_source.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <vector>

#include "fourbit/io/atomic_file.h"
#include "fourbit/tensor/error.h"
#include "fourbit/train/batch_checks.h"
#include "fourbit/train/sequence_rng.h"

namespace fourbit::data {

std::string read_data_file(const std::string& path) {
  // Directories and anything that is not a regular file (/dev/zero would be read until memory
  // runs out) are refused by name before opening.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(st)) fail("{}: cannot open data file", path);
  if (std::filesystem::is_directory(st)) fail("{}: is a directory, expected a data file", path);
  if (!std::filesystem::is_regular_file(st))
    fail("{}: is not a regular file (a device, pipe or socket), expected a data file", path);
  const io::InputFile f(path);
  if (f.size() > uint64_t(std::numeric_limits<int64_t>::max() / 4))
    fail("{}: data file of {} bytes is too large", path, f.size());
  std::string bytes(size_t(f.size()), '\0');
  f.read_at(0, bytes.data(), bytes.size(), "the data");
  return bytes;
}

int64_t train_split_tokens(int64_t total_tokens, double eval_fraction) {
  if (!(eval_fraction > 0 && eval_fraction < 1))
    fail("data.eval_fraction must be in (0, 1), got {}", eval_fraction);
  const double train = std::floor(double(total_tokens) * (1.0 - eval_fraction));
  return std::min<int64_t>(total_tokens, std::max<int64_t>(0, int64_t(train)));
}

WindowSource::WindowSource(std::string path, Split split, uint64_t seed, int64_t total_tokens,
                           double eval_fraction)
    : path_(std::move(path)), split_(split), seed_(seed), total_(total_tokens),
      eval_fraction_(eval_fraction) {
  const int64_t train_end = train_split_tokens(total_tokens, eval_fraction);
  begin_ = split == Split::Train ? 0 : train_end;
  end_ = split == Split::Train ? train_end : total_tokens;
}

std::string WindowSource::split_description() const {
  return fmt::format("{} split: tokens [{}, {}) of {}", split_name(split_), begin_, end_, total_);
}

int64_t WindowSource::window_start(int64_t index, int64_t B, int64_t b, int64_t T) const {
  const int64_t have = end_ - begin_;
  if (T < 1 || have < T + 2)
    fail("{}: the {} split has {} tokens (tokens [{}, {}) of the file's {} with "
         "data.eval_fraction {}) but windows of seq_len {} need at least {}",
         path_, split_name(split_), have, begin_, end_, total_, eval_fraction_, T, T + 2);
  const uint64_t starts = uint64_t(have - T);  // windows [s, s + T + 1) for s in [0, have - T)
  SequenceRng rng(seed_, split_, sequence_number(index, B, b));
  return begin_ + int64_t(rng.next_u64() % starts);
}

void WindowSource::batch(int64_t index, int64_t B, int64_t T, int32_t* tokens,
                         int32_t* targets) const {
  check_batch_args(path_, index, B, T, tokens, targets);
  std::vector<int32_t> w(size_t(T) + 1);
  for (int64_t b = 0; b < B; ++b) {
    read_tokens(window_start(index, B, b, T), T + 1, w.data());
    for (int64_t t = 0; t < T; ++t) {
      tokens[b * T + t] = w[size_t(t)];
      targets[b * T + t] = w[size_t(t) + 1];
    }
  }
}

}  // namespace fourbit::data
