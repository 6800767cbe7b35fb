// defines: Split, split_name, TokenSource, sequence_number, make_token_source,
//          unigram_entropy_nats
// Where training tokens come from. A TokenSource gives batch `index` of one split as a pure
// function of (seed, split, index, B, T): no cursor, no hidden state, so a resumed run needs only
// its step count, and any batch can be regenerated to debug it. Users: docs/data.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "fourbit/model/config.h"
#include "fourbit/train/tokenizer.h"

namespace fourbit::data {

enum class Split { Train, Eval };
const char* split_name(Split split);  // "train" | "eval"

class TokenSource {
 public:
  virtual ~TokenSource();
  // Fills tokens and targets, both [B, T] row-major. Row b is a window of T+1 tokens w:
  // tokens[b, t] = w[t], targets[b, t] = w[t + 1]. Row b of batch `index` is sequence number
  // sequence_number(index, B, b) of this source's split.
  virtual void batch(int64_t index, int64_t B, int64_t T, int32_t* tokens,
                     int32_t* targets) const = 0;
  // One line for logs: the kind of source, its file, split and sizes.
  virtual std::string describe() const = 0;
};

// index * B + b: the stream of sequences is the same whatever the batch size, so B = 16 at index
// i covers exactly the sequences of B = 8 at indices 2i and 2i + 1 (gradient accumulation keeps
// the data). Fails on negative arguments or overflow.
int64_t sequence_number(int64_t index, int64_t B, int64_t b);

// d.source: "synthetic", "text:FILE" or "tokens:FILE". vocab_size is the model's: synthetic and
// text need the byte tokenizer's 260 ids, token shards must hold only ids < vocab_size.
std::unique_ptr<TokenSource> make_token_source(const DataConfig& d, Split split, uint64_t seed,
                                               int64_t vocab_size);

// Entropy (nats) of the frequency distribution of the target tokens of batches 0..batches-1:
// the loss of the best model that ignores context, the baseline a trained model should beat.
double unigram_entropy_nats(const TokenSource& src, int64_t batches, int64_t B, int64_t T);

}  // namespace fourbit::data
