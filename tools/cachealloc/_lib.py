"""_lib.py: finding and loading the cachealloc shared library (ctypes, no torch import).

Search order for the library (first hit wins):

1. ``CACHEALLOC_LIBRARY``: a path to ``libcachealloc_plugin.so`` (or, for torch-free use,
   ``libcachealloc_capi.so``).
2. next to this package: the copy ``pip install ./tools`` bundled from the build tree.
3. the build tree of the repository the package was installed from (recorded at install time in
   ``_build_info.py``) or, when running from a checkout, ``<repo>/build*/allocator/plugin/``.

The LibTorch adapter ``libcachealloc_torch.so`` (``cachealloc.enable(full=True)``) is found the
same way: ``CACHEALLOC_TORCH_LIBRARY``, next to this package, ``<repo>/build*/allocator/torch/``.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

PLUGIN_NAME = "libcachealloc_plugin.so"
CAPI_NAME = "libcachealloc_capi.so"
TORCH_NAME = "libcachealloc_torch.so"

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None
_torch_lib: Optional[ctypes.CDLL] = None
_torch_lib_path: Optional[str] = None


class LibraryNotFound(RuntimeError):
    """No cachealloc shared library was found (see the module docstring for where we look)."""


def _repo_roots() -> list[Path]:
    roots = []
    try:
        from . import _build_info  # written by setup.py at install time

        if getattr(_build_info, "REPO_ROOT", None):
            roots.append(Path(_build_info.REPO_ROOT))
    except ImportError:
        pass
    here = Path(__file__).resolve().parent
    if (here.parent / "pyproject.toml").is_file() and (here.parent.parent / "allocator").is_dir():
        roots.append(here.parent.parent)  # running from a checkout: tools/cachealloc -> the repository
    return roots


def candidate_paths(name: str = PLUGIN_NAME, env_var: str = "CACHEALLOC_LIBRARY", subdir: str = "plugin") -> list[Path]:
    """Every place searched for `name`, in order (the env variable first)."""
    out: list[Path] = []
    env = os.environ.get(env_var)
    if env:
        out.append(Path(env))
    here = Path(__file__).resolve().parent
    out.append(here / name)
    for root in _repo_roots():
        out.append(root / "build" / "allocator" / subdir / name)
        for other in sorted(glob.glob(str(root / "build*" / "allocator" / subdir / name))):
            out.append(Path(other))
    seen = set()
    unique = []
    for p in out:
        if str(p) not in seen:
            seen.add(str(p))
            unique.append(p)
    return unique


def find_library() -> str:
    """The path of the library that would be loaded. Raises LibraryNotFound."""
    return _find(PLUGIN_NAME, "CACHEALLOC_LIBRARY", "plugin")


def find_torch_library() -> str:
    """The path of libcachealloc_torch.so (the LibTorch adapter). Raises LibraryNotFound."""
    return _find(TORCH_NAME, "CACHEALLOC_TORCH_LIBRARY", "torch")


def _find(name: str, env_var: str, subdir: str) -> str:
    env = os.environ.get(env_var)
    if env and not Path(env).is_file():
        raise LibraryNotFound(f"{env_var}={env!r} does not name a file")
    for p in candidate_paths(name, env_var, subdir):
        if p.is_file():
            return str(p.resolve())
    looked = "\n  ".join(str(p) for p in candidate_paths(name, env_var, subdir))
    raise LibraryNotFound(
        f"cachealloc: {name} not found. Build it (cmake with "
        "-DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')) "
        "and reinstall the package (pip install --no-build-isolation ./tools), or set "
        f"{env_var} to its path. Looked in:\n  {looked}"
    )


def load_torch() -> ctypes.CDLL:
    """Loads libcachealloc_torch.so once per process (after `import torch`: it needs libc10)."""
    global _torch_lib, _torch_lib_path
    with _lock:
        if _torch_lib is None:
            path = find_torch_library()
            lib = ctypes.CDLL(path)
            c = ctypes
            lib.cachealloc_torch_install.restype = c.c_int
            lib.cachealloc_torch_install.argtypes = [c.c_char_p, c.c_char_p, c.c_size_t]
            lib.cachealloc_torch_is_installed.restype = c.c_int
            lib.cachealloc_torch_is_installed.argtypes = []
            lib.cachealloc_torch_built_for.restype = c.c_char_p
            lib.cachealloc_torch_built_for.argtypes = []
            lib.cachealloc_torch_version.restype = c.c_char_p
            lib.cachealloc_torch_version.argtypes = []
            lib.cachealloc_torch_allocator_ns.restype = c.c_uint64
            lib.cachealloc_torch_allocator_ns.argtypes = [c.c_int]
            _torch_lib, _torch_lib_path = lib, path
        return _torch_lib


def loaded_torch_path() -> Optional[str]:
    return _torch_lib_path


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "cachealloc_alloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "cachealloc_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "cachealloc_init": (None, [c.c_int]),
        "cachealloc_reset": (None, []),
        "cachealloc_set_memory_fraction": (None, [c.c_double, c.c_int]),
        "cachealloc_record_stream": (None, [c.c_void_p, c.c_void_p]),
        "cachealloc_base_alloc": (c.c_void_p, [c.c_void_p, c.POINTER(c.c_size_t)]),
        "cachealloc_memory_stats_json": (c.c_int64, [c.c_int, c.c_char_p, c.c_size_t]),
        "cachealloc_policies_json": (c.c_int64, [c.c_char_p, c.c_size_t]),
        "cachealloc_reset_peak": (c.c_int, [c.c_int]),
        "cachealloc_reset_accumulated": (c.c_int, [c.c_int]),
        "cachealloc_empty_cache": (c.c_int, [c.c_int]),
        "cachealloc_dump_snapshot": (c.c_int, [c.c_char_p]),
        "cachealloc_allocator_ns": (c.c_uint64, [c.c_int]),
        "cachealloc_validate_config": (c.c_int, [c.c_char_p]),
        "cachealloc_check_invariants": (c.c_int, [c.c_int]),
        "cachealloc_policy_name": (c.c_char_p, []),
        "cachealloc_device_count": (c.c_int, []),
        "cachealloc_is_active": (c.c_int, []),
        "cachealloc_is_torch_plugin": (c.c_int, []),
        "cachealloc_last_error": (c.c_char_p, []),
        "cachealloc_last_error_code": (c.c_int, []),
        "cachealloc_clear_error": (None, []),
        "cachealloc_version": (c.c_char_p, []),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load() -> ctypes.CDLL:
    """Loads the library once per process (the same handle PyTorch's CUDAPluggableAllocator gets)."""
    global _lib, _lib_path
    with _lock:
        if _lib is None:
            path = find_library()
            lib = ctypes.CDLL(path)
            _declare(lib)
            _lib, _lib_path = lib, path
        return _lib


def loaded_path() -> Optional[str]:
    return _lib_path


def function_address(name: str) -> int:
    """The address of an exported function, for the CUDAPluggableAllocator setters."""
    addr = ctypes.cast(getattr(load(), name), ctypes.c_void_p).value
    if not addr:
        raise RuntimeError(f"cachealloc: {name} not found in {_lib_path}")
    return int(addr)


def last_error() -> str:
    raw = load().cachealloc_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def read_json(fn, *args: Any) -> Any:
    """Calls a `(…, char* buf, size_t len) -> length` function and parses its JSON."""
    size = 16384
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, size)
        if n < 0:
            raise RuntimeError(last_error() or "cachealloc: unknown error")
        if n < size:
            return json.loads(buf.value.decode("utf-8"))
        size = int(n) + 1
