"""test_async_stats.py: under policy `async`, cachealloc.memory_stats() agrees with the pool (issue 6).

GPU only: every check runs PyTorch in a fresh subprocess with cachealloc enabled as
`policy:async`; without a GPU or the built plugin the tests are skipped with the reason shown.

"Agree", precisely (Note [Pool attributes in the stats] in allocator/include/cachealloc/allocator.h):
the plugin's stats carry the private cudaMemPool_t's own attributes as pool.reserved_mem_current,
pool.reserved_mem_high, pool.used_mem_current, pool.used_mem_high (cudaMemPoolAttr*), with
pool.front_cache_bytes (freed blocks the policy keeps) and pool.calls, all read in one snapshot
under the allocator's lock. Then, with the default release threshold (the pool keeps everything):
  1. reserved_bytes.all.current == pool.reserved_mem_current             (exact)
  2. reserved_bytes.all.peak == pool.reserved_mem_high                     (exact; no peak reset)
  3. active_bytes.all.current + pool.front_cache_bytes <= pool.used_mem_current
                                                   <= pool.reserved_mem_current
     (the driver may round requests up, and counts a block as used until its free completed)
  4. after everything is freed, the device synchronised and empty_cache(): allocated == 0,
     pool.front_cache_bytes == 0, pool.used_mem_current == 0, and 1. still holds.

    python -m pytest -q -rs tools/tests/test_async_stats.py     # or: python tools/tests/test_async_stats.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import TRAIN_SCRIPT, need_plugin_gpu, run_python  # noqa: E402

POOL_KEYS = ("pool.reserved_mem_current", "pool.reserved_mem_high", "pool.used_mem_current", "pool.used_mem_high",
             "pool.front_cache_bytes", "pool.calls")


def _stats_lines(stdout: str) -> dict[str, dict]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("STATS "):
            tag, payload = line[len("STATS "):].split(" ", 1)
            out[tag] = json.loads(payload)
    return out


def _check_agree(s: dict, where: str) -> None:
    for k in POOL_KEYS:
        assert k in s, f"{where}: {k} missing from cachealloc.memory_stats()"
    assert s["reserved_bytes.all.current"] == s["pool.reserved_mem_current"], where
    assert s["reserved_bytes.all.peak"] == s["pool.reserved_mem_high"], where
    held = s["active_bytes.all.current"] + s["pool.front_cache_bytes"]
    assert held <= s["pool.used_mem_current"] <= s["pool.reserved_mem_current"], (where, held, s)
    assert s["allocated_bytes.all.peak"] <= s["pool.used_mem_high"], where
    print(f"{where}: used - (active + front cache) = {s['pool.used_mem_current'] - held} bytes")


_PRELUDE = (
    "import json, torch, cachealloc\n"
    "cachealloc.enable('policy:async')\n"
    "def dump(tag):\n"
    "    torch.cuda.synchronize()\n"
    "    print('STATS', tag, json.dumps(cachealloc.memory_stats()), flush=True)\n"
)


def test_async_stats_agree_with_the_pool_while_tensors_live_and_after_freeing():
    lib = need_plugin_gpu()
    body = (
        "side = torch.cuda.Stream()\n"
        "keep = [torch.empty(n, dtype=torch.uint8, device='cuda') for n in (512, 3000, 100_000, 3 << 20, 40 << 20)]\n"
        "with torch.cuda.stream(side):\n"
        "    other = [torch.empty(n, dtype=torch.uint8, device='cuda') for n in (512, 5 << 20, 300 << 20)]\n"
        "side.synchronize()\n"
        "handed = torch.ones(8 << 20, device='cuda')\n"
        "with torch.cuda.stream(side):\n"
        "    handed.record_stream(side); handed.mul_(2)\n"
        "del handed            # parked until the side stream is done with it\n"
        "freed = [torch.empty(n, dtype=torch.uint8, device='cuda') for n in (700, 64 << 10, 2 << 20)]\n"
        "del freed             # into the front cache\n"
        "dump('live')\n"
        "del keep, other\n"
        "torch.cuda.synchronize()\n"
        "cachealloc.empty_cache()\n"
        "dump('freed')\n"
        "cachealloc.check_invariants()\n"
    )
    r = run_python(_PRELUDE + body, CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    stats = _stats_lines(r.stdout)
    live, freed = stats["live"], stats["freed"]
    _check_agree(live, "live")
    assert live["allocated_bytes.all.current"] >= (3 << 20) + (40 << 20) + (300 << 20)
    assert live["pool.front_cache_bytes"] > 0, "the freed small blocks should sit in the front cache"
    assert live["pool.calls"] > 0
    _check_agree(freed, "freed")
    assert freed["allocated_bytes.all.current"] == 0
    assert freed["pool.front_cache_bytes"] == 0
    assert freed["pool.used_mem_current"] == 0


def test_async_stats_agree_with_the_pool_after_training():
    lib = need_plugin_gpu()
    body = (
        "import runpy, sys\n"
        f"sys.argv = [{str(TRAIN_SCRIPT)!r}, '--steps', '30']\n"
        f"runpy.run_path({str(TRAIN_SCRIPT)!r}, run_name='__main__')\n"
        "dump('trained')\n"
        "import gc; gc.collect(); torch.cuda.synchronize(); cachealloc.empty_cache()\n"
        "dump('emptied')\n"
    )
    r = run_python(_PRELUDE + body, CACHEALLOC_LIBRARY=lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done: 30 steps" in r.stdout
    stats = _stats_lines(r.stdout)
    _check_agree(stats["trained"], "trained")
    assert stats["trained"]["alloc_calls"] > 0 and stats["trained"]["pool.calls"] > 0
    _check_agree(stats["emptied"], "emptied")
    # What the script still references (the model, the optimizer's state) is all the pool still
    # has in use, apart from the free parts of the 2 MiB slabs whose small blocks are still live
    # (Note [Small blocks from slabs] in policies/include/cachealloc/policies/async.h): empty_cache
    # gives back every slab without a live block, so at most 2 MiB stays per live allocation, and
    # never more than before it ran.
    e = stats["emptied"]
    assert e["pool.front_cache_bytes"] <= stats["trained"]["pool.front_cache_bytes"]
    assert e["pool.front_cache_bytes"] <= (2 << 20) * e["allocation.all.current"]
    assert e["pool.front_cache_bytes"] % 512 == 0
    assert e["pool.used_mem_current"] >= e["active_bytes.all.current"]


if __name__ == "__main__":
    from _support import run_module

    sys.exit(run_module(globals()))
