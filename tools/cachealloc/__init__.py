"""cachealloc: a drop-in replacement for PyTorch's CUDA caching allocator.

Two ways to turn it on:

* No change to your script: ``pip install --no-build-isolation ./tools`` installs a startup hook
  (``cachealloc_autoload.pth``). When the environment variable ``CACHEALLOC_CONF`` is set to a
  non-empty value (``policy:size_class``; an empty value leaves PyTorch's allocator), the hook calls :func:`enable` right after ``import torch``, before CUDA is
  initialised::

      CACHEALLOC_CONF=policy:size_class python train.py

* Explicitly, before the first CUDA tensor::

      import torch, cachealloc
      cachealloc.enable("policy:size_class,record:/tmp/trace.pickle")

Two ways to plug in:

* the pluggable allocator (default): ``libcachealloc_plugin.so`` through
  torch.cuda.memory.CUDAPluggableAllocator (allocate/free and a few hooks);
* the full adapter, ``full:True`` in the configuration or ``enable(conf, full=True)``:
  ``libcachealloc_torch.so`` implements PyTorch's whole CUDA allocator interface, so
  torch.cuda.memory_stats(), memory snapshots, CUDA graphs and torch.cuda.MemPool work unchanged.
  It must be built against exactly the PyTorch that runs (checked).

Under a pluggable allocator ``torch.cuda.memory_stats()`` and friends raise, so use
:func:`memory_stats`, :func:`reset_peak_memory_stats`, :func:`empty_cache` and
:func:`dump_snapshot` from this package (they fall back to PyTorch's own functions when
cachealloc is not enabled, so the same code works both ways).

To compare with PyTorch's own allocators on equal terms, :func:`time_native` wraps whatever CUDA
allocator PyTorch has (native, ``expandable_segments``, ``backend:cudaMallocAsync``) in a thin
forwarding wrapper from ``libcachealloc_torch.so`` that times its allocations and frees the way
cachealloc times its own (``allocator_ns``); read it with :func:`native_allocator_ns` and
:func:`native_allocator_stats`::

    import torch, cachealloc
    cachealloc.time_native()          # before the first CUDA tensor
    ...                               # train
    print(cachealloc.native_allocator_stats())

Importing this package imports neither torch nor the shared library; both are loaded on first use.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Union

from ._lib import LibraryNotFound, find_library  # noqa: F401  (re-exported)

__all__ = [
    "enable",
    "is_enabled",
    "is_full",
    "memory_stats",
    "allocator_ns",
    "empty_cache",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "dump_snapshot",
    "policies",
    "policy_report",
    "policy_name",
    "validate_config",
    "check_invariants",
    "library_path",
    "time_native",
    "is_native_timed",
    "native_allocator_ns",
    "native_allocator_stats",
    "LibraryNotFound",
]

__version__ = "0.1.0"

_enable_lock = threading.Lock()
_enabled_conf: Optional[str] = None  # the CACHEALLOC_CONF in force once enabled
_pluggable: Any = None  # keeps the CUDAPluggableAllocator object alive
_full = False  # enabled through libcachealloc_torch.so
_native_timed = False  # time_native() installed the timing wrapper

DeviceLike = Union[None, int, str, Any]


def library_path() -> str:
    """The shared library this process uses (or would use). Raises LibraryNotFound."""
    from . import _lib

    return _lib.loaded_path() or _lib.find_library()


def is_enabled() -> bool:
    """True once :func:`enable` made cachealloc PyTorch's CUDA allocator in this process."""
    return _enabled_conf is not None


def is_full() -> bool:
    """True when the full LibTorch adapter (libcachealloc_torch.so) is PyTorch's CUDA allocator."""
    return _full


def _conf_wants_full(conf: str) -> bool:
    """The `full:` key of a CACHEALLOC_CONF string (the library validates its value)."""
    depth = 0
    entry = ""
    entries = []
    for ch in conf:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            entries.append(entry)
            entry = ""
        else:
            entry += ch
    entries.append(entry)
    for e in entries:
        key, _, value = e.partition(":")
        if key.strip() == "full":
            return value.strip() in ("True", "true", "1")
    return False


