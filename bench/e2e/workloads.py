"""workloads.py: the end-to-end training workloads run_e2e.py measures.

Each workload is a function ``build(device, seed, scale) -> Workload`` returning a ``step(i)``
callable that runs one full training step (forward, backward, optimizer) and a description.
Everything random is seeded, including the per-step shapes, so every allocator configuration
sees exactly the same sequence of requests.

  gpt2      GPT-2-style decoder (pre-LayerNorm blocks, causal scaled-dot-product attention, tied
            embeddings), AdamW, bf16 autocast; batch size and sequence length drawn at random
            every step, which is what fragments caching allocators.
  resnet50  torchvision's ResNet-50 (or, without torchvision, a bottleneck conv net of the same
            shape family), SGD with momentum, bf16 autocast, channels_last, fixed 224x224 batches.
  pipeline  a two-stream input pipeline: a side stream produces (and augments) the next batch
            while the main stream trains on the current one; each batch is handed over with
            wait_stream + record_stream, so frees are cross-stream. Variable batch sizes.

``scale="tiny"`` shrinks every model so that the whole harness can be smoke-tested on a CPU.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

WORKLOADS = ("gpt2", "resnet50", "pipeline")


@dataclass
class Workload:
    name: str
    description: str
    step: Callable[[int], None]


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=torch.bfloat16)


# ---- gpt2 ------------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class _GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_gpt2(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        vocab, d, layers, heads, max_len, batches, lengths = 512, 64, 2, 4, 64, (1, 4), (8, 64)
    else:
        vocab, d, layers, heads, max_len, batches, lengths = 50304, 768, 12, 12, 1024, (4, 16), (128, 1024)
    model = _GPT(vocab, d, layers, heads, max_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    rng = random.Random(seed)

    def step(_i: int) -> None:
        b = rng.randint(*batches)
        t = rng.randint(*lengths)
        idx = torch.randint(0, vocab, (b, t + 1), device=device)
        with _autocast(device):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return Workload("gpt2", f"GPT-2-style decoder, {layers} layers, d={d}, {params / 1e6:.0f}M params, "
                    f"batch {batches[0]}-{batches[1]} x seq {lengths[0]}-{lengths[1]} random per step, "
                    "AdamW, bf16 autocast", step)


# ---- resnet50 --------------------------------------------------------------------------------

class _Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def _conv_net(stages: tuple[int, ...], width: int, classes: int) -> nn.Module:
    """A ResNet-50-shaped bottleneck network (used when torchvision is missing)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, blocks in enumerate(stages):
        mid = width * 2**i
        for j in range(blocks):
            layers.append(_Bottleneck(cin, mid, 2 if (j == 0 and i > 0) else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def build_resnet50(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        model, source, batch, size = _conv_net((1, 1, 1, 1), 8, 10), "bottleneck conv net (tiny)", 2, 32
        classes = 10
    else:
        classes, batch, size = 1000, 64, 224
        try:
            import torchvision

            model, source = torchvision.models.resnet50(weights=None), f"torchvision {torchvision.__version__} ResNet-50"
        except ImportError:
            model, source = _conv_net((3, 4, 6, 3), 64, classes), "ResNet-50-shaped conv net (torchvision missing)"
    model = model.to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def step(_i: int) -> None:
        x = torch.randn(batch, 3, size, size, device=device, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, classes, (batch,), device=device, generator=gen)
        with _autocast(device):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload("resnet50", f"{source}, batch {batch} x {size}x{size}, SGD, bf16 autocast, channels_last", step)


# ---- pipeline --------------------------------------------------------------------------------

def build_pipeline(device: torch.device, seed: int, scale: str = "full") -> Workload:
    torch.manual_seed(seed)
    if scale == "tiny":
        features, hidden, batches = 32, 64, (4, 16)
    else:
        features, hidden, batches = 4096, 8192, (512, 4096)
    model = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                          nn.Linear(hidden, features)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    rng = random.Random(seed)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    main = torch.cuda.current_stream(device) if device.type == "cuda" else None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def produce() -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, made on the side stream (decode + augment stand-in)."""
        b = rng.randint(*batches)
        ctx = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
        with ctx:
            raw = torch.randn(b, features, device=device, generator=gen)
            noise = torch.randn(b, features, device=device, generator=gen) * 0.1
            x = F.layer_norm(raw + noise, (features,))
            y = torch.roll(x, shifts=1, dims=1) * 0.5
        return x, y

    pending: list[tuple[torch.Tensor, torch.Tensor]] = [produce()]

    def step(_i: int) -> None:
        x, y = pending.pop()
        if side is not None:
            main.wait_stream(side)       # the batch is ready before the main stream reads it
            x.record_stream(main)        # and its memory is not reused before main is done
            y.record_stream(main)
        pending.append(produce())        # overlaps with the training step below
        with _autocast(device):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y

    return Workload("pipeline", f"two-stream input pipeline (side stream produces, record_stream hands over), "
                    f"MLP {features}->{hidden}->{hidden}->{features}, batch {batches[0]}-{batches[1]} random, "
                    "AdamW, bf16 autocast", step)


BUILDERS = {"gpt2": build_gpt2, "resnet50": build_resnet50, "pipeline": build_pipeline}


def build(name: str, device: torch.device, seed: int, scale: str = "full") -> Workload:
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return BUILDERS[name](device, seed, scale)
