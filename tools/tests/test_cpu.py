"""test_cpu.py: the Python package, the startup hook and the C API, on a machine without a GPU.

Everything here runs anywhere: the library's allocation path is exercised through the torch-free
C API (libcachealloc_capi.so) on the simulated backend (CACHEALLOC_PLUGIN_BACKEND=sim). Tests
that need the built libraries skip, saying so, when the build is not there.

    python -m pytest -q tools/tests          # or, without pytest: python tools/tests/test_cpu.py
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import (  # noqa: E402
    REPO,
    TOOLS,
    TRAIN_SCRIPT,
    autoload_installed,
    capi_library,
    cuda_device_count,
    plugin_library,
    run_python,
    skip,
    torch_importable,
)


def _need_e2e_runner() -> Path:
    runner = REPO / "bench" / "e2e" / "run_e2e.py"
    if not runner.is_file():
        skip("bench/e2e/run_e2e.py is not in this checkout")
    return runner


def _need_plugin() -> str:
    lib = plugin_library()
    if lib is None:
        skip("libcachealloc_plugin.so is not built (cmake with LibTorch, see README.md)")
    return lib


def _need_capi() -> str:
    lib = capi_library()
    if lib is None:
        skip("libcachealloc_capi.so is not built (cmake with CUDA, see README.md)")
    return lib


def _need_torch() -> None:
    if not torch_importable():
        skip("torch is not installed")


def _need_cpu_only() -> None:
    _need_torch()
    if cuda_device_count() > 0:
        skip("this test checks behaviour without a GPU; a GPU is visible here")


# ---- the package ----------------------------------------------------------------------------

def test_package_imports_without_torch_or_library():
    r = run_python(
        "import sys, cachealloc\n"
        "assert 'torch' not in sys.modules, 'importing cachealloc must not import torch'\n"
        "print(cachealloc.__version__, cachealloc.is_enabled())\n",
        CACHEALLOC_LIBRARY="/nonexistent/libcachealloc_plugin.so",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0.1.0", "False"]


def test_missing_library_error_says_where_it_looked():
    r = run_python(
        "import cachealloc\n"
        "try:\n"
        "    cachealloc.validate_config('policy:size_class')\n"
        "except cachealloc.LibraryNotFound as e:\n"
        "    print('NOTFOUND', e)\n",
        CACHEALLOC_LIBRARY="/nonexistent/libcachealloc_plugin.so",
    )
    assert r.returncode == 0, r.stderr
    assert "NOTFOUND" in r.stdout and "CACHEALLOC_LIBRARY" in r.stdout


def test_validate_config_accepts_every_policy():
    _need_plugin()
    code = (
        "import cachealloc\n"
        "for p in cachealloc.policies():\n"
        "    cachealloc.validate_config('policy:' + p['name'])\n"
        "    print(p['name'], p['backend'])\n"
        "cachealloc.validate_config('')\n"
        "cachealloc.validate_config('policy:size_class,timing:False,record:/tmp/x_%p.pickle,record_max_entries:1000,log_level:info')\n"
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert "size_class" in names


def test_config_errors_name_the_key_and_the_valid_ones():
    _need_plugin()
    cases = {
        "policy:size_class,bogus_key:1": ["bogus_key", "valid keys", "policy", "record"],
        "policy:no_such_policy": ["no_such_policy", "size_class"],
        "timing:maybe": ["timing", "True or False"],
        "log_level:loud": ["log_level"],
        "policy:size_class,record_max_entries:-5": ["record_max_entries"],
        "policy size_class": ["no ':'"],
    }
    for conf, words in cases.items():
        r = run_python(
            "import cachealloc, sys\n"
            "try:\n"
            f"    cachealloc.validate_config({conf!r})\n"
            "    print('ACCEPTED')\n"
            "except ValueError as e:\n"
            "    print('REJECTED', e)\n"
        )
        assert r.returncode == 0, r.stderr
        assert "REJECTED" in r.stdout, f"{conf!r} was accepted"
        for w in words:
            assert w in r.stdout, f"{conf!r}: message lacks {w!r}: {r.stdout}"


def test_policies_are_described():
    _need_plugin()
    r = run_python("import cachealloc, json; print(json.dumps(cachealloc.policies()))")
    assert r.returncode == 0, r.stderr
    policies = json.loads(r.stdout)
    assert {p["name"] for p in policies} >= {"size_class"}
    for p in policies:
        assert p["backend"] in ("runtime", "virtual_memory", "stream_ordered")
        assert isinstance(p["config_keys"], list) and p["summary"]


def test_hot_pages_describes_the_regions():
    # Note [Bookkeeping on few pages] (hot_pages.h): the diagnostic's keys and types.
    lib = _need_capi()
    r = run_python("import cachealloc, json; print(json.dumps(cachealloc.hot_pages()))", CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stderr
    hp = json.loads(r.stdout)
    assert hp["mode"] in ("huge", "small", "off")
    assert hp["region_bytes"] == 2 << 20
    for key in ("regions", "bytes_in_use", "bytes_carved", "fallback_allocations"):
        assert isinstance(hp[key], int) and hp[key] >= 0, key
    assert hp["bytes_in_use"] <= hp["bytes_carved"] <= hp["regions"] * hp["region_bytes"]
    assert hp["huge_bytes"] is None or 0 <= hp["huge_bytes"] <= hp["regions"] * hp["region_bytes"]
    r = run_python("import cachealloc; print(cachealloc.hot_pages()['mode'])",
                   CACHEALLOC_LIBRARY=lib, CACHEALLOC_HOT_PAGES="off")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "off"


def test_hot_pages_says_when_the_plugin_predates_it():
    # An A/B against an older plugin (CACHEALLOC_LIBRARY) loads without the entry point.
    code = (
        "import cachealloc, cachealloc._lib as L\n"
        "class Old: pass\n"
        "L.load = lambda: Old()\n"
        "L.loaded_path = lambda: '/old/libcachealloc_plugin.so'\n"
        "try:\n"
        "    cachealloc.hot_pages()\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "predates hot_pages()" in r.stdout and "/old/" in r.stdout


# ---- the startup hook -----------------------------------------------------------------------

def test_hook_is_off_without_conf():
    r = run_python("import cachealloc._autoload as a; print(a.status)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("off")


def test_hook_is_harmless_on_cpu():
    _need_cpu_only()
    code = (
        "import cachealloc._autoload as a\n"
        "print('STATUS', a.status)\n"
        "import torch\n"
        "print('STATUS', a.status)\n"
        "print('SUM', torch.ones(4).sum().item())\n"
    )
    r = run_python(code, CACHEALLOC_CONF="policy:size_class")
    assert r.returncode == 0, r.stderr
    statuses = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("STATUS")]
    assert statuses[0].startswith("armed")
    assert statuses[1].startswith("skipped: no CUDA device"), statuses
    assert "SUM 4.0" in r.stdout
    assert "no CUDA device is visible" in r.stderr


def test_installed_pth_triggers_on_import_torch():
    """`pip install ./tools` put cachealloc_autoload.pth in site-packages: `import torch` arms it."""
    if not autoload_installed():
        skip("the package is not installed in this interpreter (pip install --no-build-isolation ./tools)")
    _need_cpu_only()
    env = {"CACHEALLOC_CONF": "policy:size_class", "PYTHONPATH": ""}
    r = subprocess.run(
        [sys.executable, "-c", "import torch, sys; a = sys.modules.get('cachealloc._autoload'); print(a.status if a else 'NOT LOADED')"],
        capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env}, cwd="/",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("skipped: no CUDA device"), r.stdout + r.stderr
    # And without CACHEALLOC_CONF the hook module is not even imported.
    r = subprocess.run(
        [sys.executable, "-c", "import torch, sys; print('cachealloc._autoload' in sys.modules)"],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CACHEALLOC_CONF")}, cwd="/",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("False")


def test_enable_before_cuda_swaps_the_allocator():
    """enable() wires every hook into CUDAPluggableAllocator; that needs no GPU."""
    lib = _need_plugin()
    _need_cpu_only()
    code = (
        "import torch, cachealloc\n"
        "cachealloc.enable('policy:size_class')\n"
        "print('ENABLED', cachealloc.is_enabled(), cachealloc.policy_name())\n"
        "cachealloc.enable()  # same config again: a no-op\n"
        "try:\n"
        "    cachealloc.enable('policy:native')\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
        "try:\n"
        "    torch.empty(4, device='cuda')\n"
        "except Exception as e:\n"
        "    print('NOGPU', type(e).__name__)\n"
    )
    r = run_python(code, CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stderr
    assert "ENABLED True size_class" in r.stdout
    assert "REFUSED" in r.stdout and "already enabled" in r.stdout
    assert "NOGPU" in r.stdout


def test_enable_after_cuda_init_says_what_to_do():
    lib = _need_plugin()
    _need_torch()
    code = (
        "import torch, cachealloc\n"
        "torch.cuda.is_initialized = lambda: True  # pretend a CUDA tensor exists already\n"
        "try:\n"
        "    cachealloc.enable('policy:size_class')\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
    )
    r = run_python(code, CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "before" in r.stdout and "CACHEALLOC_CONF" in r.stdout


def test_enable_rejects_a_bad_config_before_swapping():
    lib = _need_plugin()
    _need_torch()
    code = (
        "import torch, cachealloc\n"
        "try:\n"
        "    cachealloc.enable('policy:size_class,bogus_key:1')\n"
        "except ValueError as e:\n"
        "    print('BAD', e)\n"
        "print('ENABLED', cachealloc.is_enabled())\n"
    )
    r = run_python(code, CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stderr
    assert "BAD" in r.stdout and "bogus_key" in r.stdout and "ENABLED False" in r.stdout


# ---- the C API on the simulated device ------------------------------------------------------

_CAPI_SCRIPT = r"""
import ctypes, json, sys
from cachealloc import _lib
lib = _lib.load()
assert lib.cachealloc_is_torch_plugin() == 0
MiB = 1 << 20
lib.cachealloc_init(1)
ptrs = [lib.cachealloc_alloc(n, 0, None) for n in (512, 3 * MiB, 100 * MiB, 7)]
assert all(ptrs), _lib.last_error()
side = ctypes.c_void_p(0x5151)
lib.cachealloc_record_stream(ptrs[1], side)
size = ctypes.c_size_t(0)
base = lib.cachealloc_base_alloc(ptrs[2], ctypes.byref(size))
assert base and size.value >= 100 * MiB
stats = _lib.read_json(lib.cachealloc_memory_stats_json, 0)
print("PEAK", stats["allocated_bytes.all.peak"], "REQUESTED", stats["requested_bytes.all.current"])
for p in ptrs:
    lib.cachealloc_free(p, 0, 0, None)