def validate_config(conf: Optional[str] = None) -> None:
    """Checks a CACHEALLOC_CONF string (default: the environment's) without touching a GPU.

    Raises ValueError naming the bad key or value and the valid keys.
    """
    from . import _lib

    lib = _lib.load()
    arg = None if conf is None else conf.encode("utf-8")
    if lib.cachealloc_validate_config(arg) != 0:
        raise ValueError(_lib.last_error())


def _cuda_initialized(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # pragma: no cover - very old torch
        return False


def enable(conf: Optional[str] = None, full: Optional[bool] = None) -> None:
    """Makes cachealloc PyTorch's CUDA allocator for this process.

    ``conf`` (PYTORCH_CUDA_ALLOC_CONF syntax, e.g. ``"policy:size_class,record:/tmp/t.pickle"``)
    is stored in ``CACHEALLOC_CONF``; ``None`` keeps the environment's value (unset: the default
    policy). Must run before CUDA is initialised: PyTorch cannot swap an allocator in use.
    Calling it again with the same (or no) configuration does nothing.

    ``full=True`` installs the complete LibTorch adapter (libcachealloc_torch.so) instead of the
    pluggable allocator; ``None`` follows the configuration's ``full:`` key (default False).

    Raises ValueError for a bad configuration, RuntimeError when CUDA is already initialised,
    this PyTorch lacks CUDA, or (full) the adapter was built for another PyTorch version,
    LibraryNotFound when the library is missing.
    """
    global _enabled_conf, _pluggable, _full
    with _enable_lock:
        if _enabled_conf is not None:
            if conf is None or conf == _enabled_conf:
                return
            raise RuntimeError(
                f"cachealloc is already enabled with CACHEALLOC_CONF={_enabled_conf!r}; the "
                f"allocator of a running process cannot be reconfigured (asked for {conf!r}). "
                "Start a new process with the new CACHEALLOC_CONF."
            )
        if _native_timed:
            raise RuntimeError(
                "cachealloc.enable() was called after cachealloc.time_native(): the timing wrapper is "
                "PyTorch's allocator now and would be replaced. Call enable(conf, full=True) first and "
                "time_native() after it to time cachealloc's adapter the same way."
            )
        import torch

        if not hasattr(torch._C, "_cuda_customAllocator"):
            raise RuntimeError(
                f"cachealloc needs a CUDA build of PyTorch; this one ({torch.__version__}) has no "
                "CUDA support (torch.version.cuda is None)."
            )
        if _cuda_initialized(torch):
            raise RuntimeError(
                "cachealloc.enable() was called after CUDA was initialised in this process, and "
                "PyTorch cannot swap an allocator that is already in use. Call cachealloc.enable() "
                "right after `import torch`, before anything touches the GPU (creating a CUDA "
                "tensor, torch.cuda.synchronize(), set_per_process_memory_fraction, ...), or set "
                "CACHEALLOC_CONF in the environment and let the startup hook installed by "
                "`pip install ./tools` enable it for you."
            )
        effective = conf if conf is not None else os.environ.get("CACHEALLOC_CONF", "")
        if full is None:
            full = _conf_wants_full(effective)
        if full:
            _enable_full(torch, effective)
            os.environ["CACHEALLOC_CONF"] = effective
            _enabled_conf, _full = effective, True
            return
        from . import _lib

        if conf is not None:
            os.environ["CACHEALLOC_CONF"] = conf
        lib = _lib.load()
        if lib.cachealloc_is_torch_plugin() != 1:
            raise RuntimeError(
                f"{_lib.loaded_path()} is the torch-free C API library, which returns NULL on "
                "out-of-memory and so cannot serve as PyTorch's allocator; point "
                "CACHEALLOC_LIBRARY at libcachealloc_plugin.so (built when CMake finds LibTorch)."
            )
        if lib.cachealloc_validate_config(None) != 0:
            raise ValueError(_lib.last_error())

        path = _lib.loaded_path()
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(path, "cachealloc_alloc", "cachealloc_free")
        hooks = pluggable.allocator()
        hooks.set_init_fn(_lib.function_address("cachealloc_init"))
        hooks.set_reset_fn(_lib.function_address("cachealloc_reset"))
        hooks.set_memory_fraction_fn(_lib.function_address("cachealloc_set_memory_fraction"))
        hooks.set_record_stream_fn(_lib.function_address("cachealloc_record_stream"))
        hooks.set_base_alloc_fn(_lib.function_address("cachealloc_base_alloc"))
        try:
            torch.cuda.memory.change_current_allocator(pluggable)
        except RuntimeError as e:
            raise RuntimeError(
                f"cachealloc: PyTorch refused the allocator swap ({e}). CUDA's allocator was "
                "already used in this process; enable cachealloc before the first CUDA tensor."
            ) from e
        _pluggable = pluggable
        _enabled_conf = os.environ.get("CACHEALLOC_CONF", "")


def _load_torch_checked(torch: Any, remedy: str) -> Any:
    """libcachealloc_torch.so, after checking it was built for the running PyTorch (its classes
    implement PyTorch's C++ allocator interface, which changes between releases)."""
    from . import _lib

    lib = _lib.load_torch()
    built_for = lib.cachealloc_torch_built_for().decode("utf-8")
    running = str(torch.__version__).split("+", 1)[0]
    if built_for != running:
        raise RuntimeError(
            f"cachealloc: {_lib.loaded_torch_path()} was built against PyTorch {built_for}, but this "
            f"process runs PyTorch {torch.__version__}. libcachealloc_torch.so implements PyTorch's C++ "
            "allocator interface, which changes between releases: rebuild cachealloc against this "
            f"PyTorch{remedy}."
        )
    return lib


def _enable_full(torch: Any, conf: str) -> None:
    """Installs libcachealloc_torch.so (cachealloc::torch::install) after checking its version."""
    import ctypes

    lib = _load_torch_checked(torch, ", or drop full:True to use the pluggable allocator")
    err = ctypes.create_string_buffer(8192)
    if lib.cachealloc_torch_install(conf.encode("utf-8"), err, len(err)) != 0:
        message = err.value.decode("utf-8", "replace")
        if "already" in message:
            raise RuntimeError(message)
        raise ValueError(message)


def time_native() -> None:
    """Times PyTorch's own CUDA allocator from the inside, the way cachealloc times itself.

    Wraps the CUDA allocator PyTorch has now (its caching allocator, with or without
    ``expandable_segments:True``; ``backend:cudaMallocAsync``; or cachealloc's full adapter when
    ``enable(..., full=True)`` ran first) in a thin wrapper from libcachealloc_torch.so that
    forwards every call and adds up, with the TSC, the time spent in its allocation calls
    (allocate, raw_alloc, raw_alloc_with_stream) and frees (tensor deleters, raw_delete). Read the
    totals with :func:`native_allocator_ns` and :func:`native_allocator_stats`. PyTorch's memory
    API (torch.cuda.memory_stats(), get_allocator_backend(), empty_cache(), snapshots, CUDA graphs)
    keeps answering as before: the wrapper forwards it. Must run before CUDA is initialised;
    calling it again does nothing.

    Raises RuntimeError when CUDA is already initialised, cachealloc's pluggable allocator is
    enabled (it times itself: :func:`allocator_ns`), this PyTorch lacks CUDA, the wrapper cannot be
    installed, or libcachealloc_torch.so was built for another PyTorch version; LibraryNotFound
    when the library is missing.
    """
    global _native_timed
    import ctypes

    with _enable_lock:
        if _native_timed:
            return
        import torch

        if not hasattr(torch._C, "_cuda_customAllocator"):
            raise RuntimeError(
                f"cachealloc.time_native() needs a CUDA build of PyTorch; this one ({torch.__version__}) "
                "has no CUDA support."
            )
        if _enabled_conf is not None and not _full:
            raise RuntimeError(
                "cachealloc.time_native(): cachealloc's pluggable allocator is enabled; it times itself "
                "(cachealloc.allocator_ns()). time_native() wraps PyTorch's own allocators, or the full "
                "adapter (enable(conf, full=True) first)."
            )
        if _cuda_initialized(torch):
            raise RuntimeError(
                "cachealloc.time_native() was called after CUDA was initialised in this process; the "
                "allocator in use cannot be wrapped any more (its tensors would be freed around the "
                "wrapper). Call it right after `import torch`, before anything touches the GPU."
            )
        lib = _load_torch_checked(torch, "")
        from . import _lib

        if not _lib.has_time_native(lib):
            raise RuntimeError(
                f"cachealloc.time_native(): {_lib.loaded_torch_path()} predates the timing wrapper "
                "(no cachealloc_torch_time_native_install); rebuild libcachealloc_torch.so."
            )
        err = ctypes.create_string_buffer(8192)
        if lib.cachealloc_torch_time_native_install(err, len(err)) != 0:
            raise RuntimeError(err.value.decode("utf-8", "replace"))
        _native_timed = True


def is_native_timed() -> bool:
    """True while :func:`time_native`'s wrapper is PyTorch's CUDA allocator in this process."""
    if not _native_timed:
        return False
    from . import _lib

    return bool(_lib.load_torch().cachealloc_torch_time_native_is_installed())


def native_allocator_ns() -> int:
    """Nanoseconds spent inside the allocator :func:`time_native` wraps, allocations and frees,
    over every device since it was installed (0 when it is not)."""
    if not _native_timed:
        return 0
    from . import _lib

    return int(_lib.load_torch().cachealloc_torch_time_native_ns())


def native_allocator_stats() -> dict[str, int]:
    """The counters of :func:`time_native`'s wrapper, over every device since it was installed:
    ``allocator_ns`` (= ``alloc_ns`` + ``free_ns``), ``alloc_calls`` (allocate, raw_alloc,
    raw_alloc_with_stream; zero-byte requests included) and ``free_calls`` (tensor deleters and
    raw_delete). All zero when the wrapper is not installed."""
    keys = ("alloc_ns", "free_ns", "alloc_calls", "free_calls")
    if not _native_timed:
        return {"allocator_ns": 0, **{k: 0 for k in keys}}
    from . import _lib

    lib = _lib.load_torch()
    out = {k: int(getattr(lib, f"cachealloc_torch_time_native_{k}")()) for k in keys}
    return {"allocator_ns": out["alloc_ns"] + out["free_ns"], **out}


def _device_index(device: DeviceLike) -> int:
    if device is None:
        try:
            import sys

            torch = sys.modules.get("torch")
            if torch is not None and _cuda_initialized(torch):
                return int(torch.cuda.current_device())
        except Exception:
            pass
        return 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    if index is not None:
        return int(index)
    if isinstance(device, str) and ":" in device:
        return int(device.rsplit(":", 1)[1])
    return 0


def memory_stats(device: DeviceLike = None) -> dict[str, int]:
    """Statistics with torch.cuda.memory_stats() key names.

    Under cachealloc: ``allocated_bytes.all.{current,peak,allocated,freed}``,
    ``reserved_bytes.all.*``, ``active_bytes.all.*``, ``requested_bytes.all.*``,
    ``allocation.all.*``, ``num_alloc_retries``, ``num_ooms``, ``num_device_alloc``,
    ``num_device_free``, ``num_sync_all_streams``, ``num_event_records``, ``num_event_queries``
    and ``event_ns`` (events recorded and queried, and the time inside those calls),
    ``reserve_ns``, ``release_ns``, ``create_ns``, ``release_physical_ns``, ``map_ns`` and
    ``unmap_ns`` (the time inside each kind of device memory call), ``background_unmaps``,
    ``background_unmap_ns`` and ``background_unmap_wait_ns`` (unmaps run by the VMM backend's own
    thread, its time in them, and the time allocations waited for them),
    ``background_event_records`` and ``background_event_ns`` (event records made by the CUDA
    event pool's own thread under ``event_thread:records`` or ``poll``, and its time in them),
    ``background_event_queries`` and ``background_event_query_ns`` (that thread's queries of the
    events it watches under ``event_thread:poll``, defrag's default, and its time in them),
    ``parked_waits`` and
    ``parked_wait_ns`` (allocations that waited for frees parked behind other streams instead of
    growing, and the time they waited: ``wait_parked_to_grow``), ``parked_reuses``,
    ``parked_reuse_bytes`` and ``parked_reuse_waits`` (frees parked behind a stream that an
    allocation on that stream took at once, their bytes, and how many of them made the stream wait
    for another on the device: ``reuse_parked``), ``allocator_ns`` (time inside the allocator's
    alloc and free, with ``alloc_ns`` and ``free_ns``), ... Without cachealloc: PyTorch's own.
    """
    if not is_enabled() or _full:
        import torch

        stats = dict(torch.cuda.memory_stats(device))
        if _full:
            stats["allocator_ns"] = allocator_ns(device)
        return stats
    from . import _lib

    lib = _lib.load()
    return {str(k): int(v) for k, v in _lib.read_json(lib.cachealloc_memory_stats_json, _device_index(device)).items()}


def allocator_ns(device: DeviceLike = None) -> int:
    """Nanoseconds spent inside cachealloc's alloc and free (0 when timing is off)."""
    from . import _lib

    if _full:
        return int(_lib.load_torch().cachealloc_torch_allocator_ns(_device_index(device)))
    return int(_lib.load().cachealloc_allocator_ns(_device_index(device)))


def _check(rc: int) -> None:
    if rc != 0:
        from . import _lib

        raise RuntimeError(_lib.last_error())


def empty_cache() -> None:
    """Returns cached, wholly free memory to the device (torch.cuda.empty_cache())."""
    if not is_enabled() or _full:
        import torch

        torch.cuda.empty_cache()
        return
    from . import _lib

    _check(_lib.load().cachealloc_empty_cache(-1))


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Peak statistics := current values (``device=None``: every device under cachealloc)."""
    if not is_enabled() or _full:
        import torch

        if device is None and _full:
            for d in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(d)
        else:
            torch.cuda.reset_peak_memory_stats(device)
        return
    from . import _lib

    _check(_lib.load().cachealloc_reset_peak(-1 if device is None else _device_index(device)))


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    """Cumulative statistics (and allocator_ns) := 0."""
    if not is_enabled() or _full:
        import torch

        if device is None and _full:
            for d in range(torch.cuda.device_count()):
                torch.cuda.reset_accumulated_memory_stats(d)
        else:
            torch.cuda.reset_accumulated_memory_stats(device)
        return
    from . import _lib

    _check(_lib.load().cachealloc_reset_accumulated(-1 if device is None else _device_index(device)))


def dump_snapshot(path: Union[str, os.PathLike]) -> None:
    """Writes the allocator's segments and recorded trace in PyTorch's snapshot format.

    The trace holds events only when CACHEALLOC_CONF has ``record:PATH`` (then it is also written
    to PATH at exit). Open the file with ``python -m torch.cuda._memory_viz trace_plot FILE -o
    out.html`` or replay it with ``cachealloc-replay``. Without cachealloc this calls
    torch.cuda.memory._dump_snapshot(path).
    """
    if not is_enabled() or _full:
        import torch

        torch.cuda.memory._dump_snapshot(str(path))
        return
    from . import _lib

    _check(_lib.load().cachealloc_dump_snapshot(os.fsencode(os.fspath(path))))


def hot_pages() -> dict[str, Any]:
    """Where the allocator keeps its own bookkeeping (Note [Bookkeeping on few pages],
    allocator/include/cachealloc/hot_pages.h): ``mode`` (CACHEALLOC_HOT_PAGES: ``huge``,
    ``small`` or ``off``), ``regions`` of ``region_bytes`` each, ``bytes_in_use``,
    ``bytes_carved``, ``fallback_allocations`` (requests served by the heap), and ``huge_bytes``,
    how much of the regions the kernel backs with huge pages (from /proc/self/smaps; None where it
    cannot be read). Reads /proc/self/smaps: milliseconds, for diagnostics. Raises RuntimeError
    when the loaded plugin predates it."""
    from . import _lib

    lib = _lib.load()
    if not hasattr(lib, "cachealloc_hot_pages_json"):
        raise RuntimeError(f"cachealloc: the plugin at {_lib.loaded_path()} predates hot_pages()")
    return dict(_lib.read_json(lib.cachealloc_hot_pages_json))


def policies() -> list[dict[str, Any]]:
    """The registered policies: name, summary, backend, replay_only, config_keys."""
    from . import _lib

    lib = _lib.load()
    return list(_lib.read_json(lib.cachealloc_policies_json))


def policy_report(device: DeviceLike = None) -> dict[str, Any]:
    """What the policy of ``device`` can tell about its decisions. Policy defrag gives
    ``slack_history``: the first 512 changes of its slack and growths beyond it, in order, each
    ``{"event": "count_raise" | "time_raise" | "return_raise" | "returned" | "pending_switch" |
    "top_at_limit" | "beyond_slack", "time_ns", "slack_before", "slack_after", "live_bytes", "peak_live_bytes",
    "reserved_bytes", "pages"}`` (why the job holds what it holds beyond its live peak), and
    ``slack_history_dropped``; ``growths``: the first 4,096 growths that moved pages or waited for
    a stream, each ``{"time_ns", "took_ns", "waited_ns", "waits", "pages_moved", "pages_created",
    "stream", "new_peak", "pending"}``, and ``windows``: the first 1,024 windows its move budget
    judged, each ``{"open_ns", "close_ns", "growths", "charged_ns", "waited_ns", "spent_ns",
    "allowed_ns", "uncharged_waits", "uncharged_wait_ns", "slack_after", "close": "full" | "early" |
    "aged", "verdict": "within" | "raised" | "switched" | "top_at_limit" | "over"}`` (times on
    CLOCK_MONOTONIC, as ``time.monotonic_ns()``), with ``growths_dropped`` and ``windows_dropped``.
    Other policies, and a device not used yet: ``{}``. Needs the
    pluggable allocator (``enable()``); raises RuntimeError with the LibTorch adapter or when
    cachealloc is not enabled."""
    if not is_enabled() or _full:
        raise RuntimeError("cachealloc.policy_report() needs cachealloc enabled as PyTorch's pluggable "
                           "allocator (cachealloc.enable() without the LibTorch adapter)")
    from . import _lib

    return dict(_lib.read_json(_lib.load().cachealloc_policy_report_json, _device_index(device)))


def policy_name() -> str:
    """The policy the current CACHEALLOC_CONF selects. Raises ValueError when it is invalid."""
    from . import _lib

    lib = _lib.load()
    lib.cachealloc_clear_error()
    name = lib.cachealloc_policy_name().decode("utf-8")
    if not name:
        raise ValueError(_lib.last_error())
    return name


def check_invariants(device: DeviceLike = None) -> None:
    """Runs the allocator's internal consistency checks; raises RuntimeError on a violation.

    Not available with the full adapter (it does nothing there)."""
    if _full:
        return
    from . import _lib

    _check(_lib.load().cachealloc_check_invariants(-1 if device is None else _device_index(device)))
