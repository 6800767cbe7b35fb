// defines: crc32c, crc32c_portable, checksum_text, add_tensor_checksums, verify_tensor_checksums,
//          kChecksumPrefix
// Integrity of stored tensors. Each tensor's bytes get a CRC-32C (Castagnoli, the checksum of
// iSCSI, ext4 metadata and Snappy framing: it catches every 1-, 2- and 3-bit error and every burst
// up to 32 bits), stored as safetensors __metadata__ "checksum.NAME" = "crc32c:xxxxxxxx"; the
// other metadata entries get one too, "checksum.__metadata__" ("__metadata__" can never name a
// tensor). A reader that finds the keys recomputes them; a flipped bit in a tensor is then an
// error naming it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fourbit/io/safetensors.h"

namespace fourbit::io {

// CRC-32C of `bytes` bytes, continuing from `crc` (0 to start). Uses the SSE4.2 crc32
// instruction where the build targets it, the table otherwise; both give the same value.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
// The table-driven form (what crc32c computes on any CPU); tests compare the two.
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);

// "crc32c:" + 8 lowercase hex digits.
std::string checksum_text(uint32_t crc);

inline constexpr std::string_view kChecksumPrefix = "checksum.";

// Adds "checksum.NAME" for every tensor to `metadata` (tensors on a GPU are copied to read them)
// and "checksum.__metadata__" for the entries already there.
void add_tensor_checksums(std::map<std::string, std::string>& metadata,
                          const std::vector<std::pair<std::string, Tensor>>& tensors);

// Recomputes every tensor's checksum, and the metadata's, and compares them with the stored ones.
// With `required`, a tensor (or the metadata) without one is an error too. Errors name the file
// and the tensor.
void verify_tensor_checksums(const SafetensorsFile& f, bool required);

}  // namespace fourbit::io
