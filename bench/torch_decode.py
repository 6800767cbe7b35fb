#!/usr/bin/env python3
"""The PyTorch peer of bench/gpu_sampler: KV-cache decode of the same MoE transformer, bf16.

Written the way strong PyTorch decode code is written today (gpt-fast style): fused QKV and
gate/up weights, a static preallocated KV cache [B, Hkv, C, hd] per layer written in place at a
device-side position, attention over the whole cache with a position mask (static shapes), MoE
experts through torch._grouped_mm with device-side group offsets, sampling with the Gumbel-max
trick on the device, and no host sync inside the decode loop. Two variants are timed in the same
process: `eager`, and `compiled` = torch.compile(mode="reduce-overhead", fullgraph=True) of one
decode step (CUDA graphs; compiled once per batch size, warmed up before timing).

Same definitions as gpu_sampler: per batch B, B distinct random prompts of P tokens are
prefilled (one forward over B x P tokens, which samples the first new token), then decoded at
temperature 1 with no stop token until the cache of C positions is full: C - P decode steps of B
tokens each. Decode tokens/s = B * (C - P) / decode time (forwards, cache writes, draws and
log-probs of the drawn tokens, all on the device; the device is synchronised at each phase's
end). Prefill is reported apart and runs eager in both variants. Weights are random (seed 1234):
the times do not depend on their values.

Usage: python3 bench/torch_decode.py [--config configs/gpu-small.toml] [--batches 1,16,64,256]
  [--prompt 16] [--cache 512] [--device auto|cuda|cpu] [--variants eager,compiled]
  [--moe auto|grouped|gather|dense] [--compile-cpu] [--json FILE]
  python3 bench/torch_decode.py --selftest   # KV-cache decode == full forward, fp32 CPU, tiny model
"""
import argparse
import dataclasses
import functools
import json
import math
import sys
import time
import tomllib

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------
# config

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The [model] fields the forward needs; defaults are fourbit's (src/fourbit/model/config.h)."""
    vocab_size: int = 260
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 0
    max_seq_len: int = 128
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 256
    n_shared_experts: int = 0
    d_shared: int = 0
    dense_layers: int = 0
    d_dense: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def hd(self):
        return self.head_dim or self.d_model // self.n_heads

    @property
    def shared_hidden(self):
        return self.d_shared or self.d_expert

    @property
    def dense_hidden(self):
        return self.d_dense or 4 * self.d_model


# [model] fields that do not change the forward (fourbit reads them for training)
IGNORED_MODEL_FIELDS = {"aux_loss_coef", "init_std"}


def read_model_shape(path):
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        sys.exit(f"torch_decode: cannot read config {path}: {e}")
    if "model" not in cfg:
        sys.exit(f"torch_decode: {path} has no [model] table")
    fields = {f.name: f.type for f in dataclasses.fields(ModelShape)}
    kw = {}
    for key, value in cfg["model"].items():
        if key in IGNORED_MODEL_FIELDS:
            continue
        if key not in fields:
            sys.exit(f"torch_decode: {path}: unknown field model.{key}")
        want = {int: int, float: (int, float), bool: bool}[fields[key]]
        if not isinstance(value, want) or (fields[key] is not bool and isinstance(value, bool)):
            sys.exit(f"torch_decode: {path}: model.{key} must be {fields[key].__name__}, got {value!r}")
        kw[key] = value
    m = ModelShape(**kw)
    if m.head_dim == 0 and m.d_model % m.n_heads:
        sys.exit(f"torch_decode: {path}: model.d_model ({m.d_model}) must be a multiple of model.n_heads "
                 f"({m.n_heads}) unless model.head_dim is set")
    if m.n_heads % m.n_kv_heads:
        sys.exit(f"torch_decode: {path}: model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads "
                 f"({m.n_kv_heads})")
    if m.n_shared_experts not in (0, 1):
        sys.exit(f"torch_decode: {path}: model.n_shared_experts must be 0 or 1, got {m.n_shared_experts}")
    if not 1 <= m.top_k <= m.n_experts:
        sys.exit(f"torch_decode: {path}: model.top_k must be in [1, n_experts={m.n_experts}], got {m.top_k}")
    return m


