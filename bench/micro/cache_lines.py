#!/usr/bin/env python3
"""cache_lines.py: the cache lines one allocator call misses when the caches are cold, counted.

Inside a training step every allocator call finds the CPU caches cold (Note [Hot fields first],
allocator/include/cachealloc/allocator.h), so what a call costs there is the cache lines it
touches. cachealloc-cold-replay times such calls, but on a shared 2-core VM its timings move
more than a layout change does. This counts the misses instead, with a simulated cache: it runs
cachealloc-cold-replay under valgrind's callgrind (--cache-sim=yes), collecting only inside the
measured calls (the tool's measured_alloc and measured_free), once with one measured pass and
once with two. The difference is exactly one measured pass, with the caches evicted before every
call (--evict, and 64 KiB of code run for the L1i); the start-up, the trace's parsing and the
warm pass cancel out. Divided by the pass's allocations and frees, it prints per call and per
pair the L1 instruction misses, the L1 data read and write misses, and the instructions.

The figures are those of callgrind's cache model (L1i 64 KiB, L1d 48 KiB on this VM: the host's
geometry), not of any real machine; they are exact and repeatable, so two builds or two
policies compare to the line. What a miss costs depends on where the line comes from: on the
H100 hosts of session 53 a defrag pair missed about 170 lines here and cost about 1 us in the
pipeline's steps without a device call, about what as many L2 hits cost
(bench/results/defrag_session53_2026-12-07.md). Compare builds with --binary LABEL=PATH (repeatable):

    python3 bench/micro/cache_lines.py bench/e2e/recordings/e2e_pipeline.pickle.xz -p defrag -p native \\
        --binary old=/tmp/old/cachealloc-cold-replay --binary new=build/bench/micro/cachealloc-cold-replay

Needs valgrind (apt-get install valgrind). Exit codes: 0 ok, 2 bad arguments or a missing tool,
1 a run that failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = REPO / "build" / "bench" / "micro" / "cachealloc-cold-replay"
CALLS_RE = re.compile(r"([\d,]+) allocs and ([\d,]+) frees per pass")


@dataclass
class Counts:
    """callgrind's event totals (the subset used here)."""

    ir: int = 0
    i1mr: int = 0
    d1mr: int = 0
    d1mw: int = 0

    def minus(self, other: "Counts") -> "Counts":
        return Counts(self.ir - other.ir, self.i1mr - other.i1mr, self.d1mr - other.d1mr,
                      self.d1mw - other.d1mw)


def parse_callgrind_totals(text: str) -> Counts:
    """The totals of a callgrind.out file: its `events:` header names the columns of `totals:`
    (or `summary:`). Raises ValueError when either is missing or an event is not there."""
    events = None
    totals = None
    for line in text.splitlines():
        if line.startswith("events:"):
            events = line.split(":", 1)[1].split()
        elif line.startswith("totals:") or (line.startswith("summary:") and totals is None):
            totals = [int(v) for v in line.split(":", 1)[1].split()]
    if events is None or totals is None:
        raise ValueError("not a callgrind output file: no 'events:' or 'totals:' line")
    values = dict(zip(events, totals + [0] * (len(events) - len(totals))))
    missing = [e for e in ("Ir", "I1mr", "D1mr", "D1mw") if e not in values]
    if missing:
        raise ValueError(f"callgrind output lacks {', '.join(missing)}: was it run with --cache-sim=yes?")
    return Counts(values["Ir"], values["I1mr"], values["D1mr"], values["D1mw"])


def parse_calls_per_pass(stdout: str) -> int:
    """Allocations + frees in one pass, from cachealloc-cold-replay's header line."""
    m = CALLS_RE.search(stdout)
    if not m:
        raise ValueError("cachealloc-cold-replay's output has no 'N allocs and M frees per pass' line")
    return int(m.group(1).replace(",", "")) + int(m.group(2).replace(",", ""))


