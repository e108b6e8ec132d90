"""_support.py: shared helpers for tools/tests, usable with or without pytest installed.

With pytest: ``python -m pytest tools/tests``. Without it (a machine with no network to install
it): ``python tools/tests/test_plugin.py`` runs the same tests through ``run_module`` below,
printing PASS / SKIP / FAIL per test.
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

try:
    import pytest  # type: ignore
except ImportError:  # pragma: no cover - exercised on machines without pytest
    pytest = None

TOOLS = Path(__file__).resolve().parent.parent
REPO = TOOLS.parent
TRAIN_SCRIPT = TOOLS / "scripts" / "train_example.py"


class Skip(Exception):
    pass


def skip(reason: str) -> None:
    """Skips the current test, with `reason` shown (pytest's skip when pytest runs us)."""
    if pytest is not None:
        pytest.skip(reason)
    raise Skip(reason)


def parametrize(name: str, values: list[Any]) -> Callable:
    """pytest.mark.parametrize, or a marker the fallback runner expands."""
    def wrap(fn: Callable) -> Callable:
        if pytest is not None:
            return pytest.mark.parametrize(name, values)(fn)
        fn._params = (name, values)  # type: ignore[attr-defined]
        return fn
    return wrap


def plugin_library() -> Optional[str]:
    """libcachealloc_plugin.so as the package would find it, or None."""
    sys.path.insert(0, str(TOOLS))
    try:
        from cachealloc import _lib

        return _lib.find_library()
    except Exception:
        return None
    finally:
        sys.path.pop(0)


def capi_library() -> Optional[str]:
    """libcachealloc_capi.so: beside the plugin, in a build tree, or CACHEALLOC_CAPI_LIBRARY."""
    env = os.environ.get("CACHEALLOC_CAPI_LIBRARY")
    if env and Path(env).is_file():
        return env
    plugin = plugin_library()
    if plugin:
        sibling = Path(plugin).with_name("libcachealloc_capi.so")
        if sibling.is_file():
            return str(sibling)
    found = sorted(glob.glob(str(REPO / "build*" / "allocator" / "plugin" / "libcachealloc_capi.so")))
    return found[0] if found else None


def torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def autoload_installed() -> bool:
    """True when cachealloc_autoload.pth sits in a site-packages of this interpreter."""
    import site

    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return any((Path(d) / "cachealloc_autoload.pth").is_file() for d in dirs)


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """GPUs visible, asked once, in a child process so that this one never initialises CUDA."""
    code = "import torch; print(torch.cuda.device_count() if torch.version.cuda else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env=clean_env())
        return int(out.stdout.strip().splitlines()[-1])
    except Exception:
        return 0


def need_gpu() -> None:
    """Skips the test, visibly, when no CUDA device is visible."""
    if cuda_device_count() == 0:
        skip("no CUDA device visible: GPU tests need one")


def torch_adapter_library() -> str:
    """libcachealloc_torch.so: CACHEALLOC_TORCH_LIBRARY if set (it must exist), else the one the
    cachealloc package finds; skips when it is not built."""
    env = os.environ.get("CACHEALLOC_TORCH_LIBRARY")
    if env:
        if not Path(env).is_file():
            raise AssertionError(f"CACHEALLOC_TORCH_LIBRARY={env!r} is not a file")
        return env
    sys.path.insert(0, str(TOOLS))
    try:
        from cachealloc import _lib

        return _lib.find_torch_library()
    except Exception:
        skip("libcachealloc_torch.so is not built (cmake with LibTorch, see README.md)")
        raise  # unreachable
    finally:
        sys.path.pop(0)


# A block used by a busy side stream (record_stream), freed, then a request of its size: the
# script leaves `ptr` (the freed block), `y` (the new one) and `side_done` for the caller's check.
# Needs `torch` and `MiB` defined.
RECORD_STREAM_ON_BUSY_SIDE = """
side = torch.cuda.Stream()
x = torch.empty(8 * MiB, dtype=torch.uint8, device='cuda')
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)  # keeps the side stream busy
    x.add_(1)
x.record_stream(side)
ptr = x.data_ptr()
del x
y = torch.empty(8 * MiB, dtype=torch.uint8, device='cuda')
side_done = side.query()
print('REUSED', y.data_ptr() == ptr, 'SIDE_DONE', side_done)
"""


def need_plugin_gpu() -> str:
    """The plugin library's path; skips the test when it is not built or there is no GPU."""
    lib = plugin_library()
    if lib is None:
        skip("libcachealloc_plugin.so is not built (cmake with LibTorch, see README.md)")
    need_gpu()
    return lib


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any cachealloc/PyTorch allocator setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CACHEALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "CACHEALLOC_PLUGIN_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(TOOLS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("CACHEALLOC_QUIET", "0")
    env.update(extra)
    return env


def run_python(code: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with clean_env(**env)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env), cwd=str(REPO))


def autoload_prefix() -> str:
    """Code that does what the installed .pth does, for runs where the package is not installed."""
    return "" if autoload_installed() else "import cachealloc._autoload\n"


def run_module(namespace: dict[str, Any]) -> int:
    """The fallback runner: every test_* function of `namespace`; returns the exit status."""
    failed = passed = skipped = 0
    for name, fn in sorted(namespace.items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        params = getattr(fn, "_params", None)
        cases = [(f"{name}[{v}]", (v,)) for v in params[1]] if params else [(name, ())]
        for label, args in cases:
            try:
                fn(*args)
                passed += 1
                print(f"PASS {label}", flush=True)
            except Skip as e:
                skipped += 1
                print(f"SKIP {label}: {e}", flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
    print(f"{passed} passed, {skipped} skipped, {failed} failed")
    return 1 if failed else 0
