// defines: crc32c, crc32c_portable, checksum_text, add_tensor_checksums, verify_tensor_checksums
// (checksum.h)
#include "fourbit/io/checksum.h"

#include <array>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

#include <fmt/format.h>

#include "fourbit/tensor/error.h"

namespace fourbit::io {
namespace {

// Reflected CRC-32C polynomial (0x1EDC6F41 bit-reversed).
constexpr uint32_t kPoly = 0x82F63B78u;

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

constexpr std::string_view kMetadataName = "__metadata__";

// CRC-32C of "key=value\n" for every metadata entry but the checksums, in key order.
std::string metadata_checksum(const std::map<std::string, std::string>& metadata) {
  uint32_t crc = 0;
  for (const auto& [k, v] : metadata) {
    if (k.rfind(kChecksumPrefix, 0) == 0) continue;
    const std::string line = k + "=" + v + "\n";
    crc = crc32c(line.data(), line.size(), crc);
  }
  return checksum_text(crc);
}

}  // namespace

uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < bytes; ++i) c = kTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
#if defined(__SSE4_2__)
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  while (bytes >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    bytes -= 8;
  }
  uint32_t c32 = uint32_t(c);
  while (bytes--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
#else
  return crc32c_portable(data, bytes, crc);
#endif
}

std::string checksum_text(uint32_t crc) { return fmt::format("crc32c:{:08x}", crc); }

void add_tensor_checksums(std::map<std::string, std::string>& metadata,
                          const std::vector<std::pair<std::string, Tensor>>& tensors) {
  metadata[std::string(kChecksumPrefix) + std::string(kMetadataName)] = metadata_checksum(metadata);
  for (const auto& [name, t] : tensors) {
    const Tensor host = t.device() == Device::CPU ? t : t.to(Device::CPU);
    metadata[std::string(kChecksumPrefix) + name] = checksum_text(crc32c(host.raw(), size_t(host.nbytes())));
  }
}

void verify_tensor_checksums(const SafetensorsFile& f, bool required) {
  const auto meta = f.metadata.find(std::string(kChecksumPrefix) + std::string(kMetadataName));
  if (meta != f.metadata.end()) {
    const std::string actual = metadata_checksum(f.metadata);
    if (actual != meta->second)
      fail("{}: the header's metadata fails its checksum (stored {}, the entries give {}): the file is corrupt", f.path,
           meta->second, actual);
  } else if (required) {
    fail("{}: the header's metadata has no checksum (the file was altered)", f.path);
  }
  for (const auto& [name, t] : f.tensors) {
    const auto it = f.metadata.find(std::string(kChecksumPrefix) + name);
    if (it == f.metadata.end()) {
      if (required) fail("{}: tensor '{}' has no checksum in the metadata (the file was altered)", f.path, name);
      continue;
    }
    const std::string actual = checksum_text(crc32c(t.raw(), size_t(t.nbytes())));
    if (actual != it->second)
      fail("{}: tensor '{}' fails its checksum (stored {}, the data gives {}): the file is corrupt", f.path, name,
           it->second, actual);
  }
  // A checksum whose tensor is gone: the header lost an entry.
  for (const auto& [key, value] : f.metadata)
    if (key.rfind(kChecksumPrefix, 0) == 0 && key.substr(kChecksumPrefix.size()) != kMetadataName &&
        !f.find(key.substr(kChecksumPrefix.size())))
      fail("{}: the metadata has a checksum for tensor '{}', which the file does not hold", f.path,
           key.substr(kChecksumPrefix.size()));
}

}  // namespace fourbit::io
