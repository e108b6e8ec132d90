#!/usr/bin/env python3
"""Compare variants of policy defrag over the whole development set, at several GPU lags.

Every change to defrag's placement or slack moves single recordings by several percent either
way (bench/results/defrag_*_session1[4-8].md), so a change is judged on all of them at once: the
4 bundled shared traces, the 3 e2e recordings and the 15 held-out validation recordings, each at
every GPU lag given (cachealloc-replay --gpu-lag-us), against PyTorch's expandable segments (the
native model with expandable_segments:True) on the same replay. A variant is a name, defrag
settings (CACHEALLOC_CONF syntax), and optionally its own replay binary (another build) or
environment variables (an experiment's switch):

    python3 bench/validation/devset.py --variant shipped= --variant held=max_grow_slack:0.01
    python3 bench/validation/devset.py --variant before= --replay-for before=/tmp/wt/build/... \\
        --variant after= --lags 0,500,1000,2000,5000 --out /tmp/devset.md

Prints one Markdown table (peak reserved / peak requested per trace and lag; bold where below
expandable segments) and, per variant: the mean and worst ratio, how many pairs are at most
--bound and below expandable, and how many are lower / higher than the first variant.

`--set gpu-runs` takes instead the jobs recorded on GPUs under several allocators
(bench/validation/gpu_runs/: offload_train, stream_weights and the pipeline, each with a copy or
producer stream), best replayed with `--lags 0 --stream-lags --late-frees-on-other-stream` and
each device-call price the GPU showed (`--call-cost NAME=map=60` and `=map=300` as two
variants). Their peak is mostly memory in flight (frees another stream still reads), so the
summary also gives each variant's mean peak over the trace's live + pending peak (live bytes plus
frees still pending at the recorded pace, cachealloc-replay's peak_live_pending_bytes: what an
allocator that reuses a free only once its streams are done must hold; reuse with device-side waits
can go below it) and its device calls' simulated time.

Each summary also counts the device calls defrag made in the last quarter of each replay
(cachealloc-replay --phases 4): a repeating job makes none once it settled, and the pipeline of
bench/e2e at the slack's limit may keep moving pages to its end, which a peak alone does not show
(e2e_pipeline_1200 and gpu_runs/h100_s47, bench/results/defrag_session47_2026-12-07.md).

The default lags include 100 ms: judged at 0-5 ms only, the shipped policy held 1.020-1.024 of
llm_serve's live peak, below expandable's 1.032, while on the H200 it held 6% more than
expandable; replayed 100 ms behind the host it does too (1.132; bench/results/
devset_lags_2026-12-04_session19.md).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_table import replay  # noqa: E402  (the one way this directory runs the replay)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV_SET = ("tests/data/traces/*.pickle.xz", "bench/e2e/recordings/*.pickle.xz",
           "bench/validation/recordings/*.pickle.xz", "bench/validation/recordings_b/*.pickle.xz")
GPU_RUNS = ("bench/validation/gpu_runs/**/*.pickle.xz",)
SETS = {"dev": DEV_SET, "gpu-runs": GPU_RUNS}
LATE_QUARTERS = 4  # the summary's late device calls: those of the last of this many slices


def short_name(trace: str) -> str:
    parts = os.path.relpath(trace, REPO).split(os.sep)
    if len(parts) > 3 and parts[:3] == ["bench", "validation", "gpu_runs"]:  # gpu_runs/<who>/<job>
        parts = parts[2:]
    else:
        parts = parts[-2:]
    return "/".join(parts[:-1] + [parts[-1].split(".pickle")[0]])


def parse_variants(args) -> list[dict]:
    variants = []
    for v in args.variant:
        name, sep, conf = v.partition("=")
        if not sep or not name:
            raise ValueError(f"--variant expects NAME=SETTINGS (SETTINGS may be empty), got '{v}'")
        if any(x["name"] == name for x in variants):
            raise ValueError(f"--variant {name} given twice")
        variants.append({"name": name, "conf": conf, "replay": args.replay, "env": {}, "args": []})
    by_name = {v["name"]: v for v in variants}
    for item in args.replay_for:
        name, sep, binary = item.partition("=")
        if not sep or name not in by_name:
            raise ValueError(f"--replay-for expects NAME=BINARY for a --variant NAME, got '{item}'")
        by_name[name]["replay"] = binary
    for item in args.env:
        name, sep, assignment = item.partition("=")
        var, sep2, value = assignment.partition("=")
        if not sep or not sep2 or name not in by_name or not var:
            raise ValueError(f"--env expects NAME=VAR=VALUE for a --variant NAME, got '{item}'")
        by_name[name]["env"][var] = value
    for item in args.call_cost:
        name, sep, spec = item.partition("=")
        if not sep or name not in by_name or "=" not in spec:
            raise ValueError(f"--call-cost expects NAME=KIND=MICROSECONDS for a --variant NAME, got '{item}'")
        by_name[name]["args"] += ["--call-cost", spec]
    for v in variants:
        if not os.access(v["replay"], os.X_OK):
            raise ValueError(f"{v['replay']} (variant {v['name']}) is not an executable; build it "
                             "first (cmake --build build --target cachealloc-replay) or pass --replay")
    return variants


def run_pair(trace: str, lag: int, variants: list[dict], check_every: int, stream_lags: bool = False,
             other_stream: bool = False) -> dict:
    lag_args = (["--gpu-lag-us", str(lag)] + (["--stream-lags"] if stream_lags or other_stream else []) +
                (["--late-frees-on-other-stream"] if other_stream else []))
    expandable = replay(variants[0]["replay"], trace,
                        ["-p", "native", "-c", "native=expandable_segments:True", *lag_args], 0)
    row = {"trace": short_name(trace), "lag_us": lag,
           "expandable": expandable["policies"][0]["ratio"], "variants": {}}
    for v in variants:
        extra = (["-p", "defrag", "--phases", str(LATE_QUARTERS), *lag_args, *v["args"]] +
                 (["-c", f"defrag={v['conf']}"] if v["conf"] else []))
        out = replay(v["replay"], trace, extra, check_every, v["env"])
        d = out["policies"][0]
        # Live bytes plus frees still pending at the recorded pace (cachealloc-replay's
        # peak_live_pending_bytes; the peak requested where the trace has no late frees).
        floor = max(out.get("peak_live_pending_bytes") or 0, out["peak_requested_bytes"], 1)
        phases = d.get("phases") or []
        row["variants"][v["name"]] = {"ratio": d["ratio"], "maps": d["map_calls"],
                                      "unmaps": d["unmap_calls"],
                                      "late": phases[-1]["device_calls"] if phases else 0,
                                      "over_floor": d["peak_reserved_bytes"] / floor,
                                      "call_ns": d.get("simulated_call_ns", 0)}
    return row


def markdown(rows: list[dict], names: list[str], bound: float) -> str:
    out = ["| trace | lag ms | expandable | " + " | ".join(names) + " |",
           "|" + " --- |" * (3 + len(names))]
    for r in rows:
        cells = []
        for n in names:
            x = r["variants"][n]["ratio"]
            cells.append(f"**{x:.3f}**" if x < r["expandable"] else f"{x:.3f}")
        out.append(f"| {r['trace']} | {r['lag_us'] / 1000:g} | {r['expandable']:.3f} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Bold: below expandable segments on the same replay. Per variant:")
    out.append("")
    base = names[0]
    for n in names:
        ratios = [r["variants"][n]["ratio"] for r in rows]
        worst = max(rows, key=lambda r: r["variants"][n]["ratio"])
        within = sum(x <= bound for x in ratios)
        below = sum(r["variants"][n]["ratio"] < r["expandable"] for r in rows)
        calls = sum(r["variants"][n]["maps"] + r["variants"][n]["unmaps"] for r in rows)
        over_floor = sum(r["variants"][n]["over_floor"] for r in rows) / len(rows)
        call_s = sum(r["variants"][n]["call_ns"] for r in rows) / 1e9
        late = sum(r["variants"][n]["late"] for r in rows)
        late_rows = [r for r in rows if r["variants"][n]["late"] > 0]
        most = max(rows, key=lambda r: r["variants"][n]["late"])
        line = (f"- {n}: mean {sum(ratios) / len(ratios):.4f}, worst {worst['variants'][n]['ratio']:.3f} "
                f"({worst['trace']} at {worst['lag_us'] / 1000:g} ms); at most {bound} on {within} of "
                f"{len(rows)}, below expandable on {below}; {calls:,} maps + unmaps in all; "
                f"mean {over_floor:.3f} of the live + pending peak; device calls {call_s:.2f} s "
                f"(simulated); {late:,} device calls in the last quarter of the replays, on "
                f"{len(late_rows)} of {len(rows)}"
                + (f" (most: {most['variants'][n]['late']:,}, {most['trace']} at {most['lag_us'] / 1000:g} ms)"
                   if late_rows else ""))
        if n != base:
            lower = sum(r["variants"][n]["ratio"] < r["variants"][base]["ratio"] - 5e-4 for r in rows)
            higher = sum(r["variants"][n]["ratio"] > r["variants"][base]["ratio"] + 5e-4 for r in rows)
            fewer = sum(r["variants"][n]["late"] < r["variants"][base]["late"] for r in rows)
            more = sum(r["variants"][n]["late"] > r["variants"][base]["late"] for r in rows)
            line += (f"; against {base}: lower on {lower}, higher on {higher}; fewer late device calls "
                     f"on {fewer}, more on {more}")
        out.append(line)
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("traces", nargs="*",
                    help="snapshot files (default: the set named by --set)")
    ap.add_argument("--set", choices=sorted(SETS), default="dev",
                    help="the traces when none are named: dev, the development set (" +
                         ", ".join(DEV_SET) + "); gpu-runs, the multi-stream jobs recorded on GPUs (" +
                         ", ".join(GPU_RUNS) + ") (default: %(default)s)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SETTINGS",
                    help="a variant: its name and defrag settings, e.g. held=max_grow_slack:0.01 or "
                         "shipped= (repeatable; the first is the one the others are compared with)")
    ap.add_argument("--replay", default=os.path.join(REPO, "build/bench/replay/cachealloc-replay"),
                    help="the cachealloc-replay binary for every variant (default: %(default)s)")
    ap.add_argument("--replay-for", action="append", default=[], metavar="NAME=BINARY",
                    help="another cachealloc-replay binary for one variant (a build of another commit)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VAR=VALUE",
                    help="an environment variable for one variant's replays (repeatable)")
    ap.add_argument("--call-cost", action="append", default=[], metavar="NAME=KIND=MICROSECONDS",
                    help="what one device call costs the simulated host in one variant's replays "
                         "(cachealloc-replay --call-cost KIND=MICROSECONDS, e.g. slow=map=66; "
                         "repeatable): how much a result depends on the modelled costs")
    ap.add_argument("--lags", default="0,2000,100000",
                    help="GPU lags in microseconds, comma-separated (default: %(default)s; 100 ms "
                         "stands for a host that queues a whole inference step ahead of the GPU)")
    ap.add_argument("--stream-lags", action="store_true",
                    help="every replay with cachealloc-replay --stream-lags: streams stay busy as long as "
                         "the trace's late frees show, on top of each lag")
    ap.add_argument("--late-frees-on-other-stream", action="store_true",
                    help="every replay with cachealloc-replay --stream-lags "
                         "--late-frees-on-other-stream: on a trace with two streams, a late free waits "
                         "for the stream that did not allocate the block (device-side reuse of parked "
                         "frees can happen); implies --stream-lags")
    ap.add_argument("--bound", type=float, default=1.02,
                    help="issue 5's bound on peak reserved / peak requested (default %(default)s)")
    ap.add_argument("--check-every", type=int, default=0,
                    help="run defrag's invariant checks every N operations (default 0: off)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="replays run at once (default: the number of cores)")
    ap.add_argument("--out", help="also write the Markdown here")
    args = ap.parse_args()
    try:
        if not args.variant:
            raise ValueError("no --variant given (e.g. --variant shipped=)")
        variants = parse_variants(args)
        lags = [int(x) for x in args.lags.split(",") if x.strip()]
        if not lags or min(lags) < 0:
            raise ValueError(f"--lags expects non-negative microseconds, got '{args.lags}'")
        if args.jobs < 1:
            raise ValueError("--jobs must be at least 1")
    except ValueError as e:
        print(f"devset: {e}", file=sys.stderr)
        return 2
    traces = args.traces or sorted(t for g in SETS[args.set]
                                   for t in glob.glob(os.path.join(REPO, g), recursive=True))
    missing = [t for t in traces if not os.path.isfile(t)]
    if missing or not traces:
        print(f"devset: no such trace: {', '.join(missing) or f'(the {args.set} set is empty)'}",
              file=sys.stderr)
        return 2
    pairs = [(t, lag) for t in traces for lag in lags]
    rows: list[dict | None] = [None] * len(pairs)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_pair, t, lag, variants, args.check_every, args.stream_lags,
                               args.late_frees_on_other_stream): i
                   for i, (t, lag) in enumerate(pairs)}
        for done, f in enumerate(concurrent.futures.as_completed(futures), 1):
            i = futures[f]
            try:
                rows[i] = f.result()
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                print(f"devset: {pairs[i][0]} at lag {pairs[i][1]} us: {e}", file=sys.stderr)
                pool.shutdown(cancel_futures=True)  # the replays not started yet would be wasted
                return 1
            print(f"[{done}/{len(pairs)}] {short_name(pairs[i][0])} at {pairs[i][1]} us",
                  file=sys.stderr, flush=True)
    table = markdown([r for r in rows if r is not None], [v["name"] for v in variants], args.bound)
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