big = lib.cachealloc_alloc(4 << 30, 0, None)   # the simulated device has 1 GiB
print("OOM", big is None, lib.cachealloc_last_error_code(), _lib.last_error()[:60])
again = lib.cachealloc_alloc(MiB, 0, None)
assert again, "allocation after an out-of-memory must work"
lib.cachealloc_free(again, 0, 0, None)
lib.cachealloc_free(again, 0, 0, None)          # double free: logged, ignored
print("USAGE", lib.cachealloc_last_error_code())
assert lib.cachealloc_check_invariants(-1) == 0, _lib.last_error()
before = _lib.read_json(lib.cachealloc_memory_stats_json, 0)["reserved_bytes.all.current"]
assert lib.cachealloc_empty_cache(-1) == 0
after = _lib.read_json(lib.cachealloc_memory_stats_json, 0)["reserved_bytes.all.current"]
print("RESERVED", before, after)
stats = _lib.read_json(lib.cachealloc_memory_stats_json, 0)
print("STATS", json.dumps(stats))
keep = lib.cachealloc_alloc(5 * MiB, 0, None)    # alive at exit: in the snapshot's segments
assert lib.cachealloc_dump_snapshot(sys.argv[1].encode()) == 0, _lib.last_error()
"""


def _run_capi(tmp: Path, conf_extra: str = "") -> tuple[subprocess.CompletedProcess, Path]:
    capi = _need_capi()
    trace = tmp / "trace.pickle"
    script = tmp / "capi.py"
    script.write_text(_CAPI_SCRIPT)
    env = {
        "CACHEALLOC_LIBRARY": capi,
        "CACHEALLOC_PLUGIN_BACKEND": "sim",
        "CACHEALLOC_PLUGIN_SIM_CAPACITY_MB": "1024",
        "CACHEALLOC_CONF": f"policy:size_class,record:{trace}{conf_extra}",
        "CACHEALLOC_AUTOLOAD": "0",
    }
    r = subprocess.run([sys.executable, str(script), str(tmp / "on_demand.pickle")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, **env, "PYTHONPATH": str(TOOLS)})
    return r, trace


def test_capi_allocates_frees_and_reports_on_simulated_device():
    with tempfile.TemporaryDirectory() as d:
        r, trace = _run_capi(Path(d))
        assert r.returncode == 0, r.stdout + r.stderr
        out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        assert int(out["PEAK"].split()[0]) >= 103 * (1 << 20)
        oom = out["OOM"].split(" ", 2)
        assert oom[0] == "True" and oom[1] == "1" and "cachealloc" in oom[2]
        assert out["USAGE"] == "3"
        before, after = map(int, out["RESERVED"].split())
        assert after < before
        stats = json.loads(out["STATS"])
        for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.peak",
                    "active_bytes.all.current", "requested_bytes.all.peak", "num_alloc_retries", "num_ooms",
                    "num_device_alloc", "num_device_free", "allocator_ns", "alloc_ns", "free_ns"):
            assert key in stats, key
        assert stats["num_ooms"] == 1 and stats["allocated_bytes.all.current"] == 0
        assert stats["allocator_ns"] > 0 and stats["num_device_alloc"] > 0
        assert "usage" in r.stderr or "double free" in r.stderr  # the ignored free was logged


_REPORT_SCRIPT = r"""
import json, sys
from cachealloc import _lib
lib = _lib.load()
MiB = 1 << 20
assert _lib.read_json(lib.cachealloc_policy_report_json, 0) == {}   # no allocator yet
lib.cachealloc_init(1)
# Blocks of 3 MiB + 512 B held one after another, with no slack: most growths end on a page the
# next block shares, so they create a page beyond the slack (Note [A history of the slack]).
ptrs = [lib.cachealloc_alloc(3 * MiB + 512, 0, None) for _ in range(40)]
assert all(ptrs), _lib.last_error()
print("REPORT", json.dumps(_lib.read_json(lib.cachealloc_policy_report_json, 0)))
print("STATS", json.dumps(_lib.read_json(lib.cachealloc_memory_stats_json, 0)))
for p in ptrs:
    lib.cachealloc_free(p, 0, 0, None)
