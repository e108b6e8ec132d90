#!/usr/bin/env python3
"""train_example.py: a small, ordinary PyTorch training script (it knows nothing of cachealloc).

Trains a 3-layer MLP on a synthetic regression task with AdamW, on the GPU when there is one.
Used by tools/tests and the README to show that cachealloc needs no change to user code::

    CACHEALLOC_CONF=policy:size_class python tools/scripts/train_example.py --steps 200
"""

import argparse
import time

import torch
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.GELU(),
        nn.Linear(args.hidden, args.hidden),
        nn.GELU(),
        nn.Linear(args.hidden, 1),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    true_w = torch.randn(args.features, 1, device=device) / args.features**0.5

    start = time.perf_counter()
    loss = torch.zeros((), device=device)
    for step in range(args.steps):
        # Batch sizes vary a little, as with real data, so the allocator sees changing shapes.
        batch = args.batch + (step % 4) * 16
        x = torch.randn(batch, args.features, device=device)
        y = x @ true_w + 0.01 * torch.randn(batch, 1, device=device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.5f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(f"done: {args.steps} steps in {elapsed:.2f} s on {device}, final loss {loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()
