// defines: the DistPayload tests: payload row layouts; the S2F6 combine codec against NUMERICS'
// formula written independently (double arithmetic), its error bound (derived below) and what
// the RHT buys on outlier channels; non-finite values travelling as NaN; MXFP8 rows equal to
// ops::quantize's; F32/BF16 rows; NVFP4/MXFP8 QTensor rows packed and unpacked verbatim; the row
// maps (gather, segments); routing metadata round trips; bad codecs refused with a message.
//
// The combine error bound. For one 32-value chunk x, y = RHT_32(x) (orthonormal), E the stored
// scale, delta = 2^(E-127) / 64 the S2F6 step. RCEIL picks the smallest E with amax|y| <= 127
// delta, so no value clips and |y_hat_i - y_i| <= delta / 2 (round to nearest). The inverse RHT is
// orthonormal too, so |x_hat - x|_2 = |y_hat - y|_2 <= sqrt(32) delta / 2 (plus float32 rounding
// of the two transforms, ~10 ulps of |x|). And E minimal means 2^(E-127) < 2 * 64 amax / 127, so
// delta / 2 < amax|y| / 127 <= |y|_2 / 127 = |x|_2 / 127: |x_hat - x|_2 < sqrt(32) / 127 |x|_2.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fourbit/dist/codec.h"
#include "test_util.h"

using namespace fourbit;
using namespace fourbit::dist;

