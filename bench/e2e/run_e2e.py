#!/usr/bin/env python3
"""run_e2e.py: PyTorch's allocators against cachealloc's policies, on real training workloads.

Every (workload, configuration, repetition) runs in a FRESH CUDA process, so each starts from an
untouched device and allocator. Repetitions are interleaved (A B C ... A B C ...), so slow drift
of the machine (clocks, temperature, other tenants) spreads over every configuration.

Fresh processes, cheaply (Note [Fork server]): one long-lived "zygote" process per configuration
imports torch, torchvision and the workloads with that configuration's environment and never
touches CUDA; each run is a child os.fork()ed from it, which initialises CUDA itself (so it is a
fresh CUDA process), enables cachealloc when asked, checks that the intended allocator is the one
in use, runs the workload and exits. A run then costs CUDA initialisation plus the workload
instead of ~10 s of Python and library start-up. --no-fork runs every run as a new interpreter
(the old behaviour); a configuration whose zygote is not fork-safe falls back to that by itself.

Note [Fork server]
PyTorch 2.11 picks its CUDA allocator backend when libc10_cuda is loaded, i.e. at `import torch`
(a static initialiser reads PYTORCH_CUDA_ALLOC_CONF): setting PYTORCH_CUDA_ALLOC_CONF=
backend:cudaMallocAsync after the import leaves get_allocator_backend() == "native" (checked on
torch 2.11.0+cu130). So one shared zygote cannot serve every configuration; each configuration
gets its own, started with exactly the environment a fresh process of that configuration would
have. A zygote is fork-safe only while CUDA was never initialised in it: it checks
torch.cuda.is_initialized() and that libcuda is not even mapped, and that it runs one thread.
Each child then verifies the allocator (allocator_check in the JSON): get_allocator_backend() is
"native" (native, expandable: plus at least one expandable segment for expandable, none for
native), "cudaMallocAsync" (async), "pluggable" with cachealloc enabled and the right policy
(cachealloc:<p>), or something that is neither of those three (cachealloc-full:<p>, the LibTorch
adapter); under +timed also that cachealloc's timing wrapper is PyTorch's allocator, before and
after the workload, and that it counted allocations in the measured steps. A failed check fails
the run. A forked run that fails the way a fork-poisoned CUDA fails is repeated as a subprocess,
and that configuration stays in subprocess mode.

Configurations (--configs, comma separated):
  native                 PyTorch's caching allocator, PYTORCH_CUDA_ALLOC_CONF unset
  expandable             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  async                  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  cachealloc:<policy>    CACHEALLOC_CONF=policy:<policy> (the plugin, through
                         CUDAPluggableAllocator; enabled by cachealloc.enable() in the child)
  cachealloc-full:<p>    CACHEALLOC_CONF=policy:<p>,full:True (the LibTorch adapter; opt-in: if
                         it is missing, each run records the error and the others go on)
  ...+key:value+...      either of the two with more CACHEALLOC_CONF settings, e.g.
                         cachealloc:async+async_cache_mb:0 (CACHEALLOC_CONF=policy:async,async_cache_mb:0)
  ...+env:NAME=VALUE     any of them with an environment variable set, for switches that are not
                         settings, e.g. cachealloc:async+env:CACHEALLOC_HOST_FENCES=1
  native+timed, expandable+timed, async+timed
                         PyTorch's allocator as above, inside cachealloc's timing wrapper
                         (cachealloc.time_native(), Note [Timing PyTorch's allocator]): its
                         allocator time is then measured exactly, as cachealloc's is. Opt-in.
  cachealloc-full:<p>+timed
                         the LibTorch adapter inside the same wrapper: the same yardstick for
                         both sides (the adapter's own allocator_ns covers only its pools)
  default: native, expandable, async and cachealloc:<p> for every registered policy.

Note [Timing PyTorch's allocator]
cachealloc measures the time inside its own alloc and free (allocator_ns, the TSC read in its
hooks); PyTorch's allocators have no such hook, so their untimed rows show only the CUDA calls
they make, a lower bound. +timed installs, at the start of the run and before CUDA is used, a thin
C++ CUDAAllocator from libcachealloc_torch.so (allocator/torch/timed_allocator.h) around whatever
allocator PyTorch has: it forwards every method and adds up, with the same TickClock, the time of
allocate/raw_alloc/raw_alloc_with_stream and of every free (tensor deleters and raw_delete), with
call counts. get_allocator_backend(), memory_stats() and snapshots answer through it as before.
Its indirection costs a little per call (a virtual call, two TSC reads, two atomic adds; for a
free also a deleter trampoline), so step times are compared on the untimed rows; the +timed rows
are for allocator µs/step, % of step and allocs/step, which they report exactly (no ≥). Needs
libcachealloc_torch.so built for the running PyTorch (like cachealloc-full).
What cachealloc's own allocator_ns leaves out: under cachealloc-full:<p> the adapter's glue around
its pools (DataPtr, per-allocation bookkeeping; session 8 on the H200: resnet50 1,760 µs/step by
the wrapper against 888 µs by allocator_ns), and under cachealloc:<p> PyTorch's
CUDAPluggableAllocator around our hooks, which +timed cannot wrap (its DataPtr context is not the
data pointer).

What is measured, the same way for every configuration, in the run's process:
  peak device memory   used = total - free of the device, sampled every --sample-ms (default
                       1 ms) by a background thread through NVML (pynvml) when importable, else
                       torch.cuda.mem_get_info; minus the used memory after CUDA initialisation
                       and before the workload's first allocation. Over the whole run (warm-up
                       included: the workloads' shape sequences are seeded, so every
                       configuration sees the same requests).
  step time            wall time of each MEASURED step (each ends with a device synchronize),
                       median per run; the table shows the median over runs and the min-max
                       of the run medians.
  allocator counters   deltas over the MEASURED steps only of the allocator's own counters
                       (cachealloc.memory_stats() for cachealloc, torch.cuda.memory_stats()
                       otherwise, where they exist): allocator_ns, alloc_calls,
                       num_device_alloc/free, num_maps/unmaps, bytes_mapped, pool.calls
                       (cudaMallocFromPoolAsync/cudaFreeAsync of policy async),
                       num_sync_all_streams, num_event_records/queries and event_ns (the
                       events cachealloc records and queries, and the time inside those calls),
                       num_alloc_retries; under +timed also the timing
                       wrapper's timed.allocator_ns, timed.alloc_ns/free_ns,
                       timed.alloc_calls/free_calls (cachealloc.native_allocator_stats()).
  allocator time/step  allocator_ns_per_step: cachealloc:<p> and cachealloc-full:<p>: time
                       inside cachealloc's pools (its own allocator_ns); +timed: the timing
                       wrapper's, everything inside the wrapped allocator's calls, exact;
                       native, expandable, async: only the CUDA allocation calls they make
                       (bench/e2e/call_timer, preloaded when built), a lower bound, flagged
                       allocator_ns_lower_bound and shown with ≥. "allocator % of step" is that
                       over the median step time; allocs/step is alloc_calls (cachealloc) or the
                       wrapper's timed.alloc_calls (+timed, zero-byte requests included);
                       "device calls/step" counts device allocs + frees + maps + unmaps + pool
                       calls.
  allocator ns per step  allocator_ns_steps in the JSON: the same allocator time (cachealloc's own,
                       or the +timed wrapper's), read after every measured step, step by step;
                       for cachealloc also device_calls_steps and, with policy defrag,
                       defrag_wait_ns_steps / defrag_move_ns_steps (time waiting for streams /
                       in growths that moved pages or waited). The report gives the median
                       step's allocator time, the heaviest step's share of the run's, and
                       the steps that made no device call (how many, and their median
                       allocator time over the median step: the allocator's floor there);
                       for runs of 30 measured steps or more also the allocator's share of
                       each third of them, and the device calls in each (a policy still
                       adapting early reads apart from one that settled).
  torch max_memory_reserved   torch.cuda.max_memory_reserved() at the end of the run: PyTorch's
                       own figure (native, expandable, async, and the LibTorch adapter); it
                       raises under the pluggable allocator (shown as –).

Steps (Note [Steps and warm-up]): defaults per workload, --steps/--warmup N override all.
  gpt2      warm-up 3, 8 measured (~170 ms a step on an H200). Shapes change every step, so
            there is no steady state by design; the warm-up covers the one-time costs (cuBLAS and
            attention kernel selection, lazy kernel loading, AdamW state on the first step).
  resnet50  warm-up 4, 20 measured (~20 ms). Fixed shapes: every allocator is in steady state
            after the first two steps (cuDNN workspaces and momentum buffers exist).
  pipeline  warm-up 4, 60 measured (~6-12 ms). Batch size changes every step; the warm-up
            covers the side stream's first record_stream hand-overs. A layout that adapts keeps
            changing for dozens of steps: with 20 measured steps (sessions 10-20) defrag was
            judged on its first ones, below expandable segments over steps 5-24 and above them
            over steps 5-64 (bench/results/defrag_session21_2026-12-04.md). 60 cost ~0.5 s a run.
  The held-out workloads of bench/validation/workloads.py run too when named in --workloads
  (never by default): llm_generate, llm_serve, moe_train, unet_train, vit_ckpt, lstm_lm,
  compiled_gpt, cudagraph_mlp, offload_train, comm_overlap, stream_weights, with the warm-up and
  measured steps of VALIDATION_STEPS (a step of the inference workloads is one request or batch:
  seconds; compiled_gpt's warm-up compiles).

--time-budget-s B: after the first round the harness prints the estimate for all --reps rounds;
if it would end past B, it runs only the rounds that fit (--fit reps, the default: every run keeps
its measured steps, so the table compares like with like) or shrinks the measured steps of the
later rounds (to at least --min-steps) so that every requested repetition still runs (--fit
steps). Shrinking changes the job: a shorter run sees fewer batch shapes (its peak) and weighs
its growth steps more (its time); session 25 lost its pipeline comparison to it (rounds of 12
measured steps beside one of 60, bench/results/defrag_session25_2026-12-05.md). Results (.md and
.json) are rewritten after every run, so a run cut by an outer timeout keeps everything measured
so far.

Results: <out-dir>/e2e_<date>[_tag].md (a Markdown table per workload, with the command, date,
GPU, torch version) and the same data, run by run, in e2e_<date>[_tag].json next to it.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import json
import lzma
import math
import os
import re
import platform
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TOOLS = REPO / "tools"
DEFAULT_WORKLOADS = ("gpt2", "resnet50", "pipeline")
STEP_DEFAULTS = {"gpt2": (3, 8), "resnet50": (4, 20), "pipeline": (4, 60)}  # (warm-up, measured)
# bench/validation/workloads.py: held-out jobs, run only when named (Note [Steps and warm-up])
VALIDATION_DIR = REPO / "bench" / "validation"
VALIDATION_STEPS = {"llm_generate": (1, 5), "llm_serve": (1, 4), "moe_train": (4, 16), "unet_train": (4, 12),
                    "vit_ckpt": (2, 8), "lstm_lm": (4, 16), "compiled_gpt": (6, 10), "cudagraph_mlp": (6, 16),
                    "offload_train": (3, 10), "comm_overlap": (3, 10), "stream_weights": (2, 8)}
STEP_DEFAULTS.update(VALIDATION_STEPS)
BUILTIN_CONFIGS = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
}
FALLBACK_POLICIES = ("native", "size_class", "defrag", "async")
COUNTER_KEYS = ("allocator_ns", "alloc_calls", "free_calls", "num_device_alloc", "num_device_free", "num_maps",
                "num_unmaps", "bytes_mapped", "bytes_unmapped", "pool.calls", "pool.ns", "num_sync_all_streams",
                "num_event_records", "num_event_queries", "event_ns",
                # time inside each kind of device memory call (Note [Time in device calls], backend.cpp)
                "reserve_ns", "release_ns", "create_ns", "release_physical_ns", "map_ns", "unmap_ns",
                # the VMM backend's unmap thread (Note [Unmapping off the allocating thread])
                "background_unmaps", "background_unmap_ns", "background_unmap_wait_ns",
                # the CUDA event pool's record thread (event_thread records or poll, record_thread.h)
                "background_event_records", "background_event_ns", "background_event_queries",
                "background_event_query_ns",
                "num_alloc_retries", "num_ooms",
                # wait_parked_to_grow (allocator.h)
                "parked_waits", "parked_wait_ns",
                # reuse_parked (Note [Reusing a parked free on the stream it waits for], allocator.h)
                "parked_reuses", "parked_reuse_bytes", "parked_reuse_waits",
                # policy defrag's own counters (DefragPolicy::stat_counters())
                "defrag.pages_moved", "defrag.chunks_moved", "defrag.stream_waits", "defrag.wait_ns",
                "defrag.move_ns", "defrag.grow_allocations", "defrag.pages_created", "defrag.slack_raises",
                "defrag.pages_moved_pending", "defrag.placed_past_queued", "defrag.placed_above_queued",
                "defrag.placed_at_top", "defrag.placed_top_at_limit",
                "defrag.budget_raises", "defrag.return_raises", "defrag.slack_returns",
                "defrag.pending_switches", "defrag.held_growths",
                # Note [Coalescing moved chunks while maps are dear] (defrag_grow.cpp)
                "defrag.coalesced_growths", "defrag.chunks_coalesced",
                # the slack in force at the end (ppm) and the pages created beyond it (Note [Why
                # pages were created beyond the slack]): did a run end at max_grow_slack?
                "defrag.slack_ppm", "defrag.beyond_slack_pages",
                # of the free pages those growths found not yet safe, how many another stream
                # held (session 38: nearly all on offload_train's replays)
                "defrag.stuck_unsafe_pages", "defrag.stuck_unsafe_other_pages",
                # the front end's step memo (Note [The step memo], allocator.h)
                "memo.served", "memo.entries", "memo.exits", "memo.replayed", "memo.verify_started",
                "memo.verify_differed", "memo.verify_not_quiet", "memo.verify_stream",
                "memo.verify_interrupted", "memo.verify_gave_up", "memo.period",
                # the timing wrapper of +timed configurations (cachealloc.native_allocator_stats())
                "timed.allocator_ns", "timed.alloc_ns", "timed.free_ns", "timed.alloc_calls", "timed.free_calls")
DEVICE_CALL_KEYS = ("num_device_alloc", "num_device_free", "num_maps", "num_unmaps", "pool.calls")
# How a CUDA process fails when it inherited CUDA state from its parent (fork after CUDA init).
FORK_POISON_MARKERS = ("initialization error", "re-initialize CUDA", "forked subprocess",
                       "cudaErrorInitializationError", "CUDA driver initialization failed")
MiB = 1 << 20


# =============================================================================================
# configurations

def registered_policies() -> list[str]:
    """cachealloc's policies from its library; the usual four when the library is not found."""
    sys.path.insert(0, str(TOOLS))
    try:
        import cachealloc

        return [p["name"] for p in cachealloc.policies() if not p.get("replay_only")]
    except Exception as e:  # library not built here: still plan (and fail visibly per run)
        print(f"run_e2e: cannot list cachealloc policies ({e}); assuming {', '.join(FALLBACK_POLICIES)}",
              file=sys.stderr)
        return list(FALLBACK_POLICIES)
    finally:
        sys.path.pop(0)


