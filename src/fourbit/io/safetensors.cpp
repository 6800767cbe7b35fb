// defines: SafetensorsFile::get/find, read_safetensors, write_safetensors, safetensors_dtype_name
// (safetensors.h)
#include "fourbit/io/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <limits>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "fourbit/io/atomic_file.h"

namespace fourbit::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is read and written as little-endian bytes");

using Json = nlohmann::ordered_json;  // keeps the header's order, used to break offset ties

constexpr std::string_view kMetadataKey = "__metadata__";

struct DTypeName {
  DType dtype;  // how the values are stored in a fourbit tensor
  std::string_view name;
};
// The first entry of each DType is the name it is written under by default; the later ones are
// dtypes fourbit keeps as raw bytes of the same size (OFP8 codes, E8M0 scales, IEEE half).
constexpr std::array<DTypeName, 13> kDTypeNames = {{
    {DType::F32, "F32"},
    {DType::F64, "F64"},
    {DType::BF16, "BF16"},
    {DType::U8, "U8"},
    {DType::I8, "I8"},
    {DType::U16, "U16"},
    {DType::I32, "I32"},
    {DType::I64, "I64"},
    {DType::U32, "U32"},
    {DType::U8, "F8_E4M3"},
    {DType::U8, "F8_E5M2"},
    {DType::U8, "F8_E8M0"},
    {DType::U16, "F16"},
}};

std::optional<DType> parse_dtype(std::string_view s) {
  for (const auto& e : kDTypeNames)
    if (e.name == s) return e.dtype;
  return std::nullopt;
}

std::string dtype_list() {
  std::string s;
  for (const auto& e : kDTypeNames) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

struct Entry {
  std::string name;
  std::string dtype_name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// Catches what JSON parsers silently resolve: a key written twice in one object.
struct DuplicateKeyWatch {
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate;
  size_t duplicate_depth = 0;

  bool operator()(int, Json::parse_event_t event, Json& parsed) {
    using E = Json::parse_event_t;
    if (event == E::object_start) {
      open_objects.emplace_back();
    } else if (event == E::object_end && !open_objects.empty()) {
      open_objects.pop_back();
    } else if (event == E::key && !open_objects.empty() && !duplicate) {
      const std::string key = parsed.get<std::string>();
      if (!open_objects.back().insert(key).second) {
        duplicate = key;
        duplicate_depth = open_objects.size();
      }
    }
    return true;  // keep every value
  }
};

uint64_t json_u64(const Json& v, const std::string& where) {
  // The parser stores every non-negative integer literal as unsigned.
  if (!v.is_number_unsigned())
    fail("{}: expected a non-negative integer, got {}", where, v.dump());
  return v.get<uint64_t>();
}

Entry parse_entry(const std::string& path, const std::string& name, const Json& v) {
  const std::string at = fmt::format("{}: tensor '{}'", path, name);
  if (!v.is_object())
    fail("{}: expected an object with dtype, shape and data_offsets, got {}", at, v.type_name());
  for (const auto& [key, _] : v.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail("{}: unexpected field '{}' (expected dtype, shape, data_offsets)", at, key);
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) fail("{}: missing field '{}'", at, key);

  Entry e;
  e.name = name;
  const Json& dt = v["dtype"];
  if (!dt.is_string()) fail("{}: dtype must be a string, got {}", at, dt.dump());
  const auto dtype = parse_dtype(dt.get<std::string>());
  if (!dtype)
    fail("{}: unknown dtype '{}' (fourbit reads {})", at, dt.get<std::string>(), dtype_list());
  e.dtype = *dtype;
  e.dtype_name = dt.get<std::string>();

  const Json& sh = v["shape"];
  if (!sh.is_array())
    fail("{}: shape must be an array of non-negative integers, got {}", at, sh.dump());
  for (size_t i = 0; i < sh.size(); ++i) {
    const uint64_t d = json_u64(sh[i], fmt::format("{}: shape[{}]", at, i));
    if (d > uint64_t(std::numeric_limits<int64_t>::max()))
      fail("{}: shape[{}] = {} is too large", at, i, d);
    e.shape.push_back(int64_t(d));
  }

  const Json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2)
    fail("{}: data_offsets must be [begin, end], got {}", at, off.dump());
  e.begin = json_u64(off[0], at + ": data_offsets[0]");
  e.end = json_u64(off[1], at + ": data_offsets[1]");
  if (e.begin > e.end) fail("{}: data_offsets [{}, {}] end before they begin", at, e.begin, e.end);

  // shape * dtype size must be exactly the byte range (computed without overflow).
  uint64_t need = uint64_t(dtype_size(e.dtype));
  bool empty = false;
  for (int64_t d : e.shape) {
    if (d == 0)
      empty = true;
    else if (need > std::numeric_limits<uint64_t>::max() / uint64_t(d))
      fail("{}: shape {} is too large", at, shape_str(e.shape));
    else
      need *= uint64_t(d);
  }
  if (empty) need = 0;
  if (e.end - e.begin != need)
    fail("{}: data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", at, e.begin, e.end,
         e.end - e.begin, shape_str(e.shape), dt.get<std::string>(), need);
  return e;
}

}  // namespace

const char* safetensors_dtype_name(DType t) {
  for (const auto& e : kDTypeNames)
    if (e.dtype == t) return e.name.data();
  fail("safetensors: no name for dtype {}", dtype_name(t));
}

const Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return &t;
  return nullptr;
}

