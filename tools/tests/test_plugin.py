"""test_plugin.py: cachealloc as PyTorch's CUDA allocator, on a real GPU.

Every test runs PyTorch in a fresh subprocess (the allocator can only be swapped before CUDA
starts, and a process that hit an out-of-memory error is best not reused). Without a GPU, or
without the built plugin, the tests are skipped with the reason shown (pytest -rs).

    python -m pytest -q -rs tools/tests/test_plugin.py     # or: python tools/tests/test_plugin.py

The unmodified training script is run under the startup hook: through the installed .pth when
the package is installed, else by importing cachealloc._autoload first (what the .pth does).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import (  # noqa: E402
    TRAIN_SCRIPT,
    autoload_prefix,
    need_plugin_gpu,
    parametrize,
    plugin_library,
    run_python,
)



def _policies() -> list[str]:
    lib = plugin_library()
    if lib is None:
        return ["size_class"]
    r = run_python("import cachealloc, json; print(json.dumps([p['name'] for p in cachealloc.policies()]))",
                   CACHEALLOC_LIBRARY=lib)
    try:
        return json.loads(r.stdout)
    except Exception:
        return ["size_class"]


def _enabled(conf: str, body: str) -> str:
    """Code that enables cachealloc with `conf` and then runs `body`."""
    return f"import torch, cachealloc, json\ncachealloc.enable({conf!r})\n" + body


def _last_json(stdout: str, tag: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    raise AssertionError(f"no {tag} line in:\n{stdout}")


def test_unmodified_training_script_under_cachealloc():
    lib = need_plugin_gpu()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.pickle"
        code = (
            autoload_prefix()
            + "import runpy, sys, json\n"
            f"sys.argv = [{str(TRAIN_SCRIPT)!r}, '--steps', '60']\n"
            f"runpy.run_path({str(TRAIN_SCRIPT)!r}, run_name='__main__')\n"
            "import cachealloc, cachealloc._autoload as a\n"
            "print('STATUS', a.status)\n"
            "print('STATS' + json.dumps(cachealloc.memory_stats()))\n"
        )
        r = run_python(code, CACHEALLOC_CONF=f"policy:size_class,record:{trace}", CACHEALLOC_LIBRARY=lib)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "done: 60 steps" in r.stdout and "STATUS enabled" in r.stdout
        stats = _last_json(r.stdout, "STATS")
        assert stats["allocated_bytes.all.peak"] > 0
        assert stats["reserved_bytes.all.peak"] >= stats["allocated_bytes.all.peak"]
        assert stats["allocator_ns"] > 0 and stats["num_device_alloc"] > 0
        assert trace.is_file(), "the recording is written at exit"
        with open(trace, "rb") as f:
            snap = pickle.load(f)
        actions = {e["action"] for e in snap["device_traces"][0]}
        assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions
        html = Path(d) / "trace.html"
        v = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(trace), "-o", str(html)],
                           capture_output=True, text=True, timeout=300)
        assert v.returncode == 0 and html.stat().st_size > 0, v.stderr


def test_out_of_memory_raises_torch_error_and_process_recovers():
    lib = need_plugin_gpu()
    body = (
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "keep = torch.ones(1 << 20, device='cuda')\n"
        "try:\n"
        "    torch.empty(2 * total, dtype=torch.uint8, device='cuda')\n"
        "    print('NO ERROR')\n"
        "except torch.OutOfMemoryError as e:\n"
        "    print('OOM', json.dumps(str(e)))\n"
        "a = torch.randn(2048, 2048, device='cuda')\n"
        "print('AFTER', float((a @ a).sum().item()) == float((a @ a).sum().item()), keep.sum().item())\n"
        "print('STATS' + json.dumps(cachealloc.memory_stats()))\n"
    )
    r = run_python(_enabled("policy:size_class", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    oom_line = next(line for line in r.stdout.splitlines() if line.startswith("OOM"))
    message = json.loads(oom_line[4:])
    assert "cachealloc" in message and "out of memory" in message and "CACHEALLOC_CONF" in message
    assert "AFTER True 1048576.0" in r.stdout
    assert _last_json(r.stdout, "STATS")["num_ooms"] == 1


def test_empty_cache_lowers_reserved():
    lib = need_plugin_gpu()
    body = (
        "xs = [torch.empty(64 << 20, dtype=torch.uint8, device='cuda') for _ in range(8)]\n"
        "del xs\n"
        "before = cachealloc.memory_stats()['reserved_bytes.all.current']\n"
        "torch.cuda.empty_cache()\n"
        "after = cachealloc.memory_stats()['reserved_bytes.all.current']\n"
        "print('RESERVED', before, after)\n"
    )
    r = run_python(_enabled("policy:size_class", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    before, after = map(int, r.stdout.split("RESERVED", 1)[1].split())
    assert before >= 512 << 20 and after < before


def test_policy_report_gives_defrag_slack_history_on_the_gpu():
    """cachealloc.policy_report() on cuda_vmm: defrag's slack history, in step with its counters
    (Note [A history of the slack]); size_class reports {}."""
    lib = need_plugin_gpu()
    body = (
        "xs = [torch.empty((3 << 20) + 512, dtype=torch.uint8, device='cuda') for _ in range(40)]\n"
        "print('REPORT', json.dumps(cachealloc.policy_report()))\n"
        "print('STATS', json.dumps(cachealloc.memory_stats()))\n"
    )
    r = run_python(_enabled("policy:defrag,grow_slack:0,max_grow_slack:0", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    report, stats = _last_json(r.stdout, "REPORT "), _last_json(r.stdout, "STATS ")
    beyond = [e for e in report["slack_history"] if e["event"] == "beyond_slack"]
    assert len(beyond) == stats["defrag.beyond_slack_growths"] > 0, (report, stats)
    assert [e["time_ns"] for e in report["slack_history"]] == sorted(e["time_ns"] for e in report["slack_history"])
    body = "x = torch.empty(1 << 20, device='cuda')\nprint('REPORT', json.dumps(cachealloc.policy_report()))\n"
    r = run_python(_enabled("policy:size_class", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _last_json(r.stdout, "REPORT ") == {}


def test_record_stream_defers_reuse_until_the_stream_is_done():
    lib = need_plugin_gpu()
    body = (
        "side = torch.cuda.Stream()\n"
        "main = torch.cuda.current_stream()\n"
        "for i in range(20):\n"
        "    with torch.cuda.stream(side):\n"
        "        x = torch.full((1 << 22,), float(i), device='cuda')\n"
        "    main.wait_stream(side)\n"
        "    x.record_stream(main)\n"
        "    y = (x * 2).sum()\n"
        "    del x\n"
        "    assert y.item() == 2.0 * i * (1 << 22)\n"
        "torch.cuda.synchronize()\n"
        "z = torch.empty(16, device='cuda')  # lets the allocator collect completed deferred frees\n"
        "cachealloc.check_invariants()\n"
        "print('STATS' + json.dumps(cachealloc.memory_stats()))\n"
    )
    r = run_python(_enabled("policy:size_class", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    stats = _last_json(r.stdout, "STATS")
    assert stats["num_pending_frees"] == 0
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]


def test_memory_fraction_limits_allocations():
    lib = need_plugin_gpu()
    body = (
        "total = torch.cuda.get_device_properties(0).total_memory\n"
        "torch.cuda.set_per_process_memory_fraction(0.1)\n"
        "try:\n"
        "    torch.empty(int(0.2 * total), dtype=torch.uint8, device='cuda')\n"
        "    print('NO ERROR')\n"
        "except torch.OutOfMemoryError as e:\n"
        "    print('OOM', 'cachealloc' in str(e))\n"
        "ok = torch.empty(int(0.05 * total), dtype=torch.uint8, device='cuda')\n"
        "print('SMALL OK')\n"
    )
    r = run_python(_enabled("policy:size_class", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OOM True" in r.stdout and "SMALL OK" in r.stdout


def test_bad_config_stops_import_torch_with_the_key_named():
    lib = need_plugin_gpu()
    r = run_python(autoload_prefix() + "import torch\nprint('IMPORTED')\n",
                   CACHEALLOC_CONF="policy:size_class,bogus_key:1", CACHEALLOC_LIBRARY=lib)
    assert r.returncode != 0 and "IMPORTED" not in r.stdout
    assert "bogus_key" in r.stderr and "valid keys" in r.stderr


def test_threads_allocate_concurrently():
    lib = need_plugin_gpu()
    body = (
        "import threading\n"
        "errors = []\n"
        "def work(seed):\n"
        "    try:\n"
        "        g = torch.Generator(device='cuda'); g.manual_seed(seed)\n"
        "        s = torch.cuda.Stream()\n"
        "        with torch.cuda.stream(s):\n"
        "            for i in range(200):\n"
        "                n = int(torch.randint(1, 1 << 20, (1,), generator=g, device='cuda').item())\n"
        "                t = torch.empty(n, dtype=torch.uint8, device='cuda'); t.fill_(1)\n"
        "        s.synchronize()\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "torch.cuda.synchronize()\n"
        "cachealloc.check_invariants()\n"
        "print('ERRORS', errors)\n"
    )
    r = run_python(_enabled("policy:size_class", body), CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ERRORS []" in r.stdout


def test_dump_snapshot_on_demand():
    lib = need_plugin_gpu()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "snap.pickle"
        body = (
            "xs = [torch.empty(n, device='cuda') for n in (10, 1 << 20, 3 << 20)]\n"
            f"cachealloc.dump_snapshot({str(path)!r})\n"
            "print('DUMPED')\n"
        )
        r = run_python(_enabled(f"policy:size_class,record:{Path(d) / 'at_exit.pickle'}", body), CACHEALLOC_LIBRARY=lib)
        assert r.returncode == 0, r.stdout + r.stderr
        with open(path, "rb") as f:
            snap = pickle.load(f)
        assert snap["segments"] and len([e for e in snap["device_traces"][0] if e["action"] == "alloc"]) >= 3
        assert (Path(d) / "at_exit.pickle").is_file()


@parametrize("policy", _policies())
def test_every_registered_policy_trains(policy):
    lib = need_plugin_gpu()
    code = (
        f"import torch, cachealloc, json, runpy, sys\n"
        f"cachealloc.enable('policy:{policy}')\n"
        f"sys.argv = [{str(TRAIN_SCRIPT)!r}, '--steps', '40']\n"
        f"runpy.run_path({str(TRAIN_SCRIPT)!r}, run_name='__main__')\n"
        "cachealloc.check_invariants()\n"
        "torch.cuda.empty_cache()\n"
        "print('POLICY', cachealloc.policy_name())\n"
        "print('STATS' + json.dumps(cachealloc.memory_stats()))\n"
    )
    r = run_python(code, CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"POLICY {policy}" in r.stdout and "done: 40 steps" in r.stdout
    stats = _last_json(r.stdout, "STATS")
    assert stats["allocated_bytes.all.peak"] > 0


if __name__ == "__main__":
    from _support import run_module

    sys.exit(run_module(globals()))
