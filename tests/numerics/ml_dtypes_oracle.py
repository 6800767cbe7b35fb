#!/usr/bin/env python3
"""Writes the ml_dtypes oracle tables that codec_oracle_test.cpp checks fourbit against.

For each format ml_dtypes knows (float4_e2m1fn, float8_e4m3fn, float8_e5m2, float8_e8m0fnu):
  <name>_decode.bin  float32 value of every code (ml_dtypes' cast code -> float32)
  <name>_encode.bin  records of (float32 input, uint8 code) for in-range inputs: every
                     representable value, every midpoint and its float32 neighbours, and a dense
                     structured + random sample across the whole range (ml_dtypes' cast
                     float32 -> format). Out-of-range inputs are left out: ml_dtypes overflows to
                     NaN/Inf where fourbit saturates (NUMERICS.md).
"""
import os
import sys

import ml_dtypes
import numpy as np

FORMATS = {
    # name: (dtype, number of codes, signed, max finite)
    "e2m1": (ml_dtypes.float4_e2m1fn, 16, True, 6.0),
    "e4m3": (ml_dtypes.float8_e4m3fn, 256, True, 448.0),
    "e5m2": (ml_dtypes.float8_e5m2, 256, True, 57344.0),
    "ue8m0": (ml_dtypes.float8_e8m0fnu, 256, False, 2.0**127),
}


def decode_table(dt, n):
    codes = np.arange(n, dtype=np.uint8)
    return codes.view(dt).astype(np.float32)


def encode_inputs(values, signed, vmax, rng):
    finite = np.unique(np.abs(values[np.isfinite(values)]).astype(np.float64))
    finite = finite[finite > 0]
    mids = (finite[:-1] + finite[1:]) / 2  # exact in float32 for these formats
    pts = np.concatenate([finite, mids]).astype(np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(0)), np.nextafter(pts, np.float32(np.inf))])
    lo = float(finite.min())
    # structured: each binade in range, top 12 mantissa bits exhaustive, random low bits
    e_lo = int(np.floor(np.log2(lo))) - 3
    e_hi = int(np.floor(np.log2(vmax)))
    binades = []
    for e in range(max(e_lo, -149), e_hi + 1):
        if e < -126:
            continue
        top = np.arange(4096, dtype=np.uint32) << 11
        low = rng.integers(0, 2048, size=4096, dtype=np.uint32)
        bits = (np.uint32(e + 127) << 23) | top | low
        binades.append(bits.view(np.float32))
    rand = np.exp2(rng.uniform(np.log2(lo) - 4, np.log2(vmax), size=100_000)).astype(np.float32)
    sub = (rng.integers(1, 1 << 23, size=1000, dtype=np.uint32)).view(np.float32)  # f32 subnormals
    x = np.concatenate([near] + binades + [rand, sub, np.float32([0.0])])
    x = x[np.isfinite(x) & (np.abs(x) <= vmax)]
    if signed:
        x = np.concatenate([x, -x])
    else:
        # UE8M0 has no zero, so below 2^-127 is out of range. Between 2^-127 and 2^-126 the inputs
        # are float32 subnormals, which ml_dtypes rounds up to 2^-126 whatever their value (it
        # reads the unnormalised mantissa); fourbit rounds to the nearest power, and
        # codec_test.cpp checks that range on its own.
        x = x[(x == np.float32(2.0**-127)) | (x >= np.float32(2.0**-126))]
    return np.unique(x)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "oracle"
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20261130)
    for name, (dt, n, signed, vmax) in FORMATS.items():
        dec = decode_table(dt, n)
        dec.tofile(os.path.join(out, f"{name}_decode.bin"))
        x = encode_inputs(dec, signed, vmax, rng)
        codes = x.astype(dt).view(np.uint8)
        rec = np.zeros(len(x), dtype=[("x", "<f4"), ("code", "u1"), ("pad", "u1", 3)])
        rec["x"] = x
        rec["code"] = codes
        rec.tofile(os.path.join(out, f"{name}_encode.bin"))
        print(f"{name}: {n} codes decoded, {len(x)} encodes")


if __name__ == "__main__":
    main()
