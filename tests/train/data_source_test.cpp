// make_token_source picks the source named by data.source and checks it against the model's
// vocabulary; unigram_entropy_nats measures what it should on sources with a known answer.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "fourbit/train/data.h"
#include "train/data_test_util.h"

using namespace fourbit;
using namespace fourbit::data;
using namespace fourbit::data::testing;

TEST(DataSource, FactoryPicksTheSourceNamedByTheConfig) {
  const std::string dir = data_test_dir();
  DataConfig d;
  EXPECT_NE(make_token_source(d, Split::Train, 1, 260)->describe().find("synthetic"),
            std::string::npos);

  d.source = "text:" + write_file(dir, "c.txt", std::string(500, 'q'));
  const auto text = make_token_source(d, Split::Eval, 1, 260);
  EXPECT_NE(text->describe().find("text:"), std::string::npos) << text->describe();
  EXPECT_NE(text->describe().find("eval split"), std::string::npos) << text->describe();

  std::string shard;
  for (int i = 0; i < 400; ++i) shard += std::string{char(i % 200), '\0'};
  d.source = "tokens:" + write_file(dir, "t.bin", shard);
  EXPECT_NE(make_token_source(d, Split::Train, 1, 260)->describe().find("raw uint16"),
            std::string::npos);
  // Token shards are checked against the model's vocabulary, not the byte tokenizer's.
  EXPECT_NO_THROW(make_token_source(d, Split::Train, 1, 200));
  EXPECT_THROW(make_token_source(d, Split::Train, 1, 199), Error);

  d.source = "text:" + dir + "/absent.txt";
  EXPECT_EQ(error_message([&] { make_token_source(d, Split::Train, 1, 260); }),
            dir + "/absent.txt: cannot open data file");
  d.source = "tokens:";
  EXPECT_NE(error_message([&] { make_token_source(d, Split::Train, 1, 260); }).find("names no file"),
            std::string::npos);
  d.source = "parquet:x";
  EXPECT_NE(error_message([&] { make_token_source(d, Split::Train, 1, 260); })
                .find("'synthetic', 'text:FILE' or 'tokens:FILE'"),
            std::string::npos);
  d.source = "synthetic";
  EXPECT_NE(error_message([&] { make_token_source(d, Split::Train, 1, 128); }).find(">= 260"),
            std::string::npos);
}

TEST(DataSource, SequenceNumbersAreIndexTimesBatchPlusRow) {
  EXPECT_EQ(sequence_number(0, 16, 0), 0);
  EXPECT_EQ(sequence_number(3, 16, 5), 53);
  EXPECT_THROW(sequence_number(-1, 16, 0), Error);
  EXPECT_THROW(sequence_number(0, 16, 16), Error);
  EXPECT_THROW(sequence_number(int64_t(1) << 60, 16, 0), Error);
}

TEST(DataSource, UnigramEntropyOfKnownDistributions) {
  const std::string dir = data_test_dir();
  DataConfig d;
  d.source = "tokens:" + write_file(dir, "const.bin", std::string(2000, '\x07'));  // id 0x0707
  EXPECT_EQ(unigram_entropy_nats(*make_token_source(d, Split::Train, 1, 2000), 4, 4, 32), 0.0);

  std::string alternating;
  for (int i = 0; i < 1000; ++i) alternating += i % 2 ? "b" : "a";
  d.source = "text:" + write_file(dir, "ab.txt", alternating);
  // Even T: every window holds T/2 of each letter among its targets.
  EXPECT_NEAR(unigram_entropy_nats(*make_token_source(d, Split::Train, 1, 260), 5, 3, 32),
              std::log(2.0), 1e-12);
  EXPECT_THROW(unigram_entropy_nats(*make_token_source(d, Split::Train, 1, 260), 0, 3, 32), Error);
}
