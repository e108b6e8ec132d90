"""test_torch_adapter.py: libcachealloc_torch.so, cachealloc as PyTorch's complete CUDA allocator.

With the full adapter installed (``cachealloc.enable(conf, full=True)`` / ``full:True``),
PyTorch's own memory API must behave as with its native allocator: torch.cuda.memory_stats(),
memory_summary(), max_memory_reserved(), reset_peak_memory_stats(), empty_cache(), snapshots and
history, record_stream(), CUDA graphs, torch.cuda.MemPool and torch.compile(mode="reduce-overhead").

Every check runs in a fresh interpreter (an allocator can only be installed before CUDA starts).
The first tests need only the built library; the rest need a GPU and skip without one (pytest -rs).

    python -m pytest -q -rs tools/tests/test_torch_adapter.py   # or: python tools/tests/test_torch_adapter.py

Set CACHEALLOC_TORCH_LIBRARY to the library (e.g. gpu-bundle/libcachealloc_torch.so) and
CACHEALLOC_LIBTORCH_APP to the sample program when they are not in a build*/ tree.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import (  # noqa: E402
    RECORD_STREAM_ON_BUSY_SIDE,
    REPO,
    autoload_prefix,
    clean_env,
    need_gpu,
    parametrize,
    run_python,
    skip,
    torch_adapter_library,
)

POLICIES = ["native", "size_class", "defrag", "async"]
GRAPH_POLICIES = ["native", "size_class", "defrag"]  # policy:async refuses graphs (see README)

def _need_gpu() -> str:
    lib = torch_adapter_library()
    need_gpu()
    return lib


def _run(lib: str, policy: str, body: str, timeout: float = 600) -> str:
    """Runs `body` after installing the adapter with policy `policy` (`pytorch`: PyTorch's own
    allocator, the baseline); `policy` is defined in the body. Returns stdout."""
    install = (
        f"cachealloc.enable('policy:{policy}', full=True)\n"
        "assert cachealloc.is_full()\n"
        "assert torch.cuda.get_allocator_backend() == 'cachealloc', torch.cuda.get_allocator_backend()\n"
    ) if policy != "pytorch" else ""
    code = (
        "import gc, json, pickle, torch, cachealloc\n"
        f"policy = {policy!r}\n" + install +
        "MiB = 1 << 20\n" + body + "\nprint('CHECKS-OK')\n"
    )
    r = run_python(code, timeout=timeout, CACHEALLOC_TORCH_LIBRARY=lib)
    assert r.returncode == 0 and "CHECKS-OK" in r.stdout, (
        f"policy {policy}: exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}"
    )
    return r.stdout


# ---- without a GPU ---------------------------------------------------------------------------


def test_bad_config_is_refused_with_the_reason():
    lib = torch_adapter_library()
    r = run_python(
        "import torch, cachealloc\n"
        "try:\n"
        "    cachealloc.enable('policy:no_such_policy', full=True)\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
        "print(torch.cuda.get_allocator_backend())\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
    )
    assert r.returncode == 0, r.stderr
    assert "REFUSED" in r.stdout and "unknown policy 'no_such_policy'" in r.stdout, r.stdout
    assert "cachealloc" not in r.stdout.splitlines()[-1]  # PyTorch's allocator stayed


def test_other_torch_version_is_refused():
    lib = torch_adapter_library()
    r = run_python(
        "import torch, cachealloc\n"
        "torch.__version__ = '0.0.1'\n"
        "try:\n"
        "    cachealloc.enable('policy:size_class', full=True)\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
    )
    assert "REFUSED" in r.stdout and "built against PyTorch" in r.stdout, r.stdout + r.stderr


def test_install_sets_the_backend_name_without_touching_cuda():
    lib = torch_adapter_library()
    r = run_python(
        "import torch, cachealloc\n"
        "cachealloc.enable('policy:defrag,full:True')\n"
        "print(cachealloc.is_full(), torch.cuda.get_allocator_backend(), torch.cuda.is_initialized())\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-3:] == ["True", "cachealloc", "False"], r.stdout


# ---- on a GPU --------------------------------------------------------------------------------


@parametrize("policy", POLICIES)
def test_stats_summary_and_peaks(policy):
    lib = _need_gpu()
    _run(lib, policy, """
