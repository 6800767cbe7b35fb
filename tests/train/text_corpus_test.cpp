// text:FILE: windows come from their split and are contiguous in the file, batches are
// deterministic, and bad files (missing, empty, too short, invalid UTF-8) fail with the file
// name and what was expected.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "fourbit/train/text_source.h"
#include "fourbit/train/utf8.h"
#include "train/data_test_util.h"

using namespace fourbit::data;
using namespace fourbit::data::testing;

namespace {

// Lowercase words for the first 3000 bytes, uppercase for the last 1000: a window's case says
// which split it came from.
std::string two_part_text() {
  std::string text;
  uint32_t x = 12345;
  while (text.size() < 4000) {
    x = x * 1103515245u + 12345u;
    const int len = 1 + int((x >> 16) % 7);
    for (int k = 0; k < len && text.size() < 4000; ++k) {
      x = x * 1103515245u + 12345u;
      const char c = char('a' + (x >> 16) % 26);
      text.push_back(text.size() < 3000 ? c : char(c - 'a' + 'A'));
    }
    if (text.size() < 4000) text.push_back(text.size() < 3000 ? ' ' : '_');
  }
  return text;
}

}  // namespace

TEST(TextFileCorpus, WindowsComeFromTheirSplit) {
  const std::string dir = data_test_dir(), text = two_part_text();
  const std::string path = write_file(dir, "corpus.txt", text);
  const TextFileSource train(path, Split::Train, 1234, 0.25), eval(path, Split::Eval, 1234, 0.25);
  EXPECT_EQ(train.split_begin(), 0);
  EXPECT_EQ(train.split_end(), 3000);
  EXPECT_EQ(eval.split_begin(), 3000);
  EXPECT_EQ(eval.split_end(), 4000);
  EXPECT_NE(train.describe().find("train split: tokens [0, 3000) of 4000"), std::string::npos)
      << train.describe();

  const int64_t B = 4, T = 64;
  for (const TextFileSource* src : {&train, &eval}) {
    int64_t lowest = 1 << 30, highest = -1;
    for (int64_t index = 0; index < 200; ++index) {
      const Batch x = batch_of(*src, index, B, T);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t start = src->window_start(index, B, b, T);
        lowest = std::min(lowest, start);
        highest = std::max(highest, start);
        ASSERT_GE(start, src->split_begin());
        ASSERT_LE(start + T + 1, src->split_end());
        for (int64_t t = 0; t < T; ++t) {
          ASSERT_EQ(x.tokens[size_t(b * T + t)], (unsigned char)text[size_t(start + t)]);
          ASSERT_EQ(x.targets[size_t(b * T + t)], (unsigned char)text[size_t(start + t + 1)]);
          const char c = char(x.targets[size_t(b * T + t)]);
          if (src == &train)
            ASSERT_TRUE(c == ' ' || (c >= 'a' && c <= 'z')) << "train window at " << start;
          else
            ASSERT_TRUE(c == '_' || (c >= 'A' && c <= 'Z')) << "eval window at " << start;
        }
      }
    }
    // 800 draws over ~3000 (train) or ~1000 (eval) starts reach both ends of the split.
    EXPECT_LT(lowest, src->split_begin() + 50);
    EXPECT_GT(highest, src->split_end() - T - 1 - 50);
  }

  const TextFileSource again(path, Split::Train, 1234, 0.25), reseeded(path, Split::Train, 99, 0.25);
  EXPECT_EQ(batch_of(again, 17, B, T).tokens, batch_of(train, 17, B, T).tokens);
  EXPECT_NE(batch_of(again, 18, B, T).tokens, batch_of(train, 17, B, T).tokens);
  EXPECT_NE(batch_of(reseeded, 17, B, T).tokens, batch_of(train, 17, B, T).tokens);
}

TEST(TextFileCorpus, MultibyteTextBecomesBytes) {
  const std::string dir = data_test_dir();
  std::string text;
  while (text.size() < 600) text += "gr\xC3\xBC\xC3\x9F" "e \xE2\x82\xAC \xF0\x9F\x98\x80 ";
  const std::string path = write_file(dir, "utf8.txt", text);
  const TextFileSource src(path, Split::Train, 1, 0.1);
  const Batch x = batch_of(src, 0, 2, 32);
  bool high = false;
  for (int32_t t : x.tokens) {
    ASSERT_TRUE(t >= 0 && t < 256);
    high |= t >= 0x80;
  }
  EXPECT_TRUE(high);
}