# ---------------------------------------------------------------------------------------------
# weights and the KV cache

class DecodeModel(nn.Module):
    """Weights of the config's model, fused the way decode code fuses them (one QKV matrix, one
    gate/up matrix per FFN: one GEMM instead of three or two). Rows of wqkv: q heads, k heads,
    v heads; rows of every w13: gate (w1) then up (w3)."""

    def __init__(self, m: ModelShape, dtype, device, seed=1234, std=0.02):
        super().__init__()
        self.m = m
        g = torch.Generator(device=device).manual_seed(seed)  # on the device: 0.6B draws are slow on a CPU

        def param(*shape, ones=False):
            t = torch.ones(shape, device=device) if ones else torch.randn(shape, generator=g, device=device) * std
            return nn.Parameter(t.to(dtype), requires_grad=False)

        D, hd, E = m.d_model, m.hd, m.n_experts
        self.embed = param(m.vocab_size, D)
        self.lm_head = None if m.tie_embeddings else param(m.vocab_size, D)
        self.final_norm = param(D, ones=True)
        self.layers = nn.ModuleList()
        for l in range(m.n_layers):
            layer = nn.Module()
            layer.attn_norm = param(D, ones=True)
            layer.wqkv = param((m.n_heads + 2 * m.n_kv_heads) * hd, D)
            layer.wo = param(D, m.n_heads * hd)
            layer.ffn_norm = param(D, ones=True)
            layer.dense = l < m.dense_layers
            if layer.dense:
                layer.w13 = param(2 * m.dense_hidden, D)
                layer.w2 = param(D, m.dense_hidden)
            else:
                layer.router = param(E, D)
                layer.experts_w13 = param(E, 2 * m.d_expert, D)
                layer.experts_w2 = param(E, D, m.d_expert)
                layer.shared = m.n_shared_experts == 1
                if layer.shared:
                    layer.shared_w13 = param(2 * m.shared_hidden, D)
                    layer.shared_w2 = param(D, m.shared_hidden)
            self.layers.append(layer)
        inv = m.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angle = torch.arange(m.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("rope_cos", angle.cos().float().to(device), persistent=False)
        self.register_buffer("rope_sin", angle.sin().float().to(device), persistent=False)

    def setup_cache(self, B, C):
        """Allocates (zeroed) k and v caches [B, Hkv, C, hd] per layer, replacing earlier ones."""
        m = self.m
        self.register_buffer("cache_positions", torch.arange(C, device=self.embed.device), persistent=False)
        for layer in self.layers:
            for name in ("k_cache", "v_cache"):
                t = torch.zeros(B, m.n_kv_heads, C, m.hd, device=self.embed.device, dtype=self.embed.dtype)
                # CUDA graphs keep addresses: a static address lets the captured graph write the
                # cache in place instead of treating it as an input to copy in
                if hasattr(torch, "_dynamo"):
                    torch._dynamo.mark_static_address(t)
                layer.register_buffer(name, t, persistent=False)

    def kv_cache_bytes(self):
        return sum(l.k_cache.numel() * l.k_cache.element_size() * 2 for l in self.layers)


# ---------------------------------------------------------------------------------------------
# layers, plain functions over the weights

def rms_norm(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def apply_rope(x, cos, sin):
    """x [B, T, heads, hd]; cos, sin [T, hd/2]; rotate-half pairs (i, i + hd/2), in fp32."""
    h = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :h], x32[..., h:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def swiglu(x, w13, w2):
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def attention_mask(model, pos):
    """[1, 1, T * G, C] bool for the folded queries of attention_cached: row t * G + g sees the
    cache positions <= pos[t]."""
    G = model.m.n_heads // model.m.n_kv_heads
    visible = model.cache_positions[None, :] <= pos[:, None]  # [T, C]
    return visible.repeat_interleave(G, dim=0)[None, None]


def attention_cached(model, layer, x, pos, mask):
    """x [B, T, D] at positions pos [T] (a device tensor): writes k, v into the cache at pos and
    attends over the whole cache through mask (attention_mask(model, pos))."""
    m = model.m
    B, T, _ = x.shape
    H, Hkv, hd = m.n_heads, m.n_kv_heads, m.hd
    G = H // Hkv
    q, k, v = (x @ layer.wqkv.t()).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    q = apply_rope(q.view(B, T, H, hd), cos, sin)
    k = apply_rope(k.view(B, T, Hkv, hd), cos, sin)
    layer.k_cache.index_copy_(2, pos, k.transpose(1, 2))
    layer.v_cache.index_copy_(2, pos, v.view(B, T, Hkv, hd).transpose(1, 2))
    # GQA by folding: the G query heads that share a KV head become G query rows of one
    # (batch, kv-head) attention, so each cached K/V row is read once, with no repeat_interleave
    # of the cache and no reliance on enable_gqa, which the masked (efficient) SDPA kernels do not
    # all take (they would fall back to the math kernel). Query head h = kv * G + g.
    q = q.view(B, T, Hkv, G, hd).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, hd)
    o = F.scaled_dot_product_attention(q, layer.k_cache, layer.v_cache, attn_mask=mask)
    o = o.view(B, Hkv, T, G, hd).permute(0, 2, 1, 3, 4).reshape(B, T, H * hd)
    return o @ layer.wo.t()


def route(x, router, top_k):
    """Softmax router in fp32, top-k with weights renormalised to sum 1 (as fourbit)."""
    probs = F.softmax(x.float() @ router.float().t(), dim=-1)
    w, idx = probs.topk(top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), idx


# MoE experts for decode. N tokens (N = B at decode, 1..256 here) with k of E experts each.
#  grouped: sort the N * k (token, expert) rows by expert, group sizes -> device-side offsets,
#    two torch._grouped_mm calls (gate/up, down) that read each selected expert's weights once and
#    do only the k / E useful FLOPs. No host sync (offsets stay on the device), static shapes, so
#    it captures into a CUDA graph. At N = 1 it reads 2 of 16 experts; at N = 256 every expert
#    once. This is what torchtitan's MoE and recent decode stacks use; the default where it runs.
#  gather: copy each row's expert weights out (w[idx]: [N * k, 2F, D]) and bmm. Traffic is
#    three times the selected weights at N = 1 (read, write, read) and grows with N * k, not with
#    the experts touched (N = 256: 1.5 GiB of copies per layer), so it only suits tiny N.
#  dense: every expert on every token, combined with a [N, E] weight matrix that is zero off the
#    top-k: reads all E experts' weights once (like grouped at large N) but does E / k times the
#    FLOPs; the fallback at larger N where _grouped_mm does not run (it needs bf16 and, on CUDA,
#    sm80+; newer torch has a CPU fallback).
# auto: grouped where it runs for this device and dtype, else gather when N * k <= E, else dense.

def experts_grouped(x, idx, w, w13, w2):
    N, k = idx.shape
    E = w13.shape[0]
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)  # rows grouped by expert
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # static shape, unlike bincount
    offs = counts.cumsum(0, dtype=torch.int32)  # group ends
    xs = x[order // k]  # [N * k, D]
    gate, up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    ys = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)  # [N * k, D]
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(N * k, device=x.device)
    # weighted sum over each token's k rows, in a fixed order (no atomics, deterministic)
    return (ys[unsort].view(N, k, -1) * w[..., None]).sum(1)


