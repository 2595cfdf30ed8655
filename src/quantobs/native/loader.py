"""Finding, checking and loading the native kernels' library (ctypes).

Where the library comes from:

1. The one built at install (setup.py's optional extension): `_qo_kernels.so`
   next to this file. An editable install (`pip install -e .`) builds it in
   place, in `src/quantobs/native/`; `python -m quantobs.native.build`
   rebuilds it there.
2. Only with `QUANTOBS_NATIVE_BUILD=1` (development), when 1. is missing,
   fails to load or is stale: a build on first use with the system C
   compiler, cached in `$QUANTOBS_CACHE_DIR` (default `~/.cache/quantobs`)
   under the hash of the sources.

A library is stale when the hash of the C sources it was built from
(`qo_source_hash`) differs from the hash of the C sources next to this file
(when they are there): its kernels may not match the Python wrappers.

Without a usable library, `library()` returns None and the callers run
their torch twins; the first such call in a process issues one
`RuntimeWarning` that says why and how to fix it. Nothing warns where the
kernels are turned off (`QUANTOBS_NATIVE=0`, `native.set_enabled(False)`):
`quantobs.native` does not ask for the library then.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from quantobs.native import build

__all__ = [
    "FIX",
    "BackendInfo",
    "Loaded",
    "backend_info",
    "installed_path",
    "library",
    "load",
    "load_library",
    "reset",
]

_LOG = logging.getLogger("quantobs")

FIX = (
    "to fix: reinstall quantobs where a C compiler is found (in a checkout: "
    "`pip install -e .`, or `python -m quantobs.native.build`), or set "
    "QUANTOBS_NATIVE_BUILD=1 to build the kernels on first use; or turn them "
    "off with QUANTOBS_NATIVE=0 (then nothing warns)"
)

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_D = ctypes.c_double
_INT = ctypes.c_int

# (argtypes, restype) of every kernel, in qo_kernels.h's order: keep in step.
_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    # qo_minmax.c
    "qo_minmax": ([_P, _I, _I, _I, _P, _P, _P, _INT], _I),
    "qo_all_finite": ([_P, _I, _INT], _I),
    "qo_symmetric_scales": (
        [_P, _P, _I, _F, _F, _INT, _INT, _F, _F, _INT, _P, _INT],
        _I,
    ),
    "qo_range_absmax": ([_P, _P, _I, _P, _INT], _I),
    # qo_histogram.c
    "qo_histogram": ([_P, _I, _I, _I, _P, _P, _I, _INT, _P, _INT], None),
    "qo_histogram_pass": ([_P, _I, _F, _F, _I, _INT, _P, _P, _P, _I, _P, _INT], _I),
    "qo_histc": ([_P, _I, _F, _F, _I, _P, _INT], None),
    # qo_mse.c
    "qo_mse_errors": (
        [_P, _I, _I, _I, _I, _P, _P, _F, _F, _INT, _INT, _INT, _F, _P, _INT],
        None,
    ),
    "qo_pow24": ([_P, _P, _I, _INT], _I),
    "qo_mse_block": (
        [_P, _I, _I, _I, _I, _I, _P, _P, _F, _F, _INT, _INT, _INT, _F, _P, _P, _INT],
        None,
    ),
    "qo_mse_rows": ([_P, _I, _I, _I, _P, _P, _P, _D, _P, _P, _P, _INT], _I),
    "qo_mse_marks": ([_P, _I, _I, _P, _P, _P, _D, _P, _INT, _P, _P, _INT], _I),
    # qo_search.c
    "qo_torch_l2_terms": ([_P, _I, _I, _I, _P, _P, _P, _I, _P, _INT], _I),
    "qo_l2_errors": ([_P, _I, _P, _P, _I, _I, _P, _INT], None),
    "qo_l2_survivors": ([_P, _P, _P, _P, _D, _I, _I, _I, _I, _D, _P, _I, _INT], _I),
    "qo_l2_candidates": ([_P, _I, _I, _P, _P, _I, _I, _INT, _P, _INT], _I),
    "qo_l2_symmetric": ([_P, _I, _I, _P, _P, _D, _D, _INT, _P, _INT], _I),
    "qo_entropy": ([_P, _I, _I, _P, _I, _I, _I, _I, _P, _INT], None),
    "qo_entropy_search": ([_P, _I, _I, _P, _I, _I, _I, _I, _I, _I, _P, _INT], _I),
    # qo_info.c
    "qo_source_hash": ([], ctypes.c_char_p),
    "qo_build_info": ([], ctypes.c_char_p),
    "qo_isa": ([], ctypes.c_char_p),
}


@dataclass(frozen=True)
class Loaded:
    """The outcome of `load()`: a library, or why there is none."""

    library: ctypes.CDLL | None
    path: Path | None  # the library loaded, or the one that was looked for
    reason: str | None = None  # why there is no library
    runtime_build: bool = False  # built on first use (QUANTOBS_NATIVE_BUILD=1)


@dataclass(frozen=True)
class BackendInfo:
    """Which implementation the ops run, for `quantobs info` and bug reports."""

    backend: str  # "native" or "torch"
    enabled: bool  # False: turned off by QUANTOBS_NATIVE=0 or set_enabled
    path: Path | None
    reason: str | None = None  # why torch
    source_hash: str | None = None
    openmp: str | None = None  # the _OPENMP version, None without OpenMP
    clones: tuple[str, ...] = ()  # the ISA clones of the hot kernels
    isa: str | None = None  # the clone this CPU runs
    compiler: str | None = None
    runtime_build: bool = False

    def lines(self) -> list[str]:
        """The report, one fact per line."""
        if self.backend == "native":
            source = "built on first use" if self.runtime_build else "installed"
            clones = "/".join(self.clones) if self.clones else "none"
            openmp = f"OpenMP {self.openmp}" if self.openmp else "no OpenMP"
            return [
                "backend: native kernels",
                f"  library: {self.path} ({source}, sources {self.source_hash})",
                f"  build: {self.compiler}, {openmp}, ISA clones {clones}",
                f"  this CPU runs: {self.isa}",
            ]
        lines = ["backend: torch (native kernels not in use)", f"  why: {self.reason}"]
        if self.enabled:
            lines.append(f"  {FIX}")
        return lines


def installed_path() -> Path:
    """Where the library built at install lives: next to this file."""
    return Path(__file__).with_name(build.library_filename())


def load_library(path: Path | str) -> ctypes.CDLL:
    """Load a library file and declare the argument types of its kernels.

    Raises:
        OSError: it does not load.
        AttributeError: a kernel is missing.
    """
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    return lib


def _check(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at `path` if it loads and is current, else why not."""
    if not path.exists():
        return None, (
            f"{path} is missing: it is built when quantobs is installed, and that "
            f"optional build was skipped or failed (no C compiler?)"
        )
    try:
        lib = load_library(path)
    except (OSError, AttributeError) as error:
        return None, f"{path} failed to load ({error})"
    built_from, sources = build.library_hash(lib), build.source_hash()
    if sources is not None and built_from != sources:
        return None, (
            f"{path} is stale: built from other C sources (library {built_from}, "
            f"sources {sources})"
        )
    return lib, None


