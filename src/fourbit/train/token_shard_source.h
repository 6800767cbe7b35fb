// defines: TokenShardSource, kLlmcShardMagic, kLlmcHeaderBytes
// `tokens:FILE`: pre-tokenized little-endian token ids, either raw uint16 or with llm.c's shard
// header (256 int32: magic 20240520, version, token count; version 1 = uint16 ids, version 2 =
// uint32 ids). The file is validated at load: size against the header, every id < vocab_size.
#pragma once
#include <cstdint>
#include <string>

#include "fourbit/train/window_source.h"

namespace fourbit::data {

inline constexpr int32_t kLlmcShardMagic = 20240520;
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

class TokenShardSource : public WindowSource {
 public:
  TokenShardSource(const std::string& path, Split split, uint64_t seed, double eval_fraction,
                   int64_t vocab_size);
  std::string describe() const override;

 protected:
  void read_tokens(int64_t pos, int64_t n, int32_t* out) const override;

 private:
  struct Layout {
    int64_t data_offset = 0;  // bytes before the first token
    int64_t token_bytes = 2;  // 2: uint16, 4: uint32
    int64_t count = 0;
    std::string format;       // "raw uint16" | "llm.c header v1, uint16" | ...
  };
  struct Loaded {
    std::string bytes;
    Layout layout;
  };
  static Loaded load(const std::string& path);
  TokenShardSource(const std::string& path, Split split, uint64_t seed, double eval_fraction,
                   int64_t vocab_size, Loaded loaded);
  uint32_t token_at(int64_t i) const;

  std::string bytes_;
  Layout layout_;
};

}  // namespace fourbit::data
