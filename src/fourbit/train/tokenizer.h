// defines: kPad, kBos, kEos, kSep, kVocabSize, encode, decode, token_text, check_vocab_size
// The byte-level tokenizer: ids 0..255 are the bytes themselves, then four specials. Nothing is
// learned, so any UTF-8 text round-trips exactly and the model's vocabulary is fixed at 260.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::data {

inline constexpr int32_t kPad = 256;  // padding (SFT batches); never a target in pretraining
inline constexpr int32_t kBos = 257;  // begins every document
inline constexpr int32_t kEos = 258;  // ends every document
inline constexpr int32_t kSep = 259;  // separates prompt and answer (SFT/RL tasks)
inline constexpr int64_t kVocabSize = 260;

// Raw bytes as ids 0..255; no specials are added.
std::vector<int32_t> encode(std::string_view text);
// Bytes as themselves, specials as "<pad>", "<bos>", "<eos>", "<sep>", anything else "<id:N>".
std::string decode(std::span<const int32_t> tokens);
std::string token_text(int32_t token);

// Fails unless a model with `vocab_size` logits can hold every id the tokenizer emits.
void check_vocab_size(int64_t vocab_size);

}  // namespace fourbit::data
