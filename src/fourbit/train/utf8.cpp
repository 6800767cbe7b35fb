// defines: find_invalid_utf8 (utf8.h)
#include "fourbit/train/utf8.h"

namespace fourbit::data {

Utf8Problem find_invalid_utf8(std::string_view bytes) {
  const int64_t n = int64_t(bytes.size());
  const auto at = [&](int64_t i) { return static_cast<unsigned char>(bytes[size_t(i)]); };
  int64_t i = 0;
  while (i < n) {
    const unsigned char lead = at(i);
    if (lead < 0x80) {
      ++i;
      continue;
    }
    // The length of the sequence, and the range its second byte must lie in: the narrowed ranges
    // after E0, ED, F0 and F4 are what exclude overlongs, surrogates and > U+10FFFF.
    int len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    const char* narrowed = "";
    if (lead < 0xC0) return {i, "continuation byte without a lead byte"};
    if (lead < 0xC2) return {i, "overlong encoding"};
    if (lead < 0xE0) {
      len = 2;
    } else if (lead < 0xF0) {
      len = 3;
      if (lead == 0xE0) lo = 0xA0, narrowed = "overlong encoding";
      if (lead == 0xED) hi = 0x9F, narrowed = "UTF-16 surrogate";
    } else if (lead < 0xF5) {
      len = 4;
      if (lead == 0xF0) lo = 0x90, narrowed = "overlong encoding";
      if (lead == 0xF4) hi = 0x8F, narrowed = "code point above U+10FFFF";
    } else {
      return {i, "code point above U+10FFFF"};
    }
    for (int k = 1; k < len; ++k) {
      if (i + k >= n) return {i, "truncated sequence at end of file"};
      const unsigned char c = at(i + k);
      if (c < 0x80 || c > 0xBF) return {i, "truncated sequence"};
      if (k == 1 && (c < lo || c > hi)) return {i, narrowed};
    }
    i += len;
  }
  return {};
}

}  // namespace fourbit::data
