#!/usr/bin/env python3
"""record_e2e_traces.py: records the end-to-end workloads of bench/e2e as PyTorch memory snapshots.

Each workload (bench/e2e/workloads.py) runs under PyTorch's default allocator with memory history
on, in the shared traces' format (`_record_memory_history(enabled="all", context=None,
stacks="python")`: no stack frames), one device synchronize after every step as run_e2e.py does;
the snapshot is written as OUT_DIR/e2e_<workload>.pickle.xz, which `cachealloc-replay` reads.
These recordings let a policy's behaviour on the e2e workloads (device calls per step, peak) be
studied on the simulated device, without GPU time.

Each workload is recorded in a fresh process, as run_e2e.py runs it: the libraries' own
allocations made at first use (cuBLAS workspaces of about 1 MiB, long-lived) then appear in every
recording, not only in the first workload of a shared process (recordings before session 10
lacked them for resnet50 and the pipeline; Note [Which requests are small], defrag.h).

  python3 tools/scripts/record_e2e_traces.py --out-dir DIR [--workloads gpt2,resnet50,pipeline]
                                             [--steps N] [--seed 0]
"""

from __future__ import annotations

import argparse
import lzma
import pickle
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "e2e"))

import torch  # noqa: E402

import workloads  # noqa: E402

# warm-up + measured steps of run_e2e.py, with the measured part doubled so that the steady
# state is visible.
DEFAULT_STEPS = {"gpt2": 3 + 16, "resnet50": 4 + 40, "pipeline": 4 + 40}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="where e2e_<workload>.pickle.xz go")
    p.add_argument("--workloads", default=",".join(workloads.WORKLOADS),
                   help="comma-separated workloads (default: all of bench/e2e/workloads.py)")
    p.add_argument("--steps", type=int, default=None, help="steps per workload (default: run_e2e.py's "
                   "warm-up plus twice its measured steps)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("record_e2e_traces: no CUDA device visible; this script records GPU allocations", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [w for w in args.workloads.split(",") if w]
    if len(names) > 1:  # one fresh process per workload
        for name in names:
            cmd = [sys.executable, __file__, "--out-dir", str(out), "--workloads", name, "--seed", str(args.seed)]
            if args.steps is not None:
                cmd += ["--steps", str(args.steps)]
            r = subprocess.run(cmd)
            if r.returncode != 0:
                return r.returncode
        return 0
    device = torch.device("cuda")
    for name in names:
        steps = args.steps if args.steps is not None else DEFAULT_STEPS[name]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                  max_entries=5_000_000)
        t0 = time.perf_counter()
        wl = workloads.build(name, device, args.seed, "full")
        for i in range(steps):
            wl.step(i)
            torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        path = out / f"e2e_{name}.pickle.xz"
        with lzma.open(path, "wb", preset=6) as f:
            pickle.dump(snap, f)
        events = sum(len(t) for t in snap.get("device_traces", []))
        print(f"{name}: {steps} steps in {time.perf_counter() - t0:.1f} s, {events} trace entries, "
              f"peak reserved {torch.cuda.max_memory_reserved(device)} B, "
              f"peak allocated {torch.cuda.max_memory_allocated(device)} B -> {path} "
              f"({path.stat().st_size} bytes); {wl.description}", flush=True)
        del wl
    return 0


if __name__ == "__main__":
    sys.exit(main())
