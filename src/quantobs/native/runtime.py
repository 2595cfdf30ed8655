"""Whether the native kernels run, and access to their library.

`set_enabled` / `QUANTOBS_NATIVE=0` turn them off; `available` loads the
library on first call (`quantobs.native.loader`); the op wrappers take the
library from `loaded` and their thread count from `threads`.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quantobs.native.loader import BackendInfo

__all__ = [
    "PARALLEL_MIN",
    "available",
    "backend_info",
    "enabled",
    "loaded",
    "set_enabled",
    "threads",
    "usable",
]

# Below this many values a kernel runs on one thread: waking the others costs
# more than it saves (~10 us idle, milliseconds on a loaded machine).
PARALLEL_MIN = 1 << 15

_enabled = os.environ.get("QUANTOBS_NATIVE", "1") != "0"


def threads(work: int) -> int:
    """Threads for `work` values: torch's count, or one for small work."""
    return torch.get_num_threads() if work >= PARALLEL_MIN else 1


def enabled() -> bool:
    """Whether the native kernels (C and GPU) are switched on."""
    return _enabled


def set_enabled(enabled: bool) -> bool:
    """Turn the native kernels on or off; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def _library() -> ctypes.CDLL | None:
    # Imported late: `python -m quantobs.native.build` runs build.py, which
    # must not be imported before (the loader imports it).
    from quantobs.native import loader

    return loader.library()


def loaded() -> ctypes.CDLL:
    """The library (callers check `available()` first)."""
    lib = _library()
    if lib is None:  # callers check available() first
        raise RuntimeError("quantobs native kernels are not available")
    return lib


def available() -> bool:
    """Whether the native kernels are enabled and loaded.

    The first call loads the library; if it is missing, fails to load or is
    stale, that call issues one `RuntimeWarning` (per process) and the
    callers run torch. No warning while the kernels are turned off.
    """
    return _enabled and _library() is not None


def backend_info() -> BackendInfo:
    """Which implementation runs the ops (native: the library and its build;
    torch: why). Loads the library if enabled; never warns."""
    from quantobs.native import loader

    return loader.backend_info(_enabled)


def usable(x: torch.Tensor) -> bool:
    """Whether a kernel can read `x`: float32, CPU, contiguous, non-empty,
    and the kernels on and built."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.numel() > 0
        and available()
    )
