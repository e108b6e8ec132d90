#!/usr/bin/env python3
"""run_e2e.py: PyTorch's allocators against cachealloc's policies, on real training workloads.

Every (workload, configuration, repetition) runs in a FRESH Python process, so each starts from
an untouched device and allocator. Repetitions are interleaved (A B C ... A B C ...), so slow
drift of the machine (clocks, temperature, other tenants) spreads over every configuration.

Configurations (--configs, comma separated):
  native                 PyTorch's caching allocator, PYTORCH_CUDA_ALLOC_CONF unset
  expandable             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  async                  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
  cachealloc:<policy>    CACHEALLOC_CONF=policy:<policy> (enabled by the startup hook that
                         `pip install ./tools` installs, or explicitly by the child otherwise)
  default: native, expandable, async and cachealloc:<p> for every registered policy.

What is measured, the same way for every configuration, in the child process:
  peak device memory   used = total - free of the device, sampled every --sample-ms (default
                       1 ms) by a background thread through NVML (pynvml) when importable, else
                       torch.cuda.mem_get_info; minus the used memory after CUDA initialisation
                       and before the workload's first allocation (context, cuBLAS handles
                       created later are part of the workload for every configuration alike).
  step time            wall time of each measured step (each step ends with a device
                       synchronize), median per run; the table shows the median over runs and
                       the min-max of the run medians.
  allocator ns/step    for cachealloc: time inside its alloc/free hooks per measured step.
A configuration that fails (out of memory, crash, timeout) records its error in the table; the
other runs go on.

Results: bench/results/e2e_<date>.md (a Markdown table per workload, with the command, date, GPU,
torch version) and the same data, run by run, in e2e_<date>.json next to it.

Time: about (torch import + CUDA init + build ~3-4 s + (warmup + steps) x step time) per run.
With the defaults on an H200 (3 workloads x 6 configs x 5 reps, 20 steps) that is about 6 minutes;
--time-budget-s stops before a repetition round that would not fit.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
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
BUILTIN_CONFIGS = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
}
FALLBACK_POLICIES = ("native", "size_class", "defrag")
MiB = 1 << 20


# =============================================================================================
# configurations

def registered_policies() -> list[str]:
    """cachealloc's policies from its library; the usual three when the library is not found."""
    sys.path.insert(0, str(TOOLS))
    try:
        import cachealloc

        return [p["name"] for p in cachealloc.policies()]
    except Exception as e:  # library not built here: still plan (and fail visibly per run)
        print(f"run_e2e: cannot list cachealloc policies ({e}); assuming {', '.join(FALLBACK_POLICIES)}",
              file=sys.stderr)
        return list(FALLBACK_POLICIES)
    finally:
        sys.path.pop(0)


def default_configs() -> list[str]:
    return list(BUILTIN_CONFIGS) + [f"cachealloc:{p}" for p in registered_policies()]


def config_env(name: str) -> dict[str, str]:
    """The environment variables a configuration sets (everything else allocator-related unset)."""
    if name in BUILTIN_CONFIGS:
        return dict(BUILTIN_CONFIGS[name])
    if name.startswith("cachealloc:"):
        policy = name.split(":", 1)[1]
        if not policy:
            raise ValueError("cachealloc:<policy> needs a policy name")
        return {"CACHEALLOC_CONF": f"policy:{policy}"}
    raise ValueError(f"unknown configuration {name!r}; use native, expandable, async or cachealloc:<policy>")


