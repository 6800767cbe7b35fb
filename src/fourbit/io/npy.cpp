// defines: read_npy_header, read_npy, write_npy, npy_descr (npy.h)
#include "fourbit/io/npy.h"

#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

#include "fourbit/io/atomic_file.h"

namespace fourbit::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              ".npy data is read and written as little-endian bytes");

constexpr std::string_view kMagic = "\x93NUMPY";

struct DescrInfo {
  std::string_view descr;
  int64_t item_bytes;
  std::optional<DType> dtype;  // nullopt: a NumPy type fourbit has no tensor type for
  std::string_view numpy_name;
};

constexpr std::array<DescrInfo, 12> kDescrs = {{
    {"<f4", 4, DType::F32, "float32"},
    {"|u1", 1, DType::U8, "uint8"},
    {"|i1", 1, DType::I8, "int8"},
    {"<u2", 2, DType::U16, "uint16"},
    {"<i4", 4, DType::I32, "int32"},
    {"<i8", 8, DType::I64, "int64"},
    {"<u4", 4, DType::U32, "uint32"},
    {"<f8", 8, DType::F64, "float64"},
    {"<f2", 2, std::nullopt, "float16"},
    {"<i2", 2, std::nullopt, "int16"},
    {"<u8", 8, std::nullopt, "uint64"},
    {"|b1", 1, std::nullopt, "bool"},
}};

const DescrInfo* find_descr(std::string_view d) {
  // One-byte types have no byte order; NumPy writes '|', other writers sometimes '<' or '>'.
  std::string norm(d);
  if (norm.size() == 3 && norm[2] == '1' && (norm[0] == '<' || norm[0] == '>')) norm[0] = '|';
  for (const auto& e : kDescrs)
    if (e.descr == norm) return &e;
  return nullptr;
}

std::string supported_descrs() {
  std::string s;
  for (const auto& e : kDescrs)
    if (e.dtype) s += (s.empty() ? "" : ", ") + std::string(e.descr);
  return s;
}

// The header dict is a Python literal. This parser accepts what NumPy (and other writers) emit:
// a dict of quoted string keys whose values are quoted strings, True/False, or tuples of
// non-negative integers (an optional trailing L from Python 2), with optional trailing commas.
class HeaderDictParser {
 public:
  HeaderDictParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  NpyHeader parse() {
    NpyHeader h;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (!eat('}')) {
      const std::string key = parse_string("a quoted key");
      expect(':');
      if (key == "descr") {
        skip_ws();
        if (peek() == '[') bad("'descr' is a list: structured (record) dtypes are not supported");
        h.descr = parse_string("a quoted dtype string for 'descr'");
        have_descr = true;
      } else if (key == "fortran_order") {
        h.fortran_order = parse_bool("fortran_order");
        have_order = true;
      } else if (key == "shape") {
        h.shape = parse_shape();
        have_shape = true;
      } else {
        bad(fmt::format("unexpected key '{}' (expected 'descr', 'fortran_order', 'shape')", key));
      }
      if (eat(',')) continue;
      if (eat('}')) break;
      bad("expected ',' or '}' after the value of '" + key + "'");
    }
    skip_ws();
    if (pos_ != s_.size()) bad("unexpected text after the closing '}'");
    if (!have_descr) bad("missing key 'descr'");
    if (!have_order) bad("missing key 'fortran_order'");
    if (!have_shape) bad("missing key 'shape'");
    return h;
  }

 private:
  [[noreturn]] void bad(const std::string& what) const {
    const std::string shown =
        s_.size() > 120 ? std::string(s_.substr(0, 120)) + "..." : std::string(s_);
    fail("{}: bad .npy header: {} (at character {} of {:?})", path_, what, pos_, shown);
  }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool eat(char c) {
    skip_ws();
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!eat(c)) bad(fmt::format("expected '{}'", c));
  }
  std::string parse_string(const char* what) {
    skip_ws();
    const char q = peek();
    if (q != '\'' && q != '"') bad(std::string("expected ") + what);
    const size_t end = s_.find(q, pos_ + 1);
    if (end == std::string_view::npos) bad("unterminated string");
    std::string out(s_.substr(pos_ + 1, end - pos_ - 1));
    if (out.find('\\') != std::string::npos) bad("escape sequences in strings are not supported");
    pos_ = end + 1;
    return out;
  }
  bool parse_bool(const char* key) {
    skip_ws();
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    bad(fmt::format("expected True or False for '{}'", key));
  }
  Shape parse_shape() {
    expect('(');
    Shape shape;
    while (!eat(')')) {
      if (peek() < '0' || peek() > '9') bad("expected a non-negative integer in 'shape'");
      int64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        const int digit = peek() - '0';
        if (v > (std::numeric_limits<int64_t>::max() - digit) / 10)
          bad("dimension too large in 'shape'");
        v = v * 10 + digit;
        ++pos_;
      }
      if (peek() == 'L') ++pos_;
      shape.push_back(v);
      if (eat(',')) continue;
      if (eat(')')) break;
      bad("expected ',' or ')' in 'shape'");
    }
    return shape;
  }

  std::string_view s_;
  const std::string& path_;
  size_t pos_ = 0;
};

