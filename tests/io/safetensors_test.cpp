// safetensors reading and writing: round trips, the writer's byte layout, a file built byte by
// byte from the format's description, one clear Error naming the file (and the tensor) per kind
// of bad input, and the atomic-write guarantees that checkpoints rely on.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "fourbit/io/atomic_file.h"
#include "fourbit/io/safetensors.h"
#include "io/io_test_util.h"

using namespace fourbit;
using namespace fourbit::testing_io;

namespace {

Tensor pattern(const Shape& shape, DType dtype, int salt) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = t.data<uint8_t>();
  for (int64_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(i * 31 + salt);
  return t;
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((v >> (8 * i)) & 0xFF);
  return s;
}

// A safetensors file from a header text and a data buffer, exactly as the format describes it.
std::string st_bytes(const std::string& header, const std::string& data) {
  return u64_le(header.size()) + header + data;
}

}  // namespace

TEST(Safetensors, RoundTripKeepsOrderDTypesAndMetadata) {
  const std::string path = test_dir() + "/model.safetensors";
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"z.last_name_first", pattern({3}, DType::F32, 1)},
      {"layers.0.w1", pattern({4, 8}, DType::BF16, 2)},
      {"codes", pattern({5, 3}, DType::U8, 3)},
      {"i8", pattern({7}, DType::I8, 4)},
      {"u16", pattern({2, 2}, DType::U16, 5)},
      {"empty", pattern({0, 4}, DType::F32, 6)},
      {"i32", pattern({3, 1}, DType::I32, 7)},
      {"scalar", pattern({}, DType::I64, 8)},
      {"u32", pattern({2}, DType::U32, 9)},
      {"f64", pattern({2}, DType::F64, 10)},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"},
                                                   {"fourbit.recipe", "nvfp4-fwd"}};
  io::write_safetensors(path, tensors, meta);

  const io::SafetensorsFile f = io::read_safetensors(path);
  EXPECT_EQ(f.metadata, meta);
  ASSERT_EQ(f.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    EXPECT_EQ(f.tensors[i].first, name) << "tensors come back in the order they were written";
    const Tensor& back = f.get(name);
    EXPECT_EQ(back.dtype(), t.dtype()) << name;
    EXPECT_EQ(back.shape(), t.shape()) << name;
    EXPECT_EQ(std::memcmp(back.raw(), t.raw(), size_t(t.nbytes())), 0) << name;
  }
  EXPECT_EQ(f.find("nope"), nullptr);
}

TEST(Safetensors, WriterLayoutFollowsTheFormat) {
  const std::string path = test_dir() + "/w.safetensors";
  io::write_safetensors(path,
                        {{"b", pattern({3}, DType::U8, 1)}, {"a", pattern({2, 2}, DType::F32, 2)}},
                        {{"k", "v"}});
  const std::string bytes = read_raw(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  EXPECT_EQ(n % 8, 0u) << "header padded to 8 bytes";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header[header.find_last_not_of(' ')], '}') << "padded with spaces after the JSON";
  const auto j = nlohmann::ordered_json::parse(header);
  auto it = j.begin();
  EXPECT_EQ(it.key(), "__metadata__");
  EXPECT_EQ((++it).key(), "b");
  EXPECT_EQ((++it).key(), "a");
  EXPECT_EQ(j["b"]["dtype"], "U8");
  EXPECT_EQ(j["b"]["data_offsets"], nlohmann::json({0, 3}));
  EXPECT_EQ(j["a"]["dtype"], "F32");
  EXPECT_EQ(j["a"]["shape"], nlohmann::json({2, 2}));
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json({3, 19}));
  EXPECT_EQ(bytes.size(), 8 + n + 19);
}

TEST(Safetensors, ReadsAFileBuiltByteByByte) {
  // Header order differs from data order, the header is not padded, and the data is not aligned.
  const std::string path = test_dir() + "/hand.safetensors";
  const std::string header =
      R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[3,11]},)"
      R"("__metadata__":{"step":"7"},"b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})";
  std::string data = "\x01\x02\x03";
  const float w[2] = {1.5f, -3.0f};
  data.append(reinterpret_cast<const char*>(w), 8);
  write_raw(path, st_bytes(header, data));
  const io::SafetensorsFile f = io::read_safetensors(path);
  EXPECT_EQ(f.metadata.at("step"), "7");
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].first, "b");  // in data order
  EXPECT_EQ(f.tensors[1].first, "w");
  EXPECT_EQ(f.get("b").data<uint8_t>()[2], 3);
  EXPECT_EQ(f.get("w").shape(), Shape{2});
  EXPECT_EQ(f.get("w").data<float>()[1], -3.0f);
}

