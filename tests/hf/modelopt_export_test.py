#!/usr/bin/env python3
# defines: the modelopt export test (ctest hf.modelopt_export): numpy + safetensors only.
# Trains a 3-layer nvfp4-fwd run with the fourbit CLI (layer 0 dense, layer 1 MoE with NVFP4
# experts, layer 2 MoE in the MXFP8 tail), exports it twice (hf --dtype f32: fourbit's dequantized
# weights; modelopt), then decodes every quantized tensor of the modelopt export from the formats'
# published definitions (OCP MX spec / NVIDIA NVFP4: E2M1 values, E4M3 and E8M0 scales, written
# out below, not taken from fourbit) and requires them equal, bit for bit, to the hf export. Also
# checks the layout invariants serving engines rely on: gate/up weight_scale_2 equal, every
# quantized module listed in quantized_layers (and only those), block scales finite, input_scale
# finite and positive, routers and gates excluded, every other tensor BF16 and equal to the
# round-to-nearest-even BF16 of fourbit's value.
# usage: modelopt_export_test.py FOURBIT_CLI WORK_DIR
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import safetensors

CONFIG = """[model]
vocab_size = 260
d_model = 32
n_layers = 3
n_heads = 2
n_kv_heads = 1
max_seq_len = 32
n_experts = 4
top_k = 2
d_expert = 32
n_shared_experts = 1
d_shared = 32
dense_layers = 1
d_dense = 64
[train]
batch_size = 2
seq_len = 16
steps = 2
warmup_steps = 1
eval_every = 0
eval_batches = 1
log_every = 1
seed = 3
[data]
source = "synthetic"
"""

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)


