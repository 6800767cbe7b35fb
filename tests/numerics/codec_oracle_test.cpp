// defines: the CodecOracle tests (scalar codecs against ml_dtypes)
// Scalar codecs against the independent oracle ml_dtypes (tables from ml_dtypes_oracle.py):
// every code decodes to ml_dtypes' value, every in-range float32 of the sample encodes to
// ml_dtypes' code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "fourbit/numerics/minifloat.h"
#include "fourbit/numerics/ue8m0.h"

using namespace fourbit::num;

namespace {

template <typename T>
std::vector<T> read_table(const std::string& name) {
  const std::string path = std::string(FOURBIT_TEST_DATA_DIR) + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) ADD_FAILURE() << "missing oracle table " << path << " (run tests through ctest)";
  std::vector<T> out;
  if (!f) return out;
  T rec;
  while (std::fread(&rec, sizeof rec, 1, f) == 1) out.push_back(rec);
  std::fclose(f);
  return out;
}

struct EncodeRecord {
  float x;
  uint8_t code;
  uint8_t pad[3];
};
static_assert(sizeof(EncodeRecord) == 8);

uint32_t fbits(float x) { return bits_of(x); }

void check_format(const char* name, int ncodes, float (*decode)(uint32_t), uint32_t (*encode)(float)) {
  const auto dec = read_table<float>(std::string(name) + "_decode.bin");
  ASSERT_EQ(int(dec.size()), ncodes) << name;
  for (int c = 0; c < ncodes; ++c) {
    const float mine = decode(uint32_t(c));
    if (std::isnan(dec[c])) EXPECT_TRUE(std::isnan(mine)) << name << " code " << c;
    else EXPECT_EQ(fbits(mine), fbits(dec[c])) << name << " code " << c << ": " << mine << " vs " << dec[c];
  }
  const auto enc = read_table<EncodeRecord>(std::string(name) + "_encode.bin");
  ASSERT_GT(enc.size(), 100000u) << name;
  int64_t bad = 0;
  for (const auto& r : enc) {
    const uint32_t mine = encode(r.x);
    if (mine != r.code && ++bad <= 10)
      ADD_FAILURE() << name << " encode(" << r.x << " = 0x" << std::hex << fbits(r.x) << ") = 0x"
                    << mine << ", ml_dtypes 0x" << uint32_t(r.code) << std::dec;
  }
  EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << enc.size() << " encodes differ";
}

}  // namespace

TEST(CodecOracle, E2M1) {
  check_format("e2m1", 16, [](uint32_t c) { return e2m1_decode(c); },
               [](float x) { return uint32_t(e2m1_encode(x)); });
}
TEST(CodecOracle, E4M3) {
  check_format("e4m3", 256, [](uint32_t c) { return e4m3_decode(c); },
               [](float x) { return uint32_t(e4m3_encode(x)); });
}
TEST(CodecOracle, E5M2) {
  check_format("e5m2", 256, [](uint32_t c) { return e5m2_decode(c); },
               [](float x) { return uint32_t(e5m2_encode(x)); });
}
TEST(CodecOracle, UE8M0) {
  check_format("ue8m0", 256, [](uint32_t c) { return ue8m0_decode(c); },
               [](float x) { return uint32_t(ue8m0_encode(x)); });
}
