"""_lib.py: finding and loading the cachealloc shared library (ctypes, no torch import).

Search order for the library (first hit wins):

1. ``CACHEALLOC_LIBRARY``: a path to ``libcachealloc_plugin.so`` (or, for torch-free use,
   ``libcachealloc_capi.so``).
2. next to this package: the copy ``pip install ./tools`` bundled from the build tree.
3. the build tree of the repository the package was installed from (recorded at install time in
   ``_build_info.py``) or, when running from a checkout, ``<repo>/build*/allocator/plugin/``.

The LibTorch adapter ``libcachealloc_torch.so`` (``cachealloc.enable(full=True)``, and the timing
wrapper of ``cachealloc.time_native()``) is found the same way: ``CACHEALLOC_TORCH_LIBRARY``, next
to this package, ``<repo>/build*/allocator/torch/``.
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
            _declare(lib, _TORCH_SIGNATURES)
            _declare(lib, _TORCH_TIMING_SIGNATURES, optional=True)
            _torch_lib, _torch_lib_path = lib, path
        return _torch_lib


def has_time_native(lib: ctypes.CDLL) -> bool:
    """True when `lib` (libcachealloc_torch.so) has the timing wrapper's entry points."""
    return all(hasattr(lib, name) for name in _TORCH_TIMING_SIGNATURES)


def loaded_torch_path() -> Optional[str]:
    return _torch_lib_path


# The C entry points' signatures: name -> (restype, argtypes).
_PLUGIN_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cachealloc_alloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "cachealloc_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "cachealloc_init": (None, [ctypes.c_int]),
    "cachealloc_reset": (None, []),
    "cachealloc_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "cachealloc_record_stream": (None, [ctypes.c_void_p, ctypes.c_void_p]),
    "cachealloc_base_alloc": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
    "cachealloc_memory_stats_json": (ctypes.c_int64, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "cachealloc_policies_json": (ctypes.c_int64, [ctypes.c_char_p, ctypes.c_size_t]),
    "cachealloc_policy_report_json": (ctypes.c_int64, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "cachealloc_reset_peak": (ctypes.c_int, [ctypes.c_int]),
    "cachealloc_reset_accumulated": (ctypes.c_int, [ctypes.c_int]),
    "cachealloc_empty_cache": (ctypes.c_int, [ctypes.c_int]),
    "cachealloc_dump_snapshot": (ctypes.c_int, [ctypes.c_char_p]),
    "cachealloc_allocator_ns": (ctypes.c_uint64, [ctypes.c_int]),
    "cachealloc_validate_config": (ctypes.c_int, [ctypes.c_char_p]),
    "cachealloc_check_invariants": (ctypes.c_int, [ctypes.c_int]),
    "cachealloc_policy_name": (ctypes.c_char_p, []),
    "cachealloc_device_count": (ctypes.c_int, []),
    "cachealloc_is_active": (ctypes.c_int, []),
    "cachealloc_is_torch_plugin": (ctypes.c_int, []),
    "cachealloc_last_error": (ctypes.c_char_p, []),
    "cachealloc_last_error_code": (ctypes.c_int, []),
    "cachealloc_clear_error": (None, []),
    "cachealloc_version": (ctypes.c_char_p, []),
}
_TORCH_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cachealloc_torch_install": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "cachealloc_torch_is_installed": (ctypes.c_int, []),
    "cachealloc_torch_built_for": (ctypes.c_char_p, []),
    "cachealloc_torch_version": (ctypes.c_char_p, []),
    "cachealloc_torch_allocator_ns": (ctypes.c_uint64, [ctypes.c_int]),
}
# Entry points added after the first release; optional, so that an older plugin (an A/B against
# a previous build through CACHEALLOC_LIBRARY) still loads. hot_pages() says when one is missing.
_PLUGIN_OPTIONAL_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cachealloc_hot_pages_json": (ctypes.c_int64, [ctypes.c_char_p, ctypes.c_size_t]),
}
# The timing wrapper's entry points (cachealloc.time_native()); optional, so that a library built
# before they existed still serves enable(full=True). has_time_native() says whether they are there.
_TORCH_TIMING_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cachealloc_torch_time_native_install": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]),
    "cachealloc_torch_time_native_is_installed": (ctypes.c_int, []),
    "cachealloc_torch_time_native_ns": (ctypes.c_uint64, []),
    "cachealloc_torch_time_native_alloc_ns": (ctypes.c_uint64, []),
    "cachealloc_torch_time_native_free_ns": (ctypes.c_uint64, []),
    "cachealloc_torch_time_native_alloc_calls": (ctypes.c_uint64, []),
    "cachealloc_torch_time_native_free_calls": (ctypes.c_uint64, []),
}


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[Any, list[Any]]], optional: bool = False) -> None:
    for name, (restype, argtypes) in signatures.items():
        if optional and not hasattr(lib, name):
            continue
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
            _declare(lib, _PLUGIN_SIGNATURES)
            _declare(lib, _PLUGIN_OPTIONAL_SIGNATURES, optional=True)
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
