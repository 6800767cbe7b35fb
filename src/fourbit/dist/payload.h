// defines: kRowHeaderBytes, kPayloadChunk, RowMeta, RowCodec, RowIndex, write_row_header, read_row_header,
//          chunk_amax, s2f6_payload_encode, s2f6_payload_decode, mxfp8_payload_encode, mxfp8_payload_decode, encode_payload_chunk,
//          decode_payload_chunk
// One row of an expert-parallel payload, as bytes: the per-row codecs that dispatch and combine
// put on the wire. Header-only FOURBIT_HD code over numerics/, so the CPU loops (codec.cpp) and the
// CUDA kernels (codec.cu) write the same bytes by construction.
//
// Row layout (docs/distributed.md "Payload rows"), every row `row_bytes()` long, 16-byte aligned:
//   [0, 4)   token  : int32, the row's token on its source rank
//   [4, 6)   expert : uint16, global expert index
//   [6]      k      : uint8, which of the token's top-k choices
//   [7]      0
//   [8, 12)  outer  : float32 S_dec of an NVFP4 row (its per-token outer scale), else 0
//   [12, 16) 0
//   [16, ..) codes (code_bytes()), then block scales (scale_bytes()), then zero padding
// F32 and BF16 rows hold the values as they are; NVFP4 and MXFP8 rows the codes and scales of a
// Row-axis QTensor row verbatim; S2F6 rows (NUMERICS "S2F6 combine payload") one int8 per value and
// one UE8M0 scale per 32, after an optional RHT-32.
#pragma once
#include <cstdint>

#include "fourbit/numerics/bf16.h"
#include "fourbit/numerics/formats.h"
#include "fourbit/numerics/hadamard.h"
#include "fourbit/numerics/mxfp8.h"
#include "fourbit/numerics/s2f6.h"

namespace fourbit::dist {

inline constexpr int kRowHeaderBytes = 16;
// Encoders and decoders work on chunks of 32 values (the S2F6 and MXFP8 block; F32 and BF16 rows
// use the same chunking so one loop shape serves every format).
inline constexpr int kPayloadChunk = 32;

struct RowMeta {
  int32_t token = 0;
  int32_t expert = 0;  // < 65536
  int32_t k = 0;       // < 256
};

// How one row of `cols` values travels. NVFP4 and MXFP8 rows are packed from QTensors (the
// forward's dispatch sends the fprop operand itself); MXFP8, S2F6, F32 and BF16 rows can also be
// encoded from float32 rows.
struct RowCodec {
  Format fmt = Format::F32;
  int64_t cols = 0;
  int hadamard = 0;  // S2F6 only: 0 or 32 (the RHT-32 of NUMERICS, signs below)
  uint32_t hadamard_signs = 0;

  FOURBIT_HD int64_t padded(int64_t block) const { return (cols + block - 1) / block * block; }
  FOURBIT_HD int64_t code_bytes() const {
    switch (fmt) {
      case Format::F32: return 4 * cols;
      case Format::BF16: return 2 * cols;
      case Format::NVFP4: return padded(16) / 2;
      case Format::MXFP8_E4M3:
      case Format::MXFP8_E5M2:
      case Format::S2F6: return padded(32);
      default: return -1;  // not a payload format (RowCodec::check says so on the host)
    }
  }
  FOURBIT_HD int64_t scale_bytes() const {
    switch (fmt) {
      case Format::NVFP4: return padded(16) / 16;
      case Format::MXFP8_E4M3:
      case Format::MXFP8_E5M2:
      case Format::S2F6: return padded(32) / 32;
      default: return 0;
    }
  }
  FOURBIT_HD int64_t row_bytes() const {
    return kRowHeaderBytes + (code_bytes() + scale_bytes() + 15) / 16 * 16;
  }
  FOURBIT_HD int64_t chunks() const { return (cols + kPayloadChunk - 1) / kPayloadChunk; }
  // Whether rows can be encoded from float32 (otherwise only packed from a QTensor).
  FOURBIT_HD bool encodes_dense() const { return fmt != Format::NVFP4; }
  FOURBIT_HD bool packs_qtensor() const {
    return fmt == Format::NVFP4 || fmt == Format::MXFP8_E4M3 || fmt == Format::MXFP8_E5M2;
  }
};

// Which row of the other side (a float32 tensor or a QTensor) payload row i belongs to: an
// explicit I32 index (the source's slot -> token gather), segments (payload rows
// [table[s], table[s + 1]) map to other rows table[nseg + 1 + s] + (i - table[s]): the expert
// side's (source, expert) <-> (expert, source) reordering), or the identity.
struct RowIndex {
  const int32_t* index = nullptr;
  const int64_t* table = nullptr;  // nseg + 1 payload offsets, then nseg other-side starts
  int nseg = 0;
  FOURBIT_HD int64_t at(int64_t i) const {
    if (index) return index[i];
    if (!table) return i;
    int lo = 0, hi = nseg;  // the last segment starting at or before i holds it (empty ones skip)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (table[mid] <= i) lo = mid;
      else hi = mid;
    }
    return table[nseg + 1 + lo] + (i - table[lo]);
  }
};