def default_configs() -> list[str]:
    return list(BUILTIN_CONFIGS) + [f"cachealloc:{p}" for p in registered_policies()]


TIMED = "timed"  # the +timed modifier (Note [Timing PyTorch's allocator])


def config_kind(name: str) -> str:
    """native | expandable | async | plugin | full."""
    base = name.split("+", 1)[0]
    if base in BUILTIN_CONFIGS:
        return base
    if name.startswith("cachealloc:"):
        return "plugin"
    if name.startswith("cachealloc-full:"):
        return "full"
    raise ValueError(f"unknown configuration {name!r}; use native, expandable, async, cachealloc:<policy> "
                     "or cachealloc-full:<policy>, each optionally with +timed or +env:NAME=VALUE")


def config_policy(name: str) -> Optional[str]:
    """The policy of cachealloc:<p>[+key:value...] (None for PyTorch's own allocators)."""
    return name.split(":", 1)[1].split("+", 1)[0] if config_kind(name) in ("plugin", "full") else None


def config_entries(name: str) -> list[str]:
    """The +entries of native+timed+env:NAME=VALUE, cachealloc:<p>+key:value+env:NAME=VALUE..."""
    if config_kind(name) in BUILTIN_CONFIGS:
        return [e for e in name.split("+")[1:] if e]
    return [e for e in name.split(":", 1)[1].split("+")[1:] if e]


def config_timed(name: str) -> bool:
    """True for ...+timed: the allocator runs inside cachealloc's timing wrapper
    (Note [Timing PyTorch's allocator]). PyTorch's allocators and cachealloc-full:<p> only."""
    if TIMED not in config_entries(name):
        return False
    if config_kind(name) == "plugin":
        raise ValueError(f"{name!r}: +timed wraps PyTorch's allocators or the LibTorch adapter "
                         "(cachealloc-full:<p>); the pluggable allocator times itself")
    return True


def config_settings(name: str) -> list[str]:
    """The extra CACHEALLOC_CONF entries of cachealloc:<p>+key:value+key:value."""
    settings = [e for e in config_entries(name) if not e.startswith("env:") and e != TIMED]
    if settings and config_kind(name) in BUILTIN_CONFIGS:
        raise ValueError(f"{name!r}: PyTorch's allocators take only +timed and +env:NAME=VALUE entries, "
                         f"not {settings[0]!r}")
    return settings


def config_extra_env(name: str) -> dict[str, str]:
    """The environment variables of ...+env:NAME=VALUE entries (switches that are not
    CACHEALLOC_CONF settings, e.g. env:CACHEALLOC_HOST_FENCES=1)."""
    out = {}
    for e in config_entries(name):
        if e.startswith("env:"):
            key, sep, value = e[4:].partition("=")
            if not sep or not key.isidentifier():
                raise ValueError(f"{name!r}: {e!r} is not env:NAME=VALUE")
            out[key] = value
    return out


def config_env(name: str) -> dict[str, str]:
    """The environment variables a configuration sets (everything else allocator-related unset)."""
    kind = config_kind(name)
    config_timed(name)  # refuses cachealloc:<p>+timed
    if kind in BUILTIN_CONFIGS:
        config_settings(name)  # refuses anything but +timed and +env:
        return {**BUILTIN_CONFIGS[kind], **config_extra_env(name)}
    policy = config_policy(name)
    if not policy:
        raise ValueError(f"{name!r}: cachealloc:<policy> needs a policy name")
    entries = [f"policy:{policy}"] + config_settings(name) + (["full:True"] if kind == "full" else [])
    return {"CACHEALLOC_CONF": ",".join(entries), **config_extra_env(name)}


def call_timer_path() -> Optional[str]:
    """libcuda_call_timer.so (bench/e2e/call_timer): $CACHEALLOC_CALL_TIMER, else next to the
    cachealloc library in gpu-bundle/ or a build directory; None when absent."""
    env = os.environ.get("CACHEALLOC_CALL_TIMER")
    candidates = [Path(env)] if env else []
    candidates += [REPO / "gpu-bundle" / "libcuda_call_timer.so"]
    candidates += sorted(REPO.glob("build*/bench/libcuda_call_timer.so"))
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    return None