def child_env(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(config_env(name))
    env["PYTHONPATH"] = os.pathsep.join([str(TOOLS), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("CACHEALLOC_QUIET", "1")
    return env


# =============================================================================================
# the child: one workload under one configuration

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


def child_main(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {"workload": args.workload, "config": args.config, "rep": args.rep, "ok": False}
    cachealloc = None
    try:
        sys.setswitchinterval(min(sys.getswitchinterval(), args.sample_ms / 1000.0))
        import torch

        result["torch"] = torch.__version__
        result["cuda"] = torch.version.cuda
        if os.environ.get("CACHEALLOC_CONF") is not None:
            import cachealloc as _ca

            if not _ca.is_enabled():  # the startup hook is not installed: enable explicitly
                _ca.enable()
                result["enabled_by"] = "explicit enable()"
            else:
                result["enabled_by"] = "startup hook"
            cachealloc = _ca
            result["cachealloc_library"] = _ca.library_path()
        import workloads

        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        sampler: Optional[MemorySampler] = None
        baseline = 0
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.mem_get_info(device.index)  # creates the context; allocates nothing
            result["gpu"] = torch.cuda.get_device_name(device)
            result["total_memory"] = torch.cuda.get_device_properties(device).total_memory
            sampler = MemorySampler(torch, device.index, args.sample_ms / 1000.0)
            baseline = sampler.read()
            result["baseline_used_bytes"] = baseline
            result["sampler"] = sampler.kind
            sampler.start()

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        wl = workloads.build(args.workload, device, args.seed, args.scale)
        result["description"] = wl.description
        for i in range(args.warmup):
            wl.step(i)
        sync()
        ns0 = calls0 = 0
        if cachealloc is not None and device.type != "cuda":
            cachealloc = None  # a CPU smoke run: the allocator was enabled but has no device to report on
        if cachealloc is not None:
            s = cachealloc.memory_stats()
            ns0, calls0 = s.get("allocator_ns", 0), s.get("alloc_calls", 0)
        times = []
        for i in range(args.warmup, args.warmup + args.steps):
            t0 = time.perf_counter()
            wl.step(i)
            sync()
            times.append(time.perf_counter() - t0)
        result["step_s"] = times
        result["median_step_s"] = statistics.median(times)
        if sampler is not None:
            peak = sampler.stop()
            result["peak_used_bytes"] = peak
            result["peak_bytes"] = peak - baseline
            result["samples"] = sampler.samples
        if cachealloc is not None:
            s = cachealloc.memory_stats()
            result["allocator_ns_per_step"] = (s.get("allocator_ns", 0) - ns0) / args.steps
            result["allocs_per_step"] = (s.get("alloc_calls", 0) - calls0) / args.steps
            result["allocator_reserved_peak"] = s.get("reserved_bytes.all.peak")
            result["allocator_allocated_peak"] = s.get("allocated_bytes.all.peak")
            result["num_ooms"] = s.get("num_ooms")
        elif device.type == "cuda":
            s = torch.cuda.memory_stats(device)
            result["allocator_reserved_peak"] = s.get("reserved_bytes.all.peak")
            result["allocator_allocated_peak"] = s.get("allocated_bytes.all.peak")
            result["num_ooms"] = s.get("num_ooms")
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - every failure must end up in the table
        kind = type(e).__name__
        text = str(e).strip().splitlines()
        result["error"] = f"{kind}: {text[0][:300] if text else ''}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


# =============================================================================================
# the parent: plan, run, aggregate, report

def run_one(args: argparse.Namespace, workload: str, config: str, rep: int, tmp: Path) -> dict[str, Any]:
    result_file = tmp / f"{workload}_{config.replace(':', '_')}_{rep}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--workload", workload, "--config", config,
           "--rep", str(rep), "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
           "--scale", args.scale, "--device", args.device, "--sample-ms", str(args.sample_ms),
           "--result", str(result_file)]
    start = time.perf_counter()
    try:
        env = child_env(config)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        stderr_tail = proc.stderr.strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        return {"workload": workload, "config": config, "rep": rep, "ok": False,
                "error": f"timeout after {args.timeout_s} s", "wall_s": time.perf_counter() - start}
    except ValueError as e:
        return {"workload": workload, "config": config, "rep": rep, "ok": False, "error": str(e), "wall_s": 0.0}
    wall = time.perf_counter() - start
    if result_file.is_file():
        result = json.loads(result_file.read_text())
    else:  # the child died before writing (segfault, abort): keep its last words
        result = {"workload": workload, "config": config, "rep": rep, "ok": False,
                  "error": f"exit code {proc.returncode}: {' | '.join(stderr_tail)[:300]}"}
    result["wall_s"] = wall
    result["exit_code"] = proc.returncode
    if not result.get("ok") and proc.stderr:
        result.setdefault("stderr_tail", proc.stderr[-2000:])
    return result


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


def summarize(results: list[dict[str, Any]], workloads: list[str], configs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for wl in workloads:
        rows = {}
        for cfg in configs:
            runs = [r for r in results if r["workload"] == wl and r["config"] == cfg]
            ok = [r for r in runs if r.get("ok")]
            peaks = [r["peak_bytes"] for r in ok if "peak_bytes" in r]
            steps = [r["median_step_s"] for r in ok if "median_step_s" in r]
            rows[cfg] = {
                "runs": len(runs),
                "ok": len(ok),
                "peak_bytes": peaks,
                "median_step_s": steps,
                "allocator_reserved_peak": [r["allocator_reserved_peak"] for r in ok if r.get("allocator_reserved_peak") is not None],
                "allocator_ns_per_step": [r["allocator_ns_per_step"] for r in ok if "allocator_ns_per_step" in r],
                "allocs_per_step": [r["allocs_per_step"] for r in ok if "allocs_per_step" in r],
                "errors": sorted({r.get("error", "?") for r in runs if not r.get("ok")}),
                "description": next((r.get("description") for r in runs if r.get("description")), None),
            }
        summary[wl] = rows
    return summary


def markdown(args: argparse.Namespace, results: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# End-to-end allocator comparison, {meta['date']}", ""]
    lines += [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']} on {meta['host']}",
        f"- GPU: {meta.get('gpu', '?')}" + (f" (driver {meta['driver']})" if meta.get("driver") else "")
        + f"; torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}",
        f"- cachealloc library: {meta.get('cachealloc_library', '–')}",
        f"- {args.steps} measured steps after {args.warmup} warm-up steps per run; {meta['rounds_done']} "
        f"interleaved repetition(s) of every configuration (A B C … A B C …), each run a fresh process; seed {args.seed}",
        f"- peak device memory: device used memory (total − free) sampled every {args.sample_ms} ms by "
        f"{meta.get('sampler', '?')} in the run's process, minus the used memory after CUDA initialisation and "
        "before the workload's first allocation; median [min–max] over runs",
        "- step time: per run the median of the measured steps (each ends with a device synchronize); "
        "median [min–max] of those over runs",
        "- allocator µs/step: time inside cachealloc's alloc/free hooks per measured step, and allocs/step the "
        "allocations per step (not measured for PyTorch's own allocators)",
    ]
    if meta.get("stopped_early"):
        lines.append(f"- stopped early: {meta['stopped_early']}")
    for wl, rows in summary.items():
        desc = next((r["description"] for r in rows.values() if r["description"]), "")
        lines += ["", f"## {wl}", "", desc, ""]
        native_peak = statistics.median(rows["native"]["peak_bytes"]) if "native" in rows and rows["native"]["peak_bytes"] else None
        native_step = statistics.median(rows["native"]["median_step_s"]) if "native" in rows and rows["native"]["median_step_s"] else None
        lines += [
            "| config | peak device memory MiB | vs native | allocator peak reserved MiB | step ms | vs native | allocator µs/step | allocs/step | runs ok |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for cfg, r in rows.items():
            peak_rel = step_rel = "–"
            if native_peak and r["peak_bytes"]:
                peak_rel = f"{statistics.median(r['peak_bytes']) / native_peak - 1:+.1%}"
            if native_step and r["median_step_s"]:
                step_rel = f"{statistics.median(r['median_step_s']) / native_step - 1:+.1%}"
            us = f"{statistics.median(r['allocator_ns_per_step']) / 1e3:,.1f}" if r["allocator_ns_per_step"] else "–"
            allocs = f"{statistics.median(r['allocs_per_step']):,.0f}" if r["allocs_per_step"] else "–"
            lines.append(
                f"| {cfg} | {_fmt_mib(r['peak_bytes'])} | {peak_rel} | {_fmt_mib(r['allocator_reserved_peak'])} | "
                f"{_fmt_ms(r['median_step_s'])} | {step_rel} | {us} | {allocs} | {r['ok']}/{r['runs']} |")
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


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma-separated: gpt2, resnet50, pipeline (default: all)")
    p.add_argument("--configs", default=None,
                   help="comma-separated: native, expandable, async, cachealloc:<policy> "
                        "(default: the first three and every registered cachealloc policy)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per run, not measured (default 5)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every configuration (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: smoke-test sizes (CPU-able)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test of the harness)")
    p.add_argument("--sample-ms", type=float, default=1.0, help="memory sampling period in ms (default 1)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per-run timeout (default 180 s)")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="stop before a repetition round that would end past this many seconds (0: no limit)")
    p.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where the .md and .json go")
    p.add_argument("--tag", default="", help="suffix for the result file names")
    p.add_argument("--dry-run", action="store_true", help="print the run plan and exit")
    # child mode (internal)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in DEFAULT_WORKLOADS:
            print(f"run_e2e: unknown workload {w!r}; choose from {', '.join(DEFAULT_WORKLOADS)}", file=sys.stderr)
            return 2
    configs = [c.strip() for c in args.configs.split(",")] if args.configs else default_configs()
    configs = [c for c in configs if c]
    for c in configs:
        try:
            config_env(c)
        except ValueError as e:
            print(f"run_e2e: {e}", file=sys.stderr)
            return 2
    plan = [(rep, wl, cfg) for rep in range(args.reps) for wl in workloads for cfg in configs]
    if args.dry_run:
        for i, (rep, wl, cfg) in enumerate(plan):
            env = " ".join(f"{k}={v}" for k, v in config_env(cfg).items()) or "(no allocator variable)"
            print(f"run {i + 1}/{len(plan)} {wl} {cfg} rep={rep + 1} {env}")
        return 0

    started = time.perf_counter()
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "driver": gpu_driver() if args.device == "cuda" else None,
        "rounds_done": 0,
    }
    results: list[dict[str, Any]] = []
    round_times: list[float] = []
    per_round = len(workloads) * len(configs)
    with tempfile.TemporaryDirectory(prefix="cachealloc_e2e_") as tmpdir:
        tmp = Path(tmpdir)
        for rep in range(args.reps):
            elapsed = time.perf_counter() - started
            if args.time_budget_s > 0 and round_times and elapsed + statistics.mean(round_times) > args.time_budget_s:
                meta["stopped_early"] = (f"after {rep} of {args.reps} rounds: the next would end past "
                                         f"--time-budget-s {args.time_budget_s:.0f}")
                print(f"run_e2e: {meta['stopped_early']}", flush=True)
                break
            round_start = time.perf_counter()
            for j, (wl, cfg) in enumerate((w, c) for w in workloads for c in configs):
                r = run_one(args, wl, cfg, rep, tmp)
                results.append(r)
                n = rep * per_round + j + 1
                status = (f"peak {r['peak_bytes'] / MiB:,.0f} MiB, step {r['median_step_s'] * 1e3:.2f} ms"
                          if r.get("ok") and "peak_bytes" in r else
                          f"step {r['median_step_s'] * 1e3:.2f} ms" if r.get("ok") else f"FAILED: {r.get('error')}")
                print(f"[{n}/{len(plan)}] {wl:9s} {cfg:22s} rep {rep + 1}: {status} ({r.get('wall_s', 0):.1f} s)",
                      flush=True)
            round_times.append(time.perf_counter() - round_start)
            meta["rounds_done"] = rep + 1

    first_ok = next((r for r in results if r.get("ok")), {})
    for key in ("gpu", "torch", "cuda", "sampler", "cachealloc_library"):
        value = first_ok.get(key) or next((r.get(key) for r in results if r.get(key)), None)
        if value:
            meta[key] = value
    meta["elapsed_s"] = time.perf_counter() - started
    summary = summarize(results, workloads, configs)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"e2e_{stamp}{('_' + args.tag) if args.tag else ''}"
    md_path, json_path = out_dir / f"{name}.md", out_dir / f"{name}.json"
    md_path.write_text(markdown(args, results, summary, meta))
    json_path.write_text(json.dumps({"meta": meta, "args": vars(args), "summary": summary, "runs": results}, indent=1))
    print(f"run_e2e: {len(results)} runs in {meta['elapsed_s']:.0f} s; wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
