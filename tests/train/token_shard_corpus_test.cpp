// tokens:FILE: raw uint16 and llm.c-header (v1 uint16, v2 uint32) shards read back exactly, and
// bad files (odd size, header/size mismatch, wrong magic or version, ids >= vocab_size) fail with
// the file name and what was expected.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fourbit/train/token_shard_source.h"
#include "train/data_test_util.h"

using namespace fourbit::data;
using namespace fourbit::data::testing;

namespace {

void put_le(std::string& out, uint32_t v, int bytes) {
  for (int k = 0; k < bytes; ++k) out.push_back(char((v >> (8 * k)) & 0xFF));
}

std::string raw_u16(const std::vector<uint32_t>& ids) {
  std::string s;
  for (uint32_t id : ids) put_le(s, id, 2);
  return s;
}

// llm.c's layout: 256 little-endian int32 (magic, version, count, zeros), then the ids.
std::string llmc_shard(const std::vector<uint32_t>& ids, int32_t version = 1,
                       int32_t magic = kLlmcShardMagic, int64_t count = -1) {
  std::string s;
  put_le(s, uint32_t(magic), 4);
  put_le(s, uint32_t(version), 4);
  put_le(s, uint32_t(count < 0 ? int64_t(ids.size()) : count), 4);
  s.resize(1024, '\0');
  for (uint32_t id : ids) put_le(s, id, version == 2 ? 4 : 2);
  return s;
}

std::vector<uint32_t> pattern(int64_t n, uint32_t vocab) {
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = uint32_t((i * 7919 + i / 3) % vocab);
  return ids;
}

// Every row of a few batches is the file's ids at window_start, shifted by one for targets.
void expect_reads_back(const TokenShardSource& src, const std::vector<uint32_t>& ids) {
  const int64_t B = 3, T = 40;
  for (int64_t index = 0; index < 20; ++index) {
    const Batch x = batch_of(src, index, B, T);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t start = src.window_start(index, B, b, T);
      ASSERT_GE(start, src.split_begin());
      ASSERT_LE(start + T + 1, src.split_end());
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(x.tokens[size_t(b * T + t)], int32_t(ids[size_t(start + t)]));
        ASSERT_EQ(x.targets[size_t(b * T + t)], int32_t(ids[size_t(start + t + 1)]));
      }
    }
  }
}

}  // namespace

TEST(TokenShardCorpus, RawUint16ReadsBack) {
  const std::string dir = data_test_dir();
  const std::vector<uint32_t> ids = pattern(2000, 260);
  const std::string path = write_file(dir, "raw.bin", raw_u16(ids));
  const TokenShardSource train(path, Split::Train, 3, 0.1, 260), eval(path, Split::Eval, 3, 0.1, 260);
  EXPECT_EQ(train.total_tokens(), 2000);
  EXPECT_EQ(train.split_end(), 1800);
  EXPECT_EQ(eval.split_begin(), 1800);
  EXPECT_NE(train.describe().find("raw uint16"), std::string::npos) << train.describe();
  expect_reads_back(train, ids);
  expect_reads_back(eval, ids);
}

TEST(TokenShardCorpus, LlmcHeaderShardsReadBack) {
  const std::string dir = data_test_dir();
  const std::vector<uint32_t> gpt2 = pattern(3000, 50257);
  const std::string v1 = write_file(dir, "v1.bin", llmc_shard(gpt2));
  const TokenShardSource s1(v1, Split::Train, 8, 0.05, 50257);
  EXPECT_EQ(s1.total_tokens(), 3000);
  EXPECT_NE(s1.describe().find("llm.c header v1, uint16"), std::string::npos) << s1.describe();
  expect_reads_back(s1, gpt2);
  expect_reads_back(TokenShardSource(v1, Split::Eval, 8, 0.05, 50257), gpt2);

  const std::vector<uint32_t> llama = pattern(3000, 128256);
  const std::string v2 = write_file(dir, "v2.bin", llmc_shard(llama, 2));
  const TokenShardSource s2(v2, Split::Train, 8, 0.05, 128256);
  EXPECT_NE(s2.describe().find("llm.c header v2, uint32"), std::string::npos) << s2.describe();
  expect_reads_back(s2, llama);
}

TEST(TokenShardCorpus, BadFilesFailClearly) {
  const std::string dir = data_test_dir();
  const auto error_for = [&](const std::string& name, const std::string& bytes, int64_t vocab = 260) {
    const std::string path = write_file(dir, name, bytes);
    return std::make_pair(path, error_message([&] { TokenShardSource(path, Split::Train, 1, 0.1, vocab); }));
  };

  auto [odd, odd_msg] = error_for("odd.bin", raw_u16(pattern(100, 260)) + "x");
  EXPECT_EQ(odd_msg, odd + ": size 201 is not a whole number of uint16 tokens");

  auto [empty, empty_msg] = error_for("empty.bin", "");
  EXPECT_EQ(empty_msg, empty + ": empty data file");

  const std::string missing = dir + "/missing.bin";
  EXPECT_EQ(error_message([&] { TokenShardSource(missing, Split::Train, 1, 0.1, 260); }),
            missing + ": cannot open data file");

  std::vector<uint32_t> ids = pattern(500, 260);
  ids[123] = 300;
  auto [range, range_msg] = error_for("range.bin", raw_u16(ids));
  EXPECT_NE(range_msg.find(range + ": token at position 123"), std::string::npos) << range_msg;
  EXPECT_NE(range_msg.find("id 300"), std::string::npos) << range_msg;
  EXPECT_NE(range_msg.find("vocab_size 260"), std::string::npos) << range_msg;

  std::vector<uint32_t> big = pattern(500, 50257);
  big[400] = 50257;
  auto [hrange, hrange_msg] = error_for("hrange.bin", llmc_shard(big), 50257);
  EXPECT_NE(hrange_msg.find("token at position 400 (byte 1824) has id 50257"), std::string::npos)
      << hrange_msg;

  auto [magic, magic_msg] = error_for("magic.bin", llmc_shard(pattern(500, 260), 1, 20240521));
  EXPECT_NE(magic_msg.find(magic + ": looks like an llm.c token shard"), std::string::npos) << magic_msg;
  EXPECT_NE(magic_msg.find("magic is 20240521, expected 20240520"), std::string::npos) << magic_msg;

  auto [version, version_msg] = error_for("version.bin", llmc_shard(pattern(500, 260), 3));
  EXPECT_NE(version_msg.find("header version 3 is not supported"), std::string::npos) << version_msg;

  auto [count, count_msg] = error_for("count.bin", llmc_shard(pattern(500, 260), 1, kLlmcShardMagic, 600));
  EXPECT_NE(count_msg.find(count + ": llm.c shard header says 600 tokens (2224 bytes"), std::string::npos)
      << count_msg;
  EXPECT_NE(count_msg.find("file has 2024 bytes"), std::string::npos) << count_msg;

  auto [trunc, trunc_msg] = error_for("trunc.bin", llmc_shard({}).substr(0, 100));
  EXPECT_NE(trunc_msg.find("less than the 1024-byte header"), std::string::npos) << trunc_msg;

  auto [zero, zero_msg] = error_for("zero.bin", llmc_shard({}));
  EXPECT_EQ(zero_msg.rfind(zero + ": empty data file", 0), 0u) << zero_msg;
}