TEST(TextFileCorpus, ShortSplitNamesFileSplitAndSizes) {
  const std::string dir = data_test_dir();
  const std::string path = write_file(dir, "short.txt", std::string(1000, 'x'));
  const TextFileSource eval(path, Split::Eval, 1, 0.05);  // 50 bytes
  const std::string msg = error_message([&] { batch_of(eval, 0, 2, 64); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("eval split has 50 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("seq_len 64 need at least 66"), std::string::npos) << msg;
  const TextFileSource train(path, Split::Train, 1, 0.05);  // 950 bytes: fine
  EXPECT_NO_THROW(batch_of(train, 0, 2, 64));
  EXPECT_NO_THROW(batch_of(train, 0, 2, 948));
  EXPECT_THROW(batch_of(train, 0, 2, 949), fourbit::Error);
  EXPECT_THROW(batch_of(train, -1, 2, 64), fourbit::Error);
  EXPECT_THROW(batch_of(train, 0, 0, 64), fourbit::Error);
}

TEST(TextFileCorpus, EmptyAndMissingFiles) {
  const std::string dir = data_test_dir();
  const std::string empty = write_file(dir, "corpus.txt", "");
  EXPECT_EQ(error_message([&] { TextFileSource(empty, Split::Train, 1, 0.1); }),
            empty + ": empty data file");
  const std::string missing = dir + "/nope.txt";
  EXPECT_EQ(error_message([&] { TextFileSource(missing, Split::Train, 1, 0.1); }),
            missing + ": cannot open data file");
}

TEST(Utf8Corpus, StrictValidationReportsTheFirstBadSequence) {
  struct Case {
    std::string bytes;
    int64_t offset;  // -1: valid
    const char* what;
  };
  const std::vector<Case> cases = {
      {"plain ascii\n", -1, "ascii"},
      {"\xC2\x80 \xDF\xBF", -1, "2-byte min/max"},
      {"\xE0\xA0\x80 \xED\x9F\xBF \xEE\x80\x80 \xEF\xBF\xBF", -1, "3-byte around the surrogates"},
      {"\xF0\x90\x80\x80 \xF4\x8F\xBF\xBF", -1, "4-byte min and U+10FFFF"},
      {"ab\xC0\xAF", 2, "overlong '/' in 2 bytes"},
      {"ab\xC1\xBF", 2, "overlong 2-byte"},
      {"abc\xE0\x80\xAF", 3, "overlong 3-byte"},
      {"\xE0\x9F\xBF", 0, "overlong 3-byte (U+07FF)"},
      {"\xF0\x82\x82\xAC", 0, "overlong 4-byte"},
      {"hello \x80 world", 6, "lone continuation byte"},
      {"ok\xE2\x82\xAC\xBF", 5, "continuation after a complete sequence"},
      {"ok\xE2\x82", 2, "truncated at end of file"},
      {"ok\xE2\x82x", 2, "truncated by ASCII"},
      {"\xF0\x9F\x98", 0, "truncated 4-byte"},
      {"\xC3", 0, "lead byte at end of file"},
      {"\xED\xA0\x80", 0, "high surrogate U+D800"},
      {"x\xED\xBF\xBF", 1, "low surrogate U+DFFF"},
      {"\xF4\x90\x80\x80", 0, "U+110000"},
      {"\xF5\x80\x80\x80", 0, "lead F5"},
      {"\xF8\x88\x80\x80\x80", 0, "5-byte form"},
      {"a\xFF", 1, "byte FF"},
  };
  for (const Case& c : cases) {
    const Utf8Problem p = find_invalid_utf8(c.bytes);
    EXPECT_EQ(p.offset, c.offset) << c.what;
    if (c.offset >= 0) {
      EXPECT_STRNE(p.reason, "") << c.what;
    }
  }
  EXPECT_EQ(std::string(find_invalid_utf8("\xED\xA0\x80").reason), "UTF-16 surrogate");
  EXPECT_EQ(std::string(find_invalid_utf8("\xE0\x80\x80").reason), "overlong encoding");
}

TEST(Utf8Corpus, TextFileNamesTheOffset) {
  const std::string dir = data_test_dir();
  const std::string bad = std::string(1234, 'a') + "\x80" + std::string(100, 'b');
  const std::string path = write_file(dir, "corpus.txt", bad);
  const std::string msg = error_message([&] { TextFileSource(path, Split::Train, 1, 0.1); });
  EXPECT_EQ(msg.rfind(path + ": not valid UTF-8 at byte 1234", 0), 0u) << msg;
  for (const std::string& seq : {std::string("\xC0\x80"), std::string("\xED\xB0\x80"),
                                 std::string("\xE2\x82")}) {
    const std::string p2 = write_file(dir, "c2.txt", std::string(77, 'z') + seq);
    const std::string m2 = error_message([&] { TextFileSource(p2, Split::Eval, 1, 0.1); });
    EXPECT_EQ(m2.rfind(p2 + ": not valid UTF-8 at byte 77", 0), 0u) << m2;
  }
}