uint64_t read_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string python_shape(const Shape& s) {
  if (s.size() == 1) return fmt::format("({},)", s[0]);
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

NpyHeader read_header(const InputFile& f) {
  const std::string& path = f.path();
  // Preamble: magic (6), version (2), header length (2 in 1.0, 4 in 2.0/3.0).
  if (f.size() < 10) fail("{}: file is {} bytes, too short to be a .npy file", path, f.size());
  uint8_t pre[12] = {};
  f.read_at(0, pre, f.size() >= 12 ? 12 : 10, "the .npy preamble");
  if (std::memcmp(pre, kMagic.data(), kMagic.size()) != 0)
    fail("{}: not a .npy file (expected the magic bytes \\x93NUMPY at the start)", path);
  const int major = pre[6], minor = pre[7];
  if (!((major == 1 || major == 2 || major == 3) && minor == 0))
    fail("{}: unsupported .npy format version {}.{} (expected 1.0, 2.0 or 3.0)", path, major,
         minor);
  const int len_bytes = major == 1 ? 2 : 4;
  if (f.size() < uint64_t(8 + len_bytes))
    fail("{}: file is {} bytes, too short for a version {}.0 .npy preamble", path, f.size(), major);
  const uint64_t header_len = read_le(pre + 8, len_bytes);
  const uint64_t data_offset = 8 + uint64_t(len_bytes) + header_len;
  if (data_offset > f.size())
    fail("{}: header length {} runs past the end of the file ({} bytes)", path, header_len,
         f.size());

  std::string text(size_t(header_len), '\0');
  f.read_at(8 + uint64_t(len_bytes), text.data(), text.size(), "the .npy header");
  NpyHeader h = HeaderDictParser(text, path).parse();
  h.version_major = major;
  h.version_minor = minor;
  h.data_offset = data_offset;

  const DescrInfo* info = find_descr(h.descr);
  if (!info) {
    if (!h.descr.empty() && h.descr[0] == '>')
      fail("{}: big-endian dtype '{}' is not supported (save it with arr.astype('<{}'))", path,
           h.descr, h.descr.substr(1));
    fail("{}: unsupported dtype '{}' (fourbit reads {})", path, h.descr, supported_descrs());
  }
  h.item_bytes = info->item_bytes;
  if (h.fortran_order)
    fail(
        "{}: array is stored in Fortran (column-major) order; only C order is supported "
        "(save np.ascontiguousarray(arr))",
        path);

  // numel * item_bytes without overflow, then the data section must be exactly that long.
  uint64_t need = uint64_t(h.item_bytes);
  bool zero = false;
  for (int64_t d : h.shape) {
    if (d == 0)
      zero = true;
    else if (need > uint64_t(std::numeric_limits<int64_t>::max()) / uint64_t(d))
      fail("{}: shape {} is too large", path, shape_str(h.shape));
    else
      need *= uint64_t(d);
  }
  if (zero) need = 0;
  const uint64_t have = f.size() - data_offset;
  if (have < need)
    fail("{}: truncated: shape {} of '{}' needs {} data bytes, the file has {} after the header",
         path, shape_str(h.shape), h.descr, need, have);
  if (have > need)
    fail("{}: {} unexpected bytes after the array data (shape {} of '{}' is {} bytes)", path,
         have - need, shape_str(h.shape), h.descr, need);
  return h;
}

}  // namespace

const char* npy_descr(DType t) {
  for (const auto& e : kDescrs)
    if (e.dtype == t) return e.descr.data();
  fail("dtype {} has no NumPy .npy equivalent", dtype_name(t));
}

NpyHeader read_npy_header(const std::string& path) { return read_header(InputFile(path)); }

Tensor read_npy(const std::string& path) {
  const InputFile f(path);
  const NpyHeader h = read_header(f);
  const DescrInfo* info = find_descr(h.descr);
  if (!info->dtype)
    fail(
        "{}: dtype '{}' ({}) has no fourbit tensor type (fourbit reads {}); convert it first, "
        "e.g. arr.astype(np.float32)",
        path, h.descr, info->numpy_name, supported_descrs());
  Tensor t = Tensor::empty(h.shape, *info->dtype);
  f.read_at(h.data_offset, t.raw(), size_t(t.nbytes()), "the array data");
  return t;
}

void write_npy(const std::string& path, const Tensor& t) {
  if (!t.defined()) fail("{}: cannot write an undefined tensor", path);
  if (t.dtype() == DType::BF16)
    fail("{}: bf16 has no NumPy .npy dtype; convert to f32 before writing", path);
  const Tensor host = t.device() == Device::CPU ? t : t.to(Device::CPU);
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
                                 npy_descr(t.dtype()), python_shape(t.shape()));
  // Pad with spaces so that the data starts on a 64-byte boundary; the header ends in '\n'.
  // Version 1.0 stores the header length in 2 bytes; a longer header needs version 2.0.
  int major = 1;
  size_t preamble = 10;
  size_t total = (preamble + dict.size() + 1 + 63) / 64 * 64;
  if (total - preamble > 0xFFFF) {
    major = 2;
    preamble = 12;
    total = (preamble + dict.size() + 1 + 63) / 64 * 64;
  }
  dict.append(total - preamble - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::string head(kMagic);
  head.push_back(char(major));
  head.push_back('\0');
  const uint64_t len = dict.size();
  for (size_t i = 0; i < preamble - 8; ++i) head.push_back(char((len >> (8 * i)) & 0xFF));
  head += dict;
  write_file_atomic(path, [&](FileSink& sink) {
    sink.write(head);
    sink.write(host.raw(), size_t(host.nbytes()));
  });
}

}  // namespace fourbit::io
