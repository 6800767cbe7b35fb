#!/usr/bin/env python3
"""The peer for bench/train_bench: the same MoE transformer in PyTorch, bf16 training step,
written the way a strong PyTorch user writes it today (torchtitan style).

Reads the same TOML config (default configs/gpu-small.toml) and builds the same architecture:
tied byte embedding, L blocks of RMSNorm -> causal GQA attention with rotate-half RoPE
(scaled_dot_product_attention, flash kernel) -> RMSNorm -> MoE (linear router, softmax, top-k
with renormalised weights, SwiGLU experts, shared expert, load-balance loss; the first
dense_layers blocks use a dense SwiGLU FFN), final RMSNorm, LM head. FP32 master weights with
bf16 autocast, fused AdamW. Tokens are random bytes (the step time does not depend on them).

Experts (--experts):
  grouped  the (token, expert) rows sorted by expert, group ends computed on the device, and two
           torch._grouped_mm calls (gate|up, down) over all experts: no host sync anywhere in the
           step, static shapes, so torch.compile captures it whole and CUDA graphs can replay it.
  loop     one GEMM per expert in a Python loop after reading the router counts back to the host
           (a sync per layer): what this file did before, kept as the reference of --selftest.
Modes (--mode): eager; compile (torch.compile); graphs (the compiled model, and the whole step,
forward + backward + clipping + fused AdamW with capturable=True, captured once in one CUDA graph
with torch.cuda.graph and replayed: no host work per step at all; the grouped experts' static
shapes and device-side group ends are what make the capture possible).

Usage: python3 bench/torch_reference.py [--config F] [--mode eager|compile|graphs]
           [--experts grouped|loop] [--warmup 3] [--steps 10] [--json OUT]
       python3 bench/torch_reference.py --selftest [--device cpu|cuda]
--selftest: on a small config, grouped and loop give the same loss and gradients (fp32 where
_grouped_mm runs in fp32, else bf16 with a bf16 tolerance), and on CUDA the grouped step under bf16
autocast runs with torch.cuda.set_sync_debug_mode("error") (a host sync would raise). Not in fp32:
on CUDA, torch 2.11's fp32 _grouped_mm is a fallback that reads the offsets on the host.
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
    def __init__(self, m, experts="grouped"):
        super().__init__()
        D, self.E, self.k, Fh = m["d_model"], m["n_experts"], m["top_k"], m["d_expert"]
        self.coef = m.get("aux_loss_coef", 0.01)
        self.experts = experts
        self.router = nn.Linear(D, self.E, bias=False)
        s = 0.02
        self.w13 = nn.Parameter(torch.randn(self.E, 2 * Fh, D) * s)  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.randn(self.E, D, Fh) * s)
        self.shared = SwiGLU(D, m.get("d_shared", 0) or Fh) if m.get("n_shared_experts", 0) else None

    def forward(self, x):
        B, T, D = x.shape
        xt = x.reshape(-1, D)
        N = xt.shape[0]
        with torch.autocast(xt.device.type, enabled=False):
            probs = F.softmax(self.router(xt.float()), dim=-1)
        w, idx = probs.topk(self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(xt.dtype)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # rows grouped by expert
        # per-expert counts with a static shape (bincount's depends on the data)
        counts = torch.zeros(self.E, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        xs = xt[order // self.k]
        if self.experts == "grouped":
            ys = grouped_swiglu(xs, counts, self.w13, self.w2)
        else:
            ys = loop_swiglu(xs, counts, self.w13, self.w2)
        out = torch.zeros_like(xt)
        out.index_add_(0, order // self.k, ys * w.reshape(-1)[order, None])
        frac = counts.float() / (N * self.k)
        aux = self.coef * self.E * (frac * probs.mean(0)).sum()
        if self.shared is not None:
            out = out + self.shared(xt)
        return out.view(B, T, D), aux


def compute_dtype(x):
    """The dtype autocast would give a matmul of x (torch._grouped_mm is not on autocast's lists)."""
    t = x.device.type
    return torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else x.dtype


def grouped_swiglu(xs, counts, w13, w2):
    """Rows xs [R, D] sorted by expert, counts [E] on the device: SwiGLU of each row by its expert."""
    dt = compute_dtype(xs)
    xs = xs.to(dt)
    offs = counts.cumsum(0, dtype=torch.int32)  # group ends, on the device
    h = torch._grouped_mm(xs, w13.to(dt).transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.to(dt).transpose(-2, -1), offs=offs)


def loop_swiglu(xs, counts, w13, w2):
    dt = compute_dtype(xs)
    xs = xs.to(dt)
    ys = torch.empty(xs.shape[0], w2.shape[1], dtype=dt, device=xs.device)
    start = 0
    for e, c in enumerate(counts.tolist()):  # a host sync per layer
        if c:
            gate, up = (xs[start:start + c] @ w13[e].t().to(dt)).chunk(2, dim=-1)
            ys[start:start + c] = (F.silu(gate) * up) @ w2[e].t().to(dt)
        start += c
    return ys


class Block(nn.Module):
    def __init__(self, m, dense, experts):
        super().__init__()
        eps = m.get("norm_eps", 1e-5)
        self.n1, self.n2 = RMSNorm(m["d_model"], eps), RMSNorm(m["d_model"], eps)
        self.attn = Attention(m)
        self.ffn = SwiGLU(m["d_model"], m.get("d_dense", 0) or 4 * m["d_model"]) if dense else MoE(m, experts)
        self.dense = dense

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        if self.dense:
            return x + self.ffn(self.n2(x)), x.new_zeros(())
        f, aux = self.ffn(self.n2(x))
        return x + f, aux


class Model(nn.Module):
    def __init__(self, m, experts="grouped"):
        super().__init__()
        self.m = m
        self.embed = nn.Embedding(m["vocab_size"], m["d_model"])
        nn.init.normal_(self.embed.weight, std=0.02)  # tied with the LM head: N(0, 1) would give huge logits
        self.blocks = nn.ModuleList(Block(m, l < m.get("dense_layers", 0), experts) for l in range(m["n_layers"]))
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


def make_step(model, opt, cos, sin, device):
    def step(tokens, targets):
        opt.zero_grad(set_to_none=False)  # gradients keep their buffers (a CUDA graph replays into them)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tokens, targets, cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        return loss
    return step


def graphed_step(step, shape, device, warmup_batches):
    """The whole step captured in one CUDA graph: warm-up steps on a side stream (compilation,
    gradient buffers, optimizer state, cuBLAS workspaces), then one capture; each call copies its
    batch into the static inputs and replays."""
    tokens = torch.zeros(shape, dtype=torch.long, device=device)
    targets = torch.zeros(shape, dtype=torch.long, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in warmup_batches:
            tokens.copy_(x)
            targets.copy_(y)
            step(tokens, targets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(tokens, targets)

    def run(x, y):
        tokens.copy_(x)
        targets.copy_(y)
        graph.replay()
        return loss
    return run


def selftest(device):
    """grouped == loop (loss and every gradient) on a small config, in fp32 and under bf16
    autocast (the benchmark's setting); on CUDA the grouped step must not sync with the host."""
    m = {"vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "n_experts": 4,
         "top_k": 2, "d_expert": 32, "n_shared_experts": 1, "d_shared": 32, "dense_layers": 1, "d_dense": 128,
         "rope_theta": 10000.0, "aux_loss_coef": 0.01}
    B, T = 2, 16
    ok = True
    for label, autocast, tol in (("fp32", None, 1e-5), ("bf16 autocast", torch.bfloat16, 3e-2)):
        dt = autocast or torch.float32
        try:
            torch._grouped_mm(torch.randn(4, 8, device=device, dtype=dt), torch.randn(2, 8, 8, device=device, dtype=dt),
                              offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
        except (RuntimeError, NotImplementedError) as e:
            print(f"selftest {label}: _grouped_mm does not run in {dt} on {device} "
                  f"({str(e).splitlines()[0][:80]}); skipped")
            continue
        torch.manual_seed(1)
        ref = Model(m, "loop").to(device)
        grp = Model(m, "grouped").to(device)
        grp.load_state_dict(ref.state_dict())
        cos, sin = rope_tables(T, m["d_model"] // m["n_heads"], m["rope_theta"], device)
        data = torch.randint(0, 256, (B, T + 1), device=device)
        losses = []
        for model in (ref, grp):
            sync = device == "cuda" and model is grp and autocast is not None
            if sync:
                torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast(device, dtype=dt, enabled=autocast is not None):
                    loss = model(data[:, :-1], data[:, 1:], cos, sin)
                loss.backward()
            finally:
                if sync:
                    torch.cuda.set_sync_debug_mode("default")
            losses.append(loss.detach().float().item())
        worst = ("loss", abs(losses[0] - losses[1]) / max(abs(losses[0]), 1e-12))
        for (name, a), (_, b) in zip(ref.named_parameters(), grp.named_parameters()):
            ga, gb = a.grad.float(), b.grad.float()
            err = ((ga - gb).norm() / ga.norm().clamp_min(1e-30)).item()
            if err > worst[1]:
                worst = (name, err)
        good = worst[1] <= tol
        ok &= good
        print(f"selftest {label} on {device}: loss {losses[0]:.6f} (loop) vs {losses[1]:.6f} (grouped); "
              f"worst relative difference {worst[1]:.2e} ({worst[0]}), tolerance {tol:g}: "
              f"{'ok' if good else 'FAIL'}" +
              (", no host sync in the grouped step" if device == "cuda" and autocast is not None else ""))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/gpu-small.toml")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--mode", choices=["eager", "compile", "graphs"], default="eager")
    ap.add_argument("--compile", action="store_true", help="the same as --mode compile")
    ap.add_argument("--experts", choices=["grouped", "loop"], default="grouped")
    ap.add_argument("--json", default="")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    if a.selftest:
        raise SystemExit(0 if selftest(a.device) else 1)
    if a.compile:
        a.mode = "compile"
    with open(a.config, "rb") as f:
        cfg = tomllib.load(f)
    m, t = cfg["model"], cfg["train"]
    torch.manual_seed(0)
    dev = a.device
    cuda = dev == "cuda"
    if a.mode == "graphs" and not cuda:
        raise SystemExit("--mode graphs: CUDA graphs need --device cuda")
    model = Model(m, a.experts).to(dev)
    if a.mode == "graphs" and a.experts != "grouped":
        raise SystemExit("--mode graphs needs --experts grouped (the loop reads counts on the host)")
    # capturable: the optimizer's step count stays on the GPU, so its step can be captured
    opt = torch.optim.AdamW(model.parameters(), lr=t.get("lr", 1e-3), betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True, capturable=a.mode == "graphs")
    if a.mode != "eager":
        # fullgraph for grouped experts: a graph break (a host sync, a data-dependent shape) fails
        # instead of hiding; the loop's count read-back is one by design
        model = torch.compile(model, fullgraph=a.experts == "grouped")
    B, T = t["batch_size"], t["seq_len"]
    hd = m.get("head_dim", 0) or m["d_model"] // m["n_heads"]
    cos, sin = rope_tables(T, hd, m.get("rope_theta", 10000.0), dev)
    data = torch.randint(0, 256, (a.warmup + a.steps, B, T + 1), device=dev)
    step = make_step(model, opt, cos, sin, dev)
    warm = [(data[i, :, :-1], data[i, :, 1:]) for i in range(a.warmup)]
    if a.mode == "graphs":  # the warm-up steps run before the capture
        step = graphed_step(step, (B, T), dev, warm)
        warm = warm[:1]

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for x, y in warm:
        step(x, y)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        step(data[a.warmup + i, :, :-1], data[a.warmup + i, :, 1:])
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    ms = times[len(times) // 2]
    flops = 6 * active_params(m) * B * T + attention_flops(m, B, T)
    res = {"impl": f"pytorch {torch.__version__} {a.mode}, {a.experts} experts",
           "config": a.config, "mode": a.mode, "experts": a.experts, "step_ms": ms,
           "tokens_per_s": B * T / (ms / 1e3), "steps_ms": times,
           "model_tflops_per_s": flops / (ms / 1e3) / 1e12,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
           "params": sum(p.numel() for p in model.parameters())}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def active_params(m):
    """Weights a token multiplies through (the routed experts it picks, not all of them), LM head included."""
    D, L = m["d_model"], m["n_layers"]
    hd = m.get("head_dim", 0) or D // m["n_heads"]
    attn = D * hd * (2 * m["n_heads"] + 2 * m["n_kv_heads"])
    dense = 3 * D * (m.get("d_dense", 0) or 4 * D)
    moe = 3 * D * m["d_expert"] * m["top_k"] + D * m["n_experts"]
    if m.get("n_shared_experts", 0):
        moe += 3 * D * (m.get("d_shared", 0) or m["d_expert"])
    nd = m.get("dense_layers", 0)
    return L * attn + nd * dense + (L - nd) * moe + D * m["vocab_size"]


def attention_flops(m, B, T):
    """Causal attention's QK^T and PV, forward and backward (x3), half the T^2 square."""
    D, L = m["d_model"], m["n_layers"]
    hd = m.get("head_dim", 0) or D // m["n_heads"]
    return 3 * L * 2 * 2 * B * m["n_heads"] * hd * T * T // 2


if __name__ == "__main__":
    main()
