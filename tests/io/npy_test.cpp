// .npy reading and writing: round trips for every dtype and rank, the exact bytes NumPy writes,
// hand-built files of versions 1.0/2.0/3.0, and one clear Error naming the file per kind of bad
// input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "fourbit/io/npy.h"
#include "io/io_test_util.h"

using namespace fourbit;
using namespace fourbit::testing_io;

namespace {

// magic, version, header length (2 bytes in 1.0, 4 in 2.0/3.0), the dict (padded with spaces and
// a newline to a 64-byte boundary when `pad`), then the data bytes.
std::string npy_bytes(int major, std::string dict, const std::string& data, bool pad = true) {
  const size_t pre = major == 1 ? 10 : 12;
  if (pad) {
    const size_t total = (pre + dict.size() + 1 + 63) / 64 * 64;
    dict.append(total - pre - dict.size() - 1, ' ');
    dict.push_back('\n');
  }
  std::string out = "\x93NUMPY";
  out.push_back(char(major));
  out.push_back('\0');
  for (size_t i = 0; i < pre - 8; ++i) out.push_back(char((dict.size() >> (8 * i)) & 0xFF));
  return out + dict + data;
}

std::string f32_bytes(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

Tensor iota(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = t.data<uint8_t>();
  for (int64_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(i * 37 + 11);
  return t;
}

void expect_same(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.dtype(), b.dtype());
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())), 0);
}

}  // namespace

TEST(Npy, RoundTripsEveryDType) {
  const std::string dir = test_dir();
  for (DType t : {DType::F32, DType::F64, DType::U8, DType::I8, DType::U16, DType::I32, DType::I64,
                  DType::U32}) {
    const std::string path = dir + "/" + dtype_name(t) + ".npy";
    const Tensor x = iota({3, 5}, t);
    io::write_npy(path, x);
    expect_same(io::read_npy(path), x);
    const io::NpyHeader h = io::read_npy_header(path);
    EXPECT_EQ(h.version_major, 1);
    EXPECT_EQ(h.data_offset % 64, 0u) << dtype_name(t);
    EXPECT_EQ(h.descr, io::npy_descr(t));
  }
}

TEST(Npy, RoundTripsEveryRank) {
  const std::string dir = test_dir();
  for (const Shape& s : {Shape{}, Shape{7}, Shape{2, 0, 3}, Shape{2, 3, 4}, Shape{1, 1, 1, 1, 5}}) {
    const std::string path = dir + "/x.npy";
    const Tensor x = iota(s, DType::F32);
    io::write_npy(path, x);
    expect_same(io::read_npy(path), x);
  }
}

TEST(Npy, WritesTheBytesNumPyWrites) {
  // np.save(f, np.arange(6, dtype='<f4').reshape(2, 3)) with NumPy 2.4.
  const std::string dir = test_dir();
  const float v[6] = {0, 1, 2, 3, 4, 5};
  io::write_npy(dir + "/a.npy", Tensor::from_host(v, {2, 3}, DType::F32));
  std::string expected = std::string("\x93NUMPY\x01\x00v\x00", 10) +
                         "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" +
                         std::string(58, ' ') + "\n" + f32_bytes({0, 1, 2, 3, 4, 5});
  EXPECT_EQ(read_raw(dir + "/a.npy"), expected);
  // 1-D and 0-d shapes are written as Python tuples: (5,) and ().
  const uint8_t u[5] = {1, 2, 3, 4, 5};
  io::write_npy(dir + "/u.npy", Tensor::from_host(u, {5}, DType::U8));
  EXPECT_NE(
      read_raw(dir + "/u.npy").find("{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }"),
      std::string::npos);
}

