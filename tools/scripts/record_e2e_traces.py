#!/usr/bin/env python3
"""record_e2e_traces.py: records the end-to-end workloads of bench/e2e (or, with --suite validation,
the held-out workloads of bench/validation) as PyTorch memory snapshots.

Each workload (bench/e2e/workloads.py) runs under PyTorch's default allocator with memory history
on, in the shared traces' format (`_record_memory_history(enabled="all", context=None,
stacks="python")`: no stack frames), one device synchronize after every step as run_e2e.py does;
the snapshot is written as OUT_DIR/e2e_<workload>.pickle.xz (validation: OUT_DIR/<workload>.pickle.xz),
which `cachealloc-replay` reads.
These recordings let a policy's behaviour on the e2e workloads (device calls per step, peak) be
studied on the simulated device, without GPU time.

Each workload is recorded in a fresh process, as run_e2e.py runs it: the libraries' own
allocations made at first use (cuBLAS workspaces of about 1 MiB, long-lived) then appear in every
recording, not only in the first workload of a shared process (recordings before session 10
lacked them for resnet50 and the pipeline; Note [Which requests are small], defrag.h).

  python3 tools/scripts/record_e2e_traces.py --out-dir DIR [--workloads gpt2,resnet50,pipeline]
                                             [--steps N] [--seed 0]
  python3 tools/scripts/record_e2e_traces.py --suite validation --out-dir DIR [--timeout-s 300]

A workload that fails or runs past --timeout-s (its own process is killed) is reported and the
others still run; the exit status is then 1.

PyTorch's allocator runs with whatever PYTORCH_CUDA_ALLOC_CONF says (expandable_segments:True
records an expandable run). With --cachealloc CONF the workload runs under cachealloc's plugin
instead (CACHEALLOC_CONF=CONF plus `record:`), and the snapshot is cachealloc's own recording
(cachealloc.dump_snapshot()): its segment_map/segment_unmap entries are what the policy mapped on
the device, so `cachealloc-replay` shows that run's real peak in its `recorded` row beside what
the simulated device makes of the same requests (a check of the replay's model of the GPU).
"""

from __future__ import annotations

import argparse
import lzma
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "e2e"))

import torch  # noqa: E402

from run_e2e import load_workloads_file  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
from trace_to_csv import load_snapshot  # noqa: E402

SUITES = {"e2e": REPO / "bench" / "e2e" / "workloads.py", "validation": REPO / "bench" / "validation" / "workloads.py"}


def load_suite(suite: str):
    """The workloads module of a suite (both are named workloads.py, so loaded by path)."""
    return load_workloads_file(SUITES[suite], f"{suite}_workloads")


# warm-up + measured steps of run_e2e.py, with the measured part doubled so that the steady
# state is visible.
DEFAULT_STEPS = {"gpt2": 3 + 16, "resnet50": 4 + 40, "pipeline": 4 + 40}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="e2e",
                   help="e2e: bench/e2e/workloads.py (default); validation: bench/validation/workloads.py")
    p.add_argument("--out-dir", required=True, help="where e2e_<workload>.pickle.xz (validation: "
                   "<workload>.pickle.xz) go")
    p.add_argument("--workloads", default=None,
                   help="comma-separated workloads (default: all of the suite)")
    p.add_argument("--steps", type=int, default=None, help="steps per workload (default: e2e, run_e2e.py's "
                   "warm-up plus twice its measured steps; validation, the suite's DEFAULT_STEPS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cachealloc", metavar="CONF", default=None,
                   help="run under cachealloc's plugin with CACHEALLOC_CONF=CONF (e.g. policy:defrag) and write "
                   "its own recording instead of PyTorch's")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="per workload, when several run (each in its own process): kill it after this long")
    args = p.parse_args()
    workloads = load_suite(args.suite)
    default_steps = DEFAULT_STEPS if args.suite == "e2e" else workloads.DEFAULT_STEPS
    prefix = "e2e_" if args.suite == "e2e" else ""
    if not torch.cuda.is_available():
        print("record_e2e_traces: no CUDA device visible; this script records GPU allocations", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [w for w in (args.workloads or ",".join(workloads.WORKLOADS)).split(",") if w]
    unknown = [w for w in names if w not in workloads.WORKLOADS]
    if unknown:
        print(f"record_e2e_traces: unknown {args.suite} workload(s) {', '.join(unknown)}; the suite has "
              f"{', '.join(workloads.WORKLOADS)}", file=sys.stderr)
        return 2
    if len(names) > 1:  # one fresh process per workload
        failed = []
        for name in names:
            cmd = [sys.executable, __file__, "--suite", args.suite, "--out-dir", str(out), "--workloads", name,
                   "--seed", str(args.seed)]
            if args.cachealloc is not None:
                cmd += ["--cachealloc", args.cachealloc]
            if args.steps is not None:
                cmd += ["--steps", str(args.steps)]
            try:
                r = subprocess.run(cmd, timeout=args.timeout_s)
                why = f"exit {r.returncode}" if r.returncode != 0 else ""
            except subprocess.TimeoutExpired:
                why = f"killed after {args.timeout_s:.0f} s"
            if why:
                failed.append(f"{name} ({why})")
                print(f"record_e2e_traces: {name}: {why}, no recording", file=sys.stderr, flush=True)
        if failed:
            print(f"record_e2e_traces: {len(failed)} of {len(names)} workloads not recorded: {', '.join(failed)}",
                  file=sys.stderr)
        return 1 if failed else 0
    device = torch.device("cuda")
    cachealloc = None
    if args.cachealloc is not None:
        import cachealloc  # tools/cachealloc (tools/ is on sys.path above)

        # `record:` turns the plugin's recorder on; it would also write the trace to that path at
        # exit, which dump_snapshot() below does already.
        cachealloc.enable(f"{args.cachealloc},record:{os.devnull}")
    for name in names:
        steps = args.steps if args.steps is not None else default_steps[name]
        if cachealloc is None:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                      max_entries=5_000_000)
        t0 = time.perf_counter()
        wl = workloads.build(name, device, args.seed, "full")
        for i in range(steps):
            wl.step(i)
            torch.cuda.synchronize(device)
        path = out / f"{prefix}{name}.pickle.xz"
        if cachealloc is None:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with lzma.open(path, "wb", preset=6) as f:
                pickle.dump(snap, f)
            events = sum(len(t) for t in snap.get("device_traces", []))
            peaks = f"peak reserved {torch.cuda.max_memory_reserved(device)} B, " \
                    f"peak allocated {torch.cuda.max_memory_allocated(device)} B"
            allocator = "torch" + (f" ({os.environ['PYTORCH_CUDA_ALLOC_CONF']})"
                                   if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") else "")
        else:
            raw = out / f".{name}.pickle"
            cachealloc.dump_snapshot(raw)
            snap = load_snapshot(str(raw))  # plain data only (tools/trace_to_csv.py)
            with lzma.open(path, "wb", preset=6) as f:
                f.write(raw.read_bytes())
            raw.unlink()
            events = sum(len(t) for t in snap.get("device_traces", []))
            stats = cachealloc.memory_stats(device)
            peaks = f"peak reserved {stats['reserved_bytes.all.peak']} B, " \
                    f"peak allocated {stats['allocated_bytes.all.peak']} B"
            allocator = f"cachealloc ({args.cachealloc})"
        print(f"{name}: {steps} steps in {time.perf_counter() - t0:.1f} s under {allocator}, "
              f"{events} trace entries, {peaks} -> {path} "
              f"({path.stat().st_size} bytes); {wl.description}", flush=True)
        del wl
    return 0


if __name__ == "__main__":
    sys.exit(main())
