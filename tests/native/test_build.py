"""Building and loading the native kernels: the library built at install, its
staleness check, the one warning of the torch fallback, the development
opt-in build, and the portable flags.

Tests that break the library (a missing, unloadable or stale file) patch the
loader and reset it before and after, so that the other tests load the real
library again.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from quantobs import QuantizationArgs, native
from quantobs.native import build, loader


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing loaded yet, the kernels enabled, no opt-in build; afterwards
    the loader forgets what the test loaded (the real library loads again)."""
    monkeypatch.delenv("QUANTOBS_NATIVE_BUILD", raising=False)
    previous = native.set_enabled(True)
    loader.reset()
    yield
    loader.reset()
    native.set_enabled(previous)


def _missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    monkeypatch.setattr(loader, "installed_path", lambda: tmp_path / "absent.so")
    return "is missing"


def _unloadable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    bad = tmp_path / build.library_filename()
    bad.write_bytes(b"not a shared library")
    monkeypatch.setattr(loader, "installed_path", lambda: bad)
    return "failed to load"


def _stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    monkeypatch.setattr(build, "source_hash", lambda directory=None: "0" * 16)
    return "is stale"


BREAKS: dict[str, Callable[[pytest.MonkeyPatch, Path], str]] = {
    "missing": _missing,
    "unloadable": _unloadable,
    "stale": _stale,
}


def _ops() -> dict[str, Callable[[], object]]:
    """One call of every op, with input it would run natively."""
    gen = torch.Generator().manual_seed(0)
    x3 = torch.randn(2, 4, 16, generator=gen)
    ranges = (x3.amin(dim=(0, 2)), x3.amax(dim=(0, 2)))
    fmt = QuantizationArgs(num_bits=4).format
    scale = torch.full((3, 4), 0.1)
    hist = torch.rand(1, 64, generator=gen)
    starts, ends = torch.tensor([0, 8]), torch.tensor([63, 40])
    return {
        "minmax": lambda: native.minmax(x3),
        "all_finite": lambda: native.all_finite(x3.repeat(1024, 1, 1)),  # not small
        "symmetric_scales": lambda: native.symmetric_scales(
            *ranges, 7.0, None, False, 1e-8, False
        ),
        "range_absmax": lambda: native.range_absmax(*ranges),
        "mse_errors": lambda: native.mse_errors(x3, scale, None, fmt, 2.4),
        "add_counts": lambda: native.add_counts(
            x3,
            torch.ones(4),
            torch.full((4,), -8.0),
            torch.zeros(4, 16, dtype=torch.int64),
            False,
        ),
        "histogram_pass": lambda: native.histogram_pass(x3, 1.0, -8.0, 16, False, 64),
        "histc": lambda: native.histc(x3, 16, -1.0, 1.0),
        "torch_l2_terms": lambda: native.torch_l2_terms(
            hist, starts, ends, torch.full((2,), 0.1, dtype=torch.float64), 16
        ),
        "l2_errors": lambda: native.l2_errors(
            torch.zeros(64, 4, dtype=torch.float64),
            torch.tensor([1.0]),
            torch.tensor([9.0]),
            16,
        ),
        "l2_survivors": lambda: native.l2_survivors(
            torch.zeros(3, 65),
            torch.zeros(3),
            torch.zeros(3),
            torch.zeros(65),
            0.0,
            16,
            4,
            0,
            -1.0,  # no survivors: an empty (0, 2) result
            8,
        ),
        "entropy": lambda: native.entropy(torch.ones(2, 64), torch.tensor([32]), 16),
        "pow24": lambda: native.pow24(x3.abs()),
    }


def _declined(result: object) -> bool:
    return result is None or result is False


# ----------------------------------------------------------- the dev install


def test_installed_library_is_found_and_current(fresh: None) -> None:
    loaded = loader.load()
    assert loaded.library is not None, loaded.reason
    assert loaded.path == loader.installed_path()
    assert loaded.path.parent == Path(native.__file__).parent
    assert not loaded.runtime_build
    assert build.library_hash(loaded.library) == build.source_hash()
    info = native.backend_info()
    assert info.backend == "native"
    assert info.source_hash == build.source_hash()
    assert info.isa in (*info.clones, "default")


def test_every_op_runs_natively_in_the_dev_install(fresh: None) -> None:
    for name, op in _ops().items():
        assert not _declined(op()), name


def test_sources_are_the_c_files_present() -> None:
    assert sorted(p.name for p in build.SOURCE_DIR.glob("*.c")) == sorted(build.SOURCES)
    assert sorted(p.name for p in build.SOURCE_DIR.glob("*.h")) == sorted(build.HEADERS)


def test_signatures_match_the_header() -> None:
    """Every exported kernel of qo_kernels.h has its ctypes signature, with
    as many arguments."""
    header = (build.SOURCE_DIR / "qo_kernels.h").read_text()
    prototypes = re.findall(r"QO_API [^;(]*?\b(qo_\w+)\(([^)]*)\);", header)
    declared = {
        name: 0 if params.strip() == "void" else len(params.split(","))
        for name, params in prototypes
    }
    assert declared == {
        name: len(argtypes) for name, (argtypes, _) in loader._SIGNATURES.items()
    }