namespace {

Tensor random_rows(int64_t rows, int64_t cols, uint64_t seed, double stddev = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> nd(0.0f, float(stddev));
  Tensor t = Tensor::empty({rows, cols}, DType::F32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(gen);
  return t;
}

Tensor meta_rows(int64_t m, uint64_t seed) {
  std::mt19937_64 gen(seed);
  Tensor t = Tensor::empty({m, 3}, DType::I32);
  for (int64_t i = 0; i < m; ++i) {
    t.data<int32_t>()[3 * i] = int32_t(gen() % 100000);
    t.data<int32_t>()[3 * i + 1] = int32_t(gen() % 65536);
    t.data<int32_t>()[3 * i + 2] = int32_t(gen() % 256);
  }
  return t;
}

RowCodec s2f6(int64_t cols, uint32_t signs, bool rht = true) {
  return RowCodec{Format::S2F6, cols, rht ? 32 : 0, rht ? signs : 0u};
}

// NUMERICS "S2F6 combine payload" in double: E = ceil(log2(amax * 64 / 127)), q = clamp(rne(y * 64
// * 2^-(E-127))). y is the float32 RHT (the butterfly is part of the contract, tested in
// tests/numerics/hadamard_test.cpp).
struct S2f6Reference {
  int scale;
  int8_t q[32];
};
S2f6Reference reference_chunk(const float* y) {
  double amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(double(y[i])));
  S2f6Reference r{127, {}};
  if (amax > 0) {
    int e = -127;
    while (e < 127 && amax * 64.0 / 127.0 > std::ldexp(1.0, e)) ++e;
    r.scale = e + 127;
  }
  for (int i = 0; i < 32; ++i) {
    const double v = std::nearbyint(double(y[i]) * 64.0 * std::ldexp(1.0, -(r.scale - 127)));
    r.q[i] = int8_t(std::clamp(v, -128.0, 127.0));
  }
  return r;
}

const uint8_t* row_codes(const Tensor& payload, const RowCodec& c, int64_t i) {
  return payload.data<uint8_t>() + i * c.row_bytes() + kRowHeaderBytes;
}

TEST(DistPayload, RowLayouts) {
  // 16-byte header, codes, scales, padded to 16 bytes (docs/distributed.md "Payload rows").
  EXPECT_EQ((RowCodec{Format::NVFP4, 1024}).row_bytes(), 16 + 512 + 64);
  EXPECT_EQ((RowCodec{Format::S2F6, 1024}).row_bytes(), 16 + 1024 + 32);
  EXPECT_EQ((RowCodec{Format::MXFP8_E4M3, 1024}).row_bytes(), 16 + 1024 + 32);
  EXPECT_EQ((RowCodec{Format::BF16, 1024}).row_bytes(), 16 + 2048);
  EXPECT_EQ((RowCodec{Format::F32, 1024}).row_bytes(), 16 + 4096);
  EXPECT_EQ((RowCodec{Format::NVFP4, 40}).row_bytes(), 16 + 32);     // 48 padded: 24 + 3 -> 32
  EXPECT_EQ((RowCodec{Format::S2F6, 40}).row_bytes(), 16 + 80);      // 64 padded: 64 + 2 -> 80
  EXPECT_EQ((RowCodec{Format::F32, 3}).row_bytes(), 16 + 16);
  // bits per value on the wire at d_model 7168 (a large MoE): NVFP4 ~4.5, S2F6 ~8.25, BF16 ~16
  EXPECT_NEAR(8.0 * (RowCodec{Format::NVFP4, 7168}).row_bytes() / 7168, 4.52, 0.01);
  EXPECT_NEAR(8.0 * (RowCodec{Format::S2F6, 7168}).row_bytes() / 7168, 8.27, 0.01);
}

TEST(DistPayload, HeaderRoundTrips) {
  uint8_t row[16];
  const RowMeta in{-5, 65535, 255};
  write_row_header(row, in, -0.0f);
  const RowMeta out = read_row_header(row);
  EXPECT_EQ(out.token, -5);
  EXPECT_EQ(out.expert, 65535);
  EXPECT_EQ(out.k, 255);
  EXPECT_EQ(std::bit_cast<uint32_t>(read_row_outer(row)), 0x80000000u);
  EXPECT_EQ(row[0], 0xFB);  // little-endian whatever the host
  EXPECT_EQ(row[7], 0);
  EXPECT_EQ(row[12] | row[13] | row[14] | row[15], 0);
}

TEST(DistPayload, S2f6CodesFollowNumerics) {
  const int64_t cols = 96;
  const uint32_t signs = num::rht_signs(3, 4, 32);
  for (bool rht : {false, true}) {
    const RowCodec c = s2f6(cols, signs, rht);
    Tensor x = random_rows(64, cols, 1);
    // rows on the scale-choice edges: amax exactly 127/64 * 2^k and just above, zeros, tiny, huge
    for (int64_t i = 0; i < cols; ++i) {
      x.data<float>()[0 * cols + i] = 0.0f;
      x.data<float>()[1 * cols + i] = i == 3 ? 127.0f / 64.0f * 8.0f : 0.25f;
      x.data<float>()[2 * cols + i] = i == 3 ? std::nextafter(127.0f / 64.0f * 8.0f, 100.0f) : -0.5f;
      x.data<float>()[3 * cols + i] *= 1e-30f;
      x.data<float>()[4 * cols + i] *= 1e30f;
    }
    const Tensor payload = encode_rows(x, RowMap(), meta_rows(64, 2), c);
    for (int64_t r = 0; r < 64; ++r)
      for (int64_t ch = 0; ch < 3; ++ch) {
        float y[32];
        std::memcpy(y, x.data<float>() + r * cols + 32 * ch, sizeof y);
        if (rht) num::rht_forward<32>(y, signs);
        const S2f6Reference ref = reference_chunk(y);
        const uint8_t* codes = row_codes(payload, c, r);
        ASSERT_EQ(codes[c.code_bytes() + ch], ref.scale) << "row " << r << " chunk " << ch << " rht " << rht;
        for (int i = 0; i < 32; ++i)
          ASSERT_EQ(int8_t(codes[32 * ch + i]), ref.q[i]) << "row " << r << " chunk " << ch << " value " << i;
      }
  }
}

TEST(DistPayload, S2f6CombineErrorWithinBound) {
  const int64_t rows = 256, cols = 1024;
  const RowCodec c = s2f6(cols, num::rht_signs(9, 1, 32));
  Tensor x = random_rows(rows, cols, 3);
  // heavy tails: every 7th chunk scaled by 100, every 11th value by 30
  for (int64_t i = 0; i < x.numel(); ++i) {
    if ((i / 32) % 7 == 0) x.data<float>()[i] *= 100.0f;
    if (i % 11 == 0) x.data<float>()[i] *= 30.0f;
  }
  const Tensor payload = encode_rows(x, RowMap(), meta_rows(rows, 4), c);
  Tensor xhat = Tensor::empty({rows, cols}, DType::F32);
  decode_rows(payload, RowMap(), c, xhat);
  double err2_total = 0, ref2_total = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ch = 0; ch < cols / 32; ++ch) {
      const float* xs = x.data<float>() + r * cols + 32 * ch;
      const float* hs = xhat.data<float>() + r * cols + 32 * ch;
      double err2 = 0, ref2 = 0;
      for (int i = 0; i < 32; ++i) {
        err2 += (double(hs[i]) - xs[i]) * (double(hs[i]) - xs[i]);
        ref2 += double(xs[i]) * xs[i];
      }
      const int e = row_codes(payload, c, r)[c.code_bytes() + ch];
      const double delta = std::ldexp(1.0, e - 127) / 64.0;
      // |x_hat - x|_2 <= sqrt(32) delta / 2 + float32 transform rounding; and < sqrt(32)/127 |x|_2
      ASSERT_LE(std::sqrt(err2), std::sqrt(32.0) * delta / 2 + 1e-6 * std::sqrt(ref2)) << "row " << r << " chunk " << ch;
      ASSERT_LT(std::sqrt(err2), std::sqrt(32.0) / 127.0 * std::sqrt(ref2) * (1 + 1e-5)) << "row " << r << " chunk " << ch;
      err2_total += err2;
      ref2_total += ref2;
    }
  // Typical error on such data: RMS delta / sqrt(12) of a flat rotated chunk, ~7 effective bits.
  const double bits = -std::log2(err2_total / ref2_total) / 2;
  EXPECT_GT(bits, 6.5);
  EXPECT_LT(bits, 9.0);  // it is an 8-bit code: a much smaller error means the codec was skipped
}