const Tensor& SafetensorsFile::get(const std::string& name) const {
  if (const Tensor* t = find(name)) return *t;
  std::string have;
  for (size_t i = 0; i < tensors.size() && i < 12; ++i) have += (i ? ", " : "") + tensors[i].first;
  if (tensors.size() > 12) have += fmt::format(", ... ({} in all)", tensors.size());
  fail("{}: no tensor named '{}' (the file has: {})", path, name, have.empty() ? "none" : have);
}

SafetensorsFile read_safetensors(const std::string& path) {
  const InputFile f(path);
  if (f.size() < 8)
    fail("{}: file is {} bytes, too short for the 8-byte safetensors header length", path,
         f.size());
  uint8_t len_bytes[8];
  f.read_at(0, len_bytes, 8, "the header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > f.size() - 8)
    fail("{}: header length {} runs past the end of the file ({} bytes)", path, header_len,
         f.size());
  if (header_len == 0) fail("{}: header length is 0; expected a JSON object", path);
  std::string text(size_t(header_len), '\0');
  f.read_at(8, text.data(), text.size(), "the JSON header");
  // The format pads the header with spaces only. The JSON parser would stop at a NUL byte and
  // take what follows for nothing, so a damaged padding byte is caught here.
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) fail("{}: the header holds a NUL byte at offset {}", path, 8 + nul);
  const size_t close = text.find_last_of('}');
  if (close != std::string::npos && text.find_first_not_of(' ', close + 1) != std::string::npos)
    fail("{}: the header's padding after the JSON object holds bytes other than spaces", path);

  DuplicateKeyWatch watch;
  Json header;
  try {
    header = Json::parse(text, std::ref(watch));
  } catch (const Json::parse_error& e) {
    fail("{}: header is not valid JSON: {}", path, e.what());
  }
  if (watch.duplicate) {
    if (watch.duplicate_depth == 1)
      fail("{}: tensor '{}' appears twice in the header", path, *watch.duplicate);
    fail("{}: field '{}' appears twice in one header object", path, *watch.duplicate);
  }
  if (!header.is_object())
    fail("{}: header must be a JSON object, got {}", path, header.type_name());

  SafetensorsFile out;
  out.path = path;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object())
        fail("{}: __metadata__ must be an object of strings, got {}", path, value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          fail("{}: __metadata__ value of '{}' must be a string, got {}", path, mk, mv.dump());
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, key, value));
  }

  // The tensors must tile the data buffer [0, buffer_bytes) exactly: sorted by offset, each
  // non-empty one starts where the previous one ended. Empty tensors occupy no bytes.
  const uint64_t data_start = 8 + header_len;
  const uint64_t buffer_bytes = f.size() - data_start;
  for (const Entry& e : entries)
    if (e.end > buffer_bytes)
      fail("{}: tensor '{}': data_offsets [{}, {}] run past the end of the data buffer ({} bytes)",
           path, e.name, e.begin, e.end, buffer_bytes);
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const Entry* last = nullptr;
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (e.begin < covered)
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", path, e.name,
           e.begin, e.end, last->name, last->begin, last->end);
    if (e.begin > covered)
      fail("{}: bytes [{}, {}) of the data buffer belong to no tensor (a hole before tensor '{}')",
           path, covered, e.begin, e.name);
    covered = e.end;
    last = &e;
  }
  if (covered != buffer_bytes)
    fail(
        "{}: the data buffer is {} bytes but the tensors cover only the first {} ({} bytes "
        "belong to no tensor)",
        path, buffer_bytes, covered, buffer_bytes - covered);

  out.tensors.reserve(entries.size());
  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (t.nbytes() > 0)
      f.read_at(data_start + e.begin, t.raw(), size_t(t.nbytes()),
                fmt::format("tensor '{}'", e.name));
    out.tensors.emplace_back(e.name, std::move(t));
    out.dtype_names[e.name] = e.dtype_name;
  }
  return out;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       const std::map<std::string, std::string>& dtype_names) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == kMetadataKey) fail("{}: '__metadata__' is reserved and cannot name a tensor", path);
    if (!seen.insert(name).second) fail("{}: tensor '{}' is given twice", path, name);
    if (!t.defined()) fail("{}: tensor '{}' is undefined", path, name);
    host.push_back(t.device() == Device::CPU ? t : t.to(Device::CPU));
    const uint64_t bytes = uint64_t(t.nbytes());
    std::string dtype = safetensors_dtype_name(t.dtype());
    if (auto it = dtype_names.find(name); it != dtype_names.end()) {
      const auto stored = parse_dtype(it->second);
      if (!stored) fail("{}: tensor '{}': unknown dtype '{}' (fourbit writes {})", path, name, it->second, dtype_list());
      if (*stored != t.dtype())
        fail("{}: tensor '{}' is {}, but dtype {} is stored as {}", path, name, dtype_name(t.dtype()), it->second,
             dtype_name(*stored));
      dtype = it->second;
    }
    header[name] = Json{{"dtype", dtype},
                        {"shape", t.shape()},
                        {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  for (const auto& [name, _] : dtype_names)
    if (!seen.count(name)) fail("{}: a dtype is declared for tensor '{}', which is not written", path, name);
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    fail("{}: cannot encode the header (names and metadata must be UTF-8): {}", path, e.what());
  }
  // Pad with spaces so the data buffer starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t((uint64_t(text.size()) >> (8 * i)) & 0xFF);
  write_file_atomic(path, [&](FileSink& sink) {
    sink.write(len_bytes, 8);
    sink.write(text);
    for (const Tensor& t : host) sink.write(t.raw(), size_t(t.nbytes()));
  });
}

}  // namespace fourbit::io