x = torch.empty(64 * MiB, dtype=torch.uint8, device='cuda')
s0 = torch.cuda.memory_stats()
for key in ('allocated_bytes.all.current', 'allocated_bytes.all.peak', 'reserved_bytes.all.current',
            'reserved_bytes.all.peak', 'active_bytes.all.current', 'requested_bytes.all.current',
            'allocation.all.current', 'num_alloc_retries', 'num_ooms', 'num_device_alloc', 'num_device_free'):
    assert key in s0, key
a0 = torch.cuda.memory_allocated()
assert a0 >= 64 * MiB, a0
assert torch.cuda.memory_reserved() >= a0
assert s0['num_device_alloc'] >= 1 or policy == 'async', s0
y = torch.empty(32 * MiB, dtype=torch.uint8, device='cuda')
s1 = torch.cuda.memory_stats()
grow = torch.cuda.memory_allocated() - a0
assert 32 * MiB <= grow <= 64 * MiB, grow
assert s1['requested_bytes.all.current'] - s0['requested_bytes.all.current'] == 32 * MiB
assert s1['allocation.all.current'] == s0['allocation.all.current'] + 1
assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
peak = torch.cuda.max_memory_allocated()
assert peak >= a0 + 32 * MiB
del y
assert torch.cuda.memory_allocated() == a0
assert torch.cuda.max_memory_allocated() == peak
torch.cuda.reset_peak_memory_stats()
assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == a0
assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()
summary = torch.cuda.memory_summary()
assert 'Allocated memory' in summary and 'GPU reserved memory' in summary, summary
stats = cachealloc.memory_stats()
assert stats['allocated_bytes.all.current'] == a0 and 'allocator_ns' in stats
del x
torch.cuda.synchronize()
assert torch.cuda.memory_allocated() == 0
torch.cuda.reset_accumulated_memory_stats()
assert torch.cuda.memory_stats()['allocated_bytes.all.allocated'] == 0
""")


@parametrize("policy", POLICIES)
def test_empty_cache_returns_reserved_memory(policy):
    lib = _need_gpu()
    _run(lib, policy, """
x = torch.empty(512 * MiB, dtype=torch.uint8, device='cuda')
del x
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
assert before >= 512 * MiB or policy == 'async', before
torch.cuda.empty_cache()
after = torch.cuda.memory_reserved()
assert after < 512 * MiB, (before, after)
cachealloc.empty_cache()
z = torch.ones(1000, device='cuda')
assert float(z.sum()) == 1000.0
""")


@parametrize("policy", POLICIES)
def test_snapshot_history_and_memory_viz(policy):
    lib = _need_gpu()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "snap.pickle"
        _run(lib, policy, f"""
torch.cuda.memory._record_memory_history(max_entries=100000)
x = torch.randn(1 << 20, device='cuda')
y = x * 2
del y
snap = torch.cuda.memory._snapshot()
assert set(('segments', 'device_traces')) <= set(snap), snap.keys()
actions = [e['action'] for e in snap['device_traces'][0]]
assert 'alloc' in actions and 'free_requested' in actions and 'free_completed' in actions, actions
assert all('time_us' in e and 'addr' in e and 'size' in e for e in snap['device_traces'][0])
sizes = [e['size'] for e in snap['device_traces'][0] if e['action'] == 'alloc']
assert 4 * MiB in sizes, sizes
if policy != 'async':  # the stream-ordered pool cannot list its segments
    segs = snap['segments']
    assert segs, snap
    assert sum(s['allocated_size'] for s in segs) >= 4 * MiB
    for s in segs:
        assert sum(b['size'] for b in s['blocks']) == s['total_size'], s
        assert s['allocated_size'] <= s['total_size']
    assert any(b['state'] == 'active_allocated' for s in segs for b in s['blocks'])
torch.cuda.memory._dump_snapshot({str(path)!r})
with open({str(path)!r}, 'rb') as f:
    loaded = pickle.load(f)
assert loaded['device_traces'][0], loaded
from torch.cuda import _memory_viz
html = _memory_viz.trace_plot(loaded)
assert len(html) > 1000
if policy != 'async':
    html = _memory_viz.segment_plot(loaded)
    assert len(html) > 1000