def experts_gather(x, idx, w, w13, w2):
    N, k = idx.shape
    flat = idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)[:, None, :]  # [N * k, 1, D], row n * k + j
    gate, up = torch.bmm(xs, w13[flat].transpose(1, 2)).chunk(2, dim=-1)
    ys = torch.bmm(F.silu(gate) * up, w2[flat].transpose(1, 2))  # [N * k, 1, D]
    return (ys.view(N, k, -1) * w[..., None]).sum(1)


def experts_dense(x, idx, w, w13, w2):
    N, _ = idx.shape
    E = w13.shape[0]
    gate, up = torch.matmul(x[None], w13.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, F]
    ys = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2))  # [E, N, D]
    combine = torch.zeros(N, E, dtype=x.dtype, device=x.device).scatter_(1, idx, w)
    return torch.einsum("ne,end->nd", combine, ys)


EXPERT_IMPLS = {"grouped": experts_grouped, "gather": experts_gather, "dense": experts_dense}


@functools.cache
def grouped_mm_runs(device, dtype):
    """Whether torch._grouped_mm runs for this device and dtype (tried once on a tiny problem)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(8, 16, device=device).to(dtype)
        b = torch.randn(2, 32, 16, device=device).to(dtype)
        out = torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([3, 8], device=device, dtype=torch.int32))
        want = torch.cat([a[:3] @ b[0].t(), a[3:] @ b[1].t()])
        return bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError):
        return False


def choose_experts_impl(name, device, dtype, N, m):
    if name != "auto":
        return name
    if grouped_mm_runs(device, dtype):
        return "grouped"
    return "gather" if N * m.top_k <= m.n_experts else "dense"


def ffn(model, layer, x, experts_impl):
    """x [B, T, D] (normed) -> [B, T, D]: dense SwiGLU, or MoE (routed experts + shared expert)."""
    if layer.dense:
        return swiglu(x, layer.w13, layer.w2)
    B, T, D = x.shape
    xt = x.reshape(B * T, D)
    w, idx = route(xt, layer.router, model.m.top_k)
    out = EXPERT_IMPLS[experts_impl](xt, idx, w, layer.experts_w13, layer.experts_w2)
    if layer.shared:
        out = out + swiglu(xt, layer.shared_w13, layer.shared_w2)
    return out.view(B, T, D)


def forward_cached(model, tokens, pos, experts_impl):
    """tokens [B, T] at positions pos [T] -> logits [B, T, V] in fp32, caches written at pos."""
    m = model.m
    x = model.embed[tokens]
    mask = attention_mask(model, pos)
    for layer in model.layers:
        x = x + attention_cached(model, layer, rms_norm(x, layer.attn_norm, m.norm_eps), pos, mask)
        x = x + ffn(model, layer, rms_norm(x, layer.ffn_norm, m.norm_eps), experts_impl)
    head = model.embed if model.lm_head is None else model.lm_head
    return (rms_norm(x, model.final_norm, m.norm_eps) @ head.t()).float()


def sample(logits):
    """One draw per row at temperature 1 with the Gumbel-max trick (argmax of p / Exp(1) is a
    draw from p), on the device with no sync; returns the token [B] and its log-prob [B]."""
    logp = F.log_softmax(logits, dim=-1)
    q = torch.empty_like(logp).exponential_(1)
    token = (logp.exp() / q).argmax(dim=-1)
    return token, logp.gather(-1, token[:, None])[:, 0]


def prefill(model, prompts, experts_impl):
    """prompts [B, P] at positions 0..P-1 -> (first new token [B], its log-prob [B])."""
    pos = model.cache_positions[: prompts.shape[1]]
    return sample(forward_cached(model, prompts, pos, experts_impl)[:, -1])


def make_decode_step(model, experts_impl):
    def decode_step(token, pos):
        """token [B, 1] at position pos [1] -> (next token [B], its log-prob [B])."""
        return sample(forward_cached(model, token, pos, experts_impl)[:, -1])
    return decode_step


# ---------------------------------------------------------------------------------------------
# the reference the cached decode is checked against: the plain full forward, no cache

def forward_full_reference(model, tokens):
    """tokens [B, T] -> logits [B, T, V]: causal attention over the sequence with repeated KV
    heads, and each token's top-k experts applied one by one."""
    m = model.m
    B, T = tokens.shape
    H, Hkv, hd = m.n_heads, m.n_kv_heads, m.hd
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.embed[tokens]
    for layer in model.layers:
        h = rms_norm(x, layer.attn_norm, m.norm_eps)
        q, k, v = (h @ layer.wqkv.t()).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q = apply_rope(q.view(B, T, H, hd), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, T, Hkv, hd), cos, sin).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        v = v.view(B, T, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + o.transpose(1, 2).reshape(B, T, H * hd) @ layer.wo.t()
        h = rms_norm(x, layer.ffn_norm, m.norm_eps)
        if layer.dense:
            x = x + swiglu(h, layer.w13, layer.w2)
            continue
        ht = h.reshape(B * T, -1)
        w, idx = route(ht, layer.router, m.top_k)
        out = torch.zeros_like(ht)
        for n in range(B * T):
            for j in range(m.top_k):
                e = int(idx[n, j])
                out[n] += w[n, j] * swiglu(ht[n], layer.experts_w13[e], layer.experts_w2[e])
        if layer.shared:
            out = out + swiglu(ht, layer.shared_w13, layer.shared_w2)
        x = x + out.view(B, T, -1)
    head = model.embed if model.lm_head is None else model.lm_head
    return (rms_norm(x, model.final_norm, m.norm_eps) @ head.t()).float()


SELFTEST_SHAPE = ModelShape(vocab_size=260, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32,
                            n_experts=4, top_k=2, d_expert=32, n_shared_experts=1, d_shared=48, dense_layers=1,
                            d_dense=96)


def selftest(device, dtype, rel_tol):
    """Greedy decode with the KV cache must give the logits of a full forward over the same tokens,
    for every expert implementation that runs here. Returns the number of failures."""
    B, P, C = 3, 5, 20
    # std 0.2: activations large enough that routing and attention are far from uniform
    model = DecodeModel(SELFTEST_SHAPE, dtype, device, seed=5, std=0.2)
    prompts = torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(3)).to(device)
    impls = [n for n in EXPERT_IMPLS if n != "grouped" or grouped_mm_runs(device, dtype)]
    failures = 0
    with torch.no_grad():
        for impl in impls:
            model.setup_cache(B, C)
            step_logits = [forward_cached(model, prompts, model.cache_positions[:P], impl)[:, -1]]
            tokens = [prompts, step_logits[-1].argmax(-1, keepdim=True)]
            for p in range(P, C):
                step_logits.append(forward_cached(model, tokens[-1], model.cache_positions[p:p + 1], impl)[:, -1])
                tokens.append(step_logits[-1].argmax(-1, keepdim=True))
            seq = torch.cat(tokens[:-1], dim=1)  # [B, C]: the last token was never fed
            full = forward_full_reference(model, seq)[:, P - 1:]
            cached = torch.stack(step_logits, dim=1)
            rel = ((cached - full).abs().max() / full.abs().max()).item()
            ok = rel <= rel_tol
            failures += not ok
            print(f"selftest {impl:8s} {str(dtype):15s} {device}: max |cached - full| / max |full| = {rel:.2e} "
                  f"over {cached.shape[1]} positions x {B} sequences ({'ok' if ok else f'FAIL > {rel_tol:g}'})")
    return failures