TEST(DistPayload, RhtHelpsOutlierChannels) {
  // Activations with a few outlier channels (3 of every 32 at 20x): without the RHT the chunk's
  // scale follows the outliers and the other 29 values get a coarse grid; the rotated chunk is
  // close to Gaussian with the same energy, so its amax, and the step, are several times
  // smaller. (A lone spike is not helped: without the RHT the other values flush to zero with
  // errors no larger than themselves. The bound above holds either way.)
  const int64_t rows = 64, cols = 256;
  Tensor x = random_rows(rows, cols, 5);
  for (int64_t i = 0; i < x.numel(); ++i)
    if (i % 32 == 3 || i % 32 == 17 || i % 32 == 30) x.data<float>()[i] *= 20.0f;
  auto rel_err = [&](bool rht) {
    const RowCodec c = s2f6(cols, num::rht_signs(1, 2, 32), rht);
    Tensor xhat = Tensor::empty({rows, cols}, DType::F32);
    decode_rows(encode_rows(x, RowMap(), meta_rows(rows, 6), c), RowMap(), c, xhat);
    double e = 0, n = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      e += (double(xhat.data<float>()[i]) - x.data<float>()[i]) * (double(xhat.data<float>()[i]) - x.data<float>()[i]);
      n += double(x.data<float>()[i]) * x.data<float>()[i];
    }
    return std::sqrt(e / n);
  };
  EXPECT_LT(rel_err(true), 0.6 * rel_err(false));
}

TEST(DistPayload, NonFiniteTravelsAsNan) {
  const int64_t cols = 96;
  for (Format f : {Format::S2F6, Format::MXFP8_E4M3, Format::MXFP8_E5M2}) {
    const RowCodec c{f, cols, f == Format::S2F6 ? 32 : 0, f == Format::S2F6 ? 0x1234u : 0u};
    Tensor x = random_rows(2, cols, 7);
    x.data<float>()[40] = std::numeric_limits<float>::quiet_NaN();           // row 0, chunk 1
    x.data<float>()[cols + 70] = std::numeric_limits<float>::infinity();     // row 1, chunk 2
    ops::nonfinite_seen(true);
    const Tensor payload = encode_rows(x, RowMap(), meta_rows(2, 8), c);
    EXPECT_TRUE(ops::nonfinite_seen(true)) << format_name(f);
    Tensor xhat = Tensor::empty({2, cols}, DType::F32);
    decode_rows(payload, RowMap(), c, xhat);
    for (int64_t i = 0; i < 2 * cols; ++i) {
      const bool bad_chunk = (i / 32 == 1) || (i / 32 == 5);  // row 0 chunk 1, row 1 chunk 2
      if (bad_chunk) EXPECT_TRUE(std::isnan(xhat.data<float>()[i])) << format_name(f) << " value " << i;
      else EXPECT_TRUE(std::isfinite(xhat.data<float>()[i])) << format_name(f) << " value " << i;
    }
    EXPECT_EQ(row_codes(payload, c, 0)[c.code_bytes() + 1], num::kUe8m0Nan);
  }
}

