#!/usr/bin/env python3
"""The peer for bench/train_bench: the same MoE transformer in PyTorch, bf16 training step.

Reads the same TOML config (default configs/gpu-small.toml) and builds the same architecture:
tied byte embedding, L blocks of RMSNorm -> causal GQA attention with rotate-half RoPE
(scaled_dot_product_attention, flash kernel) -> RMSNorm -> MoE (linear router, softmax, top-k
with renormalised weights, SwiGLU experts, shared expert, load-balance loss; the first
dense_layers blocks use a dense SwiGLU FFN), final RMSNorm, LM head. FP32 master weights with
bf16 autocast, fused AdamW. Tokens are random bytes (the step time does not depend on them).

Usage: python3 bench/torch_reference.py [--config F] [--warmup 3] [--steps 10] [--json OUT]
[--compile] prints tokens/s and writes JSON.
"""
import argparse
import json
import math
import time
import tomllib

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.w


def rope_tables(T, hd, theta, device):
    inv = theta ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd)
    ang = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):  # x [B, H, T, hd], rotate-half pairs (i, i + hd/2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, m):
        super().__init__()
        D, self.H, self.Hkv = m["d_model"], m["n_heads"], m["n_kv_heads"]
        self.hd = m.get("head_dim", 0) or D // self.H
        self.wq = nn.Linear(D, self.H * self.hd, bias=False)
        self.wk = nn.Linear(D, self.Hkv * self.hd, bias=False)
        self.wv = nn.Linear(D, self.Hkv * self.hd, bias=False)
        self.wo = nn.Linear(self.H * self.hd, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.Hkv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.Hkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.H != self.Hkv)
        return self.wo(o.transpose(1, 2).reshape(B, T, self.H * self.hd))


class SwiGLU(nn.Module):
    def __init__(self, D, Fh):
        super().__init__()
        self.w1 = nn.Linear(D, Fh, bias=False)
        self.w3 = nn.Linear(D, Fh, bias=False)
        self.w2 = nn.Linear(Fh, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, m):
        super().__init__()
        D, self.E, self.k, Fh = m["d_model"], m["n_experts"], m["top_k"], m["d_expert"]
        self.coef = m.get("aux_loss_coef", 0.01)
        self.router = nn.Linear(D, self.E, bias=False)
        s = 0.02
        self.w1 = nn.Parameter(torch.randn(self.E, Fh, D) * s)
        self.w3 = nn.Parameter(torch.randn(self.E, Fh, D) * s)
        self.w2 = nn.Parameter(torch.randn(self.E, D, Fh) * s)
        self.shared = SwiGLU(D, m.get("d_shared", 0) or Fh) if m.get("n_shared_experts", 0) else None

    def forward(self, x):
        B, T, D = x.shape
        xt = x.reshape(-1, D)
        N = xt.shape[0]
        with torch.autocast("cuda", enabled=False):
            probs = F.softmax(self.router(xt.float()), dim=-1)
        w, idx = probs.topk(self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(xt.dtype)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.E).tolist()  # one host sync per layer, as fourbit
        tokens = order // self.k
        xs = xt[tokens]
        ys = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c:
                xe = xs[start:start + c]
                h = F.silu(xe @ self.w1[e].t().to(xe.dtype)) * (xe @ self.w3[e].t().to(xe.dtype))
                ys[start:start + c] = h @ self.w2[e].t().to(xe.dtype)
            start += c
        out = torch.zeros_like(xt)
        out.index_add_(0, tokens, ys * w.reshape(-1)[order, None])
        frac = torch.bincount(flat, minlength=self.E).float() / (N * self.k)
        aux = self.coef * self.E * (frac * probs.mean(0)).sum()
        if self.shared is not None:
            out = out + self.shared(xt)
        return out.view(B, T, D), aux


class Block(nn.Module):
    def __init__(self, m, dense):
        super().__init__()
        eps = m.get("norm_eps", 1e-5)
        self.n1, self.n2 = RMSNorm(m["d_model"], eps), RMSNorm(m["d_model"], eps)
        self.attn = Attention(m)
        self.ffn = SwiGLU(m["d_model"], m.get("d_dense", 0) or 4 * m["d_model"]) if dense else MoE(m)
        self.dense = dense

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        if self.dense:
            return x + self.ffn(self.n2(x)), x.new_zeros(())
        f, aux = self.ffn(self.n2(x))
        return x + f, aux


class Model(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.embed = nn.Embedding(m["vocab_size"], m["d_model"])
        self.blocks = nn.ModuleList(Block(m, l < m.get("dense_layers", 0)) for l in range(m["n_layers"]))
        self.norm = RMSNorm(m["d_model"], m.get("norm_eps", 1e-5))

    def forward(self, tokens, targets, cos, sin):
        x = self.embed(tokens)
        aux_total = 0.0
        for b in self.blocks:
            x, aux = b(x, cos, sin)
            aux_total = aux_total + aux
        logits = self.norm(x) @ self.embed.weight.t().to(x.dtype)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return loss + aux_total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/gpu-small.toml")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    with open(a.config, "rb") as f:
        cfg = tomllib.load(f)
    m, t = cfg["model"], cfg["train"]
    torch.manual_seed(0)
    dev = "cuda"
    model = Model(m).to(dev)
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=t.get("lr", 1e-3), betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    B, T = t["batch_size"], t["seq_len"]
    hd = m.get("head_dim", 0) or m["d_model"] // m["n_heads"]
    cos, sin = rope_tables(T, hd, m.get("rope_theta", 10000.0), dev)
    data = torch.randint(0, 256, (a.warmup + a.steps, B, T + 1), device=dev)

    def step(i):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(data[i, :, :-1], data[i, :, 1:], cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        step(a.warmup + i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    ms = times[len(times) // 2]
    res = {"impl": "pytorch " + torch.__version__ + (" compiled" if a.compile else " eager"),
           "config": a.config, "step_ms": ms, "tokens_per_s": B * T / (ms / 1e3), "steps_ms": times,
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
           "params": sum(p.numel() for p in model.parameters())}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
