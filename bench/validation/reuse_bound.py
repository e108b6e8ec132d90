#!/usr/bin/env python3
"""reuse_bound.py: how much memory in flight reuse_parked could take back, read off recordings.

Note [Reusing a parked free on the stream it waits for] (allocator/include/cachealloc/allocator.h):
an allocation on the stream a parked free waits for may take that free at once. A PyTorch
snapshot does not name the stream a record_stream used, so the replay cannot show this (it gives
every late free a private stream). This script bounds it instead, on one device's trace: a late
free (free_requested long before its free_completed) of a block allocated on stream A is taken by
the next allocation of the same size on another stream B while it is still parked. In a job with
two streams B is the only stream that can have used the block; the block's own stream is assumed
done with it (the allocator checks that with an event), so the figures are an upper bound. It
prints, per trace, how many allocations could take a parked free and the peak of allocated +
parked bytes (what defrag's memory follows) without and with those reuses.

    python3 bench/validation/reuse_bound.py bench/validation/recordings_b/offload_train.pickle.xz ...

Reads snapshots with tools/trace_to_csv.py's loader (plain data only: nothing from the file is run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from trace_to_csv import load_snapshot  # noqa: E402


def peak_active(trace: list[dict], reuse: bool) -> tuple[int, int]:
    """(peak of allocated + parked bytes, reuses) over the trace, taking parked frees when `reuse`."""
    live: dict[int, tuple[int, int]] = {}
    parked: dict[int, tuple[int, int]] = {}  # addr -> (size, stream), in parking order
    allocated = pending = peak = reuses = 0
    for e in trace:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            size, stream = e["size"], e["stream"]
            if reuse:
                for key, (psize, pstream) in parked.items():  # the oldest of its size first
                    if psize == size and pstream != stream:
                        del parked[key]
                        pending -= size
                        reuses += 1
                        break
            live[addr] = (size, stream)
            allocated += size
            peak = max(peak, allocated + pending)
        elif action == "free_requested" and addr in live:
            size, stream = live.pop(addr)
            allocated -= size
            parked[addr] = (size, stream)
            pending += size
        elif action == "free_completed" and addr in parked:
            size, _ = parked.pop(addr)
            pending -= size
    return peak, reuses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="PyTorch memory snapshots (.pickle, .pickle.xz, ...)")
    args = ap.parse_args(argv)
    print("| trace | streams | allocations | could take a parked free | peak allocated + parked GB: as recorded / with those |")
    print("| --- | ---: | ---: | ---: | --- |")
    for path in args.traces:
        snap = load_snapshot(path)
        traces = [t for t in snap.get("device_traces", []) if t]
        if not traces:
            print(f"| {path} | – | – | – | no trace |")
            continue
        trace = max(traces, key=len)
        streams = {e["stream"] for e in trace if e.get("action") == "alloc"}
        allocs = sum(1 for e in trace if e.get("action") == "alloc")
        before, _ = peak_active(trace, False)
        after, reuses = peak_active(trace, True)
        print(f"| {path} | {len(streams)} | {allocs:,} | {reuses:,} | {before / 1e9:.2f} / {after / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