TEST(DistPayload, Mxfp8RowsEqualTheQuantizer) {
  // The dY payload is the dgrad operand: codes and scales of ops::quantize (Row axis, RCEIL, RNE).
  for (Format f : {Format::MXFP8_E4M3, Format::MXFP8_E5M2})
    for (int64_t cols : {64, 100}) {
      Tensor x = random_rows(33, cols, 9, 3.0);
      x.data<float>()[5] = 0.0f;
      QuantSpec spec;
      spec.fmt = f;
      spec.outer = OuterScale::None;
      const QTensor q = ops::quantize(x, spec);
      const RowCodec c{f, cols};
      const Tensor payload = encode_rows(x, RowMap(), meta_rows(33, 1), c);
      for (int64_t r = 0; r < 33; ++r) {
        ASSERT_EQ(std::memcmp(row_codes(payload, c, r), q.codes.data<uint8_t>() + r * q.code_row_bytes(),
                              size_t(q.code_row_bytes())), 0) << "codes, row " << r;
        ASSERT_EQ(std::memcmp(row_codes(payload, c, r) + c.code_bytes(),
                              q.block_scales.data<uint8_t>() + r * q.blocks_per_row(), size_t(q.blocks_per_row())), 0)
            << "scales, row " << r;
      }
      Tensor xhat = Tensor::empty({33, cols}, DType::F32);
      decode_rows(payload, RowMap(), c, xhat);
      const Tensor deq = ops::dequantize(q);
      EXPECT_EQ(std::memcmp(xhat.raw(), deq.raw(), size_t(deq.nbytes())), 0);
    }
}

TEST(DistPayload, DenseRowsRoundTrip) {
  Tensor x = random_rows(5, 37, 10);
  x.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  x.data<float>()[4] = -0.0f;
  Tensor out = Tensor::empty({5, 37}, DType::F32);
  const RowCodec f32{Format::F32, 37};
  decode_rows(encode_rows(x, RowMap(), meta_rows(5, 1), f32), RowMap(), f32, out);
  EXPECT_EQ(std::memcmp(out.raw(), x.raw(), size_t(x.nbytes())), 0);  // every bit, NaN and -0 too
  const RowCodec bf{Format::BF16, 37};
  decode_rows(encode_rows(x, RowMap(), meta_rows(5, 1), bf), RowMap(), bf, out);
  for (int64_t i = 0; i < x.numel(); ++i)
    EXPECT_EQ(std::bit_cast<uint32_t>(out.data<float>()[i]),
              std::bit_cast<uint32_t>(num::bf16_decode(num::bf16_encode(x.data<float>()[i]))));
}

TEST(DistPayload, QTensorRowsPackVerbatim) {
  // NVFP4 (per-token scales, Four Over Six: the dispatch operand) and MXFP8 QTensors: packing
  // rows gathered by token and unpacking them gives gather_rows' QTensor byte for byte.
  const int64_t N = 30, cols = 80;
  const Tensor x = random_rows(N, cols, 11, 2.0);
  std::vector<int32_t> idx;
  for (int64_t i = 0; i < 45; ++i) idx.push_back(int32_t((i * 7) % N));
  const Tensor index = Tensor::from_host(idx.data(), {45}, DType::I32);
  for (Format f : {Format::NVFP4, Format::MXFP8_E4M3}) {
    QuantSpec spec;
    spec.fmt = f;
    spec.outer = f == Format::NVFP4 ? OuterScale::PerRow : OuterScale::None;
    spec.four_over_six = f == Format::NVFP4;
    const QTensor q = ops::quantize(x, spec);
    const RowCodec c{f, cols};
    const Tensor meta = meta_rows(45, 12);
    const Tensor payload = pack_rows(q, RowMap::gather(index), meta, c);
    const QTensor back = unpack_rows(payload, RowMap(), c, 45);
    const QTensor want = ops::gather_rows(q, index);
    EXPECT_EQ(std::memcmp(back.codes.raw(), want.codes.raw(), size_t(want.codes.nbytes())), 0) << format_name(f);
    EXPECT_EQ(std::memcmp(back.block_scales.raw(), want.block_scales.raw(), size_t(want.block_scales.nbytes())), 0);
    if (f == Format::NVFP4) {
      EXPECT_EQ(std::memcmp(back.outer_scales.raw(), want.outer_scales.raw(), size_t(want.outer_scales.nbytes())), 0);
    }
    const Tensor a = ops::dequantize(back), b = ops::dequantize(want);
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), size_t(a.nbytes())), 0);
    EXPECT_EQ(first_meta_mismatch(read_meta(payload, RowMap(), 45), meta), -1);
  }
}