torch.cuda.memory._record_memory_history(enabled=None)
""")
        assert path.stat().st_size > 0


@parametrize("policy", POLICIES)
def test_record_stream_defers_reuse(policy):
    lib = _need_gpu()
    _run(lib, policy, RECORD_STREAM_ON_BUSY_SIDE + """
# The block may come back only once the side stream finished with it: handed out again while
# the side stream still runs is the bug. (Waiting for the side stream, then reusing, is sound.)
if policy != 'async':  # the async pool may reuse it behind an event dependency instead
    assert y.data_ptr() != ptr or side_done, 'a block still used by another stream was reused'
torch.cuda.synchronize()
z = [torch.empty(8 * MiB, dtype=torch.uint8, device='cuda') for _ in range(4)]
torch.cuda.synchronize()
""")


@parametrize("policy", GRAPH_POLICIES)
def test_cuda_graph_capture_replay_and_pool_release(policy):
    lib = _need_gpu()
    body = """
def private(snap):
    return [s for s in snap['segments'] if tuple(s['segment_pool_id']) != (0, 0)]

static_in = torch.randn(1024, 1024, device='cuda')
w = torch.randn(1024, 1024, device='cuda')
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        warm = (static_in @ w).relu() + 1
torch.cuda.current_stream().wait_stream(side)
del warm
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    tmp = (static_in @ w).relu()
    static_out = tmp + 1
    del tmp
static_in.copy_(torch.randn(1024, 1024, device='cuda'))
g.replay()
torch.cuda.synchronize()
ref = (static_in @ w).relu() + 1
assert torch.allclose(static_out, ref, rtol=1e-3, atol=1e-3)

ranges = [(s['address'], s['address'] + s['total_size']) for s in private(torch.cuda.memory._snapshot())]
assert ranges, 'no private pool segment after capture'
eager = [torch.empty(1 * MiB, dtype=torch.uint8, device='cuda') for _ in range(64)]
assert not any(lo <= t.data_ptr() < hi for t in eager for lo, hi in ranges), 'eager block inside a graph pool'
for _ in range(10):
    static_in.normal_()
    g.replay()
torch.cuda.synchronize()
assert torch.allclose(static_out, (static_in @ w).relu() + 1, rtol=1e-3, atol=1e-3)

# A second graph sharing the pool.
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=g.pool()):
    out2 = static_out * 2
g2.replay()
torch.cuda.synchronize()
assert torch.allclose(out2, static_out * 2)

del g, g2, static_out, out2, eager
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
left = private(torch.cuda.memory._snapshot())
# What PyTorch itself leaves in a released graph pool (cuBLAS keeps a workspace it allocated
# during capture) is the baseline: the test compares with it.
print('LEFTOVER', sum(s['allocated_size'] for s in left), len(left),
      [(s['total_size'], [(b['size'], b['state']) for b in s['blocks']][:4]) for s in left][:4])
assert torch.cuda.memory_stats()['num_ooms'] == 0
"""
    out = _run(lib, policy, body)
    base = _run(lib, "pytorch", body)
    ours_alloc, ours_segs = (int(x) for x in out.split("LEFTOVER ")[1].split()[:2])
    base_alloc, base_segs = (int(x) for x in base.split("LEFTOVER ")[1].split()[:2])
    assert ours_alloc <= base_alloc, f"released graph pool keeps more live bytes than under PyTorch: {out} vs {base}"
    assert base_segs > 0 or ours_segs == 0, f"the private pool outlived its graphs and tensors: {out} vs {base}"


@parametrize("policy", GRAPH_POLICIES)
def test_make_graphed_callables_trains(policy):
    lib = _need_gpu()
    _run(lib, policy, """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 64, device='cuda')
target = torch.randn(32, 8, device='cuda')
graphed = torch.cuda.make_graphed_callables(model, (x,))
losses = []
for _ in range(20):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(graphed(x), target)
    loss.backward()
    opt.step()
    losses.append(float(loss))
assert losses[-1] < losses[0], losses
""")


@parametrize("policy", GRAPH_POLICIES)
def test_mempool_routes_allocations(policy):
    lib = _need_gpu()
    _run(lib, policy, """
pool = torch.cuda.MemPool()
assert pool.use_count() == 1
with torch.cuda.use_mem_pool(pool):
    a = torch.empty(16 * MiB, dtype=torch.uint8, device='cuda')
