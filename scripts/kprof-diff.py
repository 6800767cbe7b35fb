#!/usr/bin/env python3
"""Where one training step's GPU time differs from another's, kernel by kernel.

Reads two or more kprof JSON files (bench/kprof, KPROF_OUT=...; scripts/profile-step.sh writes
them), divides each kernel's total by the steps it covered (--steps: warm-up plus timed steps of
the run, 3 for profile-step.sh's defaults), and prints each file's per-step total and its largest
differences from the first file (the baseline), host-to-device copies left out (the batches'
uploads and the model's initialisation, not a step's work).

--kinds also sums the differences by kind of kernel (GEMMs, the one-pass MXFP8 quantizer by source,
the SwiGLUs, the decode passes, the NVFP4 quantizers and amax passes, requantization, the norms,
the rest), the kinds named by the kernels' names below (KINDS).

Usage: scripts/kprof-diff.py BASE.json OTHER.json [OTHER.json ...] [--steps 3] [--top 16] [--kinds]
"""
import argparse
import json
import re
import sys


# (kind, pattern) in order: a kernel takes the first kind whose pattern its name matches.
KINDS = [
    ("SwiGLU (its kernels and the one-pass quantizer's SwiGLU sources)", r"swiglu|Swiglu"),
    ("gather and combine (their kernels and quantizer sources)", r"GatherSource|CombineGradSource|gather_rows|moe_combine"),
    ("one-pass MXFP8 quantizer, plain source", r"PlainSource"),
    ("decode passes to BF16", r"decode_bf16"),
    ("GEMMs", r"tma_kernel|tma_wgrad|nvjet|xmma|cutlass|splitK|gemm"),
    ("NVFP4 quantizers and amax passes", r"quantize_tile|nvfp4_row_fast|amax"),
    ("requantization", r"requantize"),
    ("norms", r"rmsnorm"),
]


def kind_of(name):
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "the rest"


def per_step(path, steps):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"kprof-diff: cannot read {path}: {e}")
    kernels = doc.get("kernels")
    if kernels is None:
        sys.exit(f"kprof-diff: {path} has no 'kernels' (expected a KPROF_OUT file)")
    items = kernels.items() if isinstance(kernels, dict) else ((k["name"], k) for k in kernels)
    return {name: k["ms"] / steps for name, k in items if "memcpy HtoD" not in name}


def short(name, width=90):
    name = re.sub(r"fourbit::ops::cuda::", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--steps", type=float, default=3, help="steps each file covers (default 3)")
    ap.add_argument("--top", type=int, default=16, help="differences printed each way (default 16)")
    ap.add_argument("--kinds", action="store_true", help="also the differences summed by kind of kernel")
    a = ap.parse_args()
    if len(a.files) < 2:
        sys.exit("kprof-diff: give a baseline and at least one other file")
    if a.top < 0:
        sys.exit(f"kprof-diff: --top must be 0 or more, got {a.top}")
    if a.steps <= 0:
        sys.exit(f"kprof-diff: --steps must be positive, got {a.steps}")
    base = per_step(a.files[0], a.steps)
    print(f"{a.files[0]}: {sum(base.values()):.2f} GPU ms a step (baseline)")
    for path in a.files[1:]:
        other = per_step(path, a.steps)
        print(f"\n{path}: {sum(other.values()):.2f} GPU ms a step, "
              f"{sum(other.values()) - sum(base.values()):+.2f} against the baseline")
        diffs = sorted(((other.get(k, 0.0) - base.get(k, 0.0), k) for k in set(base) | set(other)), reverse=True)
        print("  more:")
        for d, k in diffs[: a.top]:
            if d > 0:
                print(f"    {d:+7.2f}  {short(k)}")
        print("  less:")
        for d, k in reversed(diffs[len(diffs) - a.top:] if a.top > 0 else []):
            if d < 0:
                print(f"    {d:+7.2f}  {short(k)}")
        if a.kinds:
            by_kind = {}
            for d, k in diffs:
                by_kind[kind_of(k)] = by_kind.get(kind_of(k), 0.0) + d
            print("  by kind:")
            for kind, d in sorted(by_kind.items(), key=lambda kv: -kv[1]):
                print(f"    {d:+7.2f}  {kind}")


if __name__ == "__main__":
    main()