TEST(Npy, ReadsHandBuiltFilesOfEachVersion) {
  const std::string dir = test_dir();
  const std::string data = f32_bytes({1.5f, -2.0f, 0.25f, 8.0f, -0.0f, 3.0f});
  const std::vector<std::pair<int, std::string>> files = {
      {1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"},
      // key order, quotes, trailing comma and Python 2 longs vary between writers
      {2, "{\"shape\": (2L, 3L), \"fortran_order\": False, \"descr\": \"<f4\"}"},
      {3, "{'fortran_order': False,'descr':'<f4','shape':(2,3)}"},
  };
  for (const auto& [major, dict] : files) {
    const std::string path = dir + "/v" + std::to_string(major) + ".npy";
    write_raw(path, npy_bytes(major, dict, data));
    const Tensor t = io::read_npy(path);
    ASSERT_EQ(t.dtype(), DType::F32) << dict;
    ASSERT_EQ(t.shape(), (Shape{2, 3})) << dict;
    EXPECT_EQ(t.data<float>()[0], 1.5f);
    EXPECT_EQ(t.data<float>()[3], 8.0f);
    EXPECT_TRUE(std::signbit(t.data<float>()[4]));
    EXPECT_EQ(io::read_npy_header(path).version_major, major);
  }
  // An unpadded header (the data need not be aligned) and a one-byte type spelled '<u1'.
  write_raw(dir + "/u1.npy", npy_bytes(1, "{'descr': '<u1', 'fortran_order': False, 'shape': (3,)}",
                                       "\x01\x02\x03", false));
  const Tensor u = io::read_npy(dir + "/u1.npy");
  EXPECT_EQ(u.dtype(), DType::U8);
  EXPECT_EQ(u.data<uint8_t>()[2], 3);
}

TEST(Npy, HeaderOfATypeWithoutTensorTypeStillParses) {
  // '<f2' has no fourbit DType: the header is readable (so callers can name it), the data is not.
  const std::string dir = test_dir();
  const std::string path = dir + "/half.npy";
  write_raw(path, npy_bytes(1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }",
                            std::string(4, '\0')));
  EXPECT_EQ(io::read_npy_header(path).descr, "<f2");
  EXPECT_MSG_HAS(error_of([&] { io::read_npy(path); }), path, "'<f2'", "float16");
}

TEST(Npy, BadFilesGiveClearErrorsNamingTheFile) {
  const std::string dir = test_dir();
  const std::string good_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  const std::string data = f32_bytes({1, 2, 3, 4, 5, 6});
  struct Case {
    const char* name;
    std::string bytes;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"empty", "", {"too short"}},
      {"magic", "PK\x03\x04 this is a zip file, not an array", {"not a .npy file"}},
      {"version", npy_bytes(4, good_dict, data), {"version 4.0"}},
      {"header_past_end",
       npy_bytes(1, good_dict, data).substr(0, 40),
       {"header length", "past the end"}},
      {"truncated",
       npy_bytes(1, good_dict, data.substr(0, 20)),
       {"truncated", "needs 24 data bytes"}},
      {"trailing", npy_bytes(1, good_dict, data + "xx"), {"2 unexpected bytes"}},
      {"fortran",
       npy_bytes(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", data),
       {"Fortran", "C order"}},
      {"big_endian",
       npy_bytes(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", data),
       {"big-endian", "'>f4'"}},
      {"unknown_dtype",
       npy_bytes(1, "{'descr': '<c8', 'fortran_order': False, 'shape': (2, 3), }", data),
       {"unsupported dtype '<c8'"}},
      {"structured",
       npy_bytes(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", data),
       {"structured"}},
      {"missing_key",
       npy_bytes(1, "{'descr': '<f4', 'shape': (2, 3), }", data),
       {"missing key 'fortran_order'"}},
      {"extra_key",
       npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", data),
       {"unexpected key 'x'"}},
      {"bad_shape",
       npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", data),
       {"bad .npy header", "shape"}},
      {"bad_bool",
       npy_bytes(1, "{'descr': '<f4', 'fortran_order': false, 'shape': (2, 3), }", data),
       {"True or False"}},
      {"garbage",
       npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } junk", data),
       {"after the closing"}},
      {"not_a_dict", npy_bytes(1, "['descr', '<f4']", data), {"expected '{'"}},
  };
  for (const Case& c : cases) {
    const std::string path = dir + "/" + c.name + ".npy";
    write_raw(path, c.bytes);
    SCOPED_TRACE(c.name);
    const std::string msg = error_of([&] { io::read_npy(path); });
    EXPECT_MSG_HAS(msg, path);
    for (const std::string& w : c.words) EXPECT_MSG_HAS(msg, w);
  }
}

TEST(Npy, MissingFilesAndDirectoriesAreClearErrors) {
  const std::string dir = test_dir();
  EXPECT_MSG_HAS(error_of([&] { io::read_npy(dir + "/nope.npy"); }), dir + "/nope.npy",
                 "no such file");
  EXPECT_MSG_HAS(error_of([&] { io::read_npy(dir); }), dir, "is a directory");
  EXPECT_MSG_HAS(
      error_of([&] { io::write_npy(dir + "/no/such/dir/x.npy", iota({2}, DType::F32)); }),
      dir + "/no/such/dir/x.npy");
  EXPECT_MSG_HAS(error_of([&] { io::write_npy(dir + "/b.npy", iota({2}, DType::BF16)); }), "b.npy",
                 "bf16");
  EXPECT_FALSE(std::filesystem::exists(dir + "/b.npy"));
}