def test_source_hash_ignores_line_endings(tmp_path: Path) -> None:
    for name in (*build.SOURCES, *build.HEADERS):
        text = (build.SOURCE_DIR / name).read_bytes()
        (tmp_path / name).write_bytes(text.replace(b"\n", b"\r\n"))
    assert build.source_hash(tmp_path) == build.source_hash()
    (tmp_path / build.SOURCES[0]).write_bytes(b"/* changed */\n")
    assert build.source_hash(tmp_path) != build.source_hash()
    (tmp_path / build.SOURCES[0]).unlink()
    assert build.source_hash(tmp_path) is None


# ----------------------------------------------------------- portable flags


@pytest.mark.parametrize("msvc", [False, True], ids=["unix", "msvc"])
@pytest.mark.parametrize(
    "variant",
    build.VARIANTS,
    ids=lambda v: (
        f"{'openmp' if v.openmp else 'serial'}-{'clones' if v.clones else 'baseline'}"
    ),
)
def test_compile_flags_are_portable(variant: build.Variant, msvc: bool) -> None:
    flags = build.compile_args(variant, msvc) + build.link_args(variant, msvc)
    assert not [f for f in flags if f.startswith(("-march", "-mtune", "-mcpu"))]
    assert not [f for f in flags if f.startswith(("-mavx", "-msse", "/arch"))]
    assert not [f for f in flags if "native" in f]
    if not msvc:  # torch's float32 rounding, step by step
        assert "-ffp-contract=off" in flags
        assert ("-fopenmp" in flags) == variant.openmp
        assert ("-DQO_NO_CLONES" in flags) != variant.clones


def test_setup_builds_with_these_flags() -> None:
    setup = (build.SOURCE_DIR.parents[2] / "setup.py").read_text()
    assert "native_build.compile_args(variant" in setup
    assert "native_build.VARIANTS" in setup
    assert "march" not in setup.replace("no -march=native", "")


def test_clones_are_the_only_wider_isa(fresh: None) -> None:
    info = native.backend_info()
    if info.clones:  # x86 with ifunc: AVX2 copies next to the baseline ones,
        # and an AVX-512 one of the MSE scorers
        assert info.clones in (
            ("x86-64-v4", "avx2", "default"),
            ("avx512f", "avx2", "default"),
        )


# ----------------------------------------------------------- the fallback


@pytest.mark.parametrize("how", BREAKS, ids=list(BREAKS))
def test_broken_library_warns_once_and_every_op_declines(
    how: str, fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    says = BREAKS[how](monkeypatch, tmp_path)
    with pytest.warns(RuntimeWarning, match="native kernels unavailable") as caught:
        assert not native.available()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert says in message
    assert "QUANTOBS_NATIVE_BUILD=1" in message and "pip install" in message
    # no second warning (the test run turns warnings into errors)
    for name, op in _ops().items():
        assert _declined(op()), name
    assert not native.available()
    info = native.backend_info()
    assert info.backend == "torch" and info.reason is not None and says in info.reason


def test_turned_off_never_warns(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _missing(monkeypatch, tmp_path)
    native.set_enabled(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.available()
        for name, op in _ops().items():
            assert _declined(op()), name
        info = native.backend_info()
    assert info.backend == "torch" and not info.enabled
    assert "turned off" in "\n".join(info.lines())


def test_turned_off_by_environment_never_warns(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path\n"
        "from quantobs.native import loader\n"
        "loader.installed_path = lambda: Path('/nonexistent/_qo_kernels.so')\n"
        "from quantobs import native\n"
        "print(native.available(), native.minmax(__import__('torch').ones(1, 2, 8)))\n"
    )
    env = {**os.environ, "QUANTOBS_NATIVE": "0"}
    env.pop("QUANTOBS_NATIVE_BUILD", None)
    out = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "False None"
    assert "RuntimeWarning" not in out.stderr


# ----------------------------------------------------------- development builds


@pytest.mark.slow
def test_opt_in_build_on_first_use(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _missing(monkeypatch, tmp_path)
    monkeypatch.setenv("QUANTOBS_NATIVE_BUILD", "1")
    monkeypatch.setenv("QUANTOBS_CACHE_DIR", str(tmp_path / "cache"))
    assert native.available()  # built, loaded, no warning
    loaded = loader.load()
    assert loaded.runtime_build and loaded.path is not None
    assert loaded.path.parent == tmp_path / "cache"
    assert build.source_hash() in loaded.path.name
    x = torch.randn(3, 5, 16)
    got = native.minmax(x)
    assert got is not None and torch.equal(got[0], x.amin(dim=(0, 2)))
    assert "built on first use" in "\n".join(native.backend_info().lines())


def test_failed_opt_in_build_warns_once(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _missing(monkeypatch, tmp_path)
    monkeypatch.setenv("QUANTOBS_NATIVE_BUILD", "1")
    monkeypatch.setenv("QUANTOBS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="runtime build failed: no C compiler"):
        assert not native.available()
    assert not native.available()


@pytest.mark.slow
def test_build_in_place_and_if_stale(tmp_path: Path) -> None:
    target = tmp_path / build.library_filename()
    assert build.main(["--output", str(target)]) == 0
    library = ctypes.CDLL(str(target))
    assert build.library_hash(library) == build.source_hash()
    built = target.stat().st_mtime_ns
    assert build.main(["--output", str(target), "--if-stale"]) == 0
    assert target.stat().st_mtime_ns == built  # current: not rebuilt


def test_build_without_a_compiler_says_so(tmp_path: Path) -> None:
    with pytest.raises(build.BuildError, match="every build variant failed"):
        build.build_library(tmp_path / "x.so", compiler=["false"])
    assert not (tmp_path / "x.so").exists()
