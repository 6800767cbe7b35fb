// defines: TokenShardSource (token_shard_source.h)
#include "fourbit/train/token_shard_source.h"

#include "fourbit/tensor/error.h"

namespace fourbit::data {
namespace {

// Little-endian by construction, whatever the host.
uint32_t load_le(const std::string& bytes, int64_t offset, int64_t width) {
  uint32_t v = 0;
  for (int64_t k = 0; k < width; ++k)
    v |= uint32_t(static_cast<unsigned char>(bytes[size_t(offset + k)])) << (8 * k);
  return v;
}

int64_t token_bytes_of_version(int32_t version) {
  return version == 1 ? 2 : version == 2 ? 4 : 0;
}

}  // namespace

TokenShardSource::Loaded TokenShardSource::load(const std::string& path) {
  Loaded loaded;
  loaded.bytes = read_data_file(path);
  const std::string& bytes = loaded.bytes;
  Layout& l = loaded.layout;
  const int64_t size = int64_t(bytes.size());
  if (size == 0) fail("{}: empty data file", path);
  const auto header_word = [&](int k) { return int32_t(load_le(bytes, 4 * k, 4)); };
  const bool has_magic = size >= 4 && header_word(0) == kLlmcShardMagic;

  if (!has_magic && size >= kLlmcHeaderBytes) {
    // A file shaped exactly like an llm.c shard (version and count agree with the size) but with
    // another magic is a damaged or foreign shard, not raw tokens that happen to fit.
    const int32_t version = header_word(1), count = header_word(2);
    const int64_t width = token_bytes_of_version(version);
    if (width && count >= 0 && kLlmcHeaderBytes + int64_t(count) * width == size)
      fail("{}: looks like an llm.c token shard (version {}, {} tokens) but its magic is {}, "
           "expected {}",
           path, version, count, header_word(0), kLlmcShardMagic);
  }

  if (!has_magic) {
    if (size % 2 != 0) fail("{}: size {} is not a whole number of uint16 tokens", path, size);
    l.token_bytes = 2;
    l.count = size / 2;
    l.format = "raw uint16";
    return loaded;
  }
  if (size < kLlmcHeaderBytes)
    fail("{}: starts with the llm.c shard magic {} but has {} bytes, less than the {}-byte header",
         path, kLlmcShardMagic, size, kLlmcHeaderBytes);
  const int32_t version = header_word(1), count = header_word(2);
  l.token_bytes = token_bytes_of_version(version);
  if (!l.token_bytes)
    fail("{}: llm.c shard header version {} is not supported (expected 1: uint16 ids, or 2: "
         "uint32 ids)",
         path, version);
  if (count < 0) fail("{}: llm.c shard header has a negative token count {}", path, count);
  const int64_t expected = kLlmcHeaderBytes + int64_t(count) * l.token_bytes;
  if (expected != size)
    fail("{}: llm.c shard header says {} tokens ({} bytes with the {}-byte header) but the file "
         "has {} bytes",
         path, count, expected, kLlmcHeaderBytes, size);
  if (count == 0) fail("{}: empty data file (llm.c shard header with 0 tokens)", path);
  l.data_offset = kLlmcHeaderBytes;
  l.count = count;
  l.format = fmt::format("llm.c header v{}, uint{}", version, 8 * l.token_bytes);
  return loaded;
}

TokenShardSource::TokenShardSource(const std::string& path, Split split, uint64_t seed,
                                   double eval_fraction, int64_t vocab_size)
    : TokenShardSource(path, split, seed, eval_fraction, vocab_size, load(path)) {}

TokenShardSource::TokenShardSource(const std::string& path, Split split, uint64_t seed,
                                   double eval_fraction, int64_t vocab_size, Loaded loaded)
    : WindowSource(path, split, seed, loaded.layout.count, eval_fraction),
      bytes_(std::move(loaded.bytes)), layout_(std::move(loaded.layout)) {
  if (vocab_size < 1) fail("{}: model.vocab_size must be >= 1, got {}", path, vocab_size);
  // Every id is checked once here, so a batch never hands the model an out-of-range index.
  for (int64_t i = 0; i < layout_.count; ++i) {
    const uint32_t id = token_at(i);
    if (int64_t(id) >= vocab_size)
      fail("{}: token at position {} (byte {}) has id {}, expected ids < model.vocab_size {}",
           path, i, layout_.data_offset + i * layout_.token_bytes, id, vocab_size);
  }
}

uint32_t TokenShardSource::token_at(int64_t i) const {
  return load_le(bytes_, layout_.data_offset + i * layout_.token_bytes, layout_.token_bytes);
}

std::string TokenShardSource::describe() const {
  return fmt::format("tokens:{} ({}; {})", path(), layout_.format, split_description());
}

void TokenShardSource::read_tokens(int64_t pos, int64_t n, int32_t* out) const {
  for (int64_t i = 0; i < n; ++i) out[i] = int32_t(token_at(pos + i));
}

}  // namespace fourbit::data