def run_counts(binary: Path, args: list[str], passes: int) -> tuple[Counts, int]:
    with tempfile.TemporaryDirectory(prefix="cache_lines.") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes",
               "--toggle-collect=*measured_alloc*", "--toggle-collect=*measured_free*",
               f"--callgrind-out-file={out}", str(binary), *args,
               "--warm", "1", "--passes", str(passes), "--repeat", "1", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n"
                               f"{proc.stderr[-2000:]}")
        return parse_callgrind_totals(out.read_text()), parse_calls_per_pass(proc.stdout)


@dataclass
class Row:
    binary: str
    policy: str
    evict: str
    calls: int
    ir_per_call: float
    i1_misses_per_call: float
    d1_read_misses_per_call: float
    d1_write_misses_per_call: float

    @property
    def lines_per_pair(self) -> float:
        return 2 * (self.i1_misses_per_call + self.d1_read_misses_per_call + self.d1_write_misses_per_call)


def measure(label: str, binary: Path, trace: str, policy: str, evict: str) -> Row:
    args = [trace, "-p", policy, "--evict", evict]
    one, calls = run_counts(binary, args, 1)
    two, calls2 = run_counts(binary, args, 2)
    if calls != calls2:
        raise RuntimeError(f"the two runs disagree on the calls per pass ({calls} and {calls2})")
    d = two.minus(one)
    return Row(label, policy, evict, calls, d.ir / calls, d.i1mr / calls, d.d1mr / calls, d.d1mw / calls)


def format_table(rows: list[Row]) -> str:
    head = ("| build | policy | evict | calls per pass | instructions / call | L1i misses / call | "
            "L1d read misses / call | L1d write misses / call | lines missed / pair |")
    out = [head, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r.binary} | {r.policy} | {r.evict} | {r.calls:,} | {r.ir_per_call:.1f} | "
                   f"{r.i1_misses_per_call:.2f} | {r.d1_read_misses_per_call:.2f} | "
                   f"{r.d1_write_misses_per_call:.2f} | {r.lines_per_pair:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("trace", help="the snapshot to replay (.pickle or .pickle.xz), as cachealloc-cold-replay takes it")
    ap.add_argument("-p", "--policy", action="append", default=None,
                    help="policy to measure with its default settings (repeatable; default: defrag)")
    ap.add_argument("--binary", action="append", default=None, metavar="LABEL=PATH",
                    help="a cachealloc-cold-replay build to measure, under a label (repeatable; "
                         f"default: {DEFAULT_BINARY.relative_to(REPO)})")
    ap.add_argument("--evict", default="64K",
                    help="bytes of other memory touched before every measured call, as "
                         "cachealloc-cold-replay's --evict takes one size (default 64K: more than "
                         "the modelled L1d, so every line comes back as a miss; 4M gives the same "
                         "counts 20 times slower)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)

    if shutil.which("valgrind") is None:
        print("cache_lines.py: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    if not Path(args.trace).is_file():
        print(f"cache_lines.py: no such trace file: {args.trace}", file=sys.stderr)
        return 2
    builds: list[tuple[str, Path]] = []
    for spec in args.binary or [f"build={DEFAULT_BINARY}"]:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            print(f"cache_lines.py: --binary wants LABEL=PATH, got {spec!r}", file=sys.stderr)
            return 2
        if not Path(path).is_file():
            print(f"cache_lines.py: {label}: no cachealloc-cold-replay at {path} (build the target "
                  "cachealloc-cold-replay, or pass --binary LABEL=PATH)", file=sys.stderr)
            return 2
        builds.append((label, Path(path)))

    rows = []
    try:
        for policy in args.policy or ["defrag"]:
            for label, path in builds:
                print(f"cache_lines.py: {label}, {policy} ...", file=sys.stderr, flush=True)
                rows.append(measure(label, path, args.trace, policy, args.evict))
    except (RuntimeError, ValueError) as e:
        print(f"cache_lines.py: {e}", file=sys.stderr)
        return 1
    print(f"trace {Path(args.trace).name}; callgrind's cache model; one measured pass "
          f"(two passes less one), caches evicted before every call")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) | {"lines_per_pair": r.lines_per_pair} for r in rows],
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
