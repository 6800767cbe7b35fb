// defines: encode, decode, token_text, check_vocab_size (tokenizer.h)
#include "fourbit/train/tokenizer.h"

#include "fourbit/tensor/error.h"

namespace fourbit::data {

std::vector<int32_t> encode(std::string_view text) {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = int32_t(static_cast<unsigned char>(text[i]));
  return ids;
}

std::string token_text(int32_t token) {
  if (token >= 0 && token < 256) return std::string(1, char(token));
  switch (token) {
    case kPad: return "<pad>";
    case kBos: return "<bos>";
    case kEos: return "<eos>";
    case kSep: return "<sep>";
    default: return fmt::format("<id:{}>", token);
  }
}

std::string decode(std::span<const int32_t> tokens) {
  std::string out;
  out.reserve(tokens.size());
  for (int32_t t : tokens) {
    if (t >= 0 && t < 256)
      out.push_back(char(t));
    else
      out += token_text(t);
  }
  return out;
}

void check_vocab_size(int64_t vocab_size) {
  if (vocab_size < kVocabSize)
    fail("model.vocab_size is {} but the byte tokenizer emits ids up to {} (256 bytes + <pad>, "
         "<bos>, <eos>, <sep>): expected vocab_size >= {}",
         vocab_size, kVocabSize - 1, kVocabSize);
}

}  // namespace fourbit::data
