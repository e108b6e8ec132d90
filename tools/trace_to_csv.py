#!/usr/bin/env python3
"""trace_to_csv.py: turn a PyTorch CUDA memory snapshot into a flat CSV of its trace entries.

A snapshot is what torch.cuda.memory._snapshot() returns (torch.cuda.memory._dump_snapshot()
writes it as a pickle). This script reads such a file (plain, .xz, .gz or .bz2 compressed),
takes the trace of one device and writes one CSV row per entry:

    action,addr,size,stream
    segment_alloc,140315004502016,155189248,0
    alloc,140315004502016,3072,0
    ...

`action` is PyTorch's (alloc, free_requested, free_completed, segment_alloc, segment_free,
segment_map, segment_unmap, snapshot, oom, ...), `addr`, `size` and `stream` are integers as
recorded (for `alloc` the size is the unrounded request). With --settings the allocator settings
the snapshot was recorded under are printed to stderr as a CACHEALLOC_CONF-style string.

The script needs only the Python standard library: no torch import, since unpickling a snapshot
needs nothing but plain dicts, lists, strings and numbers.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import gzip
import lzma
import pickle
import sys
from typing import IO, Any, Iterable

FIELDS = ("action", "addr", "size", "stream")


def open_snapshot(path: str) -> IO[bytes]:
    """Opens `path`, decompressing by its magic bytes (xz, gzip, bzip2) or reading it plain."""
    if path == "-":
        return sys.stdin.buffer
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(path, "rb")
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    if magic.startswith(b"BZh"):
        return bz2.open(path, "rb")
    return open(path, "rb")


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every class: a memory snapshot holds only builtin containers and scalars."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a memory snapshot holds only plain data")


def load_snapshot(path: str) -> dict:
    with open_snapshot(path) as f:
        snapshot = _PlainUnpickler(f).load()
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError(f"{path}: not a PyTorch memory snapshot (no 'device_traces')")
    return snapshot


def settings_string(settings: dict) -> str:
    """The snapshot's allocator_settings as PYTORCH_CUDA_ALLOC_CONF-style text (non-defaults)."""
    parts = []
    max_split = settings.get("max_split_size", -1)
    if isinstance(max_split, int) and max_split > 0:
        parts.append(f"max_split_size_mb:{max_split // (1 << 20)}")
    gc = settings.get("garbage_collection_threshold", 0.0)
    if gc:
        parts.append(f"garbage_collection_threshold:{gc}")
    if settings.get("expandable_segments"):
        parts.append("expandable_segments:True")
    divisions = settings.get("roundup_power2_divisions") or {}
    if any(int(v) for v in divisions.values()):
        items = ",".join(f"{k}:{v}" for k, v in divisions.items())
        parts.append(f"roundup_power2_divisions:[{items}]")
    return ",".join(parts)


def rows(trace: Iterable[dict]) -> Iterable[tuple]:
    for entry in trace:
        yield (entry["action"], int(entry.get("addr", 0) or 0), int(entry.get("size", 0) or 0),
               int(entry.get("stream", 0) or 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert a PyTorch CUDA memory snapshot (pickle, optionally xz/gz/bz2 "
                    "compressed) into a CSV 'action,addr,size,stream' of one device's trace.",
        epilog="example: trace_to_csv.py gpt2_train_varlen.pickle.xz -o gpt2.csv --settings")
    parser.add_argument("snapshot", help="snapshot file, or - for standard input")
    parser.add_argument("-o", "--output", default="-", help="CSV file to write (default: stdout)")
    parser.add_argument("-d", "--device", type=int, default=0, help="device index (default 0)")
    parser.add_argument("--no-header", action="store_true", help="omit the CSV header line")
    parser.add_argument("--actions", default="",
                        help="comma-separated actions to keep (default: all)")
    parser.add_argument("--settings", action="store_true",
                        help="print the recorded allocator settings to stderr")
    args = parser.parse_args(argv)

    try:
        snapshot = load_snapshot(args.snapshot)
    except (OSError, ValueError, pickle.UnpicklingError, EOFError, lzma.LZMAError) as e:
        print(f"trace_to_csv: {e}", file=sys.stderr)
        return 1
    traces = snapshot["device_traces"]
    if not 0 <= args.device < len(traces):
        print(f"trace_to_csv: device {args.device} not in snapshot ({len(traces)} device traces)",
              file=sys.stderr)
        return 1
    keep = {a.strip() for a in args.actions.split(",") if a.strip()}
    trace = [e for e in traces[args.device] if not keep or e["action"] in keep]

    out = sys.stdout if args.output == "-" else open(args.output, "w", newline="")
    try:
        writer = csv.writer(out, lineterminator="\n")
        if not args.no_header:
            writer.writerow(FIELDS)
        writer.writerows(rows(trace))
    finally:
        if out is not sys.stdout:
            out.close()
    if args.settings:
        print(f"allocator settings: {settings_string(snapshot.get('allocator_settings') or {})!r}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
