#!/usr/bin/env python3
# defines: the transformers interop check behind `make interop` (not part of `make test`: it needs
# torch and transformers). Two directions, each compared on a held-out text:
#  1. fourbit -> transformers: a short nvfp4-fwd run, exported with `fourbit export --format hf
#     --dtype f32`, loads into Qwen2MoeForCausalLM with no missing, unexpected or mismatched keys,
#     and its logits match `fourbit score --recipe fp32` (the run's effective weights).
#  2. transformers -> fourbit: a random qwen2_moe model created by transformers (dense first
#     layer, shared expert with a zero gate, zero q/k/v biases, untied head, non-trivial norm
#     gains), saved, imported with `fourbit import` and scored; its logits match transformers'.
# Tolerance: max |logit_fourbit - logit_transformers| <= 1e-4 * max |logit_transformers| (float32
# on both sides; the differences are summation order, RoPE angles computed in double vs float32,
# and exp/rsqrt rounding). Needs no network when torch and transformers are importable.
# usage: interop_test.py --fourbit BUILD/fourbit --work DIR [--device cpu|cuda] [--log FILE]
# (--device: where fourbit trains and scores; transformers always runs on the CPU in float32)
import argparse
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

TOL = 1e-4
HELD_OUT = "The held-out line: 41+17=58, and a cat that was never in the corpus sat on 9 mats."
CONFIG = """[model]
vocab_size = 260
d_model = 64
n_layers = 3
n_heads = 4
n_kv_heads = 2
max_seq_len = 128
n_experts = 4
top_k = 2
d_expert = 64
n_shared_experts = 1
d_shared = 64
dense_layers = 1
d_dense = 128
[train]
batch_size = 4
seq_len = 64
steps = 20
warmup_steps = 5
eval_every = 0
eval_batches = 1
log_every = 5
seed = 11
[data]
source = "synthetic"
"""

LOG = []
DEVICE = "cpu"


def log(msg):
    print(msg, flush=True)
    LOG.append(msg)


def fourbit(cli, *args):
    r = subprocess.run([cli, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"fourbit {' '.join(args)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout.strip()


def transformers_logits(model, tokens):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], dtype=torch.long))
    return out.logits[0].float().numpy()


def compare(name, ours, theirs):
    if ours.shape != theirs.shape:
        log(f"FAIL {name}: shapes {ours.shape} vs {theirs.shape}")
        return False
    diff = float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64))))
    scale = float(np.max(np.abs(theirs)))
    rel = diff / scale if scale > 0 else diff
    ok = rel <= TOL
    log(f"{'ok  ' if ok else 'FAIL'} {name}: max |diff| {diff:.3e}, max |logit| {scale:.3f}, relative {rel:.3e} "
        f"(tolerance {TOL:g}); argmax agreement {np.mean(ours.argmax(-1) == theirs.argmax(-1)):.3f}")
    return ok


def load_report(info):
    bad = {k: v for k, v in info.items() if v}
    return bad


def fourbit_to_transformers(cli, work, tokens_npy, tokens):
    run = os.path.join(work, "run")
    with open(os.path.join(work, "cfg.toml"), "w") as f:
        f.write(CONFIG)
    log(fourbit(cli, "pretrain", "--config", os.path.join(work, "cfg.toml"), "--recipe", "nvfp4-fwd", "--out", run,
                "--device", DEVICE).splitlines()[-6])
    hf = os.path.join(work, "hf_f32")
    log(fourbit(cli, "export", "--run", run, "--format", "hf", "--dtype", "f32", "--out", hf))
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True, attn_implementation="eager",
                                                       **{dtype_kw: torch.float32})
    model.eval()
    bad = load_report(info)
    log(f"{'ok  ' if not bad else 'FAIL'} transformers loads the hf export as {type(model).__name__}: "
        f"{'no missing, unexpected or mismatched keys' if not bad else bad}")
    ours_npy = os.path.join(work, "fourbit_fp32.npy")
    log(fourbit(cli, "score", "--run", run, "--recipe", "fp32", "--tokens", tokens_npy, "--out", ours_npy,
                "--device", DEVICE))
    ok = compare("fourbit run (score --recipe fp32) vs transformers on its hf f32 export", np.load(ours_npy),
                 transformers_logits(model, tokens))
    return ok and not bad


def random_qwen2_moe(path):
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
              mlp_only_layers=[0], decoder_sparse_step=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
              initializer_range=0.1, use_sliding_window=False)
    params = inspect.signature(Qwen2MoeConfig.__init__).parameters
    if "rope_parameters" in params or "rope_parameters" in getattr(Qwen2MoeConfig, "__dataclass_fields__", {}):
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        kw["rope_theta"] = 10000.0
    config = Qwen2MoeConfig(**kw)
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))  # non-trivial gains test the norm mapping
            elif name.endswith("shared_expert_gate.weight") or name.endswith("_proj.bias"):
                p.zero_()  # what fourbit can compute: a constant gate of 1/2 and no biases
            elif p.dim() >= 2 and float(p.abs().max()) == 0.0:
                p.normal_(0.0, 0.1)  # a layer the initializer leaves at zero (routers in some versions)
    model.save_pretrained(path, safe_serialization=True)
    return model


def transformers_to_fourbit(cli, work, tokens_npy, tokens):
    hf = os.path.join(work, "random_qwen2_moe")
    model = random_qwen2_moe(hf)
    files = sorted(os.listdir(hf))
    log(f"transformers saved a random qwen2_moe: {files}")
    run = os.path.join(work, "imported")
    log(fourbit(cli, "import", "--hf", hf, "--out", run, "--recipe", "fp32"))
    ours_npy = os.path.join(work, "imported.npy")
    log(fourbit(cli, "score", "--run", run, "--tokens", tokens_npy, "--out", ours_npy, "--device", DEVICE))
    return compare("random transformers qwen2_moe vs fourbit import + score", np.load(ours_npy),
                   transformers_logits(model, tokens))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fourbit", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--log")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    log(f"interop {time.strftime('%Y-%m-%d %H:%M:%S')} on {platform.node()}: python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}; fourbit on {DEVICE}")
    tokens = [257] + list(HELD_OUT.encode())  # <bos> + bytes: fourbit's byte tokenizer
    tokens_npy = os.path.join(a.work, "tokens.npy")
    np.save(tokens_npy, np.array(tokens, dtype=np.int32))
    ok1 = fourbit_to_transformers(a.fourbit, a.work, tokens_npy, tokens)
    ok2 = transformers_to_fourbit(a.fourbit, a.work, tokens_npy, tokens)
    log("interop: " + ("PASS" if ok1 and ok2 else "FAIL"))
    if a.log:
        os.makedirs(os.path.dirname(os.path.abspath(a.log)), exist_ok=True)
        with open(a.log, "w") as f:
            f.write("\n".join(LOG) + "\n")
    sys.exit(0 if ok1 and ok2 else 1)


if __name__ == "__main__":
    main()
