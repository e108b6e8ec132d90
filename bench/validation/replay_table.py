#!/usr/bin/env python3
"""Replay recorded traces with every policy and write one Markdown table of the results.

For each trace: cachealloc-replay with every registered policy (native in the settings the trace
recorded), then once more with native under expandable_segments:True, all on the simulated
device. The table gives peak reserved / peak requested per policy, defrag's device calls and
moves, the replay speed, and whether the native model made the recorded run's reservations.

    python3 bench/validation/replay_table.py --replay build/bench/replay/cachealloc-replay \
        --out bench/results/validation_replay.md bench/validation/recordings/*.pickle.xz
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

POLICIES = ("native", "expandable", "async", "size_class", "defrag")


def replay(binary: str, trace: str, extra: list[str], check_every: int,
           env: dict[str, str] | None = None) -> dict:
    """One cachealloc-replay run, its --json output as a dict (env: extra environment)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [binary, trace, "-q", "--json", out, *extra]
        if check_every:
            cmd += ["--check-every", str(check_every)]
        run = subprocess.run(cmd, capture_output=True, text=True,
                             env={**os.environ, **env} if env else None)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {run.returncode}:\n{run.stderr.strip()}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def row_for(trace: str, binary: str, check_every: int) -> dict:
    started = time.monotonic()
    every = replay(binary, trace, [], check_every)
    expandable = replay(binary, trace, ["-p", "native", "-c", "native=expandable_segments:True"],
                        check_every)
    by_name = {p["name"]: p for p in every["policies"]}
    by_name["expandable"] = expandable["policies"][0]
    fidelity = by_name["native"].get("fidelity", {})
    rec = every.get("recorded") or {}
    return {
        "trace": os.path.basename(trace),
        "events": every["events"],
        "peak_requested": every["peak_requested_bytes"],
        "recorded_ratio": (rec.get("peak_reserved_bytes", 0) / every["peak_requested_bytes"]
                           if rec.get("peak_reserved_bytes") else None),
        "policies": by_name,
        "fidelity": ("MATCH" if fidelity.get("first_divergence_event") is None
                     else f"diverges at event {fidelity['first_divergence_event']}"
                     f" ({fidelity.get('model_segments')} vs {fidelity.get('recorded_segments')}"
                     " reservations)"),
        "seconds": time.monotonic() - started,
    }


def markdown(rows: list[dict], bound: float) -> str:
    head = ("| trace | events | peak requested (GiB) | recorded | native | expandable | async "
            "| size_class | defrag | defrag maps / unmaps | defrag slack | defrag Mevents/s "
            "| native model |\n")
    head += "|" + " --- |" * 13 + "\n"
    lines = []
    for r in rows:
        p = r["policies"]
        d = p["defrag"]
        slack = "?"
        detail = d.get("detail", "")
        if "slack " in detail:
            slack = detail.split("slack ", 1)[1].split(" ", 1)[0]
        ratios = [f"{p[name]['ratio']:.3f}" if name in p else "–" for name in POLICIES]
        best_torch = min(p["native"]["ratio"], p["expandable"]["ratio"])
        mark = "" if d["ratio"] <= bound else " ✗"
        ratios[-1] = f"**{ratios[-1]}**{mark}" if d["ratio"] < best_torch else ratios[-1] + mark
        rec = f"{r['recorded_ratio']:.3f}" if r["recorded_ratio"] else "–"
        lines.append(
            f"| {r['trace']} | {r['events']:,} | {r['peak_requested'] / 2**30:.2f} | {rec} | "
            + " | ".join(ratios)
            + f" | {d['map_calls']} / {d['unmap_calls']} | {slack} | "
            f"{d['events_per_second'] / 1e6:.1f} | {r['fidelity']} |")
    over = [r["trace"] for r in rows if r["policies"]["defrag"]["ratio"] > bound]
    summary = (f"\ndefrag at most {bound} of peak requested on {len(rows) - len(over)} of "
               f"{len(rows)} traces" + (f"; above it: {', '.join(over)}" if over else "") + ".\n")
    return head + "\n".join(lines) + "\n" + summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="snapshot files (.pickle or .pickle.xz)")
    ap.add_argument("--replay", default="build/bench/replay/cachealloc-replay",
                    help="the cachealloc-replay binary (default: %(default)s)")
    ap.add_argument("--out", help="write the Markdown table here (default: stdout only)")
    ap.add_argument("--json", help="also write every replay's figures as JSON here")
    ap.add_argument("--bound", type=float, default=1.02,
                    help="defrag's target for peak reserved / peak requested (default 1.02)")
    ap.add_argument("--check-every", type=int, default=0,
                    help="run the policies' invariant checks every N operations (default 0: off)")
    args = ap.parse_args()
    if not os.access(args.replay, os.X_OK):
        print(f"replay_table: {args.replay} is not an executable; build it first "
              "(cmake --build build --target cachealloc-replay) or pass --replay", file=sys.stderr)
        return 2
    rows = []
    for i, trace in enumerate(args.traces, 1):
        print(f"[{i}/{len(args.traces)}] {trace}", file=sys.stderr, flush=True)
        try:
            rows.append(row_for(trace, args.replay, args.check_every))
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            print(f"replay_table: {trace}: {e}", file=sys.stderr)
            return 1
    table = markdown(rows, args.bound)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
