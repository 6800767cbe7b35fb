// The byte tokenizer: exact round trips of any bytes, the specials' ids and spellings, and the
// vocabulary-size check.
#include <gtest/gtest.h>

#include <string>

#include "fourbit/tensor/error.h"
#include "fourbit/train/tokenizer.h"

using namespace fourbit::data;

TEST(Tokenizer, RoundTripsUtf8AndEveryByte) {
  const std::string text = "the cat sees the dogs . h\xC3\xA9llo w\xC3\xB6rld \xE2\x88\x91 \xF0\x9F\x98\x80";
  const std::vector<int32_t> ids = encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 't');
  EXPECT_EQ(ids[25], 0xC3);  // bytes, not code points
  EXPECT_EQ(decode(ids), text);

  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(char(b));
  const std::vector<int32_t> all_ids = encode(all);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(all_ids[size_t(b)], b);
  EXPECT_EQ(decode(all_ids), all);
  EXPECT_TRUE(encode("").empty());
}

TEST(Tokenizer, SpecialsHaveFixedIdsAndSpellings) {
  EXPECT_EQ(kPad, 256);
  EXPECT_EQ(kBos, 257);
  EXPECT_EQ(kEos, 258);
  EXPECT_EQ(kSep, 259);
  EXPECT_EQ(kVocabSize, 260);
  const std::vector<int32_t> ids = {kBos, 'h', 'i', kEos, kPad, kSep, 260, 70000, -1};
  EXPECT_EQ(decode(ids), "<bos>hi<eos><pad><sep><id:260><id:70000><id:-1>");
  EXPECT_EQ(token_text(kBos), "<bos>");
  EXPECT_EQ(token_text('a'), "a");
  // encode never produces specials, even from their spellings.
  for (int32_t id : encode("<bos>")) EXPECT_LT(id, 256);
}

TEST(Tokenizer, VocabSizeCheck) {
  EXPECT_NO_THROW(check_vocab_size(260));
  EXPECT_NO_THROW(check_vocab_size(50257));
  try {
    check_vocab_size(256);
    FAIL() << "expected an Error";
  } catch (const fourbit::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("vocab_size is 256"), std::string::npos) << msg;
    EXPECT_NE(msg.find(">= 260"), std::string::npos) << msg;
  }
}
