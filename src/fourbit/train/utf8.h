// defines: Utf8Problem, find_invalid_utf8
// Strict UTF-8 validation (RFC 3629): rejects stray continuation bytes, overlong encodings,
// UTF-16 surrogates (U+D800..U+DFFF), code points above U+10FFFF, and truncated sequences.
#pragma once
#include <cstdint>
#include <string_view>

namespace fourbit::data {

struct Utf8Problem {
  int64_t offset = -1;   // byte offset of the first invalid sequence; -1: the text is valid
  const char* reason = "";
  bool valid() const { return offset < 0; }
};

Utf8Problem find_invalid_utf8(std::string_view bytes);

}  // namespace fourbit::data
