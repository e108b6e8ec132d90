"""test_time_native.py: cachealloc.time_native(), the timing wrapper around PyTorch's own allocator.

``cachealloc.time_native()`` (libcachealloc_torch.so, allocator/torch/timed_allocator.h) wraps the
CUDA allocator PyTorch has (native, expandable segments, cudaMallocAsync, or cachealloc's full
adapter) in a forwarding wrapper that times allocations and frees. With it installed, PyTorch must
behave as without it (memory_stats, get_allocator_backend, record_stream, empty_cache) while the
wrapper counts and times every allocation and free.

Every check runs in a fresh interpreter (the wrapper can only be installed before CUDA starts).
The first test needs only the built library; the rest need a GPU and skip without one (pytest -rs).

    python -m pytest -q -rs tools/tests/test_time_native.py   # or: python tools/tests/test_time_native.py

Set CACHEALLOC_TORCH_LIBRARY to the library (e.g. gpu-bundle/libcachealloc_torch.so) when it is
not in a build*/ tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import (  # noqa: E402
    RECORD_STREAM_ON_BUSY_SIDE,
    need_gpu,
    parametrize,
    run_python,
    skip,
    torch_adapter_library,
)

# PyTorch's allocators, as bench/e2e/run_e2e.py sets them up: name -> PYTORCH_CUDA_ALLOC_CONF.
BACKENDS = {"native": "", "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}
BACKEND_NAME = {"native": "native", "expandable": "native", "async": "cudaMallocAsync"}


def _adapter_library() -> str:
    """libcachealloc_torch.so with the timing wrapper; skips when it is not built, or was built
    before the wrapper existed (its entry point's name is not in the file)."""
    lib = torch_adapter_library()
    if b"cachealloc_torch_time_native_install" not in Path(lib).read_bytes():
        skip(f"{lib} predates the timing wrapper: rebuild libcachealloc_torch.so "
             "(or point CACHEALLOC_TORCH_LIBRARY at a new one)")
    return lib


def _run(lib: str, backend: str, body: str, timeout: float = 600) -> str:
    """Runs `body` in a fresh interpreter under PyTorch's allocator `backend` (a BACKENDS key)
    with the timing wrapper installed first; `stats()` reads the wrapper. Returns stdout."""
    code = (
        "import torch, cachealloc\n"
        "MiB = 1 << 20\n"
        "cachealloc.time_native()\n"
        "assert cachealloc.is_native_timed()\n"
        "assert not torch.cuda.is_initialized()\n"
        "stats = cachealloc.native_allocator_stats\n"
        + body + "\nprint('CHECKS-OK')\n"
    )
    env = {"CACHEALLOC_TORCH_LIBRARY": lib}
    if BACKENDS[backend]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = BACKENDS[backend]
    r = run_python(code, timeout=timeout, **env)
    assert r.returncode == 0 and "CHECKS-OK" in r.stdout, (
        f"{backend}: exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}"
    )
    return r.stdout


# ---- without a GPU ---------------------------------------------------------------------------


@parametrize("backend", list(BACKENDS))
def test_installs_without_touching_cuda_and_keeps_the_backend_name(backend):
    lib = _adapter_library()
    out = _run(lib, backend, """
assert stats() == {'allocator_ns': 0, 'alloc_ns': 0, 'free_ns': 0, 'alloc_calls': 0, 'free_calls': 0}, stats()
cachealloc.time_native()  # a second call does nothing
print('BACKEND', torch.cuda.get_allocator_backend(), torch.cuda.is_initialized())
""")
    assert f"BACKEND {BACKEND_NAME[backend]} False" in out, out


# ---- on a GPU --------------------------------------------------------------------------------


def _need_gpu() -> str:
    lib = _adapter_library()
    need_gpu()
    return lib


@parametrize("backend", list(BACKENDS))
def test_counts_and_times_tensor_ops_and_stats_still_work(backend):
    lib = _need_gpu()
    _run(lib, backend, f"""
backend = {backend!r}
assert torch.cuda.get_allocator_backend() == {BACKEND_NAME[backend]!r}, torch.cuda.get_allocator_backend()
a = torch.randn(1024, 1024, device='cuda')
b = a @ a
c = torch.empty(0, device='cuda')  # zero bytes: counted, nothing to free
s1 = stats()
assert s1['alloc_calls'] >= 3, s1
assert s1['alloc_ns'] > 0, s1
assert torch.cuda.memory_allocated() >= 2 * 4 * MiB, torch.cuda.memory_allocated()
del a, b, c
for _ in range(20):
    x = torch.empty(int(3.5 * MiB), dtype=torch.uint8, device='cuda')
    y = (x.float() + 1).sum()
    del x, y
torch.cuda.synchronize()
s2 = stats()
assert s2['alloc_calls'] > s1['alloc_calls'] + 20, (s1, s2)
assert s2['free_calls'] >= 40, s2
assert s2['free_ns'] > 0 and s2['allocator_ns'] == s2['alloc_ns'] + s2['free_ns'], s2
# Read later, so not less, up to the clock's conversion: ticks become nanoseconds at the ratio
# measured at each read (Note [Why the TSC and not clock_gettime], tick_clock.h), which moves by
# parts per million between two reads (seen on the H200: a few ns less, failing now and then).
assert cachealloc.native_allocator_ns() >= s2['allocator_ns'] * (1 - 1e-4) - 1000, (cachealloc.native_allocator_ns(), s2)
# PyTorch's own memory API answers through the wrapper.
m = torch.cuda.memory_stats()
assert 'allocated_bytes.all.current' in m and 'reserved_bytes.all.peak' in m, sorted(m)[:20]
assert m['reserved_bytes.all.peak'] >= 4 * MiB, m['reserved_bytes.all.peak']
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
if backend != 'async':  # cudaMallocAsync has no segment snapshot
    segments = torch.cuda.memory._snapshot()['segments']
    expandable = sum(bool(s.get('is_expandable')) for s in segments)
    assert (backend == 'expandable') == (expandable > 0), (backend, expandable)
print('STATS', stats())
""")


@parametrize("backend", ["native", "expandable"])
def test_record_stream_still_defers_reuse(backend):
    """The native allocator ignores record_stream for a DataPtr whose deleter is not its own; the
    wrapper puts the inner deleter back for it (Note [Timing another allocator's frees])."""
    lib = _need_gpu()
    _run(lib, backend, RECORD_STREAM_ON_BUSY_SIDE + """
assert y.data_ptr() != ptr or side_done, 'record_stream was lost: a block still used by another stream was reused'
torch.cuda.synchronize()
""")


def test_refused_once_cuda_is_initialised():
    lib = _need_gpu()
    r = run_python(
        "import ctypes, torch, cachealloc\n"
        "from cachealloc import _lib\n"
        "torch.zeros(1, device='cuda')\n"
        "try:\n"
        "    cachealloc.time_native()\n"
        "except RuntimeError as e:\n"
        "    print('PY-REFUSED', e)\n"
        "err = ctypes.create_string_buffer(4096)\n"
        "rc = _lib.load_torch().cachealloc_torch_time_native_install(err, len(err))\n"
        "print('C-REFUSED', rc, err.value.decode())\n"
        "print('STILL', torch.cuda.get_allocator_backend(), cachealloc.is_native_timed())\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "PY-REFUSED" in r.stdout and "after CUDA was initialised" in r.stdout, r.stdout
    assert "C-REFUSED -1" in r.stdout and "already initialized" in r.stdout, r.stdout
    assert "STILL native False" in r.stdout, r.stdout


def test_times_the_full_adapter_too():
    lib = _need_gpu()
    r = run_python(
        "import torch, cachealloc\n"
        "cachealloc.enable('policy:size_class', full=True)\n"
        "cachealloc.time_native()\n"
        "assert torch.cuda.get_allocator_backend() == 'cachealloc', torch.cuda.get_allocator_backend()\n"
        "x = [torch.empty(1 << 20, device='cuda') for _ in range(10)]\n"
        "del x\n"
        "s = cachealloc.native_allocator_stats()\n"
        "assert s['alloc_calls'] >= 10 and s['free_calls'] >= 10 and s['allocator_ns'] > 0, s\n"
        "assert torch.cuda.memory_stats()['allocation.all.allocated'] >= 10\n"
        "print('CHECKS-OK', s)\n",
        CACHEALLOC_TORCH_LIBRARY=lib,
    )
    assert r.returncode == 0 and "CHECKS-OK" in r.stdout, r.stdout + r.stderr[-4000:]


if __name__ == "__main__":
    from _support import run_module

    sys.exit(run_module(globals()))
