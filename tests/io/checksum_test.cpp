// defines: tests of io/checksum: CRC-32C against the published check values (RFC 3720's test
//          patterns and "123456789"), the SSE4.2 form against the table form on every length and
//          alignment up to 64 and on chunked input, and tensor checksums in safetensors metadata:
//          every single-bit flip in a tensor's bytes is caught and the message names the tensor;
//          a changed metadata entry is caught too.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fourbit/io/checksum.h"
#include "fourbit/io/safetensors.h"
#include "io/io_test_util.h"

using namespace fourbit;
using namespace fourbit::io;
using fourbit::testing_io::error_of;
using fourbit::testing_io::read_raw;
using fourbit::testing_io::test_dir;
using fourbit::testing_io::write_raw;

TEST(Crc32c, PublishedCheckValues) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(digits.data(), digits.size()), 0xE3069283u);
  // RFC 3720 B.4: 32 bytes of zeros, of ones, ascending and descending.
  std::vector<uint8_t> b(32);
  std::fill(b.begin(), b.end(), 0x00);
  EXPECT_EQ(crc32c(b.data(), 32), 0x8A9136AAu);
  std::fill(b.begin(), b.end(), 0xFF);
  EXPECT_EQ(crc32c(b.data(), 32), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) b[size_t(i)] = uint8_t(i);
  EXPECT_EQ(crc32c(b.data(), 32), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) b[size_t(i)] = uint8_t(31 - i);
  EXPECT_EQ(crc32c(b.data(), 32), 0x113FDB5Cu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  EXPECT_EQ(checksum_text(0xE3069283u), "crc32c:e3069283");
}

TEST(Crc32c, HardwareAndTableFormsAgreeAndChain) {
  std::mt19937 rng(7);
  std::vector<uint8_t> data(200);
  for (auto& x : data) x = uint8_t(rng());
  for (size_t off = 0; off < 8; ++off)
    for (size_t n = 0; n <= 64; ++n)
      ASSERT_EQ(crc32c(data.data() + off, n), crc32c_portable(data.data() + off, n)) << off << " " << n;
  // Continuing from a partial value equals one pass.
  const uint32_t whole = crc32c(data.data(), data.size());
  EXPECT_EQ(crc32c(data.data() + 77, data.size() - 77, crc32c(data.data(), 77)), whole);
}

TEST(TensorChecksums, EveryFlippedBitOfATensorIsCaughtAndNamed) {
  const std::string dir = test_dir();
  std::vector<float> a(24), b(7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.25f * float(i) - 2.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(i * i);
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"layers.0.wq", Tensor::from_host(a.data(), {4, 6}, DType::F32)},
      {"final_norm", Tensor::from_host(b.data(), {7}, DType::F32)}};
  std::map<std::string, std::string> meta = {{"format", "test"}};
  add_tensor_checksums(meta, tensors);
  ASSERT_EQ(meta.count("checksum.layers.0.wq"), 1u);
  const std::string path = dir + "/t.safetensors";
  write_safetensors(path, tensors, meta);
  verify_tensor_checksums(read_safetensors(path), true);  // intact: no error

  // Every bit of both tensors, flipped in the loaded file's bytes (the file-level path is
  // tests/train/checkpoint_test.cpp's).
  SafetensorsFile f = read_safetensors(path);
  int caught = 0, tried = 0;
  for (auto& [name, t] : f.tensors) {
    auto* bytes = static_cast<uint8_t*>(t.raw());
    for (int64_t byte = 0; byte < t.nbytes(); ++byte)
      for (int bit = 0; bit < 8; ++bit) {
        bytes[byte] ^= uint8_t(1 << bit);
        ++tried;
        const std::string msg = error_of([&] { verify_tensor_checksums(f, true); });
        caught += msg.find("'" + name + "' fails its checksum") != std::string::npos;
        bytes[byte] ^= uint8_t(1 << bit);
      }
  }
  EXPECT_EQ(caught, tried);
  EXPECT_EQ(tried, (24 + 7) * 4 * 8);
  verify_tensor_checksums(f, true);  // restored

  // A tensor without its checksum, or a checksum without its tensor, is refused too.
  std::map<std::string, std::string> partial = meta;
  partial.erase("checksum.layers.0.wq");
  write_safetensors(path, tensors, partial);
  EXPECT_NE(error_of([&] { verify_tensor_checksums(read_safetensors(path), true); }).find("'layers.0.wq' has no checksum"),
            std::string::npos);
  verify_tensor_checksums(read_safetensors(path), false);  // optional: the one there matches
  std::map<std::string, std::string> extra = meta;
  extra["checksum.gone"] = "crc32c:00000000";
  write_safetensors(path, tensors, extra);
  EXPECT_NE(error_of([&] { verify_tensor_checksums(read_safetensors(path), true); }).find("'gone'"), std::string::npos);
  // The other metadata entries are covered as a whole.
  std::map<std::string, std::string> changed = meta;
  changed["format"] = "tesT";
  write_safetensors(path, tensors, changed);
  EXPECT_NE(error_of([&] { verify_tensor_checksums(read_safetensors(path), false); }).find("metadata fails its checksum"),
            std::string::npos);
}

// The header is padded with spaces; the JSON parser stops at a NUL, so the reader checks the
// padding itself (a flipped bit there would otherwise go unseen).
TEST(SafetensorsPadding, MustBeSpaces) {
  const std::string dir = test_dir();
  std::vector<float> a(3, 1.0f);
  const std::string path = dir + "/p.safetensors";
  write_safetensors(path, {{"a", Tensor::from_host(a.data(), {3}, DType::F32)}});
  const std::string good = read_raw(path);
  uint64_t header = 0;
  std::memcpy(&header, good.data(), 8);
  ASSERT_EQ(good[8 + header - 1], ' ') << "the test needs a padded header";
  for (const char c : {'\0', '!', '\t'}) {
    std::string bad = good;
    bad[8 + header - 1] = c;
    write_raw(path, bad);
    const std::string msg = error_of([&] { read_safetensors(path); });
    EXPECT_NE(msg.find(path + ": the header"), std::string::npos) << msg;
  }
}