// ---- header -------------------------------------------------------------------------------------

FOURBIT_HD void store_u32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
  p[2] = uint8_t(v >> 16);
  p[3] = uint8_t(v >> 24);
}
FOURBIT_HD uint32_t load_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// Little-endian bytes whatever the host order, so a payload means the same on every machine.
FOURBIT_HD void write_row_header(uint8_t* row, RowMeta m, float outer) {
  store_u32(row + 0, uint32_t(m.token));
  store_u32(row + 4, (uint32_t(m.expert) & 0xFFFFu) | (uint32_t(m.k) & 0xFFu) << 16);
  store_u32(row + 8, num::bits_of(outer));
  store_u32(row + 12, 0u);
}
FOURBIT_HD RowMeta read_row_header(const uint8_t* row) {
  const uint32_t w1 = load_u32(row + 4);
  return RowMeta{int32_t(load_u32(row)), int32_t(w1 & 0xFFFFu), int32_t((w1 >> 16) & 0xFFu)};
}
FOURBIT_HD float read_row_outer(const uint8_t* row) { return num::float_of(load_u32(row + 8)); }

// ---- S2F6 (NUMERICS "S2F6 combine payload") -------------------------------------------------------

// max |x_i| of a 32-value chunk, and whether every value is finite (the payload encoders turn a
// chunk that is not into NaN instead of choosing a scale for it).
FOURBIT_HD bool chunk_amax(const float* x, float* amax) {
  bool finite = true;
  float a = 0.0f;
  for (int i = 0; i < 32; ++i) {
    finite = finite && num::is_finite_bits(x[i]);
    a = num::max_abs_finite(a, x[i]);
  }
  *amax = a;
  return finite;
}

// y = RHT_32(x) (when rht), E = RCEIL scale of amax|y| for the S2F6 grid (127/64 max), q_i =
// clamp(rne(y_i * 64 * 2^-(E-127)), -128, 127). x: 32 values, modified in place (the transform).
// Stated choice beyond NUMERICS: S2F6 has no NaN, so a chunk in which any value (or any rotated
// value) is not finite gets the UE8M0 NaN scale 0xFF and zero codes, and decodes to NaN: a payload
// never turns a non-finite value into a finite one, and the source's loss shows it.
FOURBIT_HD uint8_t s2f6_payload_encode(float* x, bool rht, uint32_t signs, int8_t* q) {
  if (rht) num::rht_forward<32>(x, signs);
  float amax;
  if (!chunk_amax(x, &amax)) {
    for (int i = 0; i < 32; ++i) q[i] = 0;
    return num::kUe8m0Nan;
  }
  const uint8_t scale = num::s2f6_scale(amax);
  for (int i = 0; i < 32; ++i) q[i] = num::s2f6_encode_scaled(x[i], scale);
  return scale;
}

// x_hat = RHT_32^-1(q / 64 * 2^(E-127)); the dequantization is exact, the inverse transform is the
// same float butterfly on every backend. out: 32 values.
FOURBIT_HD void s2f6_payload_decode(const int8_t* q, uint8_t scale, bool rht, uint32_t signs, float* out) {
  if (scale == num::kUe8m0Nan) {
    for (int i = 0; i < 32; ++i) out[i] = num::float_of(0x7fc00000u);
    return;
  }
  for (int i = 0; i < 32; ++i) out[i] = num::s2f6_decode_scaled(q[i], scale);
  if (rht) num::rht_inverse<32>(out, signs);
}

// ---- MXFP8 rows encoded from float32 (the backward's dY) -------------------------------------------