// Quantized checkpoints declare dtypes fourbit has no arithmetic type for: their bytes travel in a
// tensor of the same element size, and the declared name survives a round trip.
TEST(Safetensors, DeclaredByteDTypesRoundTrip) {
  const std::string path = test_dir() + "/fp8.safetensors";
  const Tensor codes = pattern({2, 4}, DType::U8, 3), scales = pattern({2}, DType::U8, 5);
  const Tensor half = pattern({3}, DType::U16, 7), plain = pattern({4}, DType::U8, 9);
  io::write_safetensors(path, {{"codes", codes}, {"scales", scales}, {"half", half}, {"plain", plain}}, {},
                        {{"codes", "F8_E4M3"}, {"scales", "F8_E8M0"}, {"half", "F16"}});
  const std::string header = read_raw(path).substr(8, 200);
  EXPECT_NE(header.find(R"("codes":{"dtype":"F8_E4M3")"), std::string::npos) << header;
  const io::SafetensorsFile f = io::read_safetensors(path);
  EXPECT_EQ(f.dtype_names.at("codes"), "F8_E4M3");
  EXPECT_EQ(f.dtype_names.at("scales"), "F8_E8M0");
  EXPECT_EQ(f.dtype_names.at("half"), "F16");
  EXPECT_EQ(f.dtype_names.at("plain"), "U8");
  EXPECT_EQ(f.get("codes").dtype(), DType::U8);
  EXPECT_EQ(f.get("half").dtype(), DType::U16);
  EXPECT_EQ(std::memcmp(f.get("codes").raw(), codes.raw(), 8), 0);
  // A declaration must fit the tensor's storage and name a tensor that is written.
  EXPECT_MSG_HAS(error_of([&] { io::write_safetensors(path, {{"h", half}}, {}, {{"h", "F8_E4M3"}}); }),
                 path, "tensor 'h' is u16, but dtype F8_E4M3 is stored as u8");
  EXPECT_MSG_HAS(error_of([&] { io::write_safetensors(path, {{"c", codes}}, {}, {{"c", "F4"}}); }), path,
                 "unknown dtype 'F4'");
  EXPECT_MSG_HAS(error_of([&] { io::write_safetensors(path, {{"c", codes}}, {}, {{"x", "F8_E4M3"}}); }), path,
                 "tensor 'x', which is not written");
}

TEST(Safetensors, BadFilesGiveClearErrorsNamingTheFileAndTensor) {
  const std::string dir = test_dir();
  const std::string ok_w = R"("w":{"dtype":"F32","shape":[4,8],"data_offsets":[0,128]})";
  const std::string data128(128, '\0');
  struct Case {
    const char* name;
    std::string bytes;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"short", std::string("\x05\x00\x00", 3), {"too short"}},
      {"header_past_end", u64_le(1000) + "{}", {"header length 1000", "past the end"}},
      {"zero_header", u64_le(0), {"header length is 0"}},
      {"bad_json", st_bytes(R"({"w": {"dtype": "F32",)", ""), {"not valid JSON"}},
      {"not_object", st_bytes("[1, 2]", ""), {"must be a JSON object"}},
      {"unknown_dtype",
       st_bytes(R"({"w":{"dtype":"F8_E9M9","shape":[2],"data_offsets":[0,2]}})", "xx"),
       {"tensor 'w'", "unknown dtype 'F8_E9M9'"}},
      {"shape_mismatch",
       st_bytes(R"({"layers.0.w1":{"dtype":"F32","shape":[4,8],"data_offsets":[0,96]}})",
                std::string(96, '\0')),
       {"tensor 'layers.0.w1': data_offsets [0, 96] hold 96 bytes but shape [4, 8] of F32 needs "
        "128"}},
      {"out_of_range",
       st_bytes("{" + ok_w + R"(,"b":{"dtype":"U8","shape":[8],"data_offsets":[128,136]}})",
                data128),
       {"tensor 'b'", "past the end of the data buffer (128 bytes)"}},
      {"overlap",
       st_bytes("{" + ok_w + R"(,"b":{"dtype":"U8","shape":[8],"data_offsets":[120,128]}})",
                data128),
       {"tensor 'b'", "overlap tensor 'w'"}},
      {"hole",
       st_bytes(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", "12345678"),
       {"bytes [0, 4)", "belong to no tensor"}},
      {"trailing", st_bytes("{" + ok_w + "}", data128 + "extra"), {"cover only the first 128"}},
      {"offsets_reversed",
       st_bytes(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", "1234"),
       {"tensor 'w'", "end before they begin"}},
      {"negative_shape",
       st_bytes(R"({"w":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", "1234"),
       {"tensor 'w'", "shape[0]", "non-negative integer"}},
      {"missing_field",
       st_bytes(R"({"w":{"dtype":"U8","data_offsets":[0,4]}})", "1234"),
       {"tensor 'w'", "missing field 'shape'"}},
      {"extra_field",
       st_bytes(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1}})", "1234"),
       {"tensor 'w'", "unexpected field 'x'"}},
      {"duplicate", st_bytes("{" + ok_w + "," + ok_w + "}", data128), {"tensor 'w' appears twice"}},
      {"metadata_not_string",
       st_bytes(
           R"({"__metadata__":{"step":7},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
           "1"),
       {"__metadata__", "'step'", "must be a string"}},
  };
  for (const Case& c : cases) {
    const std::string path = dir + "/" + c.name + ".safetensors";
    write_raw(path, c.bytes);
    SCOPED_TRACE(c.name);
    const std::string msg = error_of([&] { io::read_safetensors(path); });
    EXPECT_MSG_HAS(msg, path);
    for (const std::string& w : c.words) EXPECT_MSG_HAS(msg, w);
  }
}