def child_env(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(config_env(name))
    timer = call_timer_path()
    if config_kind(name) in BUILTIN_CONFIGS and timer:
        # Note [PyTorch's allocator time]: PyTorch's own allocators have no timing hook; the
        # preloaded timer adds up the time of the CUDA calls they make (cudaMalloc/cudaFree,
        # cudaMallocAsync/cudaFreeAsync), a lower bound of the time inside them. Under +timed
        # the wrapper gives the exact figure (Note [Timing PyTorch's allocator]); the timer's
        # part is kept beside it (cuda_call_ns_per_step).
        env["LD_PRELOAD"] = " ".join(x for x in (timer, env.get("LD_PRELOAD", "")) if x)
        env["CACHEALLOC_CALL_TIMER"] = timer
    env["PYTHONPATH"] = os.pathsep.join([str(TOOLS), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("CACHEALLOC_QUIET", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def load_workloads_file(path: Path, name: str) -> Any:
    """The Python file `path` imported as module `name`, once (bench/e2e and bench/validation both
    call theirs workloads.py, so they are loaded by path; tools/scripts/record_e2e_traces.py too)."""
    if name not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]


def workloads_module(workload: str) -> Any:
    """The module that builds `workload`: bench/e2e/workloads.py, or for the held-out workloads
    bench/validation/workloads.py (same interface)."""
    if workload not in VALIDATION_STEPS:
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        import workloads

        return workloads
    return load_workloads_file(VALIDATION_DIR / "workloads.py", "validation_workloads")


def steps_for(args: argparse.Namespace, workload: str) -> tuple[int, int]:
    """(warm-up, measured) steps of `workload` (Note [Steps and warm-up] in the docstring)."""
    warmup, steps = STEP_DEFAULTS[workload]
    return (args.warmup if args.warmup is not None else warmup, args.steps if args.steps is not None else steps)


# =============================================================================================
# one run: one workload under one configuration, in a fresh CUDA process

class MemorySampler(threading.Thread):
    """Samples the device's used memory every `interval_s` and keeps the maximum."""

    def __init__(self, torch: Any, device_index: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.kind, self._read = self._reader(torch, device_index)
        self.peak = self.read()
        self.samples = 0
        self._stop_event = threading.Event()

    @staticmethod
    def _reader(torch: Any, device_index: int):
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
            return "nvml", lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            pass

        def via_cuda() -> int:
            free, total = torch.cuda.mem_get_info(device_index)
            return int(total - free)

        return "torch.cuda.mem_get_info", via_cuda

    def read(self) -> int:
        return self._read()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                used = self._read()
            except Exception:
                break
            self.samples += 1
            if used > self.peak:
                self.peak = used
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join(timeout=5)
        try:
            self.peak = max(self.peak, self._read())
        except Exception:
            pass
        return self.peak


class AllocatorMismatch(RuntimeError):
    """The allocator in use is not the one the configuration asks for."""


def _counters(stats: dict[str, Any]) -> dict[str, int]:
    return {k: int(stats[k]) for k in COUNTER_KEYS if k in stats and stats[k] is not None}


def _timed_counters(timing: Any) -> dict[str, int]:
    """The timing wrapper's counters as timed.<key> (empty without +timed)."""
    if timing is None:
        return {}
    return {f"timed.{k}": int(v) for k, v in timing.native_allocator_stats().items()}


def _call_timer() -> Optional[Any]:
    """The preloaded CUDA call timer's reader (Note [PyTorch's allocator time]), or None."""
    path = os.environ.get("CACHEALLOC_CALL_TIMER")
    if not path or path not in os.environ.get("LD_PRELOAD", ""):
        return None
    import ctypes

    fn = ctypes.CDLL(path).cachealloc_call_timer_ns
    buf = (ctypes.c_uint64 * 6)()

    def read() -> tuple[int, int]:  # (ns, calls) in all the timed calls
        fn(buf)
        return buf[0] + buf[2] + buf[4], buf[1] + buf[3] + buf[5]

    return read


def _read_stats(torch: Any, cachealloc: Any, device: Any) -> dict[str, Any]:
    """The allocator's own statistics: cachealloc's when it is enabled, else PyTorch's ({} if neither answers)."""
    if cachealloc is not None:
        try:
            return dict(cachealloc.memory_stats(device))
        except Exception:
            pass
    try:
        return dict(torch.cuda.memory_stats(device))
    except Exception:
        return {}


def _expandable_segments(torch: Any) -> Optional[int]:
    """How many of PyTorch's segments are expandable (None: the snapshot does not say)."""
    segments = torch.cuda.memory._snapshot().get("segments", [])
    flags = [s.get("is_expandable") for s in segments]
    return None if any(f is None for f in flags) else sum(bool(f) for f in flags)


def check_timing_wrapper(config: str, timing: Any) -> None:
    """For +timed: the timing wrapper must be PyTorch's allocator (nothing replaced it since)."""
    if config_timed(config) and (timing is None or not timing.is_native_timed()):
        raise AllocatorMismatch(f"configuration {config}: cachealloc's timing wrapper is not PyTorch's CUDA "
                                "allocator (cachealloc.is_native_timed() is False)")


def check_allocator_before(torch: Any, config: str, cachealloc: Any, timing: Any = None) -> str:
    """Checks, before the workload, that the configuration's allocator is in use; returns what was seen.
    Under +timed the wrapper forwards name(), so get_allocator_backend() still names the inner one."""
    check_timing_wrapper(config, timing)
    kind = config_kind(config)
    backend = torch.cuda.memory.get_allocator_backend()
    if kind in ("native", "expandable"):
        ok = backend == "native"
    elif kind == "async":
        ok = backend == "cudaMallocAsync"
    elif kind == "plugin":
        ok = backend == "pluggable" and cachealloc is not None and cachealloc.is_enabled()
        if ok and cachealloc.policy_name() != config_policy(config):
            raise AllocatorMismatch(f"cachealloc runs policy {cachealloc.policy_name()!r}, not {config_policy(config)!r}")
    else:  # full: the LibTorch adapter replaces PyTorch's allocator itself
        ok = backend not in ("native", "cudaMallocAsync", "pluggable")
    if not ok:
        raise AllocatorMismatch(f"configuration {config} expects another allocator than "
                                f"get_allocator_backend()={backend!r}"
                                + (f", cachealloc enabled={cachealloc.is_enabled()}" if cachealloc is not None else ""))
    return backend


def check_allocator_after(torch: Any, config: str, stats_delta: dict[str, int], timing: Any = None) -> str:
    """Checks, after the workload, what only shows once memory was allocated."""
    kind = config_kind(config)
    seen = []
    if config_timed(config):
        check_timing_wrapper(config, timing)
        if stats_delta.get("timed.alloc_calls", 0) <= 0:
            raise AllocatorMismatch(f"configuration {config}: the timing wrapper counted no allocation during "
                                    "the measured steps")
        seen.append(f"{stats_delta['timed.alloc_calls']} allocations through the timing wrapper "
                    "in the measured steps")
    if kind in ("native", "expandable"):
        n = _expandable_segments(torch)
        if n is None:
            seen.append("expandable segments: not reported by this torch")
        elif (kind == "expandable") != (n > 0):
            raise AllocatorMismatch(f"configuration {config}: {n} expandable segment(s) in torch's snapshot")
        else:
            seen.append(f"{n} expandable segment(s)")
    if kind == "plugin":
        if stats_delta.get("alloc_calls", 0) <= 0:
            raise AllocatorMismatch("cachealloc counted no allocation during the measured steps")
        seen.append(f"{stats_delta['alloc_calls']} cachealloc allocations in the measured steps")
    return "; ".join(seen)


def run_workload(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs one workload under one configuration in THIS process (which must not have used CUDA
    yet) and returns the result; never raises (a failure is recorded in result['error'])."""
    result: dict[str, Any] = {k: spec[k] for k in ("workload", "config", "rep", "steps", "warmup")}
    result.update(ok=False, mode=spec.get("mode", "?"), pid=os.getpid())
    cachealloc = None
    timing = None  # the cachealloc package when +timed (Note [Timing PyTorch's allocator])
    try:
        sys.setswitchinterval(min(sys.getswitchinterval(), spec["sample_ms"] / 1000.0))
        import torch

        result["torch"] = torch.__version__
        result["cuda"] = torch.version.cuda
        kind = config_kind(spec["config"])
        if kind in ("plugin", "full"):
            if str(TOOLS) not in sys.path:
                sys.path.insert(0, str(TOOLS))
            import cachealloc as _ca

            if not _ca.is_enabled():  # the startup hook did not run (zygote, or not installed)
                _ca.enable()
                result["enabled_by"] = "cachealloc.enable() in the run"
            else:
                result["enabled_by"] = "startup hook"
            cachealloc = _ca
            # the library in use: the adapter's under full:True (the plugin may not even be built)
            result["cachealloc_library"] = _ca._lib.loaded_torch_path() if _ca.is_full() else _ca.library_path()
        if config_timed(spec["config"]):  # after enable(): under cachealloc-full the wrapper wraps the adapter
            if str(TOOLS) not in sys.path:
                sys.path.insert(0, str(TOOLS))
            import cachealloc as _ca

            _ca.time_native()  # before CUDA is used: it refuses afterwards
            timing = _ca
            result["timing_wrapper"] = _ca._lib.loaded_torch_path()
        workloads = workloads_module(spec["workload"])

        device = torch.device(spec["device"])
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        sampler: Optional[MemorySampler] = None
        baseline = 0
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.mem_get_info(device.index)  # creates the context; allocates nothing
            result["allocator_backend"] = check_allocator_before(torch, spec["config"], cachealloc, timing)
            result["gpu"] = torch.cuda.get_device_name(device)
            result["total_memory"] = torch.cuda.get_device_properties(device).total_memory
            sampler = MemorySampler(torch, device.index, spec["sample_ms"] / 1000.0)
            baseline = sampler.read()
            result["baseline_used_bytes"] = baseline
            result["sampler"] = sampler.kind
            sampler.start()
        elif cachealloc is not None:
            cachealloc = None  # a CPU smoke run: enabled, but no device to report on

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        t_build = time.perf_counter()
        wl = workloads.build(spec["workload"], device, spec["seed"], spec["scale"])
        result["description"] = wl.description
        for i in range(spec["warmup"]):
            wl.step(i)
        sync()
        result["warmup_s"] = time.perf_counter() - t_build
        before = ({**_counters(_read_stats(torch, cachealloc, device)), **_timed_counters(timing)}
                  if device.type == "cuda" else {})
        timer = _call_timer() if kind in BUILTIN_CONFIGS else None
        timer_before = timer() if timer else None
        times = []
        # Allocator ns after every measured step (outside the step's time): where in the run the
        # allocator's time goes (a job that settles spends it in its first steps).
        step_ns = None
        if device.type == "cuda":
            if timing is not None:
                step_ns = timing.native_allocator_ns
            elif kind in ("plugin", "full"):
                step_ns = lambda: cachealloc.allocator_ns(device)  # noqa: E731
        marks = [step_ns()] if step_ns is not None else None
        # cachealloc's counters after every measured step too (outside the step's time): the
        # device calls and policy defrag's waits of each step.
        step_stats = ([_counters(_read_stats(torch, cachealloc, device))]
                      if device.type == "cuda" and kind in ("plugin", "full") else None)
        step_start_ns = []  # CLOCK_MONOTONIC, the clock of the policy's histories (steady_clock)
        for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
            step_start_ns.append(time.monotonic_ns())
            t0 = time.perf_counter()
            wl.step(i)
            sync()
            times.append(time.perf_counter() - t0)
            if marks is not None:
                marks.append(step_ns())
            if step_stats is not None:
                step_stats.append(_counters(_read_stats(torch, cachealloc, device)))
        result["step_s"] = times
        result["step_start_ns"] = step_start_ns
        if marks is not None:
            result["allocator_ns_steps"] = [b - a for a, b in zip(marks, marks[1:])]
        if step_stats is not None:
            def per_step(keys: tuple[str, ...]) -> list[int]:
                return [sum(b.get(k, 0) - a.get(k, 0) for k in keys) for a, b in zip(step_stats, step_stats[1:])]
            result["device_calls_steps"] = per_step(DEVICE_CALL_KEYS)
            if "defrag.wait_ns" in step_stats[0]:
                result["defrag_wait_ns_steps"] = per_step(("defrag.wait_ns",))
                result["defrag_move_ns_steps"] = per_step(("defrag.move_ns",))
        result["median_step_s"] = median_step = statistics.median(times)
        if sampler is not None:
            peak = sampler.stop()
            result["peak_used_bytes"] = peak
            result["peak_bytes"] = peak - baseline
            result["samples"] = sampler.samples
        if device.type == "cuda":
            stats = _read_stats(torch, cachealloc, device)
            after = {**_counters(stats), **_timed_counters(timing)}
            delta = {k: after[k] - before[k] for k in after if k in before}
            steps = spec["steps"]
            result["counters_delta"] = delta
            # Policy defrag's counters over the whole run, warm-up included: what the time budget
            # decided (raises, a switch to moving pending) whether or not it fell in measured steps.
            run_counters = {k: v for k, v in after.items() if k.startswith("defrag.")}
            if run_counters:
                result["defrag_counters_run"] = run_counters
                if kind == "plugin":
                    # Note [A history of the slack]: when and why its slack moved, and the
                    # growths that went beyond it, with the live peak at each moment.
                    try:
                        report = cachealloc.policy_report(device)
                        result["defrag_slack_history"] = report.get("slack_history", [])
                        # Note [A history of the time budget]: the growths that moved pages or
                        # waited and the move budget's windows, on the clock of step_start_ns.
                        result["defrag_costly_growths"] = report.get("growths", [])
                        result["defrag_budget_windows"] = report.get("windows", [])
                    except Exception as e:  # a diagnostic: the run stands without it
                        result["defrag_slack_history_error"] = f"{type(e).__name__}: {e}"
            if kind == "plugin":
                # Note [Bookkeeping on few pages] (hot_pages.h): whether the kernel gave the
                # allocator's bookkeeping huge pages in this run.
                try:
                    result["hot_pages"] = cachealloc.hot_pages()
                except Exception as e:  # a diagnostic (an older plugin lacks it)
                    result["hot_pages_error"] = f"{type(e).__name__}: {e}"
            if "allocator_ns" in delta and kind in ("plugin", "full"):
                result["allocator_ns_per_step"] = delta["allocator_ns"] / steps
                result["allocator_pct_of_step"] = 100.0 * delta["allocator_ns"] / steps / (median_step * 1e9)
            if timer is not None and timer_before is not None:
                ns, calls = (a - b for a, b in zip(timer(), timer_before))
                result["cuda_call_ns_per_step"] = ns / steps
                result["cuda_alloc_calls_per_step"] = calls / steps
                if timing is None:  # the only figure there is: a lower bound (Note [PyTorch's allocator time])
                    result["allocator_ns_per_step"] = ns / steps
                    result["allocator_pct_of_step"] = 100.0 * ns / steps / (median_step * 1e9)
                    result["allocator_ns_lower_bound"] = True
            if "alloc_calls" in delta:
                result["allocs_per_step"] = delta["alloc_calls"] / steps
            if timing is not None and "timed.allocator_ns" in delta:
                # Exact: everything inside the wrapped allocator's calls (Note [Timing PyTorch's allocator]).
                result["allocator_ns_per_step"] = delta["timed.allocator_ns"] / steps
                result["allocator_pct_of_step"] = 100.0 * delta["timed.allocator_ns"] / steps / (median_step * 1e9)
                result["allocator_ns_lower_bound"] = False
                result["allocator_ns_source"] = "timing wrapper"
                result["allocs_per_step"] = delta["timed.alloc_calls"] / steps
                result["frees_per_step"] = delta["timed.free_calls"] / steps
            calls = [delta[k] for k in DEVICE_CALL_KEYS if k in delta]
            if calls:
                result["device_calls_per_step"] = sum(calls) / steps
            result["allocator_reserved_peak"] = stats.get("reserved_bytes.all.peak")
            result["allocator_allocated_peak"] = stats.get("allocated_bytes.all.peak")
            # Note [Memory in flight]: allocated + freed blocks another stream's queued work still
            # uses (PyTorch: blocks waiting for their record_stream events; cachealloc: parked frees).
            result["allocator_active_peak"] = stats.get("active_bytes.all.peak")
            result["num_ooms"] = stats.get("num_ooms")
            result["pool_end"] = {k: v for k, v in stats.items() if k.startswith("pool.")} or None
            try:
                result["torch_max_memory_reserved"] = int(torch.cuda.max_memory_reserved(device))
            except Exception as e:  # the pluggable allocator has no device stats
                result["torch_max_memory_reserved"] = None
                result["torch_max_memory_reserved_error"] = f"{type(e).__name__}: {str(e).strip()[:160]}"
            result["allocator_check"] = check_allocator_after(torch, spec["config"], delta, timing)
        else:
            result["allocator_check"] = "not checked: no CUDA device"
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - every failure must end up in the table
        text = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {text[0][:300] if text else ''}"
        result["traceback"] = traceback.format_exc()[-4000:]
    return result


def child_main(args: argparse.Namespace) -> int:
    """--child --spec FILE: one run in a new interpreter (--no-fork, and the fallback)."""
    spec = json.loads(Path(args.spec).read_text())
    result = run_workload(spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return 0 if result["ok"] else 1


# =============================================================================================
# the zygote (Note [Fork server]): imports once, forks one child per run

def fork_safety() -> tuple[bool, str]:
    """Whether this process may fork children that use CUDA: CUDA untouched, one thread."""
    import torch

    if torch.cuda.is_initialized():
        return False, "torch.cuda.is_initialized() is True in the zygote"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    # libcuda may be mapped without being initialised (torch 2.11's libtorch_cuda links it: seen on
    # the H200); what makes a fork unsafe is cuInit, which torch.cuda.is_initialized() covers for
    # torch, and every child checks that CUDA works (FORK_POISON_MARKERS fall back to subprocesses).
    if threading.active_count() != 1:
        return False, f"the zygote runs {threading.active_count()} threads"
    return True, "CUDA untouched, libcuda not mapped, one thread"


def _wait_child(pid: int, timeout_s: float) -> tuple[int, bool]:
    """Waits for `pid` (SIGKILL after timeout_s); returns (wait status, timed out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return status, False
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            return status, True
        time.sleep(0.005)


def zygote_main(args: argparse.Namespace) -> int:
    """--zygote --config C: reads one JSON run spec per line on stdin, forks a child for each,
    answers one JSON line per run on stdout. stdout carries nothing else."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed from here on goes to the zygote's log, not the protocol
    sys.stdout = os.fdopen(1, "w", buffering=1)
    t0 = time.perf_counter()
    ready: dict[str, Any] = {"ready": True, "config": args.config}
    try:
        import torch  # noqa: F401  - the point of the zygote: imported once

        try:
            import torchvision  # noqa: F401
        except Exception:
            pass
        sys.path.insert(0, str(HERE))
        sys.path.insert(0, str(TOOLS))
        import workloads  # noqa: F401

        if config_kind(args.config) in ("plugin", "full") or config_timed(args.config):
            import cachealloc  # noqa: F401  - the package only: no torch hooks, no library yet
        ready["import_s"] = time.perf_counter() - t0
        ready["allocator_backend_at_import"] = torch.cuda.memory.get_allocator_backend()
        ready["fork_safe"], ready["why"] = fork_safety()
    except BaseException as e:  # noqa: BLE001
        ready.update(ready=False, fork_safe=False, why=f"zygote import failed: {type(e).__name__}: {e}")
    proto.write(json.dumps(ready) + "\n")
    if not ready.get("fork_safe"):
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the run: a fresh CUDA process
            code = 1
            try:
                fd = os.open(spec["result"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                spec["mode"] = "fork"
                result = run_workload(spec)
                Path(spec["result"]).write_text(json.dumps(result))
                code = 0 if result["ok"] else 1
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        status, timed_out = _wait_child(pid, float(spec["timeout_s"]))
        proto.write(json.dumps({"pid": pid, "exit_code": os.waitstatus_to_exitcode(status),
                                "timed_out": timed_out}) + "\n")
    return 0


def file_part(config: str) -> str:
    """The configuration as part of one file name: it may carry a path (+env:CACHEALLOC_LIBRARY=/...)."""
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", config)


class Zygote:
    """The harness's handle on one configuration's zygote process."""

    def __init__(self, config: str, tmp: Path) -> None:
        self.config = config
        self.log_path = tmp / f"zygote_{file_part(config)}.log"
        self.info: dict[str, Any] = {}
        self._log = open(self.log_path, "w")
        env = child_env(config)
        env["CACHEALLOC_AUTOLOAD"] = "0"  # the startup hook must not enable (or touch CUDA) in the zygote
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote", "--config", config],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=str(REPO))

    def _readline(self, timeout_s: float) -> Optional[dict[str, Any]]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout_s, 0.0))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line.strip() else None

    def wait_ready(self, timeout_s: float) -> bool:
        reply = self._readline(timeout_s)
        self.info = reply or {"ready": False, "fork_safe": False,
                              "why": f"no answer within {timeout_s:.0f} s: {self.log_tail()}"}
        return bool(self.info.get("ready") and self.info.get("fork_safe"))

    def run(self, spec: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Forks one run; None when the zygote is gone or stopped answering."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(spec) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._readline(float(spec["timeout_s"]) + 30.0)

    def log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-3:])[-400:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# =============================================================================================
# the harness: plan, run, aggregate, report

def make_spec(args: argparse.Namespace, workload: str, config: str, rep: int, steps: int, warmup: int,
              tmp: Path) -> dict[str, Any]:
    return {"workload": workload, "config": config, "rep": rep, "steps": steps, "warmup": warmup,
            "seed": args.seed, "scale": args.scale, "device": args.device, "sample_ms": args.sample_ms,
            "timeout_s": args.timeout_s,
            "result": str(tmp / f"{workload}_{file_part(config)}_{rep}_{time.monotonic_ns()}.json")}


def _read_result(spec: dict[str, Any], exit_code: Optional[int], extra: str = "") -> dict[str, Any]:
    path = Path(spec["result"])
    if path.is_file():
        return json.loads(path.read_text())
    log = Path(spec["result"] + ".log")
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:] if log.is_file() else ""
    return {k: spec[k] for k in ("workload", "config", "rep", "steps", "warmup")} | {
        "ok": False, "error": f"exit code {exit_code}{extra}: {tail}"}


def run_subprocess(spec: dict[str, Any]) -> dict[str, Any]:
    spec = dict(spec, mode="subprocess")
    spec_path = Path(spec["result"] + ".spec")
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--spec", str(spec_path)]
    try:
        proc = subprocess.run(cmd, env=child_env(spec["config"]), capture_output=True, text=True,
                              timeout=spec["timeout_s"], cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return {k: spec[k] for k in ("workload", "config", "rep", "steps", "warmup")} | {
            "ok": False, "error": f"timeout after {spec['timeout_s']} s", "mode": "subprocess"}
    Path(spec["result"] + ".log").write_text(proc.stdout + proc.stderr)
    result = _read_result(spec, proc.returncode)
    result["exit_code"] = proc.returncode
    result.setdefault("mode", "subprocess")
    return result


def _fork_poisoned(result: dict[str, Any]) -> bool:
    text = (result.get("error") or "") + (result.get("traceback") or "")
    return not result.get("ok") and any(m in text for m in FORK_POISON_MARKERS)


class Runner:
    """Runs specs in fork mode where the configuration's zygote allows it, else as subprocesses."""

    def __init__(self, args: argparse.Namespace, configs: list[str], tmp: Path, meta: dict[str, Any]) -> None:
        self.zygotes: dict[str, Zygote] = {}
        self.meta = meta
        meta["fork"] = {}
        if args.no_fork:
            meta["fork"] = {c: "off (--no-fork)" for c in configs}
            return
        started = time.perf_counter()
        for c in configs:  # all at once: their imports overlap
            self.zygotes[c] = Zygote(c, tmp)
        for c in configs:
            z = self.zygotes[c]
            if z.wait_ready(max(5.0, args.zygote_timeout_s - (time.perf_counter() - started))):
                meta["fork"][c] = f"fork (zygote import {z.info.get('import_s', 0):.1f} s, " \
                                  f"backend at import {z.info.get('allocator_backend_at_import')})"
            else:
                self.fallback(c, f"zygote not usable: {z.info.get('why')}")
        meta["zygotes_ready_s"] = time.perf_counter() - started
        print(f"run_e2e: zygotes ready in {meta['zygotes_ready_s']:.1f} s: "
              + "; ".join(f"{c}: {m}" for c, m in meta["fork"].items()), flush=True)

    def fallback(self, config: str, why: str) -> None:
        z = self.zygotes.pop(config, None)
        if z is not None:
            z.close()
        self.meta["fork"][config] = f"subprocess ({why})"
        print(f"run_e2e: {config}: falling back to one subprocess per run: {why}", flush=True)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        z = self.zygotes.get(spec["config"])
        if z is None:
            result = run_subprocess(spec)
        else:
            reply = z.run(spec)
            if reply is None:
                self.fallback(spec["config"], f"the zygote stopped answering: {z.log_tail()}")
                result = run_subprocess(spec)
            else:
                extra = " (killed after the per-run timeout)" if reply.get("timed_out") else ""
                result = _read_result(spec, reply.get("exit_code"), extra)
                result["exit_code"] = reply.get("exit_code")
                if _fork_poisoned(result):
                    self.fallback(spec["config"], f"a forked run failed like a fork-poisoned CUDA: {result.get('error')}")
                    result = run_subprocess(spec)
        result["wall_s"] = time.perf_counter() - start
        log = Path(spec["result"] + ".log")
        if not result.get("ok") and log.is_file():
            result.setdefault("log_tail", log.read_text(errors="replace")[-2000:])
        return result

    def close(self) -> None:
        for z in self.zygotes.values():
            z.close()
        self.zygotes.clear()


def _is_timed(config: str) -> bool:
    try:
        return config_timed(config)
    except ValueError:
        return False


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _fmt_mib(values: list[float]) -> str:
    if not values:
        return "–"
    med = statistics.median(values) / MiB
    lo, hi = min(values) / MiB, max(values) / MiB
    return f"{med:,.0f} [{lo:,.0f}–{hi:,.0f}]"


def _fmt_ms(values: list[float]) -> str:
    if not values:
        return "–"
    med, lo, hi = statistics.median(values) * 1e3, min(values) * 1e3, max(values) * 1e3
    return f"{med:.2f} [{lo:.2f}–{hi:.2f}]"


def _heaviest_step(r: dict[str, Any]) -> dict[str, int]:
    """The run's measured step with the most allocator time: its ns, device calls (and waits)."""
    i = max(range(len(r["allocator_ns_steps"])), key=lambda k: r["allocator_ns_steps"][k])
    h = {"step": i, "ns": r["allocator_ns_steps"][i], "calls": r["device_calls_steps"][i]}
    if r.get("defrag_wait_ns_steps"):
        h["wait_ns"] = r["defrag_wait_ns_steps"][i]
    return h


def _defrag_run(r: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What policy defrag's time budget did over the whole run (defrag_counters_run): its peak,
    slack raises (of which on time), whether it switched to moving pending, the share of its
    charged growth time spent waiting for streams, its growths placed above queued unmaps or at
    the top of a hole, those placed at the top of their range by top_at_limit, and (where the
    counters have them) the slack at the end of the run, the
    pages created beyond the slack and the growths that coalesced their chunks (Note [Coalescing
    moved chunks while maps are dear]) (None for other allocators)."""
    c = r.get("defrag_counters_run")
    if not c or "defrag.pending_switches" not in c or r.get("peak_bytes") is None:
        return None
    move = c.get("defrag.move_ns", 0)
    waits = c.get("defrag.stream_waits")
    return {"peak": r["peak_bytes"], "raises": c.get("defrag.slack_raises", 0),
            "on_time": c.get("defrag.budget_raises", 0), "switched": bool(c["defrag.pending_switches"]),
            "wait_share": c.get("defrag.wait_ns", 0) / move if move else None,
            "waits": waits, "wait_ms": c.get("defrag.wait_ns", 0) / waits / 1e6 if waits else None,
            "above": c.get("defrag.placed_above_queued"), "top": c.get("defrag.placed_at_top"),
            "top_at_limit": c.get("defrag.placed_top_at_limit"),
            "slack": c["defrag.slack_ppm"] / 1e6 if "defrag.slack_ppm" in c else None,
            "beyond": c.get("defrag.beyond_slack_pages"),
            "coalesced": c.get("defrag.coalesced_growths"), "coalesced_chunks": c.get("defrag.chunks_coalesced")}


_SLACK_EVENT_WORDS = {"count_raise": "dense moves", "time_raise": "on time", "return_raise": "pages came back",
                      "returned": "undone", "pending_switch": "switched to moving pending",
                      "top_at_limit": "over the budget at the limit: growths at the top"}


def _slack_path(r: dict[str, Any]) -> Optional[str]:
    """Policy defrag's slack over the whole run, from its history (Note [A history of the slack]):
    each change (seconds after the history's first event, the new slack, why, and the live peak
    then, MiB), then the growths beyond the slack (how many, their pages, and when the last one
    came). None for other allocators or runs without a history."""
    h = r.get("defrag_slack_history")
    if not h:
        return None
    t0 = h[0]["time_ns"]
    parts = []
    for e in h:
        if e["event"] == "beyond_slack":
            continue
        what = _SLACK_EVENT_WORDS.get(e["event"], e["event"])
        change = f"{e['slack_after']:.4g}" if e["slack_after"] != e["slack_before"] else "slack unchanged"
        parts.append(f"{(e['time_ns'] - t0) / 1e9:.2f} s {change} ({what}, peak {e['peak_live_bytes'] / MiB:,.0f})")
    beyond = [e for e in h if e["event"] == "beyond_slack"]
    text = "; ".join(parts) if parts else f"never moved from {h[0]['slack_before']:.4g}"
    if beyond:
        text += (f"; {len(beyond)} growths beyond the slack, {sum(e['pages'] for e in beyond)} pages, "
                 f"the last at {(beyond[-1]['time_ns'] - t0) / 1e9:.2f} s")
    return text


def _step_of(r: dict[str, Any], t_ns: int) -> Optional[int]:
    """The measured step (0-based) running at t_ns on the monotonic clock, -1 before the first
    (warm-up), None after the last or where the run has no step start times."""
    starts = r.get("step_start_ns")
    if not starts:
        return None
    if t_ns < starts[0]:
        return -1
    i = bisect.bisect_right(starts, t_ns) - 1
    end = starts[i] + int(r["step_s"][i] * 1e9)
    return i if t_ns <= end or i + 1 < len(starts) else None


def _budget_path(r: dict[str, Any]) -> Optional[str]:
    """Policy defrag's move budget over a run (Note [A history of the time budget]): its waits
    by measured step (warm-up as w), and each window judged over the budget: the step it closed
    in, its charged growths, the waits' share of their time, how long it was open, why it closed
    and the verdict. None for other allocators or runs without the histories."""
    growths, windows = r.get("defrag_costly_growths"), r.get("defrag_budget_windows")
    if growths is None or windows is None or not r.get("step_start_ns"):
        return None
    def where(t: int) -> str:
        s = _step_of(r, t)
        return "w" if s == -1 else "after" if s is None else str(s)
    waits: dict[str, list[float]] = {}
    for g in growths:
        if g["waits"]:
            waits.setdefault(where(g["time_ns"]), []).append(g["waited_ns"] / 1e6)
    wait_text = ", ".join(f"step {k}: {len(v)} ({sum(v):.1f} ms)" for k, v in waits.items()) or "none"
    over = [w for w in windows if w["verdict"] != "within"]
    win_text = "; ".join(
        f"step {where(w['close_ns'])}: {w['growths']} growths, {100.0 * w['waited_ns'] / max(w['charged_ns'], 1):.0f}% "
        f"waiting, open {(w['close_ns'] - w['open_ns']) / 1e6:.0f} ms, {w['close']} -> {w['verdict']}"
        for w in over[:12]) or "none"
    if len(over) > 12:
        win_text += f"; and {len(over) - 12} more"
    return (f"waits {wait_text}; {len(windows)} windows, {len(over)} over the budget: {win_text}")


def _quiet_steps(r: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The run's measured steps without a device call: how many, their median allocator ns, and
    that over the run's median step time (None where the run has no per-step calls)."""
    ns, calls = r.get("allocator_ns_steps") or [], r.get("device_calls_steps") or []
    if not ns or len(ns) != len(calls) or not r.get("median_step_s"):
        return None
    quiet = [t for t, c in zip(ns, calls) if c == 0]
    if not quiet:
        return {"steps": 0, "of": len(ns)}
    med = statistics.median(quiet)
    return {"steps": len(quiet), "of": len(ns), "ns": med, "pct": 100.0 * med / (r["median_step_s"] * 1e9)}


def _thirds(r: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """A run of at least 30 measured steps cut in three: per third, the allocator's time over the
    third's step time and its device calls, so that a policy still adapting in its first steps and
    one that settled read apart (the pipeline: session 21). None for shorter runs."""
    ns, steps = r.get("allocator_ns_steps") or [], r.get("step_s") or []
    n = len(ns)
    if n < 30 or len(steps) != n:
        return None
    calls = r.get("device_calls_steps") or []
    k, w = n // 3, int(r.get("warmup") or 0)
    out = []
    for a, b in ((0, k), (k, 2 * k), (2 * k, n)):
        t = sum(steps[a:b])
        out.append({"first": w + a + 1, "last": w + b, "pct": 100.0 * sum(ns[a:b]) / (t * 1e9) if t > 0 else 0.0,
                    "calls": sum(calls[a:b]) if len(calls) == n else None})
    return out


def summarize(results: list[dict[str, Any]], workloads: list[str], configs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for wl in workloads:
        rows = {}
        for cfg in configs:
            runs = [r for r in results if r["workload"] == wl and r["config"] == cfg]
            ok = [r for r in runs if r.get("ok")]
            for r in ok:  # results of the older format: derive what they lack
                if r.get("allocator_pct_of_step") is None and r.get("allocator_ns_per_step") and r.get("median_step_s"):
                    r["allocator_pct_of_step"] = 100.0 * r["allocator_ns_per_step"] / (r["median_step_s"] * 1e9)

            def col(key: str) -> list[Any]:
                return [r[key] for r in ok if r.get(key) is not None]

            rows[cfg] = {
                "runs": len(runs),
                "ok": len(ok),
                "peak_bytes": col("peak_bytes"),
                "median_step_s": col("median_step_s"),
                "allocator_reserved_peak": col("allocator_reserved_peak"),
                "allocator_active_peak": col("allocator_active_peak"),
                "allocator_allocated_peak": col("allocator_allocated_peak"),
                "torch_max_memory_reserved": col("torch_max_memory_reserved"),
                "allocator_ns_per_step": col("allocator_ns_per_step"),
                "allocator_ns_lower_bound": any(r.get("allocator_ns_lower_bound") for r in ok),
                "allocator_pct_of_step": col("allocator_pct_of_step"),
                "device_calls_per_step": col("device_calls_per_step"),
                "allocs_per_step": col("allocs_per_step"),
                # Per run: the share of the measured steps' allocator time in its heaviest step,
                # and the median step's allocator time (how the time spreads over the steps).
                "heaviest_step_share": [max(r["allocator_ns_steps"]) / sum(r["allocator_ns_steps"])
                                        for r in ok if sum(r.get("allocator_ns_steps") or [0]) > 0],
                "median_step_allocator_ns": [statistics.median(r["allocator_ns_steps"])
                                             for r in ok if r.get("allocator_ns_steps")],
                "heaviest_steps": [_heaviest_step(r) for r in ok
                                   if r.get("allocator_ns_steps") and r.get("device_calls_steps")],
                # Per run: the measured steps that made no device call (cachealloc), how many,
                # and their median allocator time: the allocator's floor on this workload.
                "quiet_steps": [q for r in ok if (q := _quiet_steps(r))],
                # Per run: where the allocator's bookkeeping lived (Note [Bookkeeping on few pages]).
                "hot_pages": [r["hot_pages"] for r in ok if r.get("hot_pages")],
                # Per run (policy defrag): how its time budget ended (Note [Waits that switch to
                # moving pending]): the run-to-run spread of its peak often comes from there.
                "defrag_runs": [d for r in ok if (d := _defrag_run(r))],
                # Per run (policy defrag): its slack's path (Note [A history of the slack]).
                "slack_paths": [p for r in ok if (p := _slack_path(r))],
                # Per run (policy defrag): its waits by step and its windows over the move budget
                # (Note [A history of the time budget]).
                "budget_paths": [p for r in ok if (p := _budget_path(r))],
                # Per run of 30 measured steps or more: the allocator's share in each third.
                "thirds": [t for r in ok if (t := _thirds(r))],
                # Per run that waited for parked frees instead of growing (wait_parked_to_grow):
                # the allocator's share of the step without those waits.
                "pct_without_parked_waits": [
                    100.0 * (r["allocator_ns_per_step"] - r["counters_delta"]["parked_wait_ns"] / r["steps"])
                    / (r["median_step_s"] * 1e9)
                    for r in ok if r.get("counters_delta", {}).get("parked_waits") and r.get("allocator_ns_per_step")
                    and r.get("median_step_s")],
                "counters_delta_per_step": {
                    k: statistics.median([r["counters_delta"][k] / r["steps"] for r in ok
                                          if k in r.get("counters_delta", {})])
                    for k in COUNTER_KEYS if any(k in r.get("counters_delta", {}) for r in ok)},
                "modes": sorted({r.get("mode", "?") for r in runs}),
                "errors": sorted({r.get("error", "?") for r in runs if not r.get("ok")}),
                "description": next((r.get("description") for r in runs if r.get("description")), None),
            }
        summary[wl] = rows
    return summary


# (time counter, call counter, what the CUDA backends call) per kind of device memory call.
DEVICE_CALL_KINDS = (("reserve_ns", "num_device_alloc", "cudaMalloc"), ("release_ns", "num_device_free", "cudaFree"),
                     ("create_ns", "num_device_alloc", "cuMemCreate"),
                     ("release_physical_ns", "num_device_free", "cuMemRelease"),
                     ("map_ns", "num_maps", "cuMemMap + cuMemSetAccess (per handle)"),
                     ("unmap_ns", "num_unmaps", "cuMemUnmap"))


# Note [Memory in flight]
# A block freed while another stream's queued work still uses it (record_stream) cannot be reused
# until that work ran: PyTorch keeps it until its event completes, cachealloc parks the free. The
# peak of allocated + such blocks (active_bytes.all.peak in both) is memory no allocator that does
# not wait for the GPU can give back, and it depends on how far the host ran ahead of the streams
# in that run, which the allocator's own speed changes. So where blocks are in flight the report
# shows, per configuration, that peak and what the allocator reserved beyond it: the second is
# the allocator's doing, the first mostly the run's timing.
def in_flight_line(rows: dict[str, Any]) -> str | None:
    """Per configuration: peak allocated, peak active (allocated + in flight), reserved beyond it."""
    parts = []
    for cfg, r in rows.items():
        act, alloc, res = r.get("allocator_active_peak"), r.get("allocator_allocated_peak"), r.get("allocator_reserved_peak")
        if not act or not alloc or not res or not len(act) == len(alloc) == len(res):  # the same runs
            continue
        if max(a - b for a, b in zip(act, alloc)) <= 0:
            continue  # nothing was ever in flight
        beyond = [x - a for x, a in zip(res, act)]
        parts.append(f"{cfg} allocated {statistics.median(alloc) / MiB:,.0f}, active {statistics.median(act) / MiB:,.0f} "
                     f"[{min(act) / MiB:,.0f}–{max(act) / MiB:,.0f}], reserved beyond it {statistics.median(beyond) / MiB:,.0f} "
                     f"[{min(beyond) / MiB:,.0f}–{max(beyond) / MiB:,.0f}]")
    if not parts:
        return None
    return ("- memory in flight (Note [Memory in flight]), allocator peaks in MiB, medians [min–max] over runs: "
            "allocated, active (allocated + blocks freed while another stream's queued work still used them), and "
            "reserved beyond active: " + "; ".join(parts))


def device_call_line(cfg: str, d: dict[str, float]) -> str | None:
    """Where a configuration's device memory calls spent its time, per kind (None: no such calls)."""
    parts = []
    total = 0.0
    for ns_key, count_key, label in DEVICE_CALL_KINDS:
        ns = d.get(ns_key, 0.0)
        if ns <= 0:
            continue
        total += ns
        count = d.get(count_key, 0.0)
        each = f", {ns / count / 1e3:,.0f} µs each" if count > 0 else ""
        parts.append(f"{label} {ns / 1e3:,.1f} µs/step ({count:,.2f} calls/step{each})")
    bg = d.get("background_unmaps", 0.0)
    bg_events = d.get("background_event_records", 0.0)
    if not parts and bg <= 0 and bg_events <= 0:
        return None
    line = (f"- inside {cfg}'s allocator time: {total / 1e3:,.1f} µs/step in device memory calls: "
            + "; ".join(parts))
    if bg > 0:
        # Not allocator time: the VMM backend's own thread (Note [Unmapping off the allocating
        # thread]); only the time callers blocked on it is, and it is named here.
        line += (f". On the backend's unmap thread, outside the allocator's time: cuMemUnmap "
                 f"{d.get('background_unmap_ns', 0.0) / 1e3:,.1f} µs/step ({bg:,.2f} calls/step, "
                 f"{d.get('background_unmap_ns', 0.0) / bg / 1e3:,.0f} µs each); allocations blocked "
                 f"on it {d.get('background_unmap_wait_ns', 0.0) / 1e3:,.1f} µs/step")
    if bg_events > 0:
        # Not allocator time either: Note [Event records on a thread of their own].
        line += (f". On the event pool's record thread, outside the allocator's time: cudaEventRecord "
                 f"{d.get('background_event_ns', 0.0) / 1e3:,.1f} µs/step ({bg_events:,.2f} records/step, "
                 f"{d.get('background_event_ns', 0.0) / bg_events / 1e3:,.1f} µs each)")
        bg_queries = d.get("background_event_queries", 0.0)
        if bg_queries > 0:  # Note [The record thread watches its events]
            line += (f", cudaEventQuery of the events it watches "
                     f"{d.get('background_event_query_ns', 0.0) / 1e3:,.1f} µs/step ({bg_queries:,.2f} "
                     f"queries/step, {d.get('background_event_query_ns', 0.0) / bg_queries / 1e3:,.2f} µs each)")
    return line


def verdicts(rows: dict[str, Any]) -> list[str]:
    """The per-workload questions, answered from the numbers (never hard-coded)."""
    out = []

    def peak_cmp(ours: str, theirs: str, strict: bool) -> None:
        a, b = rows.get(ours, {}).get("peak_bytes"), rows.get(theirs, {}).get("peak_bytes")
        if not a or not b:
            if ours in rows and theirs in rows:
                out.append(f"- peak, {ours} vs {theirs}: not measured (runs failed)")
            return
        ma, mb = statistics.median(a), statistics.median(b)
        holds = ma < mb if strict else ma <= mb
        rel = "<" if strict else "≤"
        beyond = max(a) < min(b) if strict else max(a) <= min(b)
        out.append(f"- peak, {ours} {rel} {theirs}: **{'yes' if holds else 'no'}** — {ma / MiB:,.0f} vs "
                   f"{mb / MiB:,.0f} MiB ({ma / mb - 1:+.1%}); "
                   + ("every run of the first below every run of the second" if beyond else
                      "the run ranges overlap or are the other way round"))

    for prefix in ("cachealloc:", "cachealloc-full:"):
        peak_cmp(f"{prefix}defrag", "expandable", strict=True)
        peak_cmp(f"{prefix}async", "async", strict=False)
    native = rows.get("native", {}).get("median_step_s")
    if native:
        lo, hi, med = min(native), max(native), statistics.median(native)
        parts = []
        for cfg, r in rows.items():
            if cfg == "native" or not r["median_step_s"]:
                continue
            m = statistics.median(r["median_step_s"])
            where = ("within" if lo <= m <= hi else
                     f"faster by {(lo - m) / med:.1%} of native's median" if m < lo else
                     f"slower by {(m - hi) / med:.1%} of native's median")
            parts.append(f"{cfg} {m * 1e3:.2f} ms {where}")
        out.append(f"- step time vs native's spread [{lo * 1e3:.2f}–{hi * 1e3:.2f}] ms (min–max of its run "
                   f"medians): " + "; ".join(parts))
    return out


def markdown(args: argparse.Namespace, summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# End-to-end allocator comparison, {meta['date']}", ""]
    any_timed = any(_is_timed(cfg) for rows in summary.values() for cfg in rows)
    steps = "; ".join(f"{wl} {w} warm-up + {s} measured" for wl, (w, s) in meta.get("steps", {}).items()) \
        or f"{args.warmup} warm-up + {args.steps} measured"
    lines += [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']} on {meta['host']}",
        f"- GPU: {meta.get('gpu', '?')}" + (f" (driver {meta['driver']})" if meta.get("driver") else "")
        + f"; torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}",
        f"- cachealloc library: {meta.get('cachealloc_library', '–')}",
        f"- steps per run: {steps}" + (f"; shrunk for rounds ≥ 2 to fit the time budget: {meta['steps_shrunk']}"
                                        if meta.get("steps_shrunk") else ""),
        f"- {meta['rounds_done']} of {args.reps} interleaved repetition(s) of every configuration "
        f"(A B C … A B C …), each run a fresh CUDA process; seed {args.seed}; {meta.get('elapsed_s', 0):.0f} s in all"
        + (f"; only {meta['reps_cut']}" if meta.get("reps_cut") else ""),
        f"- peak device memory: device used memory (total − free) sampled every {args.sample_ms} ms by "
        f"{meta.get('sampler', '?')} in the run's process, minus the used memory after CUDA initialisation and "
        "before the workload's first allocation, over the whole run; median [min–max] over runs",
        "- allocator peak reserved: the allocator's own reserved_bytes.all.peak (cachealloc.memory_stats() for "
        "cachealloc, torch.cuda.memory_stats() otherwise); torch max_memory_reserved: "
        "torch.cuda.max_memory_reserved() (– where PyTorch cannot answer: the pluggable allocator)",
        "- step time: per run the median of the measured steps (each ends with a device synchronize); "
        "median [min–max] of those over runs",
        "- allocator µs/step and % of step: time inside cachealloc's alloc/free per measured step, and that over "
        "the run's median step time; for PyTorch's own allocators (marked ≥) only the time of the CUDA "
        "allocation calls they make (cudaMalloc/cudaFree/cudaMallocAsync/cudaFreeAsync, timed by the preloaded "
        "bench/e2e/call_timer), a lower bound of their allocator time; "
        + ("+timed rows: the allocator inside cachealloc's timing wrapper (cachealloc.time_native()), which "
           "times every allocation and free of PyTorch's allocator (or of the LibTorch adapter) with the same "
           "TSC clock as cachealloc's own: exact, no ≥; their allocs/step are the wrapper's calls (zero-byte "
           "requests included); compare step times on the rows without +timed (the wrapper adds an "
           "indirection); " if any_timed else "")
        + "device calls/step: device allocs + frees + maps + unmaps + stream-ordered "
        "pool calls per measured step, from the allocator's counters (PyTorch's num_device_alloc/free where it "
        "has them); all medians over runs",
    ]
    if meta.get("fork") is not None:
        lines += ["- processes: " + "; ".join(f"{c}: {m}" for c, m in meta["fork"].items()),
                  "- allocator verified in every run (get_allocator_backend(), expandable segments in torch's "
                  "snapshot, cachealloc enabled with the right policy"
                  + (", the timing wrapper in place and counting for +timed" if any_timed else "")
                  + "); a run that fails the check is not ok"]
    if meta.get("estimate"):
        lines.append(f"- time: {meta['estimate']}")
    for wl, rows in summary.items():
        desc = next((r["description"] for r in rows.values() if r["description"]), "")
        lines += ["", f"## {wl}", "", desc, ""]
        native_peak = _median(rows.get("native", {}).get("peak_bytes", []))
        native_step = _median(rows.get("native", {}).get("median_step_s", []))
        lines += [
            "| config | peak device memory MiB | vs native | allocator peak reserved MiB | torch max_memory_reserved MiB "
            "| step ms | vs native | allocator µs/step | allocator % of step | device calls/step | allocs/step | runs ok |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for cfg, r in rows.items():
            peak_rel = step_rel = "–"
            if native_peak and r["peak_bytes"]:
                peak_rel = f"{statistics.median(r['peak_bytes']) / native_peak - 1:+.1%}"
            if native_step and r["median_step_s"]:
                step_rel = f"{statistics.median(r['median_step_s']) / native_step - 1:+.1%}"
            lb = "≥ " if r.get("allocator_ns_lower_bound") else ""
            us = f"{lb}{statistics.median(r['allocator_ns_per_step']) / 1e3:,.1f}" if r["allocator_ns_per_step"] else "–"
            pct = f"{lb}{statistics.median(r['allocator_pct_of_step']):.2f}%" if r["allocator_pct_of_step"] else "–"
            calls = f"{statistics.median(r['device_calls_per_step']):,.1f}" if r["device_calls_per_step"] else "–"
            allocs = f"{statistics.median(r['allocs_per_step']):,.0f}" if r["allocs_per_step"] else "–"
            lines.append(
                f"| {cfg} | {_fmt_mib(r['peak_bytes'])} | {peak_rel} | {_fmt_mib(r['allocator_reserved_peak'])} | "
                f"{_fmt_mib(r['torch_max_memory_reserved'])} | {_fmt_ms(r['median_step_s'])} | {step_rel} | {us} | "
                f"{pct} | {calls} | {allocs} | {r['ok']}/{r['runs']} |")
        v = verdicts(rows)
        if v:
            lines += [""] + v
        flight = in_flight_line(rows)
        if flight:
            lines += ["", flight]
        pool_rows = [(cfg, r) for cfg, r in rows.items() if "pool.ns" in r.get("counters_delta_per_step", {})]
        if pool_rows:
            # Note [Time in the pool's calls] (async.h): the driver's share of the allocator's time.
            lines += [""] + [
                f"- inside {cfg}'s allocator time: {r['counters_delta_per_step']['pool.ns'] / 1e3:,.1f} µs/step in "
                f"{r['counters_delta_per_step'].get('pool.calls', 0):,.1f} stream-ordered pool calls "
                "(cudaMallocFromPoolAsync + cudaFreeAsync, timed by the policy), the rest in cachealloc's own code"
                for cfg, r in pool_rows]
        event_rows = [(cfg, r) for cfg, r in rows.items() if "event_ns" in r.get("counters_delta_per_step", {})
                      and r["counters_delta_per_step"].get("num_event_records", 0)
                      + r["counters_delta_per_step"].get("num_event_queries", 0) > 0]
        if event_rows:
            # The events cachealloc records (cross-stream frees, policy epochs) and queries, timed
            # by the backend (BackendCounters::event_ns).
            lines += [""] + [
                f"- inside {cfg}'s allocator time: {d['event_ns'] / 1e3:,.1f} µs/step in "
                f"{d.get('num_event_records', 0):,.1f} event records and {d.get('num_event_queries', 0):,.1f} "
                "event queries"
                + (f"; {d['parked_reuses']:,.1f} parked frees per step reused on the stream they waited for "
                   f"({d.get('parked_reuse_bytes', 0) / 2**20:,.0f} MiB; {d.get('parked_reuse_waits', 0):,.1f} of them "
                   "made that stream wait for another's event)" if d.get("parked_reuses") else "")
                for cfg, r in event_rows for d in [r["counters_delta_per_step"]]]
        hot_rows = [(cfg, r["hot_pages"]) for cfg, r in rows.items() if r.get("hot_pages")]
        if hot_rows:
            # Note [Bookkeeping on few pages] (hot_pages.h): whether the kernel backed the regions
            # holding the allocator's bookkeeping with huge pages, per run.
            lines += [""] + [
                f"- {cfg}'s bookkeeping (CACHEALLOC_HOT_PAGES={hp[0]['mode']}): per run "
                + ", ".join(f"{h['regions']} region{'s' if h['regions'] != 1 else ''}, "
                            + (f"{h['huge_bytes'] / 2**20:.0f} MiB on huge pages" if h.get("huge_bytes") is not None
                               else "huge pages unknown")
                            for h in hp)
                for cfg, hp in hot_rows]
        call_lines = [line for cfg, r in rows.items()
                      if (line := device_call_line(cfg, r.get("counters_delta_per_step", {})))]
        if call_lines:
            lines += [""] + call_lines
        defrag_rows = [(cfg, r) for cfg, r in rows.items()
                       if "defrag.move_ns" in r.get("counters_delta_per_step", {})]
        if defrag_rows:
            # Where policy defrag's time goes: growths that moved pages or waited for a stream.
            lines += [""] + [
                f"- inside {cfg}'s allocator time: {d['defrag.move_ns'] / 1e3:,.1f} µs/step in growths that moved "
                f"pages or waited for a stream ({d.get('defrag.wait_ns', 0) / 1e3:,.1f} µs/step waiting, "
                f"{d.get('defrag.stream_waits', 0):,.2f} waits/step), {d.get('defrag.pages_moved', 0):,.1f} pages "
                f"moved/step in {d.get('defrag.chunks_moved', 0):,.1f} chunks"
                for cfg, r in defrag_rows for d in [r["counters_delta_per_step"]]]
        parked_rows = [(cfg, r) for cfg, r in rows.items() if r.get("pct_without_parked_waits")]
        if parked_rows:
            # Note [Waiting for frees in flight instead of growing] (allocator.h): host time spent
            # waiting for the GPU inside the allocator, and what the allocator cost besides.
            lines += [""] + [
                f"- inside {cfg}'s allocator time: {d.get('parked_wait_ns', 0) / 1e3:,.1f} µs/step waiting for frees "
                f"parked behind other streams instead of growing ({d.get('parked_waits', 0):,.2f} waits/step); "
                f"without them the allocator took {statistics.median(r['pct_without_parked_waits']):.2f}% of the "
                f"step (median over runs)"
                for cfg, r in parked_rows for d in [r["counters_delta_per_step"]]]
        spread_rows = [(cfg, r) for cfg, r in rows.items() if r.get("heaviest_step_share")]
        heavy = [(cfg, r) for cfg, r in rows.items() if r.get("heaviest_steps")]
        if spread_rows:
            lines += [""] + [
                f"- {cfg}: the median measured step spent {statistics.median(r['median_step_allocator_ns']) / 1e3:,.1f} µs "
                f"in the allocator; the heaviest step held {100 * statistics.median(r['heaviest_step_share']):.0f}% "
                f"of a run's allocator time (medians over runs)"
                for cfg, r in spread_rows]
        quiet = [(cfg, r["quiet_steps"]) for cfg, r in rows.items() if r.get("quiet_steps")]
        if quiet:
            # The floor under the allocator's share of the step: what steps that made no device
            # call cost (the calls themselves, cold caches, events), without growth or moves.
            lines += [""]
            for cfg, qs in quiet:
                with_steps = [q for q in qs if q["steps"]]
                counts = f"{sum(q['steps'] for q in qs)} of {sum(q['of'] for q in qs)} measured steps"
                if with_steps:
                    per_run = ", ".join(f"{q['pct']:.2f}%" for q in with_steps)
                    lines.append(
                        f"- {cfg}: steps without a device call: {counts}; the allocator spent "
                        f"{statistics.median(q['ns'] for q in with_steps) / 1e3:,.1f} µs in each "
                        f"({statistics.median(q['pct'] for q in with_steps):.2f}% of the median step; "
                        f"per run {per_run})")
                else:
                    lines.append(f"- {cfg}: steps without a device call: none of the "
                                 f"{sum(q['of'] for q in qs)} measured steps")
        thirds = [(cfg, r["thirds"]) for cfg, r in rows.items() if r.get("thirds")]
        if thirds:
            # Whether the allocator's time falls once a policy settles (medians over runs).
            lines += [""]
            for cfg, ts in thirds:
                # --time-budget-s may have shrunk later rounds: then each run's own thirds.
                span_sets = {tuple((t["first"], t["last"]) for t in run) for run in ts}
                spans = (" / ".join(f"{a}-{b}" for a, b in span_sets.pop()) if len(span_sets) == 1
                         else "each run's own, as its measured steps differ")
                pcts = " / ".join(f"{statistics.median(t[i]['pct'] for t in ts):.2f}%" for i in range(3))
                line = f"- {cfg}: allocator time by thirds of the measured steps ({spans}): {pcts} of their step time"
                if all(t[i]["calls"] is not None for t in ts for i in range(3)):
                    calls = " / ".join(f"{statistics.median(t[i]['calls'] for t in ts):g}" for i in range(3))
                    line += f", device calls {calls}"
                lines.append(line + " (medians over runs)")
        budget = [(cfg, r["defrag_runs"]) for cfg, r in rows.items() if r.get("defrag_runs")]
        if budget:
            lines += [""]
            for cfg, ds in budget:
                per_run = ", ".join(
                    f"{d['peak'] / MiB:,.0f} MiB / {d['raises']} ({d['on_time']} on time) / "
                    + ("switched" if d["switched"] else "no")
                    + (f" / {100 * d['wait_share']:.0f}%" if d["wait_share"] is not None else "")
                    + (f" / {d['waits']} waits of {d['wait_ms']:.2f} ms" if d.get("wait_ms") is not None else "")
                    + (f" / placed {d['above']} above queued unmaps, {d['top']} at the top"
                       if d.get("above") or d.get("top") else "")
                    + (f" / {d['top_at_limit']} growths at the top of their range once moves cost too "
                       f"much at the limit" if d.get("top_at_limit") else "")
                    + (f" / slack {d['slack']:.3f} at the end" if d.get("slack") is not None else "")
                    + (f", {d['beyond']} pages created beyond it" if d.get("beyond") else "")
                    + (f" / {d['coalesced']} growths coalesced {d['coalesced_chunks']} chunks"
                       if d.get("coalesced") else "")
                    for d in ds)
                lines.append(f"- {cfg}, each run's whole life (peak / slack raises / switched to moving "
                             f"pending / waits' share of the growths that moved or waited / stream waits and "
                             f"their mean length, where it waited; the slack at the end and the pages "
                             f"created beyond the slack, where counted; growths that coalesced their "
                             f"chunks, where any did): {per_run}; "
                             f"switched in {sum(d['switched'] for d in ds)} of {len(ds)}")
        paths = [(cfg, r["slack_paths"]) for cfg, r in rows.items() if r.get("slack_paths")]
        if paths:
            lines += [""] + [
                f"- {cfg}, its slack over each run's whole life (seconds after its first change or "
                f"growth beyond it: the new slack, why, and the peak of live bytes then, MiB): "
                + " | ".join(f"run {i + 1}: {p}" for i, p in enumerate(ps))
                for cfg, ps in paths]
        budgets = [(cfg, r["budget_paths"]) for cfg, r in rows.items() if r.get("budget_paths")]
        if budgets:
            lines += [""] + [
                f"- {cfg}, its move budget in each run (stream waits by measured step, w = warm-up; "
                f"each window over the budget: the step it closed in, its charged growths, the waits' "
                f"share of their time, how long it was open, why it closed and the verdict): "
                + " | ".join(f"run {i + 1}: {p}" for i, p in enumerate(ps))
                for cfg, ps in budgets]
        if heavy:
            # What the heaviest step of each run did (cachealloc: device calls, defrag's waits).
            lines += [""] + [
                f"- {cfg}, heaviest step of each run (µs in the allocator / device calls"
                + (" / µs waiting for streams" if any("wait_ns" in h for h in r["heaviest_steps"]) else "")
                + "): " + ", ".join(
                    f"{h['ns'] / 1e3:,.0f} / {h['calls']}" + (f" / {h['wait_ns'] / 1e3:,.0f}" if "wait_ns" in h else "")
                    for h in r["heaviest_steps"])
                for cfg, r in heavy]
        errors = [(cfg, e) for cfg, r in rows.items() for e in r["errors"]]
        if errors:
            lines += ["", "Errors:", ""]
            lines += [f"- {cfg}: {e}" for cfg, e in errors]
    lines.append("")
    return "\n".join(lines)


def gpu_driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def shrink_steps(results: list[dict[str, Any]], steps: dict[str, tuple[int, int]], rounds_left: int,
                 seconds_left: float, min_steps: int) -> Optional[dict[str, tuple[int, int]]]:
    """New (warm-up, measured) per workload so that `rounds_left` rounds of the runs in `results`
    (one round) take at most `seconds_left`; None when no change is needed. Per run, the cost is
    a fixed part (wall - measured steps x median step) plus measured steps x median step."""
    if rounds_left <= 0:
        return None
    fixed = variable = 0.0
    per_wl_var: dict[str, float] = {}
    for r in results:
        wall = r.get("wall_s", 0.0)
        step = r.get("median_step_s")
        measured = steps[r["workload"]][1]
        if step is None:
            fixed += wall
            continue
        var = measured * step
        fixed += max(wall - var, 0.0)
        variable += var
        per_wl_var[r["workload"]] = per_wl_var.get(r["workload"], 0.0) + var
    per_round = seconds_left / rounds_left
    if fixed + variable <= per_round or variable <= 0:
        return None
    factor = max((per_round - fixed) / variable, 0.0)
    return {wl: (w, max(min_steps, int(math.floor(s * factor)))) for wl, (w, s) in steps.items()}


def report_from(json_path: Path) -> int:
    """Regenerates the Markdown of a results .json (also of the older format, without counters),
    or of one compressed with xz (.json.xz, as bench/results keeps them): the .md goes beside it."""
    try:
        if json_path.name.endswith(".xz"):
            data = json.loads(lzma.decompress(json_path.read_bytes()).decode("utf-8"))
        else:
            data = json.loads(json_path.read_text())
        saved = argparse.Namespace(**data["args"])
        if not isinstance(data.get("runs"), list) or not isinstance(data.get("meta"), dict):
            raise KeyError("runs or meta")
    except (OSError, ValueError, KeyError, TypeError, EOFError, lzma.LZMAError) as e:
        print(f"run_e2e: --report-from {json_path}: cannot read it as a run_e2e results file "
              f"({type(e).__name__}: {e}); pass the .json (or .json.xz) written next to an e2e_*.md",
              file=sys.stderr)
        return 2
    meta = dict(data["meta"])
    meta.setdefault("steps", {})
    runs = data["runs"]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    stem = json_path.name.removesuffix(".xz").removesuffix(".json")
    md = json_path.with_name(stem + ".md")
    md.write_text(markdown(saved, summarize(runs, workloads, configs), meta))
    print(f"run_e2e: wrote {md}")
    return 0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma-separated: gpt2, resnet50, pipeline (default: these three), or any of the held-out "
                        "workloads of bench/validation: " + ", ".join(VALIDATION_STEPS))
    p.add_argument("--configs", default=None,
                   help="comma-separated: native, expandable, async, cachealloc:<policy>, cachealloc-full:<policy>, "
                        "each optionally +timed (not cachealloc:<p>), +env:NAME=VALUE, cachealloc ones +key:value "
                        "(default: the first three and cachealloc:<p> for every registered policy)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured steps per run, every workload (default per workload: gpt2 8, resnet50 20, pipeline 60)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps per run, not measured (default per workload: gpt2 3, resnet50 4, pipeline 4)")
    p.add_argument("--min-steps", type=int, default=5, help="--time-budget-s never shrinks measured steps below this")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every configuration (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: smoke-test sizes (CPU-able)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test of the harness)")
    p.add_argument("--sample-ms", type=float, default=1.0, help="memory sampling period in ms (default 1)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per-run timeout (default 180 s)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="end within this many seconds (estimated from round 1, printed): run only the rounds that "
                        "fit, or with --fit steps shrink the measured steps of rounds >= 2; 0: no limit")
    p.add_argument("--fit", choices=("reps", "steps"), default="reps",
                   help="what --time-budget-s gives up when all --reps rounds would not fit: reps (default: later "
                        "rounds, every run keeps its steps) or steps (every round runs, later ones shorter)")
    p.add_argument("--no-fork", action="store_true", help="a new interpreter per run instead of the fork server")
    p.add_argument("--zygote-timeout-s", type=float, default=180.0,
                   help="how long the zygotes may take to import (default 180 s; then: subprocesses)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the .md and .json go")
    p.add_argument("--tag", default="", help="suffix for the result file names")
    p.add_argument("--dry-run", action="store_true", help="print the run plan and exit")
    p.add_argument("--report-from", metavar="JSON",
                   help="rewrite the Markdown report of an earlier run's .json or .json.xz (next to it, .md) and exit")
    # internal modes
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    if args.zygote:
        return zygote_main(args)
    if args.report_from:
        return report_from(Path(args.report_from))

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in STEP_DEFAULTS:
            print(f"run_e2e: unknown workload {w!r}; choose from {', '.join(DEFAULT_WORKLOADS)} or the held-out "
                  f"{', '.join(VALIDATION_STEPS)}", file=sys.stderr)
            return 2
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else default_configs()
    configs = [c for c in configs if c]
    for c in configs:
        try:
            config_env(c)
        except ValueError as e:
            print(f"run_e2e: {e}", file=sys.stderr)
            return 2
    steps = {wl: steps_for(args, wl) for wl in workloads}
    plan = [(rep, wl, cfg) for rep in range(args.reps) for wl in workloads for cfg in configs]
    if args.dry_run:
        for i, (rep, wl, cfg) in enumerate(plan):
            env = " ".join(f"{k}={v}" for k, v in config_env(cfg).items()) or "(no allocator variable)"
            if config_timed(cfg):
                env += " + timing wrapper (cachealloc.time_native())"
            w, s = steps[wl]
            print(f"run {i + 1}/{len(plan)} {wl} {cfg} rep={rep + 1} warmup={w} steps={s} {env}")
        print(f"mode: {'one subprocess per run (--no-fork)' if args.no_fork else 'fork server: one zygote per configuration'}")
        return 0

    started = time.perf_counter()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "driver": gpu_driver() if args.device == "cuda" else None,
        "rounds_done": 0,
        "steps": dict(steps),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"e2e_{stamp}{('_' + args.tag) if args.tag else ''}"
    md_path, json_path = out_dir / f"{name}.md", out_dir / f"{name}.json"
    results: list[dict[str, Any]] = []

    def write_outputs() -> None:
        first_ok = next((r for r in results if r.get("ok")), {})
        for key in ("gpu", "torch", "cuda", "sampler", "cachealloc_library"):
            value = first_ok.get(key) or next((r.get(key) for r in results if r.get(key)), None)
            if value:
                meta[key] = value
        meta["elapsed_s"] = time.perf_counter() - started
        summary = summarize(results, workloads, configs)
        md_path.write_text(markdown(args, summary, meta))
        json_path.write_text(json.dumps({"meta": meta, "args": vars(args), "summary": summary, "runs": results},
                                        indent=1))

    per_round = len(workloads) * len(configs)
    with tempfile.TemporaryDirectory(prefix="cachealloc_e2e_") as tmpdir:
        tmp = Path(tmpdir)
        runner = Runner(args, configs, tmp, meta)
        try:
            rounds = args.reps
            for rep in range(args.reps):
                if rep >= rounds:
                    break
                round_start = time.perf_counter()
                round_results = []
                for j, (wl, cfg) in enumerate((w, c) for w in workloads for c in configs):
                    warmup, measured = steps[wl]
                    r = runner.run(make_spec(args, wl, cfg, rep, measured, warmup, tmp))
                    results.append(r)
                    round_results.append(r)
                    n = rep * per_round + j + 1
                    if r.get("ok"):
                        status = f"step {r['median_step_s'] * 1e3:.2f} ms"
                        if "peak_bytes" in r:
                            status = f"peak {r['peak_bytes'] / MiB:,.0f} MiB, " + status
                        if r.get("allocator_ns_per_step") is not None:
                            status += f", alloc {r['allocator_ns_per_step'] / 1e3:,.1f} µs/step"
                        if r.get("device_calls_per_step") is not None:
                            status += f", {r['device_calls_per_step']:.1f} device calls/step"
                    else:
                        status = f"FAILED: {str(r.get('error'))[:200]}"
                    # Of the runs that will happen: rounds, once --time-budget-s cut them.
                    print(f"[{n}/{rounds * per_round}] {wl:9s} {cfg:24s} rep {rep + 1}: {status} "
                          f"({r.get('wall_s', 0):.1f} s, {r.get('mode', '?')})", flush=True)
                    write_outputs()
                meta["rounds_done"] = rep + 1
                round_s = time.perf_counter() - round_start
                if rep == 0:
                    elapsed = time.perf_counter() - started
                    estimate = elapsed + (args.reps - 1) * round_s
                    meta["estimate"] = (f"round 1 took {round_s:.0f} s (start-up {meta.get('zygotes_ready_s', 0):.0f} s); "
                                        f"{args.reps} rounds estimated at {estimate:.0f} s"
                                        + (f" against --time-budget-s {args.time_budget_s:.0f}" if args.time_budget_s else ""))
                    print(f"run_e2e: {meta['estimate']}", flush=True)
                    if args.time_budget_s > 0 and estimate > args.time_budget_s:
                        if args.fit == "reps":
                            rounds = 1 + min(args.reps - 1, int(max(args.time_budget_s - elapsed, 0.0) // max(round_s, 1e-9)))
                            meta["reps_cut"] = f"{rounds} of {args.reps} rounds fit --time-budget-s {args.time_budget_s:.0f}"
                            print(f"run_e2e: {meta['reps_cut']}; running {rounds}, every run with its full measured "
                                  "steps (--fit steps would shorten the later rounds instead)", flush=True)
                        else:
                            new = shrink_steps(round_results, steps, args.reps - 1, args.time_budget_s - elapsed,
                                               args.min_steps)
                            if new is not None and new != steps:
                                meta["steps_shrunk"] = "; ".join(f"{wl} {s}" for wl, (_, s) in new.items())
                                steps = new
                                print(f"run_e2e: measured steps for rounds 2-{args.reps}: {meta['steps_shrunk']} "
                                      "(so that every requested repetition runs)", flush=True)
                            if new is not None and all(s == args.min_steps for _, s in new.values()):
                                print(f"run_e2e: WARNING: even {args.min_steps} measured steps may not fit the budget; "
                                      "results are written after every run", flush=True)
                write_outputs()
        finally:
            runner.close()
    write_outputs()
    print(f"run_e2e: {len(results)} runs in {meta['elapsed_s']:.0f} s; wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