# ---------------------------------------------------------------------------------------------
# the benchmark

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def mib(n_bytes):
    return n_bytes / 2**20


def cudagraph_skips():
    try:
        from torch._dynamo.utils import counters
        return counters["inductor"]["cudagraph_skips"]
    except (ImportError, KeyError):
        return 0


def bench_batch(model, variant, B, P, C, experts_impl, device, warmup_steps, tune):
    """Times one prefill and the C - P decode steps that fill the cache, after a warm-up."""
    decode_step = make_decode_step(model, experts_impl)
    mark_step = lambda: None  # noqa: E731
    if variant == "compiled":
        torch._dynamo.reset()  # drops the last batch size's graphs and their memory pools
        torch._inductor.config.coordinate_descent_tuning = tune
        decode_step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
        # the step's outputs live in the CUDA graph's pool and the next replay overwrites them:
        # each call starts a new step, and the loop copies the outputs out before the next call
        mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", mark_step)
    model.setup_cache(B, C)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    prompts = torch.randint(0, 256, (B, P), generator=torch.Generator().manual_seed(7 + B)).to(device)
    out_tokens = torch.zeros(B, C - P + 1, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(B, C - P + 1, dtype=torch.float32, device=device)
    # the step's inputs are two fixed tensors updated in place (as gpt-fast's input_pos += 1), not
    # views into out_tokens: a view's changing storage offset would make dynamo recompile
    token = torch.zeros(B, 1, dtype=torch.long, device=device)
    position = torch.zeros(1, dtype=torch.long, device=device)

    def decode(n_steps):
        position.fill_(P)
        for i in range(n_steps):
            mark_step()
            tok, lp = decode_step(token, position)
            out_tokens[:, i + 1], out_logprobs[:, i + 1] = tok, lp
            token.copy_(tok[:, None])
            position.add_(1)

    def prefill_into_outputs():
        tok, lp = prefill(model, prompts, experts_impl)
        out_tokens[:, 0], out_logprobs[:, 0] = tok, lp
        token.copy_(tok[:, None])

    # warm-up: a prefill and enough steps to compile, record and replay the graph; they write the
    # cache at P.., which the timed run overwrites before any query can see it
    skips_before = cudagraph_skips()
    t0 = time.perf_counter()
    prefill_into_outputs()
    decode(warmup_steps)
    sync(device)
    warmup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    prefill_into_outputs()
    sync(device)
    t1 = time.perf_counter()
    decode(C - P)
    sync(device)
    t2 = time.perf_counter()

    prefill_s, decode_s = t1 - t0, t2 - t1
    steps = C - P
    row = {"variant": variant, "batch": B, "experts_impl": experts_impl,
           "decode_tok_per_s": B * steps / decode_s, "ms_per_step": 1e3 * decode_s / steps,
           "prefill_tok_per_s": B * P / prefill_s, "kv_cache_MiB": mib(model.kv_cache_bytes()),
           "peak_MiB": mib(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None,
           "decode_steps": steps, "sampled_tokens": B * (steps + 1), "decode_s": decode_s, "prefill_s": prefill_s,
           "warmup_s": warmup_s, "mean_logprob": out_logprobs.mean().item()}
    if variant == "compiled":
        # inductor falls back to plain launches (and says so in a log line) when it cannot graph
        # a step; a count above 0 means the compiled row did not run as CUDA graphs
        row["cudagraph_skips"] = cudagraph_skips() - skips_before
    if not math.isfinite(row["mean_logprob"]):
        raise RuntimeError(f"non-finite log-probs at batch {B}: the forward produced NaN/inf")
    return row


def print_table(title, rows):
    print(title)
    cols = ["variant", "batch", "moe", "decode_tok_per_s", "ms_per_step", "prefill_tok_per_s", "kv_cache_MiB",
            "peak_MiB", "warmup_s"]
    print("  ".join(f"{c:>17s}" for c in cols))
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:>17s}  {r['batch']:>17d}  error: {r['error'].splitlines()[0][:160]}")
            continue
        vals = [r["variant"], r["batch"], r["experts_impl"], r["decode_tok_per_s"], r["ms_per_step"],
                r["prefill_tok_per_s"], r["kv_cache_MiB"], r["peak_MiB"], r["warmup_s"]]
        print("  ".join(f"{v:>17.3f}" if isinstance(v, float) else f"{'-' if v is None else v:>17}" for v in vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpu-small.toml")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--variants", default="eager,compiled")
    ap.add_argument("--moe", default="auto", choices=["auto", *EXPERT_IMPLS])
    ap.add_argument("--warmup-steps", type=int, default=4, help="decode steps before timing (>= 3 for CUDA graphs)")
    ap.add_argument("--compile-cpu", action="store_true", help="also time the compiled variant on the CPU")
    ap.add_argument("--tune", action="store_true",
                    help="inductor coordinate-descent tuning (gpt-fast sets it; slower compiles)")
    ap.add_argument("--json", default="")
    ap.add_argument("--selftest", action="store_true",
                    help="check KV-cache decode against the full forward (fp32, tiny model) and exit")
    a = ap.parse_args()

    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_decode: --device cuda: no CUDA device visible")
    if a.selftest:
        failures = selftest(device, torch.float32, 1e-5)
        if device.type == "cuda":  # the bf16 kernels the benchmark runs, against the bf16 full forward
            failures += selftest(device, torch.bfloat16, 5e-2)
        print("selftest:", "all ok" if failures == 0 else f"{failures} FAILED")
        sys.exit(1 if failures else 0)

    m = read_model_shape(a.config)
    P, C = a.prompt, a.cache
    if C > m.max_seq_len:
        print(f"cache {C} > max_seq_len {m.max_seq_len} of {a.config}: using {m.max_seq_len}")
        C = m.max_seq_len
    if not 1 <= P < C:
        sys.exit(f"torch_decode: --prompt must be in [1, cache) = [1, {C}), got {P}")
    try:
        batches = [int(b) for b in a.batches.split(",") if b]
    except ValueError:
        sys.exit(f"torch_decode: --batches must be comma-separated integers, got {a.batches!r}")
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in ("eager", "compiled"):
            sys.exit(f"torch_decode: --variants takes eager and compiled, got {v!r}")
    if device.type == "cpu" and not a.compile_cpu and "compiled" in variants:
        print("cpu: skipping the compiled variant (--compile-cpu times it)")
        variants.remove("compiled")
    if a.warmup_steps < 3 and "compiled" in variants:
        sys.exit("torch_decode: --warmup-steps must be >= 3 with the compiled variant (warm-up, record, replay)")
    if P + a.warmup_steps > C:
        sys.exit(f"torch_decode: --prompt + --warmup-steps ({P} + {a.warmup_steps}) must fit in the cache ({C})")

    started = time.perf_counter()
    dtype = torch.bfloat16
    torch.manual_seed(1234)
    model = DecodeModel(m, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    with torch.no_grad():
        for variant in variants:
            for B in batches:
                impl = choose_experts_impl(a.moe, device, dtype, B, m)
                try:
                    rows.append(bench_batch(model, variant, B, P, C, impl, device, a.warmup_steps, a.tune))
                    r = rows[-1]
                    skipped = r.get("cudagraph_skips", 0)
                    print(f"{variant} batch {B}: {r['decode_tok_per_s']:.0f} decode tokens/s "
                          f"({r['ms_per_step']:.3f} ms/step, moe {impl})"
                          + (f", cudagraphs skipped {skipped}x" if skipped else ""), flush=True)
                except Exception as e:  # a variant that fails on this torch is reported, the rest go on
                    rows.append({"variant": variant, "batch": B, "experts_impl": impl,
                                 "error": f"{type(e).__name__}: {e}"[:4000]})
                    print(f"{variant} batch {B}: error: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    title = (f"PyTorch KV-cache decode, {a.config} on {gpu} (bf16, prompt {P}, cache {C} positions, "
             f"torch {torch.__version__})")
    print_table(title, rows)
    res = {"name": title, "impl": "pytorch " + torch.__version__, "torch": torch.__version__, "gpu": gpu,
           "config": a.config, "device": device.type, "dtype": "bf16", "prompt_tokens": P, "cache_positions": C,
           "params": n_params, "moe": a.moe, "warmup_steps": a.warmup_steps, "tune": a.tune,
           "prefill": "eager in both variants", "elapsed_s": time.perf_counter() - started, "rows": rows}
    print(f"elapsed {res['elapsed_s']:.1f} s (model init, warm-ups and compiles included)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if any("error" in r for r in rows):
        sys.exit(2 if all("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
