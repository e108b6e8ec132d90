#!/usr/bin/env python3
"""oom_recovery.py: a training loop pushed into out-of-memory on purpose, which must recover.

Run once per allocator (a fresh process each): with CACHEALLOC_CONF=policy:<p> the startup hook
installs cachealloc; without it PyTorch's own allocator runs (the baseline). The loop:

1. caps the process at --fraction of the device (torch.cuda.set_per_process_memory_fraction),
2. trains an MLP with a batch far too large, catches torch.OutOfMemoryError, calls
   torch.cuda.empty_cache(), halves the batch and tries again until a step fits,
3. proves that no live tensor was touched by the failed steps: the model weights' checksum
   after every failure equals the one before it, and sentinel tensors written before the first
   failure read back bit for bit,
4. trains on for --steps steps and checks the loss is finite and went down.

Prints one JSON line with the outcome; exits 0 only when every check held.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn as nn


def checksum(model: nn.Module) -> str:
    # Exact: the bytes of every parameter, summed as int64 words (order-independent enough for
    # equality checks, exact for bit-identical tensors).
    total = 0
    for p in model.parameters():
        words = p.detach().contiguous().view(torch.int32).to(torch.int64)
        total = (total + int(words.sum().item()) * 1000003 + words.numel()) % (1 << 61)
    return f"{total:016x}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=0.03, help="share of device memory allowed (default 0.03)")
    ap.add_argument("--start-batch", type=int, default=1 << 20, help="first (too large) batch")
    ap.add_argument("--steps", type=int, default=30, help="steps to train after recovery")
    ap.add_argument("--hidden", type=int, default=4096)
    args = ap.parse_args()

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    torch.cuda.set_per_process_memory_fraction(args.fraction, dev)
    model = nn.Sequential(nn.Linear(1024, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden),
                          nn.GELU(), nn.Linear(args.hidden, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    w_true = torch.randn(1024, 1, device=dev) / 32

    def step(batch: int) -> float:
        x = torch.randn(batch, 1024, device=dev)
        y = x @ w_true
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    # Warm up with a small batch so optimizer state exists, then plant sentinels.
    first_loss = step(256)
    sentinels = [torch.full((1 << 18,), float(i) + 0.5, device=dev) for i in range(8)]
    expected = [float(i) + 0.5 for i in range(8)]

    batch = args.start_batch
    ooms = 0
    messages = []
    touched = False
    while True:
        before = checksum(model)
        try:
            step(batch)
            break
        except torch.OutOfMemoryError as e:
            ooms += 1
            messages.append(str(e).splitlines()[0][:300])
            del e
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if checksum(model) != before:
                touched = True
            batch //= 2
            if batch < 64:
                print(json.dumps({"ok": False, "error": "no batch size fits"}))
                return 1
    sentinel_ok = all(bool((s == v).all().item()) for s, v in zip(sentinels, expected))
    losses = [step(batch) for _ in range(args.steps)]
    stats = {}
    if os.environ.get("CACHEALLOC_CONF"):
        import cachealloc
        s = cachealloc.memory_stats()
        stats = {k: s.get(k) for k in ("num_ooms", "num_alloc_retries", "reserved_bytes.all.peak")}
    names_allocator = all(("cachealloc" in m) == bool(os.environ.get("CACHEALLOC_CONF")) for m in messages)
    ok = (ooms > 0 and not touched and sentinel_ok and all(map(lambda v: v == v and v < 1e30, losses))
          and losses[-1] < first_loss and names_allocator)
    print(json.dumps({"ok": ok, "allocator": os.environ.get("CACHEALLOC_CONF", "pytorch-native"),
                      "ooms_caught": ooms, "final_batch": batch, "weights_untouched": not touched,
                      "sentinels_intact": sentinel_ok, "first_loss": first_loss, "last_loss": losses[-1],
                      "oom_message_names_allocator": names_allocator, "first_oom_message": messages[0] if messages else "",
                      "stats": stats}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