assert pool.use_count() == 1
b = torch.empty(16 * MiB, dtype=torch.uint8, device='cuda')
segs = pool.snapshot()
assert segs and all(tuple(s['segment_pool_id']) == tuple(pool.id) for s in segs), segs
inside = lambda t: any(s['address'] <= t.data_ptr() < s['address'] + s['total_size'] for s in segs)
assert inside(a) and not inside(b)
assert torch.cuda.memory_allocated() >= 32 * MiB
del a, pool
gc.collect()
torch.cuda.empty_cache()
assert not [s for s in torch.cuda.memory._snapshot()['segments'] if tuple(s['segment_pool_id']) != (0, 0)]
""")


def test_async_policy_refuses_graphs_clearly():
    lib = _need_gpu()
    _run(lib, "async", """
pool = torch.cuda.MemPool()
try:
    with torch.cuda.use_mem_pool(pool):
        torch.empty(10, device='cuda')
    raise AssertionError('use_mem_pool worked under policy:async')
except RuntimeError as e:
    assert 'does not support CUDA graph capture' in str(e), e
x = torch.ones(10, device='cuda')
assert float(x.sum()) == 10.0
""")


@parametrize("policy", GRAPH_POLICIES)
def test_torch_compile_reduce_overhead(policy):
    lib = _need_gpu()
    _run(lib, policy, """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
compiled = torch.compile(model, mode='reduce-overhead')
x = torch.randn(64, 128, device='cuda')
with torch.no_grad():
    for _ in range(6):
        out = compiled(x).clone()
    ref = model(x)
torch.cuda.synchronize()
assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
""", timeout=900)


@parametrize("policy", POLICIES)
def test_out_of_memory_raises_and_notifies_observers(policy):
    lib = _need_gpu()
    _run(lib, policy, """
seen = []
torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(args))
try:
    torch.empty(1 << 45, dtype=torch.uint8, device='cuda')
    raise AssertionError('32 TiB were allocated')
except torch.OutOfMemoryError as e:
    assert 'cachealloc' in str(e), str(e)
assert seen, 'the OOM observer was not called'
assert torch.cuda.memory_stats()['num_ooms'] >= 1
x = torch.ones(1000, device='cuda')
assert float(x.sum()) == 1000.0
""")


def test_enable_after_cuda_init_is_refused():
    lib = _need_gpu()
    r = run_python(
        "import torch, cachealloc\n"
        "torch.ones(1, device='cuda')\n"
        "try:\n"
        "    cachealloc.enable('policy:size_class', full=True)\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
    )
    assert "REFUSED" in r.stdout, r.stdout + r.stderr


def test_unmodified_script_with_full_key():
    lib = _need_gpu()
    r = run_python(
        autoload_prefix()
        + "import torch\n"
        "x = torch.randn(1024, 1024, device='cuda') @ torch.randn(1024, 1024, device='cuda')\n"
        "print('BACKEND', torch.cuda.get_allocator_backend(), torch.cuda.memory_allocated() > 0)\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
        CACHEALLOC_CONF="policy:defrag,full:True",
    )
    assert r.returncode == 0, r.stderr
    assert "BACKEND cachealloc True" in r.stdout, r.stdout + r.stderr


def _libtorch_app() -> str:
    env = os.environ.get("CACHEALLOC_LIBTORCH_APP")
    if env:
        return env
    found = sorted(glob.glob(str(REPO / "build*" / "bench" / "libtorch_app" / "cachealloc_libtorch_app")))
    found += sorted(glob.glob(str(REPO / "gpu-bundle" / "cachealloc_libtorch_app")))
    if not found:
        skip("cachealloc_libtorch_app is not built (cmake with LibTorch)")
    return found[0]


@parametrize("policy", POLICIES)
def test_libtorch_sample_app(policy):
    _need_gpu()
    app = _libtorch_app()
    import torch  # noqa: F401  (only to find its lib directory; CUDA is not initialised here)

    torch_lib = str(Path(torch.__file__).resolve().parent / "lib")
    env = clean_env(CACHEALLOC_CONF=f"policy:{policy}")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([torch_lib, str(Path(app).parent)] +
                                             ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    r = subprocess.run([app], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "libtorch_app: OK" in r.stdout, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "allocator 'cachealloc'" in r.stdout


if __name__ == "__main__":
    from _support import run_module

    sys.exit(run_module(globals()))