TEST(DistPayload, RowMapsPermuteAndMetadataRoundTrips) {
  // Payload rows in two segments: [0, 3) -> rows 5..7, [3, 8) -> rows 0..4 (and an empty one).
  const RowMap seg = RowMap::segments({0, 3, 3, 8}, {5, 2, 0}, Device::CPU);
  const std::vector<int64_t> want{5, 6, 7, 0, 1, 2, 3, 4};
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(seg.at_host(i), want[size_t(i)]);
  const Tensor x = random_rows(8, 32, 13);
  const Tensor meta = meta_rows(8, 14);
  const RowCodec c{Format::F32, 32};
  // encode reads x row map(i); decode writes row map(i): the round trip is the identity.
  const Tensor payload = encode_rows(x, seg, meta, c);
  Tensor back = Tensor::empty({8, 32}, DType::F32);
  decode_rows(payload, seg, c, back);
  EXPECT_EQ(std::memcmp(back.raw(), x.raw(), size_t(x.nbytes())), 0);
  // payload row 0 holds x row 5 and meta row 0; read_meta puts meta row i at map(i)
  EXPECT_EQ(std::memcmp(row_codes(payload, c, 0), x.data<float>() + 5 * 32, 128), 0);
  const Tensor m = read_meta(payload, seg, 8);
  for (int64_t i = 0; i < 8; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(m.data<int32_t>()[3 * want[size_t(i)] + j], meta.data<int32_t>()[3 * i + j]);
}

TEST(DistPayload, SlotMetaNamesEveryAssignment) {
  const std::vector<int32_t> idx{3, 1, 0, 3, 1, 2};  // 3 tokens, top-2
  const Tensor topk = Tensor::from_host(idx.data(), {3, 2}, DType::I32);
  const ops::RoutePlan plan = ops::route_plan(topk, 4);
  const Tensor meta = slot_meta(plan, topk);
  for (int64_t n = 0; n < 3; ++n)
    for (int64_t j = 0; j < 2; ++j) {
      const int32_t s = plan.slot_of.data<int32_t>()[n * 2 + j];
      EXPECT_EQ(meta.data<int32_t>()[3 * s], n);
      EXPECT_EQ(meta.data<int32_t>()[3 * s + 1], idx[size_t(n * 2 + j)]);
      EXPECT_EQ(meta.data<int32_t>()[3 * s + 2], j);
    }
  // slots are expert-sorted, so the metadata's experts never decrease
  for (int64_t s = 1; s < 6; ++s) EXPECT_LE(meta.data<int32_t>()[3 * (s - 1) + 1], meta.data<int32_t>()[3 * s + 1]);
}

TEST(DistPayload, BadCodecsFailWithAMessage) {
  using testutil::error_of;
  const Tensor x = random_rows(2, 32, 1);
  const Tensor meta = meta_rows(2, 1);
  EXPECT_NE(error_of([&] { encode_rows(x, RowMap(), meta, RowCodec{Format::S2F6, 32, 16, 0}); }).find("RHT-32 on s2f6"),
            std::string::npos);
  EXPECT_NE(error_of([&] { encode_rows(x, RowMap(), meta, RowCodec{Format::NVFP4, 32}); }).find("pack_rows"),
            std::string::npos);
  EXPECT_NE(error_of([&] { encode_rows(x, RowMap(), meta, RowCodec{Format::E4M3, 32}); }).find("cannot travel"),
            std::string::npos);
  EXPECT_NE(error_of([&] { encode_rows(x, RowMap(), meta, RowCodec{Format::F32, 16}); }).find("columns"),
            std::string::npos);
  const std::vector<int32_t> far{0, 9};
  EXPECT_NE(error_of([&] {
              encode_rows(x, RowMap::gather(Tensor::from_host(far.data(), {2}, DType::I32)), meta,
                          RowCodec{Format::F32, 32});
            }).find("maps to row 9"),
            std::string::npos);
  Tensor wrong = Tensor::empty({2, 40}, DType::U8);
  Tensor out = Tensor::empty({2, 32}, DType::F32);
  EXPECT_NE(error_of([&] { decode_rows(wrong, RowMap(), RowCodec{Format::S2F6, 32}, out); }).find("bytes"),
            std::string::npos);
}

}  // namespace
