// defines: TextFileSource (text_source.h)
#include "fourbit/train/text_source.h"

#include "fourbit/tensor/error.h"
#include "fourbit/train/utf8.h"

namespace fourbit::data {
namespace {

std::string load_utf8_file(const std::string& path) {
  std::string bytes = read_data_file(path);
  if (bytes.empty()) fail("{}: empty data file", path);
  const Utf8Problem p = find_invalid_utf8(bytes);
  if (!p.valid()) fail("{}: not valid UTF-8 at byte {} ({})", path, p.offset, p.reason);
  return bytes;
}

}  // namespace

TextFileSource::TextFileSource(const std::string& path, Split split, uint64_t seed,
                               double eval_fraction)
    : TextFileSource(path, split, seed, eval_fraction, load_utf8_file(path)) {}

TextFileSource::TextFileSource(const std::string& path, Split split, uint64_t seed,
                               double eval_fraction, std::string bytes)
    : WindowSource(path, split, seed, int64_t(bytes.size()), eval_fraction),
      bytes_(std::move(bytes)) {}

std::string TextFileSource::describe() const {
  return fmt::format("text:{} (UTF-8 bytes as tokens; {})", path(), split_description());
}

void TextFileSource::read_tokens(int64_t pos, int64_t n, int32_t* out) const {
  for (int64_t i = 0; i < n; ++i)
    out[i] = int32_t(static_cast<unsigned char>(bytes_[size_t(pos + i)]));
}

}  // namespace fourbit::data