"""


def test_capi_policy_report_gives_defrag_slack_history():
    """cachealloc_policy_report_json (cachealloc.policy_report()): policy defrag's slack history
    on the simulated device agrees with its counters in memory_stats; size_class reports {}."""
    capi = _need_capi()
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "report.py"
        script.write_text(_REPORT_SCRIPT)
        for conf in ("policy:defrag,grow_slack:0,max_grow_slack:0", "policy:size_class"):
            env = {"CACHEALLOC_LIBRARY": capi, "CACHEALLOC_PLUGIN_BACKEND": "sim",
                   "CACHEALLOC_PLUGIN_SIM_CAPACITY_MB": "1024", "CACHEALLOC_CONF": conf, "CACHEALLOC_AUTOLOAD": "0"}
            r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                               env={**os.environ, **env, "PYTHONPATH": str(TOOLS)})
            assert r.returncode == 0, r.stdout + r.stderr
            out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
            report, stats = json.loads(out["REPORT"]), json.loads(out["STATS"])
            if conf == "policy:size_class":
                assert report == {}, report
                continue
            events = report["slack_history"]
            assert report["slack_history_dropped"] == 0
            beyond = [e for e in events if e["event"] == "beyond_slack"]
            assert len(beyond) == stats["defrag.beyond_slack_growths"] > 0, (events, stats)
            assert sum(e["pages"] for e in beyond) == stats["defrag.beyond_slack_pages"]
            assert sum(e["unsafe_pages"] for e in beyond) == stats["defrag.stuck_unsafe_pages"]
            assert sum(e["unsafe_other_pages"] for e in beyond) == stats["defrag.stuck_unsafe_other_pages"]
            times = [e["time_ns"] for e in events]
            assert times == sorted(times)
            for e in events:
                assert e["slack_before"] == e["slack_after"] == 0.0
                assert e["peak_live_bytes"] >= e["live_bytes"] >= e["parked_bytes"]


def test_recording_is_a_pytorch_snapshot():
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        r, trace = _run_capi(tmp)
        assert r.returncode == 0, r.stdout + r.stderr
        for path in (trace, tmp / "on_demand.pickle"):
            assert path.is_file(), f"{path} was not written"
            with open(path, "rb") as f:
                snap = pickle.load(f)
            assert set(snap) >= {"segments", "device_traces"}
            actions = [e["action"] for e in snap["device_traces"][0]]
            for a in ("segment_alloc", "alloc", "free_requested", "free_completed", "segment_free", "oom"):
                assert a in actions, f"{path.name}: no {a} event"
            assert snap["segments"], "the block alive at exit must show in segments"
            allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
            assert allocs[0]["size"] == 512 and allocs[0]["time_us"] > 0
        # PyTorch's own viewer takes it...
        html = tmp / "out.html"
        if not torch_importable():
            return
        v = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(trace), "-o", str(html)],
                           capture_output=True, text=True, timeout=300)
        assert v.returncode == 0, v.stderr
        assert html.stat().st_size > 0
        # ...and so does the repository's CSV converter (the replay tool's input path).
        conv = TOOLS / "trace_to_csv.py"
        if conv.is_file():
            c = subprocess.run([sys.executable, str(conv), str(trace)], capture_output=True, text=True, timeout=300)
            assert c.returncode == 0, c.stderr
            assert c.stdout.splitlines()[0].startswith("action,addr,size,stream")


def test_record_max_entries_keeps_the_newest():
    with tempfile.TemporaryDirectory() as d:
        r, trace = _run_capi(Path(d), ",record_max_entries:5")
        assert r.returncode == 0, r.stdout + r.stderr
        with open(trace, "rb") as f:
            snap = pickle.load(f)
        assert len(snap["device_traces"][0]) == 5


# ---- scripts --------------------------------------------------------------------------------

def test_train_example_runs_on_cpu():
    _need_torch()
    r = subprocess.run([sys.executable, str(TRAIN_SCRIPT), "--device", "cpu", "--steps", "3", "--hidden", "32",
                        "--features", "16", "--batch", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "done: 3 steps" in r.stdout


def test_validation_workloads_run_on_cpu_at_tiny_scale():
    """bench/validation/workloads.py: every held-out workload builds and steps on a CPU at
    scale="tiny" (torch.compile with the "eager" backend there), so the recording script's
    workloads stay runnable without a GPU."""
    _need_torch()
    path = REPO / "bench" / "validation" / "workloads.py"
    if not path.is_file():
        skip("bench/validation/workloads.py is not in this checkout")
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(REPO / 'bench' / 'e2e')!r})\n"
        "from run_e2e import workloads_module\n"
        "m = workloads_module('llm_generate')\n"
        "for name in m.WORKLOADS:\n"
        "    w = m.build(name, torch.device('cpu'), 0, 'tiny')\n"
        "    for i in range(2):\n"
        "        w.step(i)\n"
        "    print('ok', name)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert done == ["llm_generate", "llm_serve", "moe_train", "unet_train", "vit_ckpt", "lstm_lm",
                    "compiled_gpt", "cudagraph_mlp", "offload_train", "comm_overlap", "stream_weights"], r.stdout


def built_replay(script, trace) -> list[str]:
    """The cachealloc-replay binaries of the build trees here, the most recently built first (an
    older tree may lack newer options; skips the test when the script, the trace or a built binary
    is missing)."""
    import glob

    if not script.is_file() or not trace.is_file():
        skip(f"{script.name} or {trace.name} is not in this checkout")
    found = sorted(glob.glob(str(REPO / "build*" / "bench" / "replay" / "cachealloc-replay")),
                   key=os.path.getmtime, reverse=True)
    if not found:
        skip("cachealloc-replay is not built (cmake --build build --target cachealloc-replay)")
    return found


def test_validation_replay_table_lists_every_policy_and_says_where_defrag_misses(tmp_path):
    """bench/validation/replay_table.py on the smallest held-out recording (cudagraph_mlp), with
    the cachealloc-replay of a build tree: one row, a ratio for every policy and expandable
    segments, the native model's fidelity, a summary line; a missing binary is a clear error."""
    script = REPO / "bench" / "validation" / "replay_table.py"
    trace = REPO / "bench" / "validation" / "recordings" / "cudagraph_mlp.pickle.xz"
    found = built_replay(script, trace)
    out = tmp_path / "table.md"
    r = subprocess.run([sys.executable, str(script), "--replay", found[0], "--out", str(out), "--json",
                        str(tmp_path / "rows.json"), str(trace)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    table = out.read_text()
    row = [line for line in table.splitlines() if line.startswith("| cudagraph_mlp")]
    assert len(row) == 1, table
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    ratios = cells[4:9]  # native, expandable, async, size_class, defrag
    for cell in ratios:
        assert float(cell.strip("*").split()[0]) >= 1.0, row[0]
    assert "diverges at event" in cells[-1] or cells[-1] == "MATCH"
    assert "defrag at most 1.02 of peak requested on" in table
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert set(rows[0]["policies"]) >= {"native", "expandable", "defrag"}
    bad = subprocess.run([sys.executable, str(script), "--replay", str(tmp_path / "missing"), str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not an executable" in bad.stderr


def test_replay_explain_prints_defrag_slack_history(tmp_path):
    """cachealloc-replay --explain: for defrag, a line per moment that decided what it holds
    (here the shared two-stream trace with the GPU 5 ms behind: growths beyond the slack and the
    switch to moving pending), the same events in --json's slack_history; none for size_class."""
    trace = REPO / "tests" / "data" / "traces" / "mlp_two_streams.pickle.xz"
    found = built_replay(trace, trace)
    out = tmp_path / "r.json"
    r = subprocess.run([found[0], str(trace), "-q", "-p", "defrag", "-p", "size_class", "--gpu-lag-us", "5000",
                        "--explain", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("  defrag, the moments that decided what it holds")]
    assert len(head) == 1, r.stdout
    body = []
    for line in lines[head[0] + 1:]:
        if not line.startswith("    "):
            break
        body.append(line)
    policies = {p["name"]: p for p in json.loads(out.read_text())["policies"]}
    history = policies["defrag"]["slack_history"]
    assert len(body) == len(history) > 0
    assert "slack_history" not in policies["size_class"]
    assert any("switched to moving pending" in line for line in body), body
    beyond = [e for e in history if e["event"] == "beyond_slack"]
    assert {e["label"] for e in beyond} == {"pages created beyond the slack"}
    assert beyond and all(e["pages"] > 0 for e in beyond)
    assert [e["time_s"] for e in history] == sorted(e["time_s"] for e in history)
    # Note [A history of the time budget]: the windows over the budget and the growths that
    # waited, a line each (up to 40), in step with --json's budget_windows and costly_growths.
    windows = policies["defrag"]["budget_windows"]
    growths = policies["defrag"]["costly_growths"]
    assert "budget_windows" not in policies["size_class"]
    over = [w for w in windows if w["verdict"] != "within"]
    assert any(w["verdict"] == "switched" for w in over), windows  # the switch in the history above
    assert all(w["spent_ns"] > w["allowed_ns"] for w in over)
    summary = [line for line in lines if line.startswith("  defrag: ") and "windows of the move budget judged" in line]
    assert summary == [f"  defrag: {len(windows)} windows of the move budget judged, "
                       f"{len(windows) - len(over)} within it, {len(over)} over"], r.stdout
    waited = [g for g in growths if g["waits"] > 0]
    wait_lines = [line for line in lines if line.startswith("    ") and " wait" in line and " moved, " in line]
    assert len(wait_lines) == min(len(waited), 40) > 0, r.stdout
    assert any(line.endswith(f"{len(waited)} of {len(growths)} growths that moved pages or waited waited, "
                             f"{sum(g['waited_ns'] for g in waited) / 1e6:.2f} ms in all; "
                             f"{sum(1 for g in waited if g['new_peak'])} of them at a new peak "
                             f"({sum(g['waited_ns'] for g in waited if g['new_peak']) / 1e6:.2f} ms)")
               for line in lines), r.stdout


def test_replay_stream_lags_and_the_live_plus_pending_floor(tmp_path):
    """cachealloc-replay on a GPU run of a job that hands memory between streams (offload_train
    under defrag on an H100, bench/validation/gpu_runs): the live + pending floor and, with
    --stream-lags, how far behind each of its two streams ran; the recorded peak in the table and
    the floor and flag in --json; every policy at or above the floor."""
    trace = REPO / "bench" / "validation" / "gpu_runs" / "defrag" / "offload_train.pickle.xz"
    found = built_replay(trace, trace)
    out = tmp_path / "r.json"
    r = subprocess.run([found[0], str(trace), "-q", "-p", "defrag", "-p", "native", "-c",
                        "native=expandable_segments:True", "--stream-lags", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "recorded        11,450,449,920" in r.stdout, r.stdout
    assert "live + pending: peak " in r.stdout, r.stdout
    busy = [line for line in r.stdout.splitlines() if line.startswith("stream ") and " busy by " in line]
    assert len(busy) == 2, r.stdout
    j = json.loads(out.read_text())
    assert j["stream_lags"] is True
    assert j["peak_live_pending_bytes"] > j["peak_requested_bytes"]
    for p in j["policies"]:
        assert p["peak_reserved_bytes"] >= j["peak_live_pending_bytes"], p["name"]
    # Event queries per 1,000 allocations only where late frees wait for the job's own streams
    # (--late-frees-on-other-stream): a number for every policy, in step with --json's counts.
    assert "event queries per 1,000 allocations" not in r.stdout, r.stdout
    o = subprocess.run([found[0], str(trace), "-q", "-p", "defrag", "-p", "native", "--stream-lags",
                        "--late-frees-on-other-stream", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert o.returncode == 0, o.stderr
    line = next(x for x in o.stdout.splitlines() if x.startswith("event queries per 1,000 allocations:"))
    printed = dict(re.findall(r" (\w+) (\d+)", line.split(":", 1)[1]))
    assert set(printed) == {"defrag", "native"}, line
    allocs = int(re.search(r" (\d+) allocations,", o.stdout).group(1))  # the trace's header line
    for p in json.loads(out.read_text())["policies"]:
        assert p["event_queries"] > 0, p["name"]
        assert int(printed[p["name"]]) == round(1000 * p["event_queries"] / allocs), (p, line)


def test_devset_compares_defrag_variants_against_expandable(tmp_path):
    """bench/validation/devset.py on one shared trace at two lags with two variants: a row per
    (trace, lag) with expandable's ratio and each variant's, a summary per variant that compares
    the second with the first; bad variants are a clear error (exit 2)."""
    script = REPO / "bench" / "validation" / "devset.py"
    trace = REPO / "tests" / "data" / "traces" / "mlp_two_streams.pickle.xz"
    found = built_replay(script, trace)
    out = tmp_path / "devset.md"
    r = subprocess.run([sys.executable, str(script), "--replay", found[0], "--variant", "shipped=",
                        "--variant", "held=max_grow_slack:0.01", "--variant", "dear=",
                        "--call-cost", "dear=map=550", "--lags", "0,2000", "--jobs", "2",
                        "--out", str(out), str(trace)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| traces/mlp_two_streams")]
    assert [row.split("|")[2].strip() for row in rows] == ["0", "2"], table
    for row in rows:
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
        assert all(1.0 <= float(x) < 1.5 for x in cells[2:6]), row
    assert "- shipped: mean " in table and "at most 1.02 on" in table
    assert "- held: mean " in table and "against shipped: lower on" in table
    late = re.search(r"- shipped: .*; ([\d,]+) device calls in the last quarter of the replays, on (\d+) of 2",
                     table)
    assert late, table  # defrag's device calls in the last quarter of each replay (--phases 4)
    assert "fewer late device calls on" in table
    assert "- dear: mean " in table  # the same policy with maps ten times dearer
    # A GPU recording of a job with a copy stream, its late frees waiting for the other stream:
    # named by its path under gpu_runs/, its peak also judged against the live + pending peak.
    gpu_run = REPO / "bench" / "validation" / "gpu_runs" / "h100_s42" / "offload_train_r2.pickle.xz"
    g = subprocess.run([sys.executable, str(script), "--replay", found[0], "--variant", "shipped=",
                        "--lags", "0", "--late-frees-on-other-stream", str(gpu_run)],
                       capture_output=True, text=True, timeout=300)
    assert g.returncode == 0, g.stderr
    assert "| gpu_runs/h100_s42/offload_train_r2 | 0 |" in g.stdout, g.stdout
    floor = re.search(r"mean (\d+\.\d+) of the live \+ pending peak; device calls (\d+\.\d+) s", g.stdout)
    assert floor and float(floor.group(1)) >= 1.0 and float(floor.group(2)) > 0, g.stdout
    for bad, message in ((["--variant", "nameonly"], "NAME=SETTINGS"),
                         (["--variant", "a=", "--env", "b=X=1"], "NAME=VAR=VALUE"),
                         (["--variant", "a=", "--call-cost", "a=map"], "NAME=KIND=MICROSECONDS"),
                         (["--variant", "a=", "--lags", "-5"], "--lags")):
        b = subprocess.run([sys.executable, str(script), "--replay", found[0], *bad, str(trace)],
                           capture_output=True, text=True, timeout=60)
        assert b.returncode == 2 and message in b.stderr, (bad, b.stderr)


def test_e2e_runner_help_and_plan():
    runner = _need_e2e_runner()
    h = subprocess.run([sys.executable, str(runner), "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0, h.stderr
    assert "--steps" in h.stdout and "--reps" in h.stdout and "--configs" in h.stdout
    p = subprocess.run([sys.executable, str(runner), "--dry-run", "--reps", "2", "--workloads", "gpt2",
                        "--configs", "native,expandable,cachealloc:size_class"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    runs = [line for line in p.stdout.splitlines() if line.startswith("run ")]
    assert len(runs) == 6
    # interleaved: A B C A B C
    assert [r.split()[3] for r in runs] == ["native", "expandable", "cachealloc:size_class"] * 2
    # extra settings ride on the configuration's name
    p = subprocess.run([sys.executable, str(runner), "--dry-run", "--reps", "1", "--workloads", "pipeline",
                        "--configs", "cachealloc:async+async_cache_mb:0+async_cache_max_block:64KB"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "CACHEALLOC_CONF=policy:async,async_cache_mb:0,async_cache_max_block:64KB" in p.stdout, p.stdout


def test_e2e_time_budget_keeps_steps_or_shortens_them(tmp_path):
    """--time-budget-s smaller than one round: by default (--fit reps) only the first round runs
    and every run keeps its measured steps; --fit steps runs every round, the later ones shorter.
    Both say so on stdout and in the report (a smoke run of the harness on the CPU)."""
    runner = _need_e2e_runner()
    if not torch_importable():
        skip("torch is not importable here")
    common = [sys.executable, str(runner), "--device", "cpu", "--scale", "tiny", "--workloads", "pipeline",
              "--configs", "native", "--reps", "3", "--time-budget-s", "0.001", "--out-dir", str(tmp_path)]
    r = subprocess.run([*common, "--tag", "reps"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 of 3 rounds fit --time-budget-s" in r.stdout, r.stdout
    data = json.loads(next(tmp_path.glob("e2e_*_reps.json")).read_text())
    assert [run["steps"] for run in data["runs"]] == [60], data["runs"]
    md = next(tmp_path.glob("e2e_*_reps.md")).read_text()
    assert "- 1 of 3 interleaved repetition(s)" in md and "only 1 of 3 rounds fit" in md, md
    r = subprocess.run([*common, "--tag", "steps", "--fit", "steps"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(next(tmp_path.glob("e2e_*_steps.json")).read_text())
    assert [run["steps"] for run in data["runs"]] == [60, 5, 5], data["runs"]
    md = next(tmp_path.glob("e2e_*_steps.md")).read_text()
    assert "shrunk for rounds ≥ 2 to fit the time budget: pipeline 5" in md, md


def _e2e_report(tmp_path, runs, steps):
    """Writes a run_e2e results .json of `runs` (pipeline, cachealloc:defrag; `steps`: [warm-up,
    measured]), regenerates its Markdown with --report-from and returns it."""
    runner = _need_e2e_runner()
    meta = {"date": "2026-12-03T00:00:00", "host": "test", "command": "run_e2e.py", "driver": "-", "rounds_done": 1,
            "steps": {"pipeline": steps}, "fork": {}, "gpu": "-", "torch": "-", "cuda": "-", "sampler": "nvml",
            "elapsed_s": 1.0, "cachealloc_library": "-", "estimate": "-"}
    args = {"workloads": "pipeline", "configs": "cachealloc:defrag", "steps": None, "warmup": None, "min_steps": 5,
            "reps": 1, "seed": 0, "scale": "full", "device": "cuda", "sample_ms": 1.0, "timeout_s": 180.0,
            "time_budget_s": 0.0, "no_fork": False, "zygote_timeout_s": 180.0, "out_dir": str(tmp_path), "tag": "t",
            "dry_run": False, "report_from": None, "child": False, "spec": None, "zygote": False, "config": None}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"meta": meta, "args": args, "summary": {}, "runs": runs}))
    r = subprocess.run([sys.executable, str(runner), "--report-from", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return path.with_suffix(".md").read_text()


def test_e2e_report_shows_how_allocator_time_spreads_over_steps(tmp_path):
    """--report-from: the median step's allocator time, the heaviest step's share and what that
    step did (device calls, defrag's waits), and what the steps without a device call cost,
    computed from the runs' per-step figures."""
    runner = _need_e2e_runner()
    run = {"workload": "pipeline", "config": "cachealloc:defrag", "rep": 0, "steps": 4, "warmup": 1, "ok": True,
           "median_step_s": 0.01, "peak_bytes": 3 << 30, "allocator_reserved_peak": 2 << 30,
           "allocator_ns_per_step": 400_000.0, "allocator_pct_of_step": 4.0, "device_calls_per_step": 1.0,
           "allocs_per_step": 50.0, "allocator_ns_steps": [100_000, 120_000, 1_280_000, 100_000],
           "device_calls_steps": [0, 0, 4, 0], "defrag_wait_ns_steps": [0, 0, 900_000, 0],
           "defrag_move_ns_steps": [0, 0, 1_000_000, 0],
           "counters_delta": {"allocator_ns": 1_600_000, "alloc_calls": 200, "free_calls": 200, "num_maps": 4,
                              "defrag.move_ns": 1_000_000, "defrag.wait_ns": 900_000, "defrag.stream_waits": 1,
                              "defrag.pages_moved": 8, "defrag.chunks_moved": 4,
                              "map_ns": 400_000, "create_ns": 120_000, "num_device_alloc": 2}}
    md = _e2e_report(tmp_path, [run], [1, 4])
    assert "the median measured step spent 110.0 µs in the allocator" in md, md
    assert "the heaviest step held 80% of a run's allocator time" in md, md
    assert "heaviest step of each run (µs in the allocator / device calls / µs waiting for streams): 1,280 / 4 / 900" in md, md
    assert "250.0 µs/step in growths that moved pages or waited for a stream (225.0 µs/step waiting" in md, md
    # Note [Time in device calls]: the time inside each kind of device call, per step and per call.
    assert ("130.0 µs/step in device memory calls: cuMemCreate 30.0 µs/step (0.50 calls/step, 60 µs each); "
            "cuMemMap + cuMemSetAccess (per handle) 100.0 µs/step (1.00 calls/step, 100 µs each)") in md, md
    # The steps without a device call (three of four here: 100, 120, 100 µs) over the 10 ms median step.
    assert ("steps without a device call: 3 of 4 measured steps; the allocator spent 100.0 µs in each "
            "(1.00% of the median step; per run 1.00%)") in md, md


def test_e2e_report_reads_xz_compressed_results(tmp_path):
    """--report-from takes a results file compressed with xz (bench/results keeps them so): the
    same Markdown as from the plain .json, written beside it as <stem>.md; a file that is not xz
    gets the clear error and exit code 2."""
    import lzma

    runner = _need_e2e_runner()
    run = {"workload": "pipeline", "config": "cachealloc:defrag", "rep": 0, "steps": 4, "warmup": 1, "ok": True,
           "median_step_s": 0.01, "peak_bytes": 3 << 30, "allocator_reserved_peak": 2 << 30,
           "allocator_ns_per_step": 100_000.0, "allocator_pct_of_step": 1.0, "device_calls_per_step": 0.0,
           "allocs_per_step": 50.0, "allocator_ns_steps": [100_000] * 4, "device_calls_steps": [0] * 4}
    plain = _e2e_report(tmp_path, [run], [1, 4])
    packed = tmp_path / "packed" / "r.json.xz"
    packed.parent.mkdir()
    packed.write_bytes(lzma.compress((tmp_path / "r.json").read_bytes()))
    r = subprocess.run([sys.executable, str(runner), "--report-from", str(packed)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (packed.parent / "r.md").read_text() == plain
    bad = tmp_path / "bad.json.xz"
    bad.write_bytes(b"not xz")
    r = subprocess.run([sys.executable, str(runner), "--report-from", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "cannot read it as a run_e2e results file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_e2e_report_shows_time_waiting_for_parked_frees(tmp_path):
    """--report-from: a run with wait_parked_to_grow reports the time it waited for parked frees
    and the allocator's share of the step without it."""
    run = {"workload": "pipeline", "config": "cachealloc:defrag", "rep": 0, "steps": 4, "warmup": 1, "ok": True,
           "median_step_s": 0.01, "peak_bytes": 3 << 30, "allocator_reserved_peak": 2 << 30,
           "allocator_ns_per_step": 5_000_000.0, "allocator_pct_of_step": 50.0, "device_calls_per_step": 0.0,
           "allocs_per_step": 50.0,
           "counters_delta": {"allocator_ns": 20_000_000, "alloc_calls": 200, "free_calls": 200,
                              "parked_waits": 6, "parked_wait_ns": 16_000_000}}
    md = _e2e_report(tmp_path, [run], [1, 4])
    assert ("4,000.0 µs/step waiting for frees parked behind other streams instead of growing (1.50 waits/step); "
            "without them the allocator took 10.00% of the step") in md, md


def test_e2e_report_shows_memory_in_flight(tmp_path):
    """--report-from (Note [Memory in flight]): where blocks were in flight (active peak above the
    allocated peak), the report gives per configuration the allocated and active peaks and what
    the allocator reserved beyond the active peak, from the runs' own stats; a run with nothing
    in flight adds no such line."""
    MiB = 1 << 20

    def run(rep, active):
        return {"workload": "pipeline", "config": "cachealloc:defrag", "rep": rep, "steps": 4, "warmup": 1,
                "ok": True, "median_step_s": 0.01, "peak_bytes": 9000 * MiB, "allocator_ns_per_step": 100_000.0,
                "allocator_pct_of_step": 1.0, "allocator_reserved_peak": 8000 * MiB,
                "allocator_allocated_peak": 3000 * MiB, "allocator_active_peak": active * MiB}

    md = _e2e_report(tmp_path, [run(0, 7000), run(1, 7500)], [1, 4])
    assert ("cachealloc:defrag allocated 3,000, active 7,250 [7,000–7,500], reserved beyond it 750 [500–1,000]"
            in md), md
    md = _e2e_report(tmp_path, [run(0, 3000)], [1, 4])
    assert "memory in flight" not in md, md


def test_e2e_report_shows_defrag_slack_path(tmp_path):
    """--report-from: policy defrag's slack over each run, from the history cachealloc.
    policy_report() gives (Note [A history of the slack]): each change with its time, the new
    slack, why, and the live peak then; the growths beyond the slack summed."""
    MiB = 1 << 20

    def ev(kind, t, a, b, peak, pages=0):
        return {"event": kind, "time_ns": int(t * 1e9), "slack_before": a, "slack_after": b,
                "live_bytes": peak // 2, "peak_live_bytes": peak, "reserved_bytes": peak, "pages": pages}

    history = [ev("beyond_slack", 1.0, 0.01, 0.01, 100 * MiB, 3), ev("count_raise", 1.5, 0.01, 0.02, 200 * MiB),
               ev("time_raise", 2.0, 0.02, 0.08, 1500 * MiB), ev("returned", 4.25, 0.08, 0.02, 2100 * MiB),
               ev("pending_switch", 5.0, 0.02, 0.02, 2100 * MiB), ev("beyond_slack", 6.0, 0.02, 0.02, 2100 * MiB, 5)]
    run = {"workload": "pipeline", "config": "cachealloc:defrag", "rep": 0, "steps": 4, "warmup": 1, "ok": True,
           "median_step_s": 0.01, "peak_bytes": 3 << 30, "allocator_ns_per_step": 100_000.0,
           "allocator_pct_of_step": 1.0, "defrag_slack_history": history}
    md = _e2e_report(tmp_path, [run], [1, 4])
    assert ("- cachealloc:defrag, its slack over each run's whole life (seconds after its first change or growth "
            "beyond it: the new slack, why, and the peak of live bytes then, MiB): run 1: "
            "0.50 s 0.02 (dense moves, peak 200); 1.00 s 0.08 (on time, peak 1,500); "
            "3.25 s 0.02 (undone, peak 2,100); 4.00 s slack unchanged (switched to moving pending, peak 2,100); "
            "2 growths beyond the slack, 8 pages, the last at 5.00 s") in md, md


def test_e2e_report_places_defrag_budget_in_steps(tmp_path):
    """--report-from: policy defrag's move budget over each run (Note [A history of the time
    budget]): its stream waits by measured step (warm-up as w) and each window judged over the
    budget, placed in the step it closed in, from the histories policy_report() gives."""
    MiB = 1 << 20
    t0 = 10_000_000_000  # the first measured step starts here; steps of 10 ms

    def growth(t_ms, waits, waited_ms):
        return {"time_ns": t0 + int(t_ms * 1e6), "took_ns": int((waited_ms + 1) * 1e6),
                "waited_ns": int(waited_ms * 1e6), "waits": waits, "pages_moved": 2, "pages_created": 0,
                "stream": 0, "new_peak": False, "pending": False}

    def window(open_ms, close_ms, verdict, close="aged", growths=3, waited_ms=6.0, charged_ms=8.0):
        return {"open_ns": t0 + int(open_ms * 1e6), "close_ns": t0 + int(close_ms * 1e6), "growths": growths,
                "charged_ns": int(charged_ms * 1e6), "waited_ns": int(waited_ms * 1e6), "spent_ns": int(charged_ms * 1e6),
                "allowed_ns": 100_000, "uncharged_waits": 0, "uncharged_wait_ns": 0, "slack_after": 0.01,
                "close": close, "verdict": verdict}

    growths = [growth(-5, 1, 2.0), growth(3, 0, 0.0), growth(12, 2, 4.0), growth(15, 1, 1.5)]
    windows = [window(-20, -1, "within", close="full", growths=8, waited_ms=0.0),
               window(-5, 15, "switched", growths=3, waited_ms=7.5, charged_ms=10.0)]
    run = {"workload": "offload_train", "config": "cachealloc:defrag", "rep": 0, "steps": 3, "warmup": 1,
           "ok": True, "median_step_s": 0.01, "step_s": [0.01] * 3, "peak_bytes": 3 << 30,
           "allocator_ns_per_step": 100_000.0, "allocator_pct_of_step": 1.0,
           "step_start_ns": [t0, t0 + 10_000_000, t0 + 20_000_000],
           "defrag_costly_growths": growths, "defrag_budget_windows": windows}
    md = _e2e_report(tmp_path, [run], [1, 3])
    assert ("- cachealloc:defrag, its move budget in each run (stream waits by measured step, w = warm-up; "
            "each window over the budget: the step it closed in, its charged growths, the waits' share of their "
            "time, how long it was open, why it closed and the verdict): run 1: waits step w: 1 (2.0 ms), "
            "step 1: 2 (5.5 ms); 2 windows, 1 over the budget: step 1: 3 growths, 75% waiting, open 20 ms, "
            "aged -> switched") in md, md
    del run["step_start_ns"]  # results of runs before the histories: no line, no error
    md = _e2e_report(tmp_path, [run], [1, 3])
    assert "its move budget in each run" not in md, md
    assert MiB


def test_e2e_report_splits_long_runs_in_thirds(tmp_path):
    """--report-from: a run of 30 measured steps or more gets the allocator's share of each third
    of its steps (and the device calls in it), so a policy that is still adapting in its first
    steps reads apart from one that settled; a file that is no results file is refused clearly."""
    runner = _need_e2e_runner()
    # 30 steps of 10 ms: the first ten spend 500 us each in the allocator with 2 device calls,
    # the next ten 200 us, the last ten 100 us without a call.
    ns = [500_000] * 10 + [200_000] * 10 + [100_000] * 10
    calls = [2] * 10 + [1] * 10 + [0] * 10
    run = {"workload": "pipeline", "config": "cachealloc:defrag", "rep": 0, "steps": 30, "warmup": 4, "ok": True,
           "median_step_s": 0.01, "step_s": [0.01] * 30, "peak_bytes": 3 << 30, "allocator_ns_per_step": 266_666.7,
           "allocator_pct_of_step": 2.67, "device_calls_per_step": 1.0, "allocs_per_step": 50.0,
           "allocator_ns_steps": ns, "device_calls_steps": calls, "counters_delta": {}}
    short = dict(run, config="cachealloc:size_class", steps=29, step_s=[0.01] * 29, allocator_ns_steps=ns[:29],
                 device_calls_steps=calls[:29])
    md = _e2e_report(tmp_path, [run, short], [4, 30])
    assert ("- cachealloc:defrag: allocator time by thirds of the measured steps (5-14 / 15-24 / 25-34): "
            "5.00% / 2.00% / 1.00% of their step time, device calls 20 / 10 / 0 (medians over runs)") in md, md
    assert "cachealloc:size_class: allocator time by thirds" not in md, md  # 29 steps: not split
    # Runs whose measured steps differ (later rounds shrunk by --time-budget-s) are not labelled
    # with the first run's steps.
    longer = dict(run, rep=1, steps=33, step_s=[0.01] * 33, allocator_ns_steps=ns + [100_000] * 3,
                  device_calls_steps=calls + [0] * 3)
    md = _e2e_report(tmp_path, [run, longer], [4, 30])
    assert ("- cachealloc:defrag: allocator time by thirds of the measured steps (each run's own, as its "
            "measured steps differ):") in md, md
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": []}')
    for f in (bad, tmp_path / "missing.json"):
        r = subprocess.run([sys.executable, str(runner), "--report-from", str(f)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "cannot read it as a run_e2e results file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_e2e_report_says_how_each_defrag_run_ended(tmp_path):
    """--report-from: for policy defrag, each run's peak, slack raises (on time), whether it
    switched to moving pending, the waits' share of its charged growth time and the waits' count
    and mean length (where the counters have them), from the whole run's counters, its growths
    placed above queued unmaps or at the top of a hole where there were any, those placed at the top
    of their range by top_at_limit where there were any, the slack at the end
    and the pages created beyond it (where counted), the growths that coalesced their chunks
    (where any did), and how many runs switched; runs without
    those counters get no such line."""
    runner = _need_e2e_runner()
    base = {"workload": "pipeline", "config": "cachealloc:defrag", "rep": 0, "steps": 4, "warmup": 1, "ok": True,
            "median_step_s": 0.01, "peak_bytes": 3634 << 20, "allocator_ns_per_step": 100_000.0,
            "allocator_pct_of_step": 1.0, "device_calls_per_step": 1.0, "allocs_per_step": 50.0,
            "counters_delta": {}}
    switched = dict(base, defrag_counters_run={
        "defrag.slack_raises": 1, "defrag.budget_raises": 0, "defrag.pending_switches": 1,
        "defrag.wait_ns": 5_400_000, "defrag.move_ns": 10_000_000, "defrag.placed_above_queued": 3,
        "defrag.placed_at_top": 1, "defrag.stream_waits": 4})
    stayed = dict(base, rep=1, peak_bytes=3678 << 20, defrag_counters_run={
        "defrag.slack_raises": 2, "defrag.budget_raises": 1, "defrag.pending_switches": 0,
        "defrag.wait_ns": 4_200_000, "defrag.move_ns": 10_000_000, "defrag.slack_ppm": 200_000,
        "defrag.beyond_slack_pages": 14, "defrag.placed_top_at_limit": 9,
        "defrag.coalesced_growths": 5, "defrag.chunks_coalesced": 23})
    older = dict(base, rep=2)  # an older results file: no whole-run counters
    md = _e2e_report(tmp_path, [switched, stayed, older], [1, 4])
    assert ("- cachealloc:defrag, each run's whole life (peak / slack raises / switched to moving pending / "
            "waits' share of the growths that moved or waited / stream waits and their mean length, where it "
            "waited; the slack at the end and the pages created beyond the slack, where counted; growths that "
            "coalesced their chunks, where any did): "
            "3,634 MiB / 1 (0 on time) / switched / 54% / 4 waits of 1.35 ms / "
            "placed 3 above queued unmaps, 1 at the top, "
            "3,678 MiB / 2 (1 on time) / no / 42% / 9 growths at the top of their range once moves cost too "
            "much at the limit / slack 0.200 at the end, 14 pages created beyond it / 5 growths coalesced "
            "23 chunks; "
            "switched in 1 of 2") in md, md
    md = _e2e_report(tmp_path, [older], [1, 4])
    assert "each run's whole life" not in md, md


if __name__ == "__main__":
    from _support import run_module

    sys.exit(run_module(globals()))
