"""test_cache_lines.py: bench/micro/cache_lines.py's parsing and its errors, without valgrind.

The measurement itself needs valgrind and a built cachealloc-cold-replay (the last test runs it
when both are there, and skips, saying so, otherwise); what it reads from callgrind and from the
tool's header, and how it refuses bad arguments, is checked here on any machine.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import REPO, skip  # noqa: E402

SCRIPT = REPO / "bench" / "micro" / "cache_lines.py"


def _module():
    spec = importlib.util.spec_from_file_location("cache_lines", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cache_lines"] = mod
    spec.loader.exec_module(mod)
    return mod


CALLGRIND_OUT = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
summary: 3197513 859620 522723 246451 102797 22779 5
fl=(1) ???
fn=(1) f
0 10 2 1 1 0 0 0 0 0
totals: 3197513 859620 522723 246451 102797 22779 5
"""


def test_parses_callgrind_totals_by_event_name():
    m = _module()
    c = m.parse_callgrind_totals(CALLGRIND_OUT)
    assert (c.ir, c.i1mr, c.d1mr, c.d1mw) == (3197513, 246451, 102797, 22779)
    # The columns are read by the names of the events line, not by position: with D1mr and D1mw
    # named the other way round, the same numbers swap roles.
    swapped = CALLGRIND_OUT.replace("I1mr D1mr D1mw", "I1mr D1mw D1mr")
    c = m.parse_callgrind_totals(swapped)
    assert (c.ir, c.i1mr, c.d1mr, c.d1mw) == (3197513, 246451, 22779, 102797)


def test_refuses_output_without_cache_simulation_or_totals():
    m = _module()
    no_cache = "events: Ir\ntotals: 100\n"
    with pytest.raises(ValueError, match="cache-sim"):
        m.parse_callgrind_totals(no_cache)
    with pytest.raises(ValueError, match="not a callgrind output"):
        m.parse_callgrind_totals("fn=main\n1 2\n")


def test_reads_calls_per_pass_and_differences():
    m = _module()
    head = ("trace e2e_pipeline.pickle.xz, device 0: 2,250 allocs and 2,249 frees per pass (29 of "
            "them at the end of the pass, for blocks the trace leaves live), 2 streams\n")
    assert m.parse_calls_per_pass(head) == 4499
    with pytest.raises(ValueError, match="allocs and M frees"):
        m.parse_calls_per_pass("nothing here\n")
    a = m.Counts(100, 10, 20, 5)
    b = m.Counts(300, 25, 50, 9)
    assert b.minus(a) == m.Counts(200, 15, 30, 4)
    row = m.Row("b", "defrag", "4M", 10, 1.0, 2.0, 3.0, 0.5)
    assert row.lines_per_pair == pytest.approx(11.0)
    table = m.format_table([row])
    assert "| b | defrag | 4M | 10 | 1.0 | 2.00 | 3.00 | 0.50 | 11.0 |" in table


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    trace = tmp_path / "t.pickle"
    trace.write_bytes(b"x")
    cases = [
        ([str(tmp_path / "missing.pickle")], "no such trace file"),
        ([str(trace), "--binary", "nolabel"], "LABEL=PATH"),
        ([str(trace), "--binary", f"x={tmp_path / 'nothing'}"], "no cachealloc-cold-replay"),
    ]
    for args, message in cases:
        proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        if shutil.which("valgrind") is None:
            # Without valgrind every call stops at that check first, with the same exit code.
            assert proc.returncode == 2 and "valgrind is not installed" in proc.stderr
            continue
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr


def test_measures_one_pass_when_valgrind_and_the_tool_are_there():
    if shutil.which("valgrind") is None:
        skip("valgrind is not installed")
    binaries = sorted(REPO.glob("build*/bench/micro/cachealloc-cold-replay"))
    if not binaries:
        skip("no built cachealloc-cold-replay under build*/")
    trace = REPO / "bench" / "e2e" / "recordings" / "e2e_pipeline.pickle.xz"
    m = _module()
    # 64 KiB evicted is more than the modelled L1d (48 KiB) and keeps the run short.
    row = m.measure("build", binaries[0], str(trace), "size_class", "64K")
    assert row.calls > 0
    # A call runs instructions and, with the caches evicted, misses lines of code and data.
    assert row.ir_per_call > 20
    assert row.i1_misses_per_call > 1
    assert row.d1_read_misses_per_call > 0.5
