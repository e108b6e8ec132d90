"""workloads.py: held-out workloads, recorded to check the policies on jobs they were not tuned on.

Issue 5 asks that defrag's figures hold "on workloads the policy was not tuned on: any training or
inference trace". The shared traces (gpt2_train_varlen, resnet50_train, mlp_two_streams) and the
end-to-end workloads (bench/e2e/workloads.py) are what the policies were developed against; the
workloads here are kinds of job none of those is: inference with caches that grow, serving,
mixture-of-experts routing, a diffusion U-Net at several resolutions, activation checkpointing
with gradient accumulation, a recurrent network, and graphs compiled by torch.compile (with and
without CUDA graphs). They were written and recorded once, before any policy was replayed on
them, and no setting is chosen by looking at them: they are a check, not a target
(bench/validation/README.md).

Each workload is ``build(device, seed, scale) -> Workload``, as in bench/e2e/workloads.py: a
``step(i)`` callable (one training step, or for the inference workloads one request) and a
description. Everything random is seeded. ``scale="tiny"`` shrinks every model so that the code
runs on a CPU in seconds (tools/tests); torch.compile then uses the "eager" backend, since the
point there is only that the Python runs.

  llm_generate   inference: a 12-layer decoder generates for requests of random batch size,
                 prompt and answer length; its key/value caches grow by torch.cat at every token
  llm_serve      inference: batches of requests, each with a key/value cache allocated whole for
                 its longest sequence and written in place, prefill then decode
  moe_train      training: a mixture-of-experts transformer, top-2 routing over 8 experts, so the
                 experts' inputs change size at every step with the routing
  unet_train     training: a diffusion-style U-Net, batch and resolution (128-256) random per step
  vit_ckpt       training: a ViT-B/16 with activation checkpointing per block and 1-4 micro-batches
                 of random size accumulated per optimizer step
  lstm_lm        training: a 2-layer LSTM language model, batch and sequence length random
  compiled_gpt   training: a GPT-2-small compiled by torch.compile (inductor, dynamic shapes),
                 sequence length from five buckets per step
  cudagraph_mlp  training: an MLP compiled with mode="reduce-overhead" (CUDA graph trees), fixed
                 shapes, so most steps replay graphs from a private memory pool

Added in session 28, written before any policy was replayed on them, because the set above has no
job with more than one stream (the policies' only multi-stream evidence was the e2e pipeline and the
shared mlp_two_streams trace, both developed against):

  offload_train  training: activations offloaded to pinned host memory on a copy stream in forward
                 and copied back on it in backward (record_stream both ways)
  comm_overlap   training: gradients reduced bucket by bucket on a communication stream while
                 backward runs (cat + scale for an all-reduce), copied back on the main stream
  stream_weights inference: weights kept in pinned host memory, each layer's copied in on a copy
                 stream while the layer before it computes
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

WORKLOADS = ("llm_generate", "llm_serve", "moe_train", "unet_train", "vit_ckpt", "lstm_lm", "compiled_gpt",
             "cudagraph_mlp", "offload_train", "comm_overlap", "stream_weights")

# steps (requests, for the inference workloads) recorded per workload
DEFAULT_STEPS = {"llm_generate": 8, "llm_serve": 6, "moe_train": 24, "unet_train": 20, "vit_ckpt": 12,
                 "lstm_lm": 24, "compiled_gpt": 16, "cudagraph_mlp": 24,
                 "offload_train": 16, "comm_overlap": 16, "stream_weights": 12}


@dataclass
class Workload:
    name: str
    description: str
    step: Callable[[int], None]


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _compile(module: nn.Module, device: torch.device, **kwargs):
    if device.type != "cuda":  # tiny CPU runs check the Python only (module docstring)
        return torch.compile(module, backend="eager", **{k: v for k, v in kwargs.items() if k == "dynamic"})
    return torch.compile(module, **kwargs)


# ---- a decoder with key/value caches ---------------------------------------------------------

class _DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_DecoderLayer(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x[:, -1:]))


def build_llm_generate(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, d, layers, heads, batches, prompts, answers = 256, 32, 2, 4, (1, 3), (4, 16), (2, 6)
    else:
        vocab, d, layers, heads, batches, prompts, answers = 32000, 2048, 12, 16, (1, 16), (32, 1024), (16, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _Decoder(vocab, d, layers, heads).to(device=device, dtype=dtype).eval()
    rng = random.Random(seed)

    @torch.inference_mode()
    def step(_i: int) -> None:
        b, p, n = rng.randint(*batches), rng.randint(*prompts), rng.randint(*answers)
        tokens = torch.randint(0, vocab, (b, p), device=device)
        caches: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * layers
        for t in range(n):
            x = model.embed(tokens)
            for j, layer in enumerate(model.layers):
                q, k, v = layer.qkv_heads(x)
                cache = caches[j]
                if cache is not None:  # the cache grows by one token: a new tensor every time
                    k = torch.cat([cache[0], k], dim=2)
                    v = torch.cat([cache[1], v], dim=2)
                caches[j] = (k, v)
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
                x = layer.finish(x, attn)
            tokens = model.logits(x).argmax(dim=-1)  # greedy; the next step feeds only the new token
            del x
        del caches

    params = sum(p.numel() for p in model.parameters())
    return Workload("llm_generate", f"decoder {layers} layers d={d} ({params / 1e6:.0f}M params, bf16) generating: "
                    f"batch {batches[0]}-{batches[1]}, prompt {prompts[0]}-{prompts[1]}, answer {answers[0]}-"
                    f"{answers[1]} tokens per request, key/value caches grown by torch.cat", step)


def build_llm_serve(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, d, layers, heads, batches, prompts, answers = 256, 32, 2, 4, (1, 4), (4, 16), (2, 6)
    else:
        vocab, d, layers, heads, batches, prompts, answers = 32000, 2048, 12, 16, (4, 48), (64, 1536), (32, 96)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _Decoder(vocab, d, layers, heads).to(device=device, dtype=dtype).eval()
    hd = d // heads
    rng = random.Random(seed)

    @torch.inference_mode()
    def step(_i: int) -> None:
        b, n = rng.randint(*batches), rng.randint(*answers)
        p = max(rng.randint(*prompts) for _ in range(b))  # the batch is padded to its longest prompt
        total = p + n
        # one cache per layer for the whole batch, allocated once at its final length
        kc = [torch.empty(b, heads, total, hd, device=device, dtype=dtype) for _ in range(layers)]
        vc = [torch.empty(b, heads, total, hd, device=device, dtype=dtype) for _ in range(layers)]
        tokens = torch.randint(0, vocab, (b, p), device=device)
        pos = 0
        for _ in range(n):
            x = model.embed(tokens)
            t = x.shape[1]
            for j, layer in enumerate(model.layers):
                q, k, v = layer.qkv_heads(x)
                kc[j][:, :, pos:pos + t].copy_(k)
                vc[j][:, :, pos:pos + t].copy_(v)
                attn = F.scaled_dot_product_attention(q, kc[j][:, :, :pos + t], vc[j][:, :, :pos + t],
                                                      is_causal=pos == 0)
                x = layer.finish(x, attn)
            pos += t
            tokens = model.logits(x).argmax(dim=-1)
            del x
        del kc, vc

    params = sum(p.numel() for p in model.parameters())
    return Workload("llm_serve", f"decoder {layers} layers d={d} ({params / 1e6:.0f}M params, bf16) serving batches "
                    f"of {batches[0]}-{batches[1]} requests padded to the longest prompt ({prompts[0]}-{prompts[1]}), "
                    f"{answers[0]}-{answers[1]} tokens each; per batch one key/value cache per layer allocated at "
                    "full length and written in place", step)


# ---- mixture of experts ----------------------------------------------------------------------

class _MoE(nn.Module):
    def __init__(self, d: int, ffn: int, experts: int, top: int) -> None:
        super().__init__()
        self.top = top
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, ffn) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(experts, ffn, d) / math.sqrt(ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(x).float(), dim=-1), self.top, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)  # data-dependent size
            if rows.numel() == 0:
                continue
            h = F.gelu(x[rows] @ self.w1[e]) @ self.w2[e]
            out.index_add_(0, rows, (h * weights[rows, slot, None]).to(out.dtype))
        return out.view(shape)


class _MoEBlock(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.moe = _MoE(d, ffn, experts, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.norm2(x))


def build_moe_train(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, d, heads, ffn, experts, layers, batches, lengths = 256, 32, 4, 64, 4, 2, (1, 4), (8, 32)
    else:
        vocab, d, heads, ffn, experts, layers, batches, lengths = 32000, 1024, 16, 2816, 8, 6, (4, 16), (256, 1024)
    embed = nn.Embedding(vocab, d)
    blocks = nn.ModuleList(_MoEBlock(d, heads, ffn, experts) for _ in range(layers))
    head = nn.Linear(d, vocab, bias=False)
    model = nn.ModuleDict({"embed": embed, "blocks": blocks, "head": head}).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(seed)

    def step(_i: int) -> None:
        b, t = rng.randint(*batches), rng.randint(*lengths)
        idx = torch.randint(0, vocab, (b, t + 1), device=device)
        with _autocast(device):
            x = embed(idx[:, :-1])
            for blk in blocks:
                x = blk(x)
            loss = F.cross_entropy(head(x).float().view(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return Workload("moe_train", f"mixture-of-experts transformer, {layers} layers d={d}, {experts} experts top-2 "
                    f"({params / 1e6:.0f}M params), batch {batches[0]}-{batches[1]} x seq {lengths[0]}-{lengths[1]} "
                    "random, AdamW, bf16 autocast; expert inputs sized by the routing", step)


# ---- diffusion-style U-Net -------------------------------------------------------------------

class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.n1 = nn.GroupNorm(32 if cin % 32 == 0 else 1, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.n2 = nn.GroupNorm(32 if cout % 32 == 0 else 1, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x)))
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class _UNet(nn.Module):
    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, widths[0], 3, padding=1)
        self.down = nn.ModuleList()
        cin = widths[0]
        for w in widths:
            self.down.append(nn.ModuleList([_ResBlock(cin, w), _ResBlock(w, w)]))
            cin = w
        self.mid = _ResBlock(cin, cin)
        self.mid_attn = nn.MultiheadAttention(cin, 8 if cin % 8 == 0 else 1, batch_first=True)
        self.up = nn.ModuleList()
        for w in reversed(widths):
            self.up.append(nn.ModuleList([_ResBlock(cin + w, w), _ResBlock(w, w)]))
            cin = w
        self.out = nn.Conv2d(cin, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        skips = []
        for i, (r1, r2) in enumerate(self.down):
            h = r2(r1(h))
            skips.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h)
        b, c, hh, ww = h.shape
        seq = h.flatten(2).transpose(1, 2)
        h = h + self.mid_attn(seq, seq, seq, need_weights=False)[0].transpose(1, 2).reshape(b, c, hh, ww)
        for i, (r1, r2) in enumerate(self.up):
            if i > 0:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = r2(r1(torch.cat([h, skips.pop()], dim=1)))
        return self.out(h)


def build_unet_train(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        widths, batches, sizes = (8, 16), (1, 2), (16, 24, 32)
    else:
        widths, batches, sizes = (128, 256, 512, 512), (8, 24), (128, 192, 256)
    model = _UNet(widths).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def step(_i: int) -> None:
        b, s = rng.randint(*batches), rng.choice(sizes)
        clean = torch.randn(b, 3, s, s, device=device, generator=gen)
        noise = torch.randn(b, 3, s, s, device=device, generator=gen)
        level = torch.rand(b, 1, 1, 1, device=device, generator=gen)
        noisy = (clean * (1 - level).sqrt() + noise * level.sqrt()).to(memory_format=torch.channels_last)
        with _autocast(device):
            loss = F.mse_loss(model(noisy).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return Workload("unet_train", f"diffusion-style U-Net, widths {widths} ({params / 1e6:.0f}M params), batch "
                    f"{batches[0]}-{batches[1]} at {'/'.join(map(str, sizes))} pixels random per step, AdamW, "
                    "bf16 autocast, channels_last", step)


# ---- ViT with activation checkpointing and gradient accumulation -----------------------------

class _ViTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def build_vit_ckpt(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        d, heads, layers, patch, size, classes, micro, batches = 32, 4, 2, 8, 32, 10, (1, 2), (1, 3)
    else:
        d, heads, layers, patch, size, classes, micro, batches = 768, 12, 12, 16, 224, 1000, (1, 4), (32, 96)
    patchify = nn.Conv2d(3, d, patch, stride=patch)
    blocks = nn.ModuleList(_ViTBlock(d, heads) for _ in range(layers))
    norm, head = nn.LayerNorm(d), nn.Linear(d, classes)
    model = nn.ModuleDict({"patchify": patchify, "blocks": blocks, "norm": norm, "head": head}).to(device)
    pos = nn.Parameter(torch.zeros(1, (size // patch) ** 2, d, device=device))
    opt = torch.optim.AdamW(list(model.parameters()) + [pos], lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def step(_i: int) -> None:
        for _ in range(rng.randint(*micro)):
            b = rng.randint(*batches)
            img = torch.randn(b, 3, size, size, device=device, generator=gen)
            y = torch.randint(0, classes, (b,), device=device, generator=gen)
            with _autocast(device):
                x = patchify(img).flatten(2).transpose(1, 2) + pos
                for blk in blocks:
                    x = checkpoint(blk, x, use_reentrant=False)
                loss = F.cross_entropy(head(norm(x).mean(dim=1)).float(), y)
            loss.backward()  # gradients accumulate over the micro-batches
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload("vit_ckpt", f"ViT-B/{patch} ({layers} layers d={d}) at {size}x{size}, every block checkpointed, "
                    f"{micro[0]}-{micro[1]} micro-batches of {batches[0]}-{batches[1]} images accumulated per "
                    "AdamW step, bf16 autocast", step)


# ---- LSTM language model ---------------------------------------------------------------------

def build_lstm_lm(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, emb, hidden, batches, lengths = 256, 16, 32, (1, 4), (4, 16)
    else:
        vocab, emb, hidden, batches, lengths = 32000, 1024, 2048, (16, 64), (64, 512)
    embed = nn.Embedding(vocab, emb)
    lstm = nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
    head = nn.Linear(hidden, vocab)
    model = nn.ModuleDict({"embed": embed, "lstm": lstm, "head": head}).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    rng = random.Random(seed)

    def step(_i: int) -> None:
        b, t = rng.randint(*batches), rng.randint(*lengths)
        idx = torch.randint(0, vocab, (b, t + 1), device=device)
        out, _ = lstm(embed(idx[:, :-1]))
        loss = F.cross_entropy(head(out).view(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return Workload("lstm_lm", f"2-layer LSTM language model, hidden {hidden} ({params / 1e6:.0f}M params, fp32), "
                    f"batch {batches[0]}-{batches[1]} x seq {lengths[0]}-{lengths[1]} random, AdamW", step)


# ---- compiled graphs -------------------------------------------------------------------------

def build_compiled_gpt(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, d, layers, heads, batches, lengths = 256, 32, 2, 4, (1, 3), (8, 12, 16)
    else:
        vocab, d, layers, heads, batches, lengths = 50304, 768, 12, 12, (8, 16), (256, 384, 512, 768, 1024)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            for blk in self.blocks:
                x = blk(x)
            return F.cross_entropy(self.head(self.norm(x)).float().view(-1, vocab), target.reshape(-1))

    model = GPT().to(device)
    compiled = _compile(model, device, dynamic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    rng = random.Random(seed)

    def step(_i: int) -> None:
        b, t = rng.randint(*batches), rng.choice(lengths)
        idx = torch.randint(0, vocab, (b, t + 1), device=device)
        with _autocast(device):
            loss = compiled(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload("compiled_gpt", f"GPT-2-small ({layers} layers d={d}) compiled by torch.compile (inductor, "
                    f"dynamic shapes), batch {batches[0]}-{batches[1]} x seq {'/'.join(map(str, lengths))}, AdamW, "
                    "bf16 autocast", step)


class _GPTBlock(nn.Module):
    """A plain pre-norm transformer block (compiled_gpt)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def build_cudagraph_mlp(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        width, depth, batch = 32, 2, 8
    else:
        width, depth, batch = 8192, 6, 4096
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, width)).to(device)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _autocast(device):
            return F.mse_loss(model(x).float(), y)

    compiled = _compile(loss_fn, device, mode="reduce-overhead") if device.type == "cuda" else _compile(loss_fn, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def step(_i: int) -> None:
        x = torch.randn(batch, width, device=device, generator=gen)
        y = torch.randn(batch, width, device=device, generator=gen)
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return Workload("cudagraph_mlp", f"MLP {depth}x{width} ({params / 1e6:.0f}M params) compiled with "
                    f"mode=\"reduce-overhead\" (CUDA graph trees), batch {batch} fixed, AdamW, bf16 autocast", step)


# ---- several streams (added in session 28) ----------------------------------------------------
#
# The policies were developed on two multi-stream jobs only (the e2e pipeline and the shared
# mlp_two_streams trace): a side stream producing what the main stream consumes. These three hand
# memory between streams in the other ways real jobs do, each with record_stream as PyTorch asks
# for: activations copied out and back on a copy stream, gradients reduced bucket by bucket on a
# communication stream, and weights streamed in layer by layer ahead of the compute.

class _MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build_offload_train(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        d, layers, batches, lengths = 32, 2, (1, 4), (8, 32)
    else:
        d, layers, batches, lengths = 2048, 8, (4, 16), (256, 1024)
    blocks = nn.Sequential(*(_MLPBlock(d) for _ in range(layers))).to(device)
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    cuda = device.type == "cuda"
    copy = torch.cuda.Stream(device) if cuda else None
    params = {p.data_ptr() for p in blocks.parameters()}

    def pack(t: torch.Tensor):
        """Saved for backward: activations of 1 MiB or more go to pinned host memory on the copy
        stream; the device copy is freed as soon as the copy stream is done with it."""
        if not cuda or t.data_ptr() in params or t.numel() * t.element_size() < (1 << 20):
            return t
        main = torch.cuda.current_stream(device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copy.wait_stream(main)
        with torch.cuda.stream(copy):
            host.copy_(t, non_blocking=True)
        t.record_stream(copy)
        return host

    def unpack(saved: torch.Tensor) -> torch.Tensor:
        """Back for backward: copied in on the copy stream (allocated there), used on main."""
        if not cuda or saved.device.type == device.type:
            return saved
        main = torch.cuda.current_stream(device)
        with torch.cuda.stream(copy):
            t = saved.to(device, non_blocking=True)
        main.wait_stream(copy)
        t.record_stream(main)
        return t

    def step(_i: int) -> None:
        b, t = rng.randint(*batches), rng.randint(*lengths)
        x = torch.randn(b, t, d, device=device, generator=gen)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _autocast(device):
            loss = blocks(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    n = sum(p.numel() for p in blocks.parameters())
    return Workload("offload_train", f"{layers} MLP blocks d={d} ({n / 1e6:.0f}M params), batch {batches[0]}-"
                    f"{batches[1]} x seq {lengths[0]}-{lengths[1]} random, bf16 autocast; activations of 1 MiB or "
                    "more offloaded to pinned host memory on a copy stream in forward and copied back on it in "
                    "backward (record_stream both ways), AdamW", step)


def build_comm_overlap(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, d, layers, heads, batches, lengths, bucket_mb = 256, 32, 2, 4, (1, 4), (8, 32), 0.01
    else:
        vocab, d, layers, heads, batches, lengths, bucket_mb = 32000, 1024, 12, 16, (4, 24), (128, 1024), 25
    model = _Decoder(vocab, d, layers, heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(seed)
    cuda = device.type == "cuda"
    comm = torch.cuda.Stream(device) if cuda else None
    # buckets of about bucket_mb MiB of parameters, in the order backward produces their grads
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(list(model.parameters())):
        if size >= bucket_mb * (1 << 20):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    ready = [0] * len(buckets)
    reduced: list[Optional[torch.Tensor]] = [None] * len(buckets)

    def reduce(i: int) -> None:
        """A stand-in for an all-reduce: the bucket's grads flattened on the comm stream, scaled."""
        grads = [p.grad for p in buckets[i]]
        if cuda:
            comm.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(comm) if cuda else contextlib.nullcontext():
            reduced[i] = torch.cat([g.reshape(-1) for g in grads]).mul_(0.5)
        if cuda:
            for g in grads:
                g.record_stream(comm)

    def on_grad(p: nn.Parameter) -> None:
        i = bucket_of[id(p)]
        ready[i] += 1
        if ready[i] == len(buckets[i]):
            reduce(i)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_grad)

    def step(_i: int) -> None:
        b, t = rng.randint(*batches), rng.randint(*lengths)
        idx = torch.randint(0, vocab, (b, t + 1), device=device)
        ready[:] = [0] * len(buckets)
        with _autocast(device):
            x = model.embed(idx[:, :-1])
            for layer in model.layers:
                q, k, v = layer.qkv_heads(x)
                x = layer.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
            loss = F.cross_entropy(model.head(model.norm(x)).float().view(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        if cuda:
            torch.cuda.current_stream(device).wait_stream(comm)
        for i, bucket in enumerate(buckets):  # the reduced grads copied back on the main stream
            flat = reduced[i]
            if cuda:
                flat.record_stream(torch.cuda.current_stream(device))
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            reduced[i] = None
        opt.step()
        opt.zero_grad(set_to_none=True)

    n = sum(p.numel() for p in model.parameters())
    return Workload("comm_overlap", f"decoder {layers} layers d={d} ({n / 1e6:.0f}M params) training, batch "
                    f"{batches[0]}-{batches[1]} x seq {lengths[0]}-{lengths[1]} random, bf16 autocast; gradients "
                    f"reduced in {len(buckets)} buckets of ~{bucket_mb} MiB on a communication stream during backward "
                    "(cat + scale standing in for an all-reduce), copied back on the main stream, AdamW", step)


def build_stream_weights(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        d, layers, heads, batches, lengths = 32, 2, 4, (1, 3), (4, 16)
    else:
        d, layers, heads, batches, lengths = 4096, 8, 32, (1, 32), (128, 2048)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    # the weights live in (pinned) host memory and come to the device one layer ahead of the compute
    # (one layer's worth of random numbers, copied for the others: drawing 1.6 G of them on the
    # host would take longer than the recording; the values do not change what is allocated)
    first = [torch.randn(rows, cols, dtype=dtype) / math.sqrt(cols)
             for rows, cols in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]
    host = [[w.pin_memory() if cuda else w.clone() for w in first] for _ in range(layers)]
    copy = torch.cuda.Stream(device) if cuda else None
    rng = random.Random(seed)
    hd = d // heads

    def fetch(j: int) -> list[torch.Tensor]:
        if not cuda:
            return [w.to(device) for w in host[j]]
        with torch.cuda.stream(copy):
            return [w.to(device, non_blocking=True) for w in host[j]]

    @torch.inference_mode()
    def step(_i: int) -> None:
        b, t = rng.randint(*batches), rng.randint(*lengths)
        x = torch.randn(b, t, d, device=device, dtype=dtype)
        ahead = fetch(0)
        for j in range(layers):
            weights = ahead
            if cuda:
                main = torch.cuda.current_stream(device)
                main.wait_stream(copy)
                for w in weights:
                    w.record_stream(main)
            ahead = fetch(j + 1) if j + 1 < layers else None  # overlaps with this layer's compute
            wqkv, wo, wup, wdown = weights
            q, k, v = F.linear(F.rms_norm(x, (d,)), wqkv).view(b, t, 3, heads, hd).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, t, d), wo)
            x = x + F.linear(F.gelu(F.linear(F.rms_norm(x, (d,)), wup)), wdown)
            del weights, wqkv, wo, wup, wdown, q, k, v, attn
        del x

    per_layer = 12 * d * d * first[0].element_size()
    return Workload("stream_weights", f"decoder {layers} layers d={d} ({per_layer / 2**20:.0f} MiB of weights per "
                    f"layer, {str(dtype).removeprefix('torch.')}) whose weights stay in pinned host memory and are "
                    f"copied in one layer ahead on a copy stream (record_stream to the compute), prefill of batch "
                    f"{batches[0]}-{batches[1]} x {lengths[0]}-{lengths[1]} tokens random", step)


BUILDERS = {"llm_generate": build_llm_generate, "llm_serve": build_llm_serve, "moe_train": build_moe_train,
            "unet_train": build_unet_train, "vit_ckpt": build_vit_ckpt, "lstm_lm": build_lstm_lm,
            "compiled_gpt": build_compiled_gpt, "cudagraph_mlp": build_cudagraph_mlp,
            "offload_train": build_offload_train, "comm_overlap": build_comm_overlap,
            "stream_weights": build_stream_weights}


def build(name: str, device: torch.device, seed: int, scale: str = "full") -> Workload:
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return BUILDERS[name](device, seed, scale)