def run(cli, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([cli, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"fourbit {' '.join(args)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout


def load(path):
    """name -> (dtype string, shape, raw bytes): safetensors' own parser, no framework."""
    with open(path, "rb") as f:
        return {name: (v["dtype"], tuple(v["shape"]), v["data"]) for name, v in safetensors.deserialize(f.read())}


# ---- the published definitions ------------------------------------------------------------------

# E2M1 (OCP MX v1.0 / NVFP4): sign bit 3, 2 exponent bits (bias 1), 1 mantissa bit; no Inf/NaN.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)


def e4m3(b):
    """OFP8 E4M3 ("fn"): sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F/0xFF NaN."""
    b = b.astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return (s * v).astype(np.float32)


def e8m0(b):
    """E8M0 (OCP MX scale): 2^(b - 127); 0xFF NaN."""
    b = b.astype(np.int64)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b - 127)).astype(np.float32)


def bf16_rne(x):
    """float32 -> bfloat16 bits, round to nearest even."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(entry):
    dt, shape, data = entry
    assert dt == "F32", dt
    return np.frombuffer(data, dtype=np.float32).reshape(shape)


def decode_nvfp4(t, module):
    codes = np.frombuffer(t[module + ".weight"][2], np.uint8).reshape(t[module + ".weight"][1])
    scales = np.frombuffer(t[module + ".weight_scale"][2], np.uint8).reshape(t[module + ".weight_scale"][1])
    s2 = f32(t[module + ".weight_scale_2"]).reshape(())
    q = np.empty((codes.shape[0], codes.shape[1] * 2), np.uint8)
    q[:, 0::2] = codes & 0xF  # element 2k in the low nibble
    q[:, 1::2] = codes >> 4
    block = np.repeat(e4m3(scales), 16, axis=1)
    return (E2M1[q] * block).astype(np.float32) * s2  # E2M1 x E4M3 is exact; one rounding for x S_dec


def decode_mxfp8(t, module):
    codes = np.frombuffer(t[module + ".weight"][2], np.uint8).reshape(t[module + ".weight"][1])
    scales = np.frombuffer(t[module + ".weight_scale"][2], np.uint8).reshape(t[module + ".weight_scale"][1])
    return e4m3(codes) * np.repeat(e8m0(scales), 32, axis=1)  # exact


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.astype(np.float32).view(np.uint32))


def main():
    cli, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, "cfg.toml"), "w") as f:
        f.write(CONFIG)
    rund, hfd, mod = (os.path.join(work, n) for n in ("run", "hf", "modelopt"))
    run(cli, "pretrain", "--config", os.path.join(work, "cfg.toml"), "--recipe", "nvfp4-fwd", "--out", rund,
        "--device", "cpu")
    run(cli, "export", "--run", rund, "--format", "hf", "--dtype", "f32", "--out", hfd)
    run(cli, "export", "--run", rund, "--format", "modelopt", "--out", mod)

    ref = load(os.path.join(hfd, "model.safetensors"))
    got = load(os.path.join(mod, "model.safetensors"))
    with open(os.path.join(mod, "hf_quant_config.json")) as f:
        hq = json.load(f)
    with open(os.path.join(mod, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg["quantization_config"]
    layers = hq["quantization"]["quantized_layers"]
    check(hq["quantization"]["quant_algo"] == "MIXED_PRECISION", "hf_quant_config quant_algo")
    check(qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION", "config.json quantization_config")
    check(qc["quantized_layers"] == layers, "config.json and hf_quant_config.json list different layers")

    # Which modules hold quantized tensors, and in which format.
    found = {}
    for name, (dt, shape, _) in got.items():
        m = re.fullmatch(r"(.*)\.(weight|weight_scale|weight_scale_2|input_scale)", name)
        if m and (dt in ("U8", "F8_E4M3") or m.group(2) != "weight"):
            found.setdefault(m.group(1), set()).add((m.group(2), dt))
    nvfp4 = {k for k, v in found.items() if ("weight", "U8") in v}
    mxfp8 = {k for k, v in found.items() if ("weight", "F8_E4M3") in v}
    check(set(layers) == nvfp4 | mxfp8, f"quantized_layers {sorted(set(layers) ^ (nvfp4 | mxfp8))} mismatch the tensors")
    for k in nvfp4:
        check(found[k] == {("weight", "U8"), ("weight_scale", "F8_E4M3"), ("weight_scale_2", "F32"),
                           ("input_scale", "F32")}, f"{k}: NVFP4 tensors {found[k]}")
        check(layers.get(k) == {"quant_algo": "NVFP4", "group_size": 16}, f"{k}: listed as {layers.get(k)}")
    for k in mxfp8:
        check(found[k] == {("weight", "F8_E4M3"), ("weight_scale", "U8")}, f"{k}: MXFP8 tensors {found[k]}")
        check(layers.get(k) == {"quant_algo": "MXFP8", "group_size": 32}, f"{k}: listed as {layers.get(k)}")

    # The recipe's formats: layer 1's experts and shared expert NVFP4, everything else quantized MXFP8.
    want_nvfp4 = {f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    want_nvfp4 |= {f"model.layers.1.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    check(nvfp4 == want_nvfp4, f"NVFP4 modules {sorted(nvfp4 ^ want_nvfp4)}")
    check(len(mxfp8) == 30, f"{len(mxfp8)} MXFP8 modules, expected 30")
    check("model.layers.2.mlp.experts.3.down_proj" in mxfp8 and "model.layers.0.self_attn.q_proj" in mxfp8,
          "tail experts and attention are MXFP8")
    excluded = set(hq["quantization"]["exclude_modules"])
    for l in (1, 2):
        check(f"model.layers.{l}.mlp.gate" in excluded, f"router of layer {l} not excluded")
        check(f"model.layers.{l}.mlp.shared_expert_gate" in excluded, f"shared_expert_gate of layer {l} not excluded")
    check(not (excluded & set(layers)), "a module is both quantized and excluded")

    # Bit for bit: decoded modelopt == fourbit's dequantized weights (the hf f32 export).
    for k in sorted(nvfp4):
        check(same_bits(decode_nvfp4(got, k), f32(ref[k + ".weight"])), f"{k}: NVFP4 decode differs")
        s = np.frombuffer(got[k + ".weight_scale"][2], np.uint8)
        check(not np.any((s & 0x7F) == 0x7F) and not np.any(s & 0x80), f"{k}: block scales not finite and positive")
        for n in (".weight_scale_2", ".input_scale"):
            v = f32(got[k + n]).reshape(())
            check(np.isfinite(v) and v > 0, f"{k}{n} = {v}")
    for k in sorted(mxfp8):
        check(same_bits(decode_mxfp8(got, k), f32(ref[k + ".weight"])), f"{k}: MXFP8 decode differs")
        check(not np.any(np.frombuffer(got[k + ".weight_scale"][2], np.uint8) == 0xFF), f"{k}: E8M0 NaN scale")

    # vLLM and SGLang fuse gate and up: one weight_scale_2 for both (NUMERICS: one outer-scale group).
    for k in sorted(nvfp4):
        if k.endswith(".gate_proj"):
            up = k[: -len("gate_proj")] + "up_proj"
            g, u = f32(got[k + ".weight_scale_2"]), f32(got[up + ".weight_scale_2"])
            check(np.array_equal(g, u), f"{k}: gate/up weight_scale_2 differ ({g} vs {u})")

    # Everything else: BF16, the round-to-nearest-even of fourbit's value.
    for name, (dt, shape, data) in got.items():
        mod_name = name.rsplit(".", 1)[0]
        if mod_name in layers:
            continue
        check(dt == "BF16", f"{name} is {dt}, not BF16")
        if name in ref:
            check(np.array_equal(np.frombuffer(data, np.uint16).reshape(shape), bf16_rne(f32(ref[name]))),
                  f"{name}: not the BF16 of fourbit's value")
        elif name == "lm_head.weight":
            FAILURES.append("lm_head.weight without a reference")
    check(cfg["tie_word_embeddings"] is True and "lm_head.weight" not in got,
          "the tied LM head rounds to the embedding in BF16 and is written once")

    if FAILURES:
        print(f"{len(FAILURES)} failure(s):")
        for f in FAILURES:
            print("  " + f)
        sys.exit(1)
    print(f"ok: {len(nvfp4)} NVFP4 and {len(mxfp8)} MXFP8 modules decode bit for bit to fourbit's weights")


if __name__ == "__main__":
    main()
