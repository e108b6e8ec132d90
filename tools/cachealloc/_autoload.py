"""_autoload.py: enable cachealloc right after ``import torch`` when CACHEALLOC_CONF is set.

``pip install ./tools`` puts ``cachealloc_autoload.pth`` into site-packages. Python runs its one
line at every start-up; the line imports this module only when ``CACHEALLOC_CONF`` is in the
environment, so other processes pay nothing. This module then installs a meta-path finder that
waits for the top-level ``torch`` import, lets it finish, and calls :func:`cachealloc.enable`
before anything can initialise CUDA. Nothing in the user's script changes.

* No CUDA device visible (or a CPU-only PyTorch): PyTorch's allocator stays, with one line on
  stderr; CPU-only programs are never disturbed.
* A bad CACHEALLOC_CONF or a missing library: the error is printed and raised from
  ``import torch``, since running silently on the wrong allocator would be worse.
* ``CACHEALLOC_AUTOLOAD=0`` switches the hook off.

``status`` says what happened, for tests and for ``python -c 'import torch, cachealloc._autoload
as a; print(a.status)'``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any, Optional

status = "not triggered: torch not imported yet"


def _note(message: str) -> None:
    sys.stderr.write(f"cachealloc: {message}\n")


def _cuda_device_count(torch: Any) -> int:
    """Devices visible without initialising CUDA (torch uses NVML when it can)."""
    try:
        if getattr(torch.version, "cuda", None) is None:
            return 0
        return int(torch.cuda.device_count())
    except Exception:
        return 0


def _on_torch_imported(torch: Any) -> None:
    global status
    import cachealloc

    if cachealloc.is_enabled():
        status = "enabled (before the hook ran)"
        return
    if _cuda_device_count(torch) == 0:
        status = "skipped: no CUDA device visible"
        if os.environ.get("CACHEALLOC_QUIET", "0") in ("", "0"):
            _note("CACHEALLOC_CONF is set but no CUDA device is visible; PyTorch's allocator stays.")
        return
    try:
        cachealloc.enable()
    except Exception as e:
        status = f"failed: {e}"
        _note(f"CACHEALLOC_CONF={os.environ.get('CACHEALLOC_CONF', '')!r} is set but cachealloc could not be enabled: {e}")
        raise
    status = "enabled (full adapter)" if cachealloc.is_full() else "enabled"


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds `torch` through the other finders and wraps its loader's exec_module."""

    def find_spec(self, fullname: str, path: Optional[Any] = None, target: Optional[Any] = None):  # noqa: D102
        if fullname != "torch":
            return None
        _remove_hook()  # one shot; also keeps the nested find_spec below from recursing
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _on_torch_imported(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_hook: Optional[_TorchImportHook] = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None and _hook in sys.meta_path:
        sys.meta_path.remove(_hook)
    _hook = None


def install() -> None:
    """Arms the hook (idempotent); if torch is already imported, enables at once."""
    global _hook, status
    if not os.environ.get("CACHEALLOC_CONF") or os.environ.get("CACHEALLOC_AUTOLOAD", "1") == "0":
        status = "off: CACHEALLOC_CONF unset/empty or CACHEALLOC_AUTOLOAD=0"
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        _on_torch_imported(torch)
        return
    if _hook is None:
        _hook = _TorchImportHook()
        sys.meta_path.insert(0, _hook)
        status = "armed: waiting for import torch"


install()