TEST(Safetensors, MissingTensorAndMissingFileAreClearErrors) {
  const std::string dir = test_dir();
  const std::string path = dir + "/m.safetensors";
  io::write_safetensors(path, {{"codes", pattern({2}, DType::U8, 0)}});
  const io::SafetensorsFile f = io::read_safetensors(path);
  EXPECT_MSG_HAS(error_of([&] { f.get("block_scales"); }), path, "no tensor named 'block_scales'",
                 "codes");
  EXPECT_MSG_HAS(error_of([&] { io::read_safetensors(dir + "/none.safetensors"); }),
                 dir + "/none.safetensors", "no such file");
  EXPECT_MSG_HAS(error_of([&] { io::read_safetensors(dir); }), dir, "is a directory");
}

TEST(Safetensors, WriterRejectsBadInput) {
  const std::string path = test_dir() + "/bad.safetensors";
  const Tensor t = pattern({2}, DType::U8, 0);
  EXPECT_MSG_HAS(error_of([&] {
                   io::write_safetensors(path, {{"a", t}, {"a", t}});
                 }),
                 path, "'a' is given twice");
  EXPECT_MSG_HAS(error_of([&] {
                   io::write_safetensors(path, {{"__metadata__", t}});
                 }),
                 path, "reserved");
  EXPECT_MSG_HAS(error_of([&] {
                   io::write_safetensors(path, {{"u", Tensor()}});
                 }),
                 path, "'u' is undefined");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(AtomicFile, FailedWriterLeavesTheTargetUntouchedAndNoTempFile) {
  const std::string dir = test_dir();
  const std::string path = dir + "/ckpt.safetensors";
  write_raw(path, "the old checkpoint");
  const std::string msg = error_of([&] {
    io::write_file_atomic(path, [](io::FileSink& sink) {
      sink.write("half of a new checkp");
      throw std::runtime_error("disk on fire");
    });
  });
  EXPECT_MSG_HAS(msg, path, "disk on fire");
  EXPECT_EQ(read_raw(path), "the old checkpoint");
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ckpt.safetensors"});

  // A fourbit::Error from inside the writer (here: a tensor that cannot be written) too.
  EXPECT_MSG_HAS(error_of([&] {
                   io::write_file_atomic(path, [&](io::FileSink& sink) {
                     sink.write("x");
                     fail("tensor 'w': not on this device");
                   });
                 }),
                 path, "tensor 'w'");
  EXPECT_EQ(read_raw(path), "the old checkpoint");
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ckpt.safetensors"});
}

TEST(AtomicFile, ReplacesTheTargetAndKeepsItsPermissions) {
  const std::string dir = test_dir();
  const std::string path = dir + "/f.bin";
  write_raw(path, "old");
  std::filesystem::permissions(path, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::owner_write |
                                         std::filesystem::perms::group_read);
  io::write_file_atomic(path, std::string_view("new contents"));
  EXPECT_EQ(read_raw(path), "new contents");
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                std::filesystem::perms::group_read);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"f.bin"});
  const std::vector<uint8_t> back = io::read_file_bytes(path);
  EXPECT_EQ(std::string(back.begin(), back.end()), "new contents");
}

TEST(AtomicFile, ErrorsNameThePath) {
  const std::string dir = test_dir();
  EXPECT_MSG_HAS(
      error_of([&] { io::write_file_atomic(dir + "/missing/x", std::string_view("x")); }),
      dir + "/missing/x", "temp file");
  EXPECT_MSG_HAS(error_of([&] { io::write_file_atomic(dir, std::string_view("x")); }), dir,
                 "is a directory");
  EXPECT_MSG_HAS(error_of([&] { io::read_file_bytes(dir + "/absent"); }), dir + "/absent",
                 "no such file");
  EXPECT_MSG_HAS(error_of([&] { io::read_file_bytes(dir); }), dir, "is a directory");
}