// The MXFP8 quantizer of NUMERICS (RCEIL scale, RNE codes): for finite blocks the codes and scale
// ops::quantize writes for a Row-axis MXFP8 spec. A block holding NaN/Inf gets the NaN scale and
// zero codes (decodes to NaN), as the S2F6 payload does.
FOURBIT_HD uint8_t mxfp8_payload_encode(const float* x, num::MiniFloatSpec elem, uint8_t* codes) {
  float amax;
  if (!chunk_amax(x, &amax)) {
    for (int i = 0; i < 32; ++i) codes[i] = 0;
    return num::kUe8m0Nan;
  }
  const uint8_t scale = num::mxfp8_scale(amax, elem, num::MxScaleRule::RCEIL);
  for (int i = 0; i < 32; ++i) codes[i] = num::mxfp8_encode(x[i], scale, elem);
  return scale;
}

// x_hat_i = elem(q_i) * 2^(E-127), exact; a NaN scale decodes to one NaN bit pattern on every
// backend (0 * NaN would carry the platform's NaN). out: 32 values.
FOURBIT_HD void mxfp8_payload_decode(const uint8_t* codes, uint8_t scale, num::MiniFloatSpec elem, float* out) {
  for (int i = 0; i < 32; ++i)
    out[i] = scale == num::kUe8m0Nan ? num::float_of(0x7fc00000u) : num::mxfp8_decode(codes[i], scale, elem);
}

FOURBIT_HD num::MiniFloatSpec mx_elem(Format f) {
  return f == Format::MXFP8_E5M2 ? num::e5m2_spec() : num::e4m3_spec();
}

// ---- one chunk of a row ---------------------------------------------------------------------------

// Encodes values [32 c, 32 c + 32) of the float32 row x (cols values; the tail reads as zeros)
// into the payload row `row`. Formats: F32, BF16, MXFP8_E4M3/E5M2, S2F6.
FOURBIT_HD void encode_payload_chunk(const RowCodec& codec, const float* x, int64_t c, uint8_t* row) {
  const int64_t base = c * kPayloadChunk;
  const int n = codec.cols - base < kPayloadChunk ? int(codec.cols - base) : kPayloadChunk;
  uint8_t* codes = row + kRowHeaderBytes;
  if (codec.fmt == Format::F32) {
    for (int i = 0; i < n; ++i) store_u32(codes + 4 * (base + i), num::bits_of(x[base + i]));
    return;
  }
  if (codec.fmt == Format::BF16) {
    for (int i = 0; i < n; ++i) {
      const uint16_t h = num::bf16_encode(x[base + i]);
      codes[2 * (base + i)] = uint8_t(h);
      codes[2 * (base + i) + 1] = uint8_t(h >> 8);
    }
    return;
  }
  float v[32];
  for (int i = 0; i < 32; ++i) v[i] = i < n ? x[base + i] : 0.0f;
  uint8_t* scales = codes + codec.code_bytes();
  if (codec.fmt == Format::S2F6) {
    scales[c] = s2f6_payload_encode(v, codec.hadamard == 32, codec.hadamard_signs,
                                    reinterpret_cast<int8_t*>(codes + base));
  } else {  // MXFP8
    scales[c] = mxfp8_payload_encode(v, mx_elem(codec.fmt), codes + base);
  }
}

// Decodes values [32 c, 32 c + 32) of the payload row into the float32 row out (cols values).
// Formats: all but NVFP4 (NVFP4 rows are unpacked into QTensors, which the GEMMs decode).
FOURBIT_HD void decode_payload_chunk(const RowCodec& codec, const uint8_t* row, int64_t c, float* out) {
  const int64_t base = c * kPayloadChunk;
  const int n = codec.cols - base < kPayloadChunk ? int(codec.cols - base) : kPayloadChunk;
  const uint8_t* codes = row + kRowHeaderBytes;
  if (codec.fmt == Format::F32) {
    for (int i = 0; i < n; ++i) out[base + i] = num::float_of(load_u32(codes + 4 * (base + i)));
    return;
  }
  if (codec.fmt == Format::BF16) {
    for (int i = 0; i < n; ++i)
      out[base + i] = num::bf16_decode(uint16_t(codes[2 * (base + i)] | codes[2 * (base + i) + 1] << 8));
    return;
  }
  const uint8_t scale = codes[codec.code_bytes() + c];
  if (codec.fmt == Format::S2F6) {
    float v[32];
    s2f6_payload_decode(reinterpret_cast<const int8_t*>(codes + base), scale, codec.hadamard == 32,
                        codec.hadamard_signs, v);
    for (int i = 0; i < n; ++i) out[base + i] = v[i];
  } else {  // MXFP8 (a padded chunk's codes are there too: code_bytes() covers whole chunks)
    float v[32];
    mxfp8_payload_decode(codes + base, scale, mx_elem(codec.fmt), v);
    for (int i = 0; i < n; ++i) out[base + i] = v[i];
  }
}

}  // namespace fourbit::dist