def _runtime_build(reason: str) -> Loaded:
    """QUANTOBS_NATIVE_BUILD=1: build into the cache on first use."""
    sources = build.source_hash()
    if sources is None:
        return Loaded(None, None, f"{reason}; no C sources to build from")
    cache = Path(
        os.environ.get("QUANTOBS_CACHE_DIR", Path.home() / ".cache" / "quantobs")
    )
    compiler = hashlib.sha256(os.environ.get("CC", "").encode()).hexdigest()[:8]
    name = f"{build.LIBRARY}-{platform.machine()}-{sources}-{compiler}"
    path = cache / (name + Path(build.library_filename()).suffix)
    if not path.exists():
        _LOG.info("quantobs: building the native kernels into %s", path)
        try:
            build.build_library(path)
        except (build.BuildError, OSError) as error:
            return Loaded(None, path, f"{reason}; the runtime build failed: {error}")
    lib, why = _check(path)
    if lib is None:
        return Loaded(None, path, f"{reason}; the runtime build: {why}")
    return Loaded(lib, path, runtime_build=True)


_lock = threading.Lock()
_loaded: Loaded | None = None
_warned = False


def load() -> Loaded:
    """Find, check and load the library once per process (see the module)."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = installed_path()
            lib, reason = _check(path)
            if lib is not None:
                _loaded = Loaded(lib, path)
            elif os.environ.get("QUANTOBS_NATIVE_BUILD", "0") not in ("", "0"):
                _loaded = _runtime_build(str(reason))
            else:
                _loaded = Loaded(None, path, reason)
        return _loaded


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (warning once per process: see the module)."""
    global _warned
    loaded = load()
    if loaded.library is None and not _warned:
        _warned = True
        warnings.warn(
            "quantobs: native kernels unavailable, running the torch "
            f"implementations (same results, slower): {loaded.reason}; {FIX}",
            RuntimeWarning,
            stacklevel=2,
        )
    return loaded.library


def reset() -> None:
    """Forget the loaded library and the warning (tests; then load again)."""
    global _loaded, _warned
    with _lock:
        _loaded, _warned = None, False


def _text(lib: ctypes.CDLL, name: str) -> str:
    value: bytes | None = getattr(lib, name)()
    return "" if value is None else value.decode()


def backend_info(enabled: bool) -> BackendInfo:
    """What runs the ops; loads the library if `enabled`, and never warns."""
    if not enabled:
        return BackendInfo(
            "torch",
            False,
            installed_path(),
            reason="the native kernels are turned off (QUANTOBS_NATIVE=0 or "
            "quantobs.native.set_enabled(False))",
        )
    loaded = load()
    if loaded.library is None:
        return BackendInfo("torch", True, loaded.path, reason=loaded.reason)
    details = dict(
        item.partition("=")[::2]
        for item in _text(loaded.library, "qo_build_info").split(";", 2)
    )
    openmp = details.get("openmp", "0")
    clones = details.get("clones", "")
    return BackendInfo(
        "native",
        True,
        loaded.path,
        source_hash=_text(loaded.library, "qo_source_hash"),
        openmp=None if openmp == "0" else openmp,
        clones=tuple(clones.split(",")) if clones else (),
        isa=_text(loaded.library, "qo_isa"),
        compiler=details.get("compiler"),
        runtime_build=loaded.runtime_build,
    )
